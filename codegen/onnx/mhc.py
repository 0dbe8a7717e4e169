"""ONNX lowerings of the `mhc` kernel family:
hc_pre_norm, mhc_post_pre, mhc_post_head, hc_expand, hc_pre, hc_post, hc_head.
"""

from __future__ import annotations

import numpy as np

from ...ir.types import TensorType


def hc_mix(g, streams: str, st: TensorType, fn: str, eps: float) -> str:
    """RMS-normalised flattened streams times fn^T (`ops.mhc._mix_inputs`)."""
    *lead, n, d = st.shape
    flat = g.rms(g.reshape(streams, (*lead, n * d)), None, eps, n * d)
    return g.matmul_t(flat, fn)


def sinkhorn(g, comb: str, eps: float, iters: int) -> str:
    """The spec's Sinkhorn (one column normalisation, then `iters - 1` (row, column) pairs, eps in every
    denominator) on [..., n, n] matrices in 2 * iters + 2 nodes instead of ~4 * iters: per-node overhead is
    what a decode step costs.

    Only the first column normalisation is written out with its eps: its sums can be as small as n * eps (a
    column the softmax left empty), where eps changes the result. After it every row and column sum lies in
    ~[1/n, n] (a softmax row sums to 1), so each later eps is a factor 1 / (1 + eps / s) on one row or
    column: to first order the same factor (1 - eps) on every row or column, which the next normalisation
    removes, and only the last one survives; hence eps-free `LpNormalization` (p=1: x / sum|x|, entries > 0)
    for the rest and one final 1 / (1 + eps). Measured against the spec in float64 (tests/onnx/
    test_onnx_sinkhorn.py): within the error of the spec's own fp32 evaluation (<= 3e-7), also for peaked
    and sparse-support inputs where Sinkhorn converges slowly."""
    c = g.op("Div", comb, g.op("Add", g.op("ReduceSum", comb, g.i64(-2), keepdims=1), g.scalar(eps)))
    for _ in range(iters - 1):
        c = g.op("LpNormalization", c, axis=-1, p=1)
        c = g.op("LpNormalization", c, axis=-2, p=1)
    return g.op("Mul", c, g.scalar(1.0 / (1.0 + eps))) if iters > 1 else c


def transpose_last(g, x: str, rank: int | None = None) -> str:
    r = rank or g.memo.get(("rank_of", x), None)
    if r is None:
        raise ValueError("transpose_last needs the rank")
    perm = list(range(r - 2)) + [r - 1, r - 2]
    return g.op("Transpose", x, perm=perm)


def hc_pre(g, streams: str, st: TensorType, fn: str, base: str, scale: str, eps: float, hc_eps: float,
           iters: int) -> tuple[str, str, str]:
    *lead, n, d = st.shape
    m = hc_mix(g, streams, st, fn, eps)
    # m * scale + base for all 2n + n*n entries at once (the same products and sums as per part): the
    # scale per entry is a Gather of a weight by constants, which ONNX Runtime folds at session creation
    per = g.op("Gather", scale, g.const(np.repeat(np.arange(3), (n, n, n * n)), np.int64), axis=0)
    pre_z, post_z, comb_z = g.split(g.op("Add", g.op("Mul", m, per), base), (n, n, n * n))
    pre = g.op("Add", g.op("Sigmoid", pre_z), g.scalar(hc_eps))
    post = g.op("Mul", g.op("Sigmoid", post_z), g.scalar(2.0))
    comb = g.op("Add", g.op("Softmax", g.reshape(comb_z, (*lead, n, n)), axis=-1), g.scalar(hc_eps))
    comb = sinkhorn(g, comb, hc_eps, iters)
    y = g.sum(g.op("Mul", g.unsqueeze(pre, -1), streams), -2)
    return y, post, comb


def hc_post(g, y: str, streams: str, st: TensorType, post: str, comb: str) -> str:
    mixed = g.op("MatMul", transpose_last(g, comb, st.rank), streams)
    return g.op("Add", g.op("Mul", g.unsqueeze(post, -1), g.unsqueeze(y, -2)), mixed)


def hc_head(g, streams: str, st: TensorType, fn: str, base: str, scale: str, eps: float, hc_eps: float) -> str:
    m = hc_mix(g, streams, st, fn, eps)
    pre = g.op("Add", g.op("Sigmoid", g.op("Add", g.op("Mul", m, scale), base)), g.scalar(hc_eps))
    return g.sum(g.op("Mul", g.unsqueeze(pre, -1), streams), -2)


def lower_hc_pre_norm(g, o, a, r):
    y, post, comb = hc_pre(g, o.streams, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"], a["iters"])
    return (y if o.norm is None else g.rms(y, o.norm, a["norm_eps"])), post, comb


def lower_mhc_post_pre(g, o, a, r):
    out = hc_post(g, o.y, o.streams, o.types["streams"], o.post, o.comb)
    y, post, comb = hc_pre(g, out, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"], a["iters"])
    return out, (y if o.norm is None else g.rms(y, o.norm, a["norm_eps"])), post, comb


def lower_mhc_post_head(g, o, a, r):
    out = hc_post(g, o.y, o.streams, o.types["streams"], o.post, o.comb)
    return hc_head(g, out, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"])


def lower_hc_expand(g, o, a, r):
    return g.op("Expand", g.unsqueeze(o.x, -2), g.i64(*r[0].shape))


def lower_hc_pre(g, o, a, r):
    return hc_pre(g, o.streams, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"], a["iters"])


def lower_hc_post(g, o, a, r):
    return hc_post(g, o.y, o.streams, o.types["streams"], o.post, o.comb)


def lower_hc_head(g, o, a, r):
    return hc_head(g, o.streams, o.types["streams"], o.fn, o.base, o.scale, a["eps"], a["hc_eps"])
