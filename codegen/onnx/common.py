"""ONNX lowerings of ops without a kernel family: reshape, split, fp8_round, hadamard_fp4_round, rope."""

from __future__ import annotations

from . import quant, rotary


def lower_reshape(g, o, a, r):
    return g.reshape(o.x, r[0].shape)


def lower_split(g, o, a, r):
    return g.split(o.x, (a["at"], o.types["x"].shape[-1] - a["at"]))


def lower_fp8_round(g, o, a, r):
    return quant.fp8_round(g, o.x, o.types["x"], a["dims"], a["block"])


def lower_hadamard_fp4_round(g, o, a, r):
    return quant.hadamard_fp4(g, o.x, o.types["x"], a["block"])


def lower_rope(g, o, a, r):
    return rotary.rotate(g, o.x, o.types["x"], g.as_i64(o.pos, o.types["pos"].dtype), o.types["pos"].rank, a["dim"],
                         a["theta"], tuple(a["yarn"]), a["inverse"])
