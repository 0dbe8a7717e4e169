"""ONNX lowerings of the `grouped_gemm` kernel family: grouped_out_proj, rope_out_proj."""

from __future__ import annotations

from ...ir.types import TensorType
from . import gemm_input, linear, rotary


def lower_grouped_out_proj(g, o, a, r):
    if o.o_scale is not None:
        raise NotImplementedError("grouped_out_proj: the ONNX lowering takes an fp32 input (no o_scale)")
    return _grouped(g, "grouped_out_proj", o.o, o, a)


def lower_rope_out_proj(g, o, a, r):
    """The rotation, then the GEMM (ONNX Runtime fuses what it fuses)."""
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    y = rotary.rotate(g, o.o, o.types["o"], pos, 2, a["dim"], a["theta"], tuple(a["yarn"]), inverse=True)
    return _grouped(g, "rope_out_proj", y, o, a)


def _grouped(g, what, x, o, a):
    """The block-diagonal GEMM of x (o's type) by o's weight: [B, T, H, d] -> [B, T, R], as G batched GEMMs
    [G, BT, k] x [G, k, R/G]. One token (decode b1): [1, G, k] is [G, 1, k] in memory, so Reshapes stand
    for the two Transposes (two nodes fewer a layer, the same values). A verify step's few lanes at batch 1
    (`few_lanes`): that one-token form for each lane, [BT, G, 1, k] against the [G, k, R/G] weights."""
    B, T = o.types["o"].shape[:2]
    w, wt = linear.weight(g, o.w, o.types["w"], o.scale, a["block"])
    G, (R, k) = a["groups"], wt.shape
    lanes = B == 1 and g.few_lanes(T, what)
    shape = (G, 1, k) if B * T == 1 else (B * T, G, 1, k) if lanes else (B * T, G, k)
    x = gemm_input(g, what, a, g.reshape(x, shape), TensorType(shape, o.types["o"].dtype))  # per group's K
    if B * T == 1 or lanes:
        return g.reshape(g.matmul_t(x, g.reshape(w, (G, R // G, k))), (B, T, R))
    x = g.op("Transpose", x, perm=[1, 0, 2])  # [G, BT, k]
    z = g.matmul_t(x, g.reshape(w, (G, R // G, k)))  # [G, BT, R/G]
    return g.reshape(g.op("Transpose", z, perm=[1, 0, 2]), (B, T, R))
