"""Quantisation numerics of the cpu target's graphs (`formats.py`, spec 13): the FP8 / FP4 round trips with
their UE8M0 power-of-two scales, the FP8 GEMM's activation rounding and the QAT roundings (`fp8_round`,
`hadamard_fp4`), each written out in ONNX ops so the values are the reference's bit for bit."""

from __future__ import annotations

import math

from onnx import TensorProto

from ...ir.types import TensorType


def pow2_scale(g, amax: str, qmax: float, floor: float) -> str:
    """2^ceil(log2(max(amax, floor) / qmax)), exact: the log2 estimate is corrected by one step each way."""
    r = g.op("Div", g.op("Max", amax, g.scalar(floor)), g.scalar(qmax))
    e = g.op("Ceil", g.op("Div", g.op("Log", r), g.scalar(math.log(2.0))))
    two = g.scalar(2.0)
    lower = g.op("Pow", two, g.op("Sub", e, g.scalar(1.0)))
    e = g.where(g.op("GreaterOrEqual", lower, r), g.op("Sub", e, g.scalar(1.0)), e)
    e = g.where(g.op("Less", g.op("Pow", two, e), r), g.op("Add", e, g.scalar(1.0)), e)
    return g.op("Pow", two, e)


def fp8_qdq(g, x: str, xt: TensorType, block: int) -> str:
    """Spec 13.2: round through e4m3 with one UE8M0 scale per `block` values of the last axis."""
    lead, n = xt.shape[:-1], xt.shape[-1]
    grp = g.reshape(x, (*lead, n // block, block))
    s = pow2_scale(g, g.max(g.op("Abs", grp), -1, 1), 448.0, 1e-4)
    q = g.op("Clip", g.op("Div", grp, s), g.scalar(-448.0), g.scalar(448.0))
    q = g.cast(g.op("Cast", q, to=TensorProto.FLOAT8E4M3FN, saturate=1), TensorProto.FLOAT)
    return g.reshape(g.op("Mul", q, s), xt.shape)


def fp4_qdq(g, x: str, xt: TensorType, block: int = 32) -> str:
    """Spec 13.3: round through e2m1 (nearest magnitude, ties to the even code) with a UE8M0 scale."""
    from v4compile.formats import FP4_VALUES

    lead, n = xt.shape[:-1], xt.shape[-1]
    grp = g.reshape(x, (*lead, n // block, block))
    s = pow2_scale(g, g.max(g.op("Abs", grp), -1, 1), 6.0, 6.0 * 2.0 ** -126)
    y = g.op("Clip", g.op("Div", grp, s), g.scalar(-6.0), g.scalar(6.0))
    dist = g.op("Abs", g.op("Sub", g.unsqueeze(g.op("Abs", y), -1), g.const(FP4_VALUES)))
    best = g.op("ReduceMin", dist, g.i64(-1), keepdims=1)
    pref = g.op("Mul", g.cast(g.op("Equal", dist, best), TensorProto.FLOAT),
                g.const([2.0 - (i & 1) for i in range(8)]))
    code = g.op("ArgMax", pref, axis=-1, keepdims=0)
    mag = g.op("Gather", g.const(FP4_VALUES), code)
    val = g.where(g.op("Less", y, g.scalar(0.0)), g.op("Neg", mag), mag)
    return g.reshape(g.op("Mul", val, s), xt.shape)


def act_qdq(g, x: str, xt: TensorType, block: int = 128) -> str:
    """`formats.act_qdq`: the FP8 GEMM's activation, per `block` values of the last axis (a partial last
    block has its own scale: its zero padding changes no amax)."""
    n = xt.shape[-1]
    full = n - n % block
    if full == 0:
        return fp8_qdq(g, x, xt, n)
    if full == n:
        return fp8_qdq(g, x, xt, block)
    a, b = g.split(x, (full, n - full))
    return g.concat([fp8_qdq(g, a, xt.with_shape(*xt.shape[:-1], full), block),
                     fp8_qdq(g, b, xt.with_shape(*xt.shape[:-1], n - full), n - full)], -1)


def hadamard_fp4(g, x: str, xt: TensorType, block: int = 32) -> str:
    from v4compile.formats import hadamard

    h = g.op("MatMul", x, g.const(hadamard(xt.shape[-1]).numpy()))
    return fp4_qdq(g, h, xt, block)


def fp8_round(g, x: str, xt: TensorType, dims: int, block: int) -> str:
    """`ops.numerics.fp8_round_ref`: FP8 on the first `dims` channels, the rest kept."""
    head, tail = g.split(x, (dims, xt.shape[-1] - dims))
    return g.concat([fp8_qdq(g, head, xt.with_shape(*xt.shape[:-1], dims), block), tail], -1)
