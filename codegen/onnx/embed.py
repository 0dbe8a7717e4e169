"""ONNX lowerings of the `embed` kernel family: embed."""

from __future__ import annotations


def lower_embed(g, o, a, r):
    return g.op("Gather", o.table, g.clamp_min0(g.as_i64(o.ids, o.types["ids"].dtype)), axis=0)
