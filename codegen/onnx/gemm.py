"""ONNX lowerings of the `gemm` kernel family: linear, norm_linear, linear_pair."""

from __future__ import annotations

from . import gemm_input, linear


def lower_linear(g, o, a, r):
    x = gemm_input(g, "linear", a, o.x, o.types["x"])
    return linear.linear(g, x, o.types["x"], o.w, o.types["w"], o.scale, a["block"])


def lower_norm_linear(g, o, a, r):
    x = gemm_input(g, "norm_linear", a, g.rms(o.x, o.norm, a["eps"]), o.types["x"])
    return linear.linear(g, x, o.types["x"], o.w, o.types["w"], o.scale, a["block"])


def lower_linear_pair(g, o, a, r):
    """Two `linear`s of one input (one launch on the GPU targets; two MatMuls here)."""
    ys = []
    for i in (0, 1):
        x = gemm_input(g, "linear_pair", {"act": a[f"act{i}"], "out_dtype": a[f"out_dtype{i}"]}, o.x, o.types["x"])
        ys.append(linear.linear(g, x, o.types["x"], getattr(o, f"w{i}"), o.types[f"w{i}"], getattr(o, f"scale{i}"),
                                a[f"block{i}"]))
    return ys[0], ys[1]
