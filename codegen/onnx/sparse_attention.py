"""ONNX lowerings of the `sparse_attention` kernel family: sparse_attention."""

from __future__ import annotations

from . import native_only


def lower_sparse_attention(g, o, a, r):
    native_only(a, o)
    parts = [(o.win_indptr, a["win_base"])] + ([(o.comp_indptr, a["comp_base"])] if o.comp_indptr is not None else [])
    return g.sparse_attention(o.q, o.types["q"], o.kv, g.as_i64(o.pos, o.types["pos"].dtype), o.sink, parts, o.p0,
                              a["window"], a["scale"])
