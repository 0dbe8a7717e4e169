"""ONNX lowerings of the `compress` kernel family: compress_paged."""

from __future__ import annotations

from . import native_only


def lower_compress_paged(g, o, a, r):
    native_only(a, o)
    plane, skv, sg = g.compress(o, a, o.p0, o.state_kv, o.state_gate)
    return skv, sg, plane
