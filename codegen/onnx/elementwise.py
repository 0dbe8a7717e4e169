"""ONNX lowerings of the `elementwise` kernel family: swiglu, add."""

from __future__ import annotations


def lower_swiglu(g, o, a, r):
    lim = a["limit"]
    gate = g.op("Min", o.gate, g.scalar(lim))
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), g.op("Clip", o.up, g.scalar(-lim), g.scalar(lim)))


def lower_add(g, o, a, r):
    return g.op("Add", o.a, o.b)
