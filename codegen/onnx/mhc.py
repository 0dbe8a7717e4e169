"""ONNX lowerings of the `mhc` kernel family:
hc_pre_norm, mhc_post_pre, mhc_post_head, hc_expand, hc_pre, hc_post, hc_head.
"""

from __future__ import annotations


def lower_hc_pre_norm(g, o, a, r):
    y, post, comb = g.hc_pre(o.streams, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"], a["iters"])
    return (y if o.norm is None else g.rms(y, o.norm, a["norm_eps"])), post, comb


def lower_mhc_post_pre(g, o, a, r):
    out = g.hc_post(o.y, o.streams, o.types["streams"], o.post, o.comb)
    y, post, comb = g.hc_pre(out, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"], a["iters"])
    return out, (y if o.norm is None else g.rms(y, o.norm, a["norm_eps"])), post, comb


def lower_mhc_post_head(g, o, a, r):
    out = g.hc_post(o.y, o.streams, o.types["streams"], o.post, o.comb)
    return g.hc_head(out, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"])


def lower_hc_expand(g, o, a, r):
    return g.op("Expand", g.unsqueeze(o.x, -2), g.i64(*r[0].shape))


def lower_hc_pre(g, o, a, r):
    return g.hc_pre(o.streams, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"], a["iters"])


def lower_hc_post(g, o, a, r):
    return g.hc_post(o.y, o.streams, o.types["streams"], o.post, o.comb)


def lower_hc_head(g, o, a, r):
    return g.hc_head(o.streams, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"])
