"""GEMM family: `linear` and `norm_linear` (`y = [rmsnorm](x) W^T`), every weight format of the checkpoint;
`linear_pair` (two GEMMs of one input whose weights cannot be stacked) in one launch of `gemm_pair_kernel`.

Weights: fp32 / bf16; FP8 e4m3 with a 128x128 scale grid (E8M0 bytes or fp32 multipliers); FP4 e2m1 packed
two per byte along K with 1x32 E8M0 scales. Activations: `act="native"` (x in its dtype times the
dequantised weight, fp32 accumulation) or `act="fp8"` (spec 13.1: per token and 128-wide K block,
s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(x / s)); the scales are applied per K block to the
fp32 partial sums). `norm_linear` applies the weighted RMSNorm on the way in (a first pass over the row for
its rsqrt, then the normalised row is rounded to x's dtype exactly as `rms_norm` would store it).

Always swap-AB: the accumulator is `acc[BN, BM] = W[BN, BK] @ x^T[BK, BM]`, so the weight rows sit on the
MMA's M side. Decode batches have few tokens and sm_90's fp8 wgmma needs M >= 64 (otherwise Triton falls
back to fp16 mma.sync); gfx950's MFMA is indifferent, so one orientation serves both targets and all M.
Weight scales are per output row (a [BN] vector) and per K tile, because BK divides the scale block.
FP4 weights use `tl.dot_scaled` (native MXFP4 MFMA on gfx950) for bf16 / fp8 activations; fp32
activations (the fp32 debug numerics) dequantise the nibbles in registers instead, to stay exact.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .pdl import pdl_enter
from .arrival import last_to_arrive
from .rotary import inverse_rope, rope_constants

FP8_MAX = tl.constexpr(448.0)
ACT_BLOCK = 128  # spec 13.1: one activation scale per 128 K values


@triton.jit
def _e8m0(b):
    """E8M0 byte(s) -> fp32 2^(b-127), exactly, by placing the byte in the exponent field."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_ceil(v):
    """2^ceil(log2(v)) for positive normal fp32 v, exactly (from the bits, not a log approximation)."""
    bits = v.to(tl.int32, bitcast=True)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_value(code):
    """e2m1 code (4 bits, sign in bit 3) -> fp32 value: exponent bits 2..1, mantissa bit 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def mma_step(acc, xt, xs, w_ptr, s_ptr, offs_n, n_ok, kk, k_ok, k0,
             K: tl.constexpr, W_RS: tl.constexpr, W_CS: tl.constexpr, S_RS: tl.constexpr, S_CS: tl.constexpr,
             W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
             CDT: tl.constexpr, BK: tl.constexpr):
    """acc[BN, BM] += W[offs_n, kk] @ xt[kk, BM] for one K tile, in any weight format / activation mode.
    xt is the activation tile transposed (K on axis 0), in the activation dtype, zero where masked.
    ACT "pre": xt is already e4m3 with per-column scales xs [BM] (a pre-quantised activation)."""
    if ACT == "pre":
        xq = xt
        sa = xs
    elif ACT == "fp8":
        xf = xt.to(tl.float32)
        sa = _pow2_ceil(tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-4) / FP8_MAX)  # [BM]
        inv = ((254 << 23) - sa.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)  # 1 / sa, exact
        xq = tl.minimum(tl.maximum(xf * inv[None, :], -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
    if W_FMT == "float":
        w = tl.load(w_ptr + offs_n[:, None] * W_RS + kk[None, :] * W_CS, mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(CDT)
        if ACT != "native":
            xa = (xq.to(tl.float32) * sa[None, :]).to(CDT)
        else:
            xa = xt.to(CDT)
        acc = tl.dot(w, xa, acc, input_precision="ieee")
    elif W_FMT == "fp8":
        wq = tl.load(w_ptr + offs_n[:, None] * W_RS + kk[None, :] * W_CS, mask=n_ok[:, None] & k_ok[None, :],
                     other=0.0)
        sb = tl.load(s_ptr + (offs_n // BLOCK) * S_RS + (k0 // BLOCK) * S_CS, mask=n_ok, other=0)
        sw = _e8m0(sb) if S_E8M0 else sb.to(tl.float32)
        if ACT != "native":
            acc += tl.dot(wq, xq) * sw[:, None] * sa[None, :]
        else:
            acc += tl.dot(wq.to(CDT), xt.to(CDT), input_precision="ieee") * sw[:, None]
    else:  # fp4: packed [N, K/2] bytes, scales [N, K/32]
        if CDT == tl.float32:
            # exact fp32 path (the fp32 debug numerics): decode each (n, k) nibble in registers
            byte = tl.load(w_ptr + offs_n[:, None] * W_RS + (kk[None, :] // 2) * W_CS,
                           mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.int32)
            code = (byte >> ((kk[None, :] & 1) * 4)) & 15
            sb = tl.load(s_ptr + offs_n[:, None] * S_RS + (kk[None, :] // BLOCK) * S_CS,
                         mask=n_ok[:, None] & k_ok[None, :], other=0)
            w = _fp4_value(code) * _e8m0(sb)
            if ACT != "native":
                xa = xq.to(tl.float32) * sa[None, :]
            else:
                xa = xt.to(tl.float32)
            acc = tl.dot(w, xa, acc, input_precision="ieee")
        else:
            kh = k0 // 2 + tl.arange(0, BK // 2)
            wp = tl.load(w_ptr + offs_n[:, None] * W_RS + kh[None, :] * W_CS,
                         mask=n_ok[:, None] & (kh[None, :] < K // 2), other=0)
            ks = k0 // BLOCK + tl.arange(0, BK // BLOCK)
            ws = tl.load(s_ptr + offs_n[:, None] * S_RS + ks[None, :] * S_CS,
                         mask=n_ok[:, None] & (ks[None, :] < K // BLOCK), other=127)
            if ACT != "native":
                acc += tl.dot_scaled(wp, ws, "e2m1", xq, None, "e4m3") * sa[None, :]
            else:
                acc = tl.dot_scaled(wp, ws, "e2m1", xt.to(tl.bfloat16), None, "bf16", acc)
    return acc


@triton.jit
def gemm_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, n_ptr, pos_ptr, y_ptr, part_ptr, sem_ptr,
                M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, G_K: tl.constexpr, XS_RS: tl.constexpr,
                SPLIT: tl.constexpr, KS: tl.constexpr, NT: tl.constexpr,
                X_RS: tl.constexpr, X_CS: tl.constexpr, Y_RS: tl.constexpr, Y_CS: tl.constexpr,
                W_RS: tl.constexpr, W_CS: tl.constexpr, S_RS: tl.constexpr, S_CS: tl.constexpr,
                W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                NORM: tl.constexpr, EPS: tl.constexpr, CDT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                ROPE_T: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr, D: tl.constexpr,
                DIM: tl.constexpr, FREQS: tl.constexpr, SIGN: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    gemm_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), x_ptr, xs_ptr, w_ptr, s_ptr, n_ptr, pos_ptr,
                 y_ptr, part_ptr, sem_ptr, M, N, K, G_K, XS_RS, SPLIT, KS, NT, X_RS, X_CS, Y_RS, Y_CS, W_RS, W_CS,
                 S_RS, S_CS, W_FMT, S_E8M0, BLOCK, ACT, NORM, EPS, CDT, BM, BN, BK, STAGES, ROPE_T, P_BS, P_TS, D,
                 DIM, FREQS, SIGN)


@triton.jit
def gemm_program(pid_n, pid_m, pid_z, x_ptr, xs_ptr, w_ptr, s_ptr, n_ptr, pos_ptr, y_ptr, part_ptr, sem_ptr,
                 M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, G_K: tl.constexpr, XS_RS: tl.constexpr,
                 SPLIT: tl.constexpr, KS: tl.constexpr, NT: tl.constexpr,
                 X_RS: tl.constexpr, X_CS: tl.constexpr, Y_RS: tl.constexpr, Y_CS: tl.constexpr,
                 W_RS: tl.constexpr, W_CS: tl.constexpr, S_RS: tl.constexpr, S_CS: tl.constexpr,
                 W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                 NORM: tl.constexpr, EPS: tl.constexpr, CDT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 ROPE_T: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr, D: tl.constexpr,
                 DIM: tl.constexpr, FREQS: tl.constexpr, SIGN: tl.constexpr):
    """Output tile (pid_n, pid_m) of group / K split pid_z of one GEMM (the body of `gemm_kernel`, and of
    each half of `gemm_pair_kernel`). pos_ptr (rope_out_proj): x is the attention output, rotated back
    (`rotary.inverse_rope`, heads of D channels, token m = b * ROPE_T + t at pos[b, t]) as each K tile is
    loaded, before any quantisation."""
    # axis z: group (grouped_out_proj: x columns [gid*G_K, +K), weight rows / y columns [gid*N, +N)) x K split
    gid = pid_z // SPLIT
    sid = pid_z % SPLIT
    local_n = pid_n * BN + tl.arange(0, BN)
    offs_n = gid * N + local_n
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_ok = local_n < N
    m_ok = offs_m < M
    rk = tl.arange(0, BK)
    x_ptr = x_ptr + gid * G_K * X_CS
    if pos_ptr is not None:
        tb = offs_m // ROPE_T
        pos = tl.load(pos_ptr + tb * P_BS + (offs_m - tb * ROPE_T) * P_TS, mask=m_ok, other=0).to(tl.float32)

    if NORM:
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            xt = tl.load(x_ptr + offs_m[None, :] * X_RS + kk[:, None] * X_CS,
                         mask=m_ok[None, :] & (kk[:, None] < K), other=0.0).to(tl.float32)
            ss += tl.sum(xt * xt, axis=0)
        rinv = 1.0 / tl.sqrt_rn(ss / K + EPS)

    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in tl.range(sid * KS, tl.minimum(sid * KS + KS, K), BK, num_stages=STAGES):
        kk = k0 + rk
        k_ok = kk < K
        xt = tl.load(x_ptr + offs_m[None, :] * X_RS + kk[:, None] * X_CS, mask=m_ok[None, :] & k_ok[:, None],
                     other=0.0)
        if NORM:
            nw = tl.load(n_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            xt = (nw[:, None] * (xt.to(tl.float32) * rinv[None, :])).to(x_ptr.dtype.element_ty)
        if pos_ptr is not None:
            # the pair partner (channel ^ 1): heads and each group's K start at even columns
            xp = tl.load(x_ptr + offs_m[None, :] * X_RS + (kk ^ 1)[:, None] * X_CS,
                         mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            xt = inverse_rope(xt.to(tl.float32), xp.to(tl.float32), ((gid * G_K + kk) % D)[:, None], pos[None, :],
                              D, DIM, FREQS, SIGN, x_ptr.dtype.element_ty)
        xs = None
        if ACT == "pre":
            xs = tl.load(xs_ptr + offs_m * XS_RS + (gid * G_K + k0) // 128, mask=m_ok, other=0.0)
        acc = mma_step(acc, xt, xs, w_ptr, s_ptr, offs_n, n_ok, kk, k_ok, k0, K, W_RS, W_CS, S_RS, S_CS, W_FMT,
                       S_E8M0, BLOCK, ACT, CDT, BK)

    if SPLIT == 1:
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_m[None, :] * Y_RS + offs_n[:, None] * Y_CS, y, mask=n_ok[:, None] & m_ok[None, :])
    else:
        # fp32 partial sums [SPLIT, M, NT]; the last of a tile's SPLIT programs to arrive (codegen/kernels/
        # arrival.py) adds them in split order and stores y
        tile_ok = n_ok[:, None] & m_ok[None, :]
        tl.store(part_ptr + (sid * M + offs_m[None, :]).to(tl.int64) * NT + offs_n[:, None], acc, mask=tile_ok)
        tile = (gid * ((M + BM - 1) // BM) + pid_m) * ((N + BN - 1) // BN) + pid_n
        if last_to_arrive(sem_ptr + tile, SPLIT):
            total = tl.zeros([BN, BM], dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part_ptr + (s * M + offs_m[None, :]).to(tl.int64) * NT + offs_n[:, None],
                                 mask=tile_ok, other=0.0)
            tl.store(y_ptr + offs_m[None, :] * Y_RS + offs_n[:, None] * Y_CS, total.to(y_ptr.dtype.element_ty),
                     mask=tile_ok)
            tl.store(sem_ptr + tile, 0)


@triton.jit
def _pair_half(pid, x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, sem_ptr, M: tl.constexpr, K: tl.constexpr,
               X_RS: tl.constexpr, X_CS: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, N: tl.constexpr,
               SPLIT: tl.constexpr, KS: tl.constexpr, NT: tl.constexpr, Y_RS: tl.constexpr, Y_CS: tl.constexpr,
               W_RS: tl.constexpr, W_CS: tl.constexpr, S_RS: tl.constexpr, S_CS: tl.constexpr, W_FMT: tl.constexpr,
               S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr, CDT: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, PART: tl.constexpr, SEM: tl.constexpr):
    """Program `pid` of one GEMM of a pair, its grid flattened with the K splits fastest (then N tiles, then M
    tiles): an output tile's splits take adjacent programs, so its partials are read back, and each slice of x
    read again by the next tile, within a tile's bytes of their last touch (`tile_group_bytes`: a cache hit
    however large the GEMM, codegen/roofline.py). Its partials and arrival counters start PART / SEM elements
    into the pair's scratch."""
    TN: tl.constexpr = (N + BN - 1) // BN
    if SPLIT > 1:
        part_ptr = part_ptr + PART
        sem_ptr = sem_ptr + SEM
    gemm_program((pid // SPLIT) % TN, pid // (SPLIT * TN), pid % SPLIT, x_ptr, None, w_ptr, s_ptr, None, None, y_ptr,
                 part_ptr, sem_ptr, M, N, K, 0, 0, SPLIT, KS, NT, X_RS, X_CS, Y_RS, Y_CS, W_RS, W_CS, S_RS, S_CS,
                 W_FMT, S_E8M0, BLOCK, ACT, False, 0.0, CDT, BM, BN, BK, STAGES, 1, 0, 0, 0, 0, 0, -1.0)


@triton.jit
def gemm_pair_kernel(x_ptr, w0_ptr, s0_ptr, y0_ptr, w1_ptr, s1_ptr, y1_ptr, part_ptr, sem_ptr,
                     M: tl.constexpr, K: tl.constexpr, X_RS: tl.constexpr, X_CS: tl.constexpr, BM: tl.constexpr,
                     STAGES: tl.constexpr, P0: tl.constexpr,
                     N0: tl.constexpr, SPLIT0: tl.constexpr, KS0: tl.constexpr, NT0: tl.constexpr,
                     Y_RS0: tl.constexpr, Y_CS0: tl.constexpr, W_RS0: tl.constexpr, W_CS0: tl.constexpr,
                     S_RS0: tl.constexpr, S_CS0: tl.constexpr, W_FMT0: tl.constexpr, S_E8M00: tl.constexpr,
                     BLOCK0: tl.constexpr, ACT0: tl.constexpr, CDT0: tl.constexpr, BN0: tl.constexpr, BK0: tl.constexpr,
                     N1: tl.constexpr, SPLIT1: tl.constexpr, KS1: tl.constexpr, NT1: tl.constexpr,
                     Y_RS1: tl.constexpr, Y_CS1: tl.constexpr, W_RS1: tl.constexpr, W_CS1: tl.constexpr,
                     S_RS1: tl.constexpr, S_CS1: tl.constexpr, W_FMT1: tl.constexpr, S_E8M01: tl.constexpr,
                     BLOCK1: tl.constexpr, ACT1: tl.constexpr, CDT1: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                     PART1: tl.constexpr, SEM1: tl.constexpr, PDL: tl.constexpr = False):
    """`linear_pair`: two GEMMs of one input x in one launch; programs [0, P0) are the first GEMM's grid,
    the rest the second's (each `gemm_program` with its own weight format, numerics and tiling)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < P0:
        _pair_half(pid, x_ptr, w0_ptr, s0_ptr, y0_ptr, part_ptr, sem_ptr, M, K, X_RS, X_CS, BM, STAGES, N0, SPLIT0,
                   KS0, NT0, Y_RS0, Y_CS0, W_RS0, W_CS0, S_RS0, S_CS0, W_FMT0, S_E8M00, BLOCK0, ACT0, CDT0, BN0, BK0,
                   0, 0)
    else:
        _pair_half(pid - P0, x_ptr, w1_ptr, s1_ptr, y1_ptr, part_ptr, sem_ptr, M, K, X_RS, X_CS, BM, STAGES, N1,
                   SPLIT1, KS1, NT1, Y_RS1, Y_CS1, W_RS1, W_CS1, S_RS1, S_CS1, W_FMT1, S_E8M01, BLOCK1, ACT1, CDT1,
                   BN1, BK1, PART1, SEM1)


# Split K when the output tiles alone would leave most of the GPU idle (decode GEMVs): aim for this many
# programs (about the CU count of MI355X / 2x the SM count of H200), never below 2 K tiles per split.
TARGET_PROGRAMS = 256


def tiles(w_fmt: str, K: int, blk: int, act: str, cdt: str) -> int:
    """BK for a weight format: 128 (or the next power of two of a smaller K, >= 32); it must divide an FP8
    scale block; quantised activations use 128 (one activation scale per tile); FP4 via dot_scaled >= 64."""
    BK = 128 if K >= 128 else max(32, triton.next_power_of_2(K))
    if w_fmt == "fp8":
        BK = min(BK, blk)
    if act != "native":
        BK = 128  # one activation scale per 128 K values (a partial last block is scaled by its own amax)
    elif w_fmt == "fp4" and cdt != "fp32":
        BK = max(64, BK)  # dot_scaled: whole 32-value scale groups, at least 64 values per tile
    if w_fmt == "fp4" and K % 32:
        raise ValueError(f"gemm: FP4 weights need K a multiple of 32, got {K}")
    if w_fmt == "fp8" and blk % 32:
        raise ValueError(f"gemm: FP8 scale block must be a multiple of 32, got {blk}")
    if w_fmt == "fp4" and blk != 32:
        raise ValueError(f"gemm: FP4 weights need 1x32 scales (MXFP4), got block {blk}")
    return BK


W_FMT = {"fp32": "float", "bf16": "float", "fp8e4m3": "fp8", "fp4x2": "fp4"}


def _tl_dtype(ir: str):
    return {"fp32": tl.float32, "bf16": tl.bfloat16}[ir]


def gemm_call(prefix: str, x: TensorArg, w: TensorArg, scale: TensorArg | None, y: TensorArg,
              norm: TensorArg | None, *, block: int, act: str, eps: float, names: dict[str, str],
              groups: int = 1, x_scale: TensorArg | None = None, rope: dict | None = None) -> list[KernelCall]:
    """One GEMM launch. `names` maps kernel roles (x, xs, w, s, n, y) to the op's operand / result names.
    groups > 1: block-diagonal (grouped_out_proj): group g multiplies x columns [g*K, (g+1)*K) by weight
    rows [g*N, (g+1)*N). x_scale: x is pre-quantised e4m3 with one fp32 scale per 128 columns (act "pre").
    rope: {"pos": TensorArg [B, T], "head_dim": d, "attrs": the op's rope attributes}: x (the flattened
    [B, T, H * d] attention output) rotated back as it is loaded (rope_out_proj)."""
    if x_scale is not None:
        act = "pre"
    if act not in ("native", "fp8", "pre"):
        raise ValueError(f"gemm: act must be native or fp8, got {act!r}")
    M, x_rs, x_cs = rows_of(x, "x")
    _, y_rs, y_cs = rows_of(y, "y")
    w_fmt = W_FMT[w.dtype]
    N = w.shape[0] // groups
    K = x.shape[-1] // groups
    blk = block
    cdt = y.dtype if act == "pre" else x.dtype
    if act == "native" and y.dtype == "fp32" and (w.dtype == "fp32" or scale is not None and scale.dtype == "fp32"):
        cdt = "fp32"  # out_dtype fp32: the reference multiplies in fp32; only bf16-exact weights may use bf16 MMA
    BK = tiles(w_fmt, K, blk, act, cdt)
    BN = 64 if N <= 64 else 128
    BM = min(64, max(16, triton.next_power_of_2(M)))
    xs_rs = rows_of(x_scale, "x scale")[1] if x_scale is not None else 0
    tiles_out = triton.cdiv(N, BN) * triton.cdiv(M, BM) * groups
    ktiles = triton.cdiv(K, BK)
    split = max(1, min(ktiles // 2, TARGET_PROGRAMS // tiles_out))
    KS = triton.cdiv(ktiles, split) * BK
    split = triton.cdiv(K, KS)
    NT = N * groups
    ce = dict(M=M, N=N, K=K, G_K=K if groups > 1 else 0, XS_RS=xs_rs, SPLIT=split, KS=KS, NT=NT, X_RS=x_rs, X_CS=x_cs, Y_RS=y_rs, Y_CS=y_cs, W_RS=w.strides[0], W_CS=w.strides[1],
              S_RS=scale.strides[0] if scale is not None else 0, S_CS=scale.strides[1] if scale is not None else 0,
              W_FMT=w_fmt, S_E8M0=scale is not None and scale.dtype == "e8m0", BLOCK=blk, ACT=act,
              NORM=norm is not None, EPS=float(eps), CDT=_tl_dtype(cdt), BM=BM, BN=BN, BK=BK, STAGES=2)
    pointers = [ptr("x_ptr", "operand", names["x"], x)]
    if x_scale is not None:
        pointers.append(ptr("xs_ptr", "operand", names["xs"], x_scale))
    else:
        ce["xs_ptr"] = None
    pointers.append(ptr("w_ptr", "operand", names["w"], w))
    if scale is not None:
        pointers.append(ptr("s_ptr", "operand", names["s"], scale))
    else:
        ce["s_ptr"] = None
    if norm is not None:
        pointers.append(ptr("n_ptr", "operand", names["n"], norm))
    else:
        ce["n_ptr"] = None
    if rope is not None:
        pos = rope["pos"]
        if rope["head_dim"] % 2 or K % 2:
            raise ValueError(f"gemm: a rope prologue pairs channels: head dim {rope['head_dim']} and K {K} must be even")
        ce.update(ROPE_T=pos.shape[1], P_BS=pos.strides[0], P_TS=pos.strides[1], D=rope["head_dim"],
                  **rope_constants(rope["attrs"]))
        pointers.append(ptr("pos_ptr", "operand", names["pos"], pos))
    else:
        ce.update(pos_ptr=None, ROPE_T=1, P_BS=0, P_TS=0, D=0, DIM=0, FREQS=0, SIGN=-1.0)
    scratch = {}
    pointers.append(ptr("y_ptr", "result", names["y"], y))
    if split == 1:
        ce["part_ptr"] = ce["sem_ptr"] = None
    else:
        # one arrival counter per output tile: the tile's last split program reduces (see gemm_kernel)
        scratch = {"gemm_partial": split * M * NT * 4, "gemm_arrivals": tiles_out * 4}
        pointers.append(ptr("part_ptr", "scratch", "gemm_partial", "*fp32"))
        pointers.append(ptr("sem_ptr", "semaphore", "gemm_arrivals", "*i32"))
    wbytes = w.type.nbytes + (scale.type.nbytes if scale is not None else 0)
    tag = (f"{w_fmt}w_{act}_m{M}_n{N}_k{K}" + ("_norm" if norm is not None else "") + ("_rope" if rope else "") + (f"_g{groups}" if groups > 1 else "")
           + (f"_s{split}" if split > 1 else ""))
    calls = [KernelCall(
        name=call_name(prefix, ce, tag), fn=gemm_kernel, constexprs=ce, pointers=pointers,
        # 64x128 fp32 accumulators need 8 warps on sm_90 (255-register cap); gfx950 is spill-free either way
        grid=(triton.cdiv(N, BN), triton.cdiv(M, BM), groups * split), num_warps=8 if BM * BN >= 8192 else 4,
        num_stages=2,
        scratch_bytes=scratch,
        unaligned=unaligned({"x_ptr": x, "xs_ptr": x_scale, "w_ptr": w, "s_ptr": scale, "n_ptr": norm,
                             "pos_ptr": rope["pos"] if rope else None, "y_ptr": y}),
        flops=2 * M * N * K * groups, mma_dtype="fp8" if act != "native" else "bf16",
        # split > 1: the partials are written once and read once more by the reducing programs. Re-reads (cache
        # hits when the launch fits, roofline.py): the partials' read-back, and x past its first read (each of
        # the cdiv(N, BN) output columns of tiles reads all of x, so no more than that many reads are re-reads)
        bytes_moved=wbytes + split * x.type.nbytes + y.type.nbytes + 2 * scratch.get("gemm_partial", 0)
        + (norm.type.nbytes if norm else 0) + (rope["pos"].type.nbytes if rope else 0),
        reread_bytes=(min(split, triton.cdiv(N, BN)) - 1) * x.type.nbytes + scratch.get("gemm_partial", 0))]
    return calls


def tile_group_bytes(x: TensorArg, w: TensorArg, scale: TensorArg | None, y: TensorArg, ce: dict) -> int:
    """The bytes one output tile's programs move in a pair half (`_pair_half`: a tile's K splits adjacent):
    min(BN, N) rows of the weight and their scales, x once over the splits, the tile's fp32 partials written
    and read back, its y tile. Every re-read of a half (a partial, a slice of x the previous tile read) comes
    within this many bytes of its last touch, programs taken in order (M within one row tile: decode, chunks)."""
    rows = min(ce["BN"], ce["N"])
    part = 2 * ce["SPLIT"] * ce["M"] * rows * 4 if ce["SPLIT"] > 1 else 0
    wbytes = w.type.nbytes + (scale.type.nbytes if scale is not None else 0)
    return -(-wbytes * rows // ce["N"]) + x.type.nbytes + part + -(-y.type.nbytes * rows // ce["N"])


PAIR_SIDE = ("N", "SPLIT", "KS", "NT", "Y_RS", "Y_CS", "W_RS", "W_CS", "S_RS", "S_CS", "W_FMT", "S_E8M0", "BLOCK",
             "ACT", "CDT", "BN", "BK")


def gemm_pair_call(x: TensorArg, sides: list[dict]) -> list[KernelCall]:
    """`linear_pair`: each side ({w, scale, y, block, act}) specialised as its own `gemm_call`, then the two
    grids, scratch regions and arrival counters laid end to end in one launch of `gemm_pair_kernel`."""
    names = [{"x": "x", "w": f"w{i}", "s": f"scale{i}", "y": f"y{i}"} for i in (0, 1)]
    one = [gemm_call("gemm", x, s["w"], s["scale"], s["y"], None, block=s["block"], act=s["act"], eps=0.0,
                     names=names[i])[0] for i, s in enumerate(sides)]
    a, b = (c.constexprs for c in one)
    if a["BM"] != b["BM"] or a["K"] != b["K"]:
        raise ValueError(f"gemm pair: the GEMMs must share x's tiling, got BM {a['BM']}/{b['BM']}, K {a['K']}/{b['K']}")
    ce = {k: a[k] for k in ("M", "K", "X_RS", "X_CS", "BM", "STAGES")}
    ce["P0"] = math.prod(one[0].grid)
    for i, c in enumerate((a, b)):
        ce.update({f"{k}{i}": c[k] for k in PAIR_SIDE})
    part0 = one[0].scratch_bytes.get("gemm_partial", 0)
    sem0 = one[0].scratch_bytes.get("gemm_arrivals", 0)
    ce.update(PART1=part0 // 4, SEM1=sem0 // 4)
    scratch = {k: sum(c.scratch_bytes.get(k, 0) for c in one) for k in ("gemm_partial", "gemm_arrivals")}
    scratch = {k: v for k, v in scratch.items() if v}
    pointers = [ptr("x_ptr", "operand", "x", x)]
    for i, s in enumerate(sides):
        pointers.append(ptr(f"w{i}_ptr", "operand", f"w{i}", s["w"]))
        if s["scale"] is not None:
            pointers.append(ptr(f"s{i}_ptr", "operand", f"scale{i}", s["scale"]))
        else:
            ce[f"s{i}_ptr"] = None
        pointers.append(ptr(f"y{i}_ptr", "result", f"y{i}", s["y"]))
    if scratch:
        pointers.append(ptr("part_ptr", "scratch", "gemm_partial", "*fp32"))
        pointers.append(ptr("sem_ptr", "semaphore", "gemm_arrivals", "*i32"))
    else:
        ce["part_ptr"] = ce["sem_ptr"] = None
    un = {f"{p}{i}_ptr": s[k] for i, s in enumerate(sides) for p, k in (("w", "w"), ("s", "scale"), ("y", "y"))}
    tag = "_".join(c.name.split("_", 1)[1].rsplit("_", 1)[0] for c in one)
    return [KernelCall(
        name=call_name("gemm_pair", ce, tag), fn=gemm_pair_kernel, constexprs=ce, pointers=pointers,
        grid=(ce["P0"] + math.prod(one[1].grid), 1, 1), num_warps=max(c.num_warps for c in one), num_stages=2,
        scratch_bytes=scratch, unaligned=unaligned({"x_ptr": x, **un}), flops=sum(c.flops for c in one),
        # x is read by both halves: the two calls' bytes, as two launches would move them; the second half's x is a re-read
        mma_dtype="fp8" if "fp8" in (a["ACT"], b["ACT"]) else "bf16",
        bytes_moved=sum(c.bytes_moved for c in one), reread_bytes=sum(c.reread_bytes for c in one) + x.type.nbytes,
        # a half's re-reads come within its tile group; the second half's first reads of x within the first's
        # last group and its own first
        reuse_bytes=(sum(tile_group_bytes(x, s["w"], s["scale"], s["y"], c.constexprs) for s, c in zip(sides, one)),))]


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name == "linear_pair":
        return gemm_pair_call(operands["x"], [
            {"w": operands[f"w{i}"], "scale": operands.get(f"scale{i}"), "y": results[f"y{i}"],
             "block": attrs[f"block{i}"], "act": attrs[f"act{i}"]} for i in (0, 1)])
    act = attrs.get("act", "native")
    names = {"x": "x", "w": "w", "s": "scale", "n": "norm", "y": "y"}
    if op_name == "linear":
        return gemm_call("gemm", operands["x"], operands["w"], operands.get("scale"), results["y"], None,
                         block=attrs.get("block", 128), act=act, eps=0.0, names=names)
    if op_name == "norm_linear":
        return gemm_call("gemm", operands["x"], operands["w"], operands.get("scale"), results["y"], operands["norm"],
                         block=attrs.get("block", 128), act=act, eps=attrs["eps"], names=names)
    raise KeyError(f"gemm family has no op '{op_name}'")
