"""ONNX lowerings of the `inv_rope_quant` kernel family: inv_rope_group_quant."""

from __future__ import annotations

from . import rotary


def lower_inv_rope_group_quant(g, o, a, r):
    if a.get("fmt", "none") != "none":
        raise NotImplementedError("inv_rope_group_quant: the ONNX lowering has no FP8 activations (fmt none only)")
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    return rotary.rotate(g, o.x, o.types["x"], pos, 2, a["dim"], a["theta"], tuple(a["yarn"]), inverse=True, fused=True)
