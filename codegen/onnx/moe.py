"""ONNX lowerings of the `moe` kernel family: moe_experts_shared, moe_experts."""

from __future__ import annotations

from . import native_gemm


def lower_moe_experts_shared(g, o, a, r):
    if any(getattr(o, n) is not None for n in ("w1_scale", "s1_scale")):
        raise NotImplementedError("moe_experts_shared: the ONNX lowering takes dense fp32 experts")
    native_gemm("moe_experts_shared", a)
    x, xt, lim = o.x, o.types["x"], a["limit"]
    routed = g.moe_routed(x, xt, o.weights, o.indices, o.w1, o.w2, o.w3, o.types["w1"], o.types["indices"].shape[-1],
                          lim, a["route_weight"])
    gt = g.op("Min", g.linear(x, xt, o.s1, o.types["s1"]), g.scalar(lim))
    up = g.op("Clip", g.linear(x, xt, o.s3, o.types["s3"]), g.scalar(-lim), g.scalar(lim))
    h = g.op("Mul", g.op("Mul", gt, g.op("Sigmoid", gt)), up)
    return g.op("Add", routed, g.linear(h, xt.with_shape(*xt.shape[:-1], o.types["s1"].shape[0]), o.s2, o.types["s2"]))


def lower_moe_experts(g, o, a, r):
    if o.w1_scale is not None:
        raise NotImplementedError("moe_experts: the ONNX lowering takes dense fp32 experts")
    native_gemm("moe_experts", a)
    return g.moe_routed(o.x, o.types["x"], o.weights, o.indices, o.w1, o.w2, o.w3, o.types["w1"],
                        o.types["indices"].shape[-1], a["limit"], a["route_weight"])
