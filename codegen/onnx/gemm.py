"""ONNX lowerings of the `gemm` kernel family: linear, norm_linear."""

from __future__ import annotations

from . import native_gemm


def lower_linear(g, o, a, r):
    native_gemm("linear", a)
    return g.linear(o.x, o.types["x"], o.w, o.types["w"], o.scale)


def lower_norm_linear(g, o, a, r):
    native_gemm("norm_linear", a)
    return g.linear(g.rms(o.x, o.norm, a["eps"]), o.types["x"], o.w, o.types["w"], o.scale)
