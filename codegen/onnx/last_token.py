"""ONNX lowerings of the `last_token` kernel family: last_token."""

from __future__ import annotations


def lower_last_token(g, o, a, r):
    B, T = o.types["x"].shape[:2]
    if T == 1:  # one token a lane (decode): it is the last, whatever its position
        return g.reshape(o.x, (B, *o.types["x"].shape[2:]))
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    n = g.sum(g.cast(g.op("GreaterOrEqual", pos, g.iscalar(0)), 7), 1)  # 7: INT64
    idx = g.op("Add", g.clamp_min0(g.op("Sub", n, g.iscalar(1))), g.const([b * T for b in range(B)], "int64"))
    return g.op("Gather", g.reshape(o.x, (B * T, *o.types["x"].shape[2:])), idx, axis=0)
