"""ONNX lowerings of the `rms_norm` kernel family: rms_norm."""

from __future__ import annotations


def lower_rms_norm(g, o, a, r):
    if a["mean"] != "fp32" and o.types["x"].dtype != "fp32":  # in fp32 both statistics are the same maths
        raise NotImplementedError("rms_norm mean=\"dtype\" on a non-fp32 input (cpu: fp32)")
    return g.rms(o.x, o.weight, a["eps"], o.types["x"].shape[-1])
