"""Rotary position embedding in the cpu target's graphs: the cos / sin tables of a step's positions (one
Sin / Cos per positions and frequencies, shared by every layer) and the interleaved rotation
(`ops.rope.rotate`), forward and inverse, as four nodes or, at one position, one MatMul."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from ...ir.types import TensorType


def rope_tables(g, pos: str, pos_rank: int, extra: int, dim: int, theta: float, yarn: tuple,
                inverse: bool, width: int | None = None) -> tuple[str, str]:
    """cos / sin `[*pos, 1 * extra, width]` (each pair's value twice) at integer positions, for the last
    `dim` of `width` channels: the first `width - dim` have frequency 0 (cos 1, sin 0 exactly). One
    Sin / Cos per positions and frequencies: the other ranks (q's head axis) are Unsqueezes of them and
    the inverse's sin their Neg (the same values, so every user shares the one computation)."""
    width = width or dim
    key = (pos, dim, width, theta, tuple(yarn))

    def base():
        from v4compile.ops.rope import inv_freq

        f = np.concatenate([np.zeros(width - dim, np.float32), np.repeat(inv_freq(dim, theta, tuple(yarn)).numpy(), 2)])
        ang = g.op("Mul", g.unsqueeze(g.cast(pos, TensorProto.FLOAT), -1), g.const(f))
        return g.op("Cos", ang), g.op("Sin", ang)

    def ranked():
        cos, sin = g.cached(("rope",) + key, base)
        if not extra:
            return cos, sin
        axes = g.i64(*range(pos_rank, pos_rank + extra))
        return g.op("Unsqueeze", cos, axes), g.op("Unsqueeze", sin, axes)

    def make():
        cos, sin = g.cached(("rope", extra) + key, ranked)
        return cos, (g.op("Neg", sin) if inverse else sin)
    return g.cached(("rope", extra, inverse) + key, make)


def rotate(g, x: str, xt: TensorType, pos: str, pos_rank: int, dim: int, theta: float, yarn: tuple,
           inverse: bool = False, fused: bool = False) -> str:
    """Interleaved RoPE on the last `dim` channels, as `ops.rope.rotate`: x * cos + rot_half(x) * sin over
    all D channels, rot_half (pairs (a, b) -> (-b, a)) an exact product with a constant +-1 matrix that
    is zero on the first D - dim channels, where cos is 1 and sin 0: those come out as x + 0 = x, bit
    for bit (finite x), with no Split / Concat around the rotation (two nodes fewer a call). The inverse
    (sin negated) subtracts the product instead: x * cos - r * sin is x * cos + r * (-sin) bit for bit.

    `fused`, at a single position (a decode step at batch 1, `one_token(1, "rotate")`): one MatMul with
    the step's rotation matrix diag(cos) + R diag(sin), built once per positions and frequencies, for
    the four nodes. The first D - dim channels still come out exactly (a column of the identity); a
    rotated one is x_a cos + x_b sin in one GEMM sum (an FMA may round once where the four nodes round
    twice: ~1 ulp), so a caller whose result feeds a rounding to a coarse grid (FP4) keeps it off.
    At a batch-1 verify step's few positions (pos [1, T], `few_lanes(T)`), the same form vectorised
    over them: one [*pos, D, D] stack of those matrices, and one batched MatMul a call (x without a head
    axis: Unsqueeze / Squeeze around it), so each lane rotates as a decode step at its position would."""
    lead, D = xt.shape[:-1], xt.shape[-1]
    R = np.zeros((D, D), np.float32)
    for i in range(D - dim, D, 2):
        R[i + 1, i], R[i, i + 1] = -1.0, 1.0
    if fused and math.prod(lead[:pos_rank]) == 1 and g.one_token(1, "rotate"):
        def matrix():
            cos, sin = rope_tables(g, pos, pos_rank, 0, dim, theta, yarn, False, D)  # [1.., D]
            m = g.op("Sub" if inverse else "Add", g.op("Mul", cos, g.const(np.eye(D, dtype=np.float32))),
                     g.op("Mul", sin, g.const(R)))
            return m if pos_rank == 1 else g.reshape(m, (D, D))  # cos [1, D]: m is [D, D] already
        return g.op("MatMul", x, g.cached(("rope_matrix", pos, dim, D, theta, tuple(yarn), inverse), matrix))
    extra = len(lead) - pos_rank
    if fused and pos_rank == 2 and extra <= 1 and lead[0] == 1 and g.few_lanes(lead[1], "rotate"):
        def lanes():  # the one-position matrix for each of a verify step's positions: [*pos, D, D]
            cos, sin = rope_tables(g, pos, pos_rank, 1, dim, theta, yarn, False, D)  # [*pos, 1, D]
            return g.op("Sub" if inverse else "Add", g.op("Mul", cos, g.const(np.eye(D, dtype=np.float32))),
                        g.op("Mul", sin, g.const(R)))
        m = g.cached(("rope_matrices", pos, pos_rank, dim, D, theta, tuple(yarn), inverse), lanes)
        if extra:  # [*pos, H, D] @ [*pos, D, D]: each position's heads through its own matrix
            return g.op("MatMul", x, m)
        return g.squeeze(g.op("MatMul", g.unsqueeze(x, -2), m), -2)
    cos, sin = rope_tables(g, pos, pos_rank, extra, dim, theta, yarn, False, D)
    return g.op("Sub" if inverse else "Add", g.op("Mul", x, cos),
                g.op("Mul", g.op("MatMul", x, g.const(R)), sin))
