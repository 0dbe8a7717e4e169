"""ONNX lowerings of the `grouped_gemm` kernel family: grouped_out_proj."""

from __future__ import annotations


def lower_grouped_out_proj(g, o, a, r):
    if o.scale is not None or o.o_scale is not None or a.get("act", "native") != "native":
        raise NotImplementedError("grouped_out_proj: the ONNX lowering takes dense fp32 operands (act native)")
    B, T = o.types["o"].shape[:2]
    G, (R, k) = a["groups"], o.types["w"].shape
    x = g.op("Transpose", g.reshape(o.o, (B * T, G, k)), perm=[1, 0, 2])  # [G, BT, k]
    z = g.matmul_t(x, g.reshape(o.w, (G, R // G, k)))  # [G, BT, R/G]
    return g.reshape(g.op("Transpose", z, perm=[1, 0, 2]), (B, T, R))
