"""ONNX lowerings of the `router` kernel family: router."""

from __future__ import annotations

from . import linear


def lower_router(g, o, a, r):
    if a["fp32"] and o.types["x"].dtype != "fp32":  # on fp32 activations the fp32 router is the same maths
        raise NotImplementedError("router fp32 on a non-fp32 input (cpu: fp32)")
    k = a["k"]
    scores = g.op("Sqrt", g.op("Softplus", linear.linear(g, o.x, o.types["x"], o.w, o.types["w"])))
    if o.tid2eid is not None:
        idx = g.op("Gather", o.tid2eid, g.clamp_min0(g.as_i64(o.ids, o.types["ids"].dtype)), axis=0)
    else:
        idx = g.op("TopK", g.op("Add", scores, o.bias), g.i64(k), n_out=2, axis=-1, largest=1, sorted=1)[1]
    wts = g.op("GatherElements", scores, idx, axis=-1)
    wts = g.op("Div", wts, g.op("Add", g.sum(wts, -1, 1), g.scalar(a["denom_eps"])))
    return g.op("Mul", wts, g.scalar(a["route_scale"])), idx
