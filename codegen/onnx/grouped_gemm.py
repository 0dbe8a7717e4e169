"""ONNX lowerings of the `grouped_gemm` kernel family: grouped_out_proj."""

from __future__ import annotations

from ...ir.types import TensorType
from . import gemm_input


def lower_grouped_out_proj(g, o, a, r):
    if o.o_scale is not None:
        raise NotImplementedError("grouped_out_proj: the ONNX lowering takes an fp32 input (no o_scale)")
    B, T = o.types["o"].shape[:2]
    w, wt = g.weight(o.w, o.types["w"], o.scale, a["block"])
    G, (R, k) = a["groups"], wt.shape
    x = g.reshape(o.o, (B * T, G, k))
    x = gemm_input(g, "grouped_out_proj", a, x, TensorType((B * T, G, k), o.types["o"].dtype))  # per group's K
    x = g.op("Transpose", x, perm=[1, 0, 2])  # [G, BT, k]
    z = g.matmul_t(x, g.reshape(w, (G, R // G, k)))  # [G, BT, R/G]
    return g.reshape(g.op("Transpose", z, perm=[1, 0, 2]), (B, T, R))
