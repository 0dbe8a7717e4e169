"""ONNX lowerings of the `gemm` kernel family: linear, norm_linear."""

from __future__ import annotations

from . import gemm_input


def lower_linear(g, o, a, r):
    x = gemm_input(g, "linear", a, o.x, o.types["x"])
    return g.linear(x, o.types["x"], o.w, o.types["w"], o.scale, a["block"])


def lower_norm_linear(g, o, a, r):
    x = gemm_input(g, "norm_linear", a, g.rms(o.x, o.norm, a["eps"]), o.types["x"])
    return g.linear(x, o.types["x"], o.w, o.types["w"], o.scale, a["block"])
