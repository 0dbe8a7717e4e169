"""ONNX lowerings of the `moe` kernel family: moe_experts_shared, moe_experts."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ...ir.types import TensorType
from . import native_gemm


def moe_routed(g, x: str, xt: TensorType, weights: str, indices: str, w1: str, w2: str, w3: str,
               w1t: TensorType, k: int, limit: float, route_weight: str) -> str:
    """Routed experts. Few (token, expert) pairs: gather each pair's expert matrices (what decode reads);
    as many pairs as experts or more: every expert on every token, combined with the routing weights.
    The weight scales w2's output ("after_w2") or its input ("before_w2"), as the op says."""
    D = xt.shape[-1]
    N = xt.numel // D
    E = w1t.shape[0]
    flat = g.reshape(x, (N, D))
    idx = g.reshape(indices, (N, k))
    wts = g.reshape(weights, (N, k))
    lim = g.scalar(limit)

    def swiglu(gt: str, up: str) -> str:
        gt = g.op("Min", gt, lim)
        return g.op("Mul", g.op("Mul", gt, g.op("Sigmoid", gt)), g.op("Clip", up, g.op("Neg", lim), lim))

    if N * k < E:
        # each (token, expert) pair: W_e [out, in] times the token as a column (a GEMV on the weight as
        # stored: no transposed copy of a weight)
        fi = g.reshape(idx, (N * k,))
        xr = g.reshape(g.op("Expand", g.unsqueeze(flat, 1), g.i64(N, k, D)), (N * k, D, 1))
        h = swiglu(g.op("MatMul", g.op("Gather", w1, fi, axis=0), xr),
                   g.op("MatMul", g.op("Gather", w3, fi, axis=0), xr))  # [N*k, I, 1]
        pw = g.reshape(wts, (N * k, 1, 1))
        if route_weight == "before_w2":
            h = g.op("Mul", h, pw)
        y = g.op("MatMul", g.op("Gather", w2, fi, axis=0), h)  # [N*k, D, 1]
        if route_weight == "after_w2":
            y = g.op("Mul", y, pw)
        out = g.sum(g.reshape(y, (N, k, D)), 1)
    else:
        xe = g.unsqueeze(flat, 0)  # [1, N, D]
        h = swiglu(g.matmul_t(xe, w1), g.matmul_t(xe, w3))  # [E, N, I]
        onehot = g.cast(g.op("Equal", g.unsqueeze(idx, -1), g.const(np.arange(E), np.int64)),
                           TensorProto.FLOAT)  # [N, k, E]
        comb = g.sum(g.op("Mul", onehot, g.unsqueeze(wts, -1)), 1)  # [N, E]
        comb = g.unsqueeze(g.op("Transpose", comb, perm=[1, 0]), -1)  # [E, N, 1]
        if route_weight == "before_w2":
            h = g.op("Mul", h, comb)
        y = g.matmul_t(h, w2)  # [E, N, D]
        if route_weight == "after_w2":
            y = g.op("Mul", y, comb)
        out = g.sum(y, 0)
    return g.reshape(out, xt.shape)


def lower_moe_experts_shared(g, o, a, r):
    if any(getattr(o, n) is not None for n in ("w1_scale", "s1_scale")):
        raise NotImplementedError("moe_experts_shared: the ONNX lowering takes dense fp32 experts")
    native_gemm("moe_experts_shared", a)
    x, xt, lim = o.x, o.types["x"], a["limit"]
    routed = moe_routed(g, x, xt, o.weights, o.indices, o.w1, o.w2, o.w3, o.types["w1"], o.types["indices"].shape[-1],
                          lim, a["route_weight"])
    gt = g.op("Min", g.linear(x, xt, o.s1, o.types["s1"]), g.scalar(lim))
    up = g.op("Clip", g.linear(x, xt, o.s3, o.types["s3"]), g.scalar(-lim), g.scalar(lim))
    h = g.op("Mul", g.op("Mul", gt, g.op("Sigmoid", gt)), up)
    return g.op("Add", routed, g.linear(h, xt.with_shape(*xt.shape[:-1], o.types["s1"].shape[0]), o.s2, o.types["s2"]))


def lower_moe_experts(g, o, a, r):
    if o.w1_scale is not None:
        raise NotImplementedError("moe_experts: the ONNX lowering takes dense fp32 experts")
    native_gemm("moe_experts", a)
    return moe_routed(g, o.x, o.types["x"], o.weights, o.indices, o.w1, o.w2, o.w3, o.types["w1"],
                        o.types["indices"].shape[-1], a["limit"], a["route_weight"])
