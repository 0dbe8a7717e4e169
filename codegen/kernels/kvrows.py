"""Shared Triton helpers of the attention-side families (not a family itself): UE8M0 scales, FP8 / FP4
rounding, RoPE, and reading / writing rows of the paged pool's plane families (`v4compile/pool.py`).

Plane formats (`fmt` attribute of the paged ops, `v4compile/ops/paged.py`):
  main  native | bf16 : p0 [N, d]                       (value cast to the plane dtype)
  main  fp8           : p0 nope [N, d-r] e4m3, p1 [N, (d-r)/blk] e8m0, p2 rope [N, r]   (NPLANES = 3)
  index fp4           : p0 [N, d/2] e2m1 pairs (low nibble first), p1 [N, d/32] e8m0
  index fp8           : p0 [N, d] e4m3, p1 [N, 1] fp32 power-of-two row scale          (NPLANES = 2)
Each helper takes a tile `[R, DP]` of rows (DP = next power of two of the row width d, padded lanes
masked) and the physical row numbers `[R]`.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

FP8_MAX = 448.0
FP4_MAX = 6.0

# Triton element types of the compute dtypes (for in-kernel casts that emulate the reference's roundings).
TL_DTYPE = {"fp32": tl.float32, "bf16": tl.bfloat16}


def hadamard_scale(n: int) -> float:
    import torch  # (here, not at the top: the AOT worker imports this module and needs no torch)
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float64).float())


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def rope_table(dim: int, theta: float, yarn: tuple) -> tuple[float, ...]:
    """The fp32 inverse frequencies of the reference (`ops.rope.inv_freq`), as exact constexpr floats: an
    in-kernel `theta ** x` would differ in the last bits and the error grows with the position."""
    from ...ops.rope import inv_freq  # (torch: here, not at the top, as in `hadamard_scale`)
    return tuple(float(v) for v in inv_freq(dim, theta, tuple(yarn)).tolist())


def plane_strides(planes: list) -> dict:
    """Row strides of up to three planes as constexprs (0 for an absent plane)."""
    return {f"S{i}": (planes[i].strides[0] if i < len(planes) and planes[i] is not None else 0) for i in range(3)}


def plane_dtype_tl(arg) -> tl.dtype | None:
    return None if arg is None else {"fp32": tl.float32, "bf16": tl.bfloat16, "fp8e4m3": tl.float8e4nv,
                                     "e8m0": tl.uint8, "fp4x2": tl.uint8}[arg.dtype]


@triton.jit
def pow2_scale(amax, QMAX: tl.constexpr, FLOOR: tl.constexpr):
    """`2^ceil(log2(max(amax, FLOOR) / QMAX))` computed exactly from the fp32 bits (a hardware log2 can be
    off by an ulp at exact powers of two and then ceil jumps a whole binade). Returns (scale, e8m0 byte)."""
    x = tl.maximum(amax, FLOOR) / QMAX
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 1), 254)
    return (e << 23).to(tl.float32, bitcast=True), e


@triton.jit
def e8m0_float(byte):
    """E8M0 byte -> 2^(byte - 127) (byte 0 -> 2^-127 as a subnormal is not needed: scales here are >= 2^-126)."""
    e = byte.to(tl.int32)
    return (tl.maximum(e, 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp4_code(v):
    """Nearest e2m1 code of v (|v| <= 6), ties to the even code, sign in bit 3 (never on zero)."""
    a = tl.abs(v)
    c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
         + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return c + 8 * ((v < 0) & (c != 0)).to(tl.int32)


@triton.jit
def fp4_value(code):
    """e2m1 code (int) -> fp32 value."""
    m = code & 1
    e = (code >> 1) & 3
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, (1.0 + 0.5 * m.to(tl.float32)) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def group_amax(x, R: tl.constexpr, DP: tl.constexpr, BLK: tl.constexpr):
    """|x| max over groups of BLK consecutive columns, broadcast back to [R, DP]."""
    g = tl.max(tl.reshape(tl.abs(x), [R, DP // BLK, BLK]), axis=2)
    return tl.reshape(tl.broadcast_to(tl.expand_dims(g, 2), [R, DP // BLK, BLK]), [R, DP])


@triton.jit
def fp8_qdq(x, DIMS: tl.constexpr, R: tl.constexpr, DP: tl.constexpr, BLK: tl.constexpr):
    """Spec 13.2 (`formats.fp8_qdq` on the first DIMS columns): e4m3 with a UE8M0 scale per BLK values."""
    s, _e = pow2_scale(group_amax(x, R, DP, BLK), 448.0, 1e-4)
    q = tl.minimum(tl.maximum(x / s, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * s
    col = tl.arange(0, DP)[None, :]
    return tl.where(col < DIMS, q, x)


@triton.jit
def fp4_qdq(x, R: tl.constexpr, DP: tl.constexpr):
    """Spec 13.3 (`formats.fp4_qdq`, block 32): e2m1 with a UE8M0 scale per 32 values."""
    s, _e = pow2_scale(group_amax(x, R, DP, 32), 6.0, 6.0 * 2.0 ** -126)
    v = tl.minimum(tl.maximum(x / s, -6.0), 6.0)
    return fp4_value(fp4_code(v)) * s


@triton.jit
def fwht(x, R: tl.constexpr, DP: tl.constexpr, HS: tl.constexpr):
    """x [R, DP] times the orthonormal Sylvester Walsh-Hadamard matrix (DP a power of two; HS =
    fp32(1/sqrt(DP)), `hadamard_scale`): log2(DP) butterfly stages (a + b, a - b) on pairs h apart, then
    the scale. The reference multiplies by the dense matrix; the sums round differently by fp32 ulps."""
    for k in tl.static_range(16):
        if (1 << k) < DP:
            y = tl.permute(tl.reshape(x, [R, DP // (2 << k), 2, 1 << k]), (0, 1, 3, 2))
            a, b = tl.split(y)
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, DP])
    return x * HS


@triton.jit
def rope(x, posf, F: tl.constexpr, R: tl.constexpr, DP: tl.constexpr, D: tl.constexpr, DIM: tl.constexpr,
         DT: tl.constexpr):
    """Interleaved RoPE (`ops.rope.rotate`) of the last DIM of D columns of x [R, DP] (fp32 holding DT
    values) at positions posf [R]: cos / sin in fp32 rounded to DT, rotation in fp32, result rounded to DT."""
    a, b = tl.split(tl.reshape(x, [R, DP // 2, 2]))
    k = tl.arange(0, DP // 2) - (D - DIM) // 2
    f = tl.zeros([DP // 2], tl.float32)
    for i in tl.static_range(len(F)):
        f = tl.where(k == i, F[i], f)
    ang = posf[:, None] * f[None, :]
    c = tl.cos(ang).to(DT).to(tl.float32)
    s = tl.sin(ang).to(DT).to(tl.float32)
    ra = (a * c - b * s).to(DT).to(tl.float32)
    rb = (b * c + a * s).to(DT).to(tl.float32)
    rot = ((k >= 0) & (k < DIM // 2))[None, :]
    return tl.reshape(tl.join(tl.where(rot, ra, a), tl.where(rot, rb, b)), [R, DP])


@triton.jit
def store_rows(p0, p1, p2, rows, ok, x, FMT: tl.constexpr, NPLANES: tl.constexpr, R: tl.constexpr,
               DP: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr,
               S1: tl.constexpr, S2: tl.constexpr):
    """`ops.paged.write_rows`: store the rows x [R, DP] (fp32 holding the value dtype) at physical rows
    rows [R] where ok [R], in the plane format FMT."""
    col = tl.arange(0, DP)[None, :]
    r = rows.to(tl.int64)[:, None]
    m = ok[:, None] & (col < D)
    if FMT == "fp8":
        if NPLANES == 3:
            s, e = pow2_scale(group_amax(tl.where(col < NOPE, x, 0.0), R, DP, BLK), 448.0, 1e-4)
            q = tl.minimum(tl.maximum(x / s, -448.0), 448.0).to(tl.float8e4nv)
            tl.store(p0 + r * S0 + col, q, mask=m & (col < NOPE))
            gcol = col // BLK
            first = (col % BLK) == 0
            tl.store(p1 + r * S1 + gcol, e.to(tl.uint8), mask=m & first & (col < NOPE))
            tl.store(p2 + r * S2 + (col - NOPE), x.to(p2.dtype.element_ty), mask=m & (col >= NOPE))
        else:
            amax = tl.max(tl.where(col < D, tl.abs(x), 0.0), axis=1)
            s, _e = pow2_scale(amax, 448.0, 1e-4)
            q = tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0).to(tl.float8e4nv)
            tl.store(p0 + r * S0 + col, q, mask=m)
            tl.store(p1 + rows.to(tl.int64) * S1, s, mask=ok)
    elif FMT == "fp4":
        s, e = pow2_scale(group_amax(x, R, DP, 32), 6.0, 6.0 * 2.0 ** -126)
        code = fp4_code(tl.minimum(tl.maximum(x / s, -6.0), 6.0))
        lo, hi = tl.split(tl.reshape(code, [R, DP // 2, 2]))
        byte = (lo | (hi << 4)).to(tl.uint8)
        c2 = tl.arange(0, DP // 2)[None, :]
        tl.store(p0 + r * S0 + c2, byte, mask=ok[:, None] & (c2 < D // 2))
        tl.store(p1 + r * S1 + col // 32, e.to(tl.uint8), mask=m & ((col % 32) == 0))
    else:
        tl.store(p0 + r * S0 + col, x.to(p0.dtype.element_ty), mask=m)


@triton.jit
def load_rows(p0, p1, p2, rows, ok, FMT: tl.constexpr, NPLANES: tl.constexpr, R: tl.constexpr, DP: tl.constexpr,
              D: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
              S2: tl.constexpr):
    """`ops.paged.read_rows` before its final cast: rows [R] -> fp32 [R, DP] (0 where not ok or padded).
    fp8 main rows are dequantised in the RoPE plane's dtype, as the reference does."""
    col = tl.arange(0, DP)[None, :]
    r = rows.to(tl.int64)[:, None]
    m = ok[:, None] & (col < D)
    if FMT == "fp8":
        if NPLANES == 3:
            q = tl.load(p0 + r * S0 + col, mask=m & (col < NOPE), other=0.0).to(tl.float32)
            e = tl.load(p1 + r * S1 + col // BLK, mask=m & (col < NOPE), other=127)
            nope = (q * e8m0_float(e)).to(p2.dtype.element_ty).to(tl.float32)
            rp = tl.load(p2 + r * S2 + (col - NOPE), mask=m & (col >= NOPE), other=0.0).to(tl.float32)
            x = tl.where(col < NOPE, nope, rp)
        else:
            q = tl.load(p0 + r * S0 + col, mask=m, other=0.0).to(tl.float32)
            s = tl.load(p1 + rows.to(tl.int64) * S1, mask=ok, other=0.0)
            x = q * s[:, None]
    elif FMT == "fp4":
        byte = tl.load(p0 + r * S0 + col // 2, mask=m, other=0).to(tl.int32)
        code = (byte >> ((col % 2) * 4)) & 0xF
        e = tl.load(p1 + r * S1 + col // 32, mask=m, other=127)
        x = fp4_value(code) * e8m0_float(e)
    else:
        x = tl.load(p0 + r * S0 + col, mask=m, other=0.0).to(tl.float32)
    return tl.where(m, x, 0.0)


def plane_consts(fmt: str, planes: list, width: int) -> dict:
    """The constexprs `store_rows` / `load_rows` take for a plane family of row width `width`."""
    ps = [p for p in planes if p is not None]
    nope = ps[0].shape[1] if fmt == "fp8" and len(ps) == 3 else width
    blk = nope // ps[1].shape[1] if fmt == "fp8" and len(ps) == 3 else 32
    return {"FMT": fmt if fmt in ("fp8", "fp4") else "native", "NPLANES": len(ps), "NOPE": nope, "BLK": blk,
            **plane_strides(ps)}



@triton.jit
def ring_keep(pos_ptr, b, lane, T: tl.constexpr, TP: tl.constexpr, SLOTS: tl.constexpr):
    """`ops.attention.ring_lanes` for the lanes `lane` of sequence b: valid lanes among the sequence's
    last SLOTS positions (so no ring slot is written twice). Returns (keep, pos) of those lanes."""
    allp = tl.load(pos_ptr + b * T + tl.arange(0, TP), mask=tl.arange(0, TP) < T, other=-1)
    n = tl.sum((allp >= 0).to(tl.int32), axis=0)
    start = tl.maximum(tl.max(tl.where(tl.arange(0, TP) == 0, allp, -1), axis=0), 0)
    p = tl.load(pos_ptr + b * T + lane, mask=lane < T, other=-1)
    last = start + n - 1
    return (lane < T) & (p >= 0) & (p > last - SLOTS), p
