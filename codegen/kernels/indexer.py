"""indexer_select: lightning-indexer scores over the index pool, top-k, translation of the picks to main
pool rows, packed as CSR (`ops.fused.indexer_select`).

One launch: one program per (query lane, block of BR candidate rows); only the rows the lane may see
(w < min((t + 1) // ratio, max_rows): the sequence's real length, not the compiled maximum) are scored,
into a scratch [L, max_rows] fp32. The last of a lane's programs to arrive (an arrival counter per lane,
a `semaphore` pointer) then selects for the lane (`_pick`): when more than k rows are visible it finds the k-th largest score exactly by a 32-step bisection over the order-preserving integer
image of the fp32 scores, then keeps every row above it and the first rows (ascending w) equal to it.
Picks are emitted in ascending w (the reference lists them by descending score: the attention does not
depend on the order). A lane's CSR offset is the closed-form sum of min(k, visible) of the lanes before.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, any_row, call_name, ptr, row_offsets, unaligned
from .arrival import last_to_arrive
from .kvrows import load_rows, plane_consts, pow2
from .pdl import pdl_enter

BR = 64


@triton.jit
def _visible(pos_ptr, lane, L: tl.constexpr, RATIO: tl.constexpr, MAXR: tl.constexpr):
    t = tl.load(pos_ptr + lane, mask=lane < L, other=-1)
    return tl.where((t >= 0) & (lane < L), tl.minimum((t + 1) // RATIO, MAXR), 0)


@triton.jit
def indexer_select_kernel(q_ptr, w_ptr, pos_ptr, bt_ptr, p0, p1, sc_ptr, sem_ptr, indptr_ptr, indices_ptr,
                          K: tl.constexpr, ENV: tl.constexpr, BL: tl.constexpr,
                          T: tl.constexpr, L: tl.constexpr, HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr,
                          DIP: tl.constexpr, BR: tl.constexpr, RATIO: tl.constexpr, MAXR: tl.constexpr,
                          PER_BLOCK: tl.constexpr, IENV: tl.constexpr, BT_S: tl.constexpr,
                          Q_S: tl.constexpr, W_S: tl.constexpr, Q_SCALE: tl.constexpr, W_SCALE: tl.constexpr,
                          FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                          S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, EXACT_BF16: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_enter(PDL)
    lane = tl.program_id(0)
    w0 = tl.program_id(1) * BR
    n = tl.sum(_visible(pos_ptr, lane + tl.arange(0, 1), L, RATIO, MAXR), axis=0)
    if w0 < n:
        b = lane // T
        tq = lane % T
        h = tl.arange(0, HIP)[:, None]
        c = tl.arange(0, DIP)[None, :]
        q = tl.load(q_ptr + b * Q_S[0] + tq * Q_S[1] + h * Q_S[2] + c, mask=(h < HI) & (c < DI), other=0.0).to(tl.float32)
        hw = tl.arange(0, HIP)
        wt = tl.load(w_ptr + b * W_S[0] + tq * W_S[1] + hw, mask=hw < HI, other=0.0).to(tl.float32) * W_SCALE
        w = w0 + tl.arange(0, BR)
        ok = w < n
        blk = tl.maximum(tl.load(bt_ptr + b * BT_S + w // PER_BLOCK, mask=ok, other=0), 0)
        rows = blk.to(tl.int64) * IENV + w % PER_BLOCK  # planes start at the layer's offset
        k = load_rows(p0, p1, None, rows, ok, FMT, NPLANES, BR, DIP, DI, NOPE, BLK, S0, S1, S2)
        if EXACT_BF16:  # bf16 q and keys exact in bf16 (FP4 / FP8 x power of two, bf16 rows): exact products
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = tl.maximum(s, 0.0) * Q_SCALE  # [HIP, BR]
        tl.store(sc_ptr + lane.to(tl.int64) * MAXR + w, tl.sum(s * wt[:, None], axis=0), mask=ok)
    # the lane's (MAXR + BR - 1) // BR programs (a constexpr: tl.num_programs would need hidden kernel
    # arguments on AMD); codegen/kernels/arrival.py
    if last_to_arrive(sem_ptr + lane, (MAXR + BR - 1) // BR):
        _pick(lane, pos_ptr, bt_ptr, sc_ptr, indptr_ptr, indices_ptr, T, L, K, BR, RATIO, MAXR, PER_BLOCK, ENV, BT_S,
              BL)
        tl.store(sem_ptr + lane, 0)


@triton.jit
def _key(x):
    """fp32 -> int32 with the same order (finite values)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _pick(lane, pos_ptr, bt_ptr, sc_ptr, indptr_ptr, indices_ptr,
          T: tl.constexpr, L: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, RATIO: tl.constexpr,
          MAXR: tl.constexpr, PER_BLOCK: tl.constexpr, ENV: tl.constexpr, BT_S: tl.constexpr, BL: tl.constexpr):
    """Lane `lane`'s top-k of its scores, as CSR: its indptr entry (and the last one) and its picks."""
    off = 0
    for c0 in range(0, lane, BL):
        prev = c0 + tl.arange(0, BL)
        off += tl.sum(tl.where(prev < lane, tl.minimum(_visible(pos_ptr, prev, L, RATIO, MAXR), K), 0), axis=0).to(tl.int32)
    n = tl.sum(_visible(pos_ptr, lane + tl.arange(0, 1), L, RATIO, MAXR), axis=0)
    tl.store(indptr_ptr + lane, off)
    if lane == L - 1:
        tl.store(indptr_ptr + L, off + tl.minimum(n, K))
    b = lane // T
    base = sc_ptr + lane.to(tl.int64) * MAXR
    # Threshold: the largest v with #(key >= v) >= K (every row when n <= K).
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    if n > K:
        for _ in range(32):
            mid = (lo + hi + 1) >> 1
            cnt = 0
            for w0 in range(0, n, BR):
                w = w0 + tl.arange(0, BR)
                key = _key(tl.load(base + w, mask=w < n, other=0.0)).to(tl.int64)
                cnt += tl.sum(((w < n) & (key >= mid)).to(tl.int32), axis=0).to(tl.int32)
            ge = cnt >= K
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid - 1)
    n_gt = 0
    if n > K:
        for w0 in range(0, n, BR):
            w = w0 + tl.arange(0, BR)
            key = _key(tl.load(base + w, mask=w < n, other=0.0)).to(tl.int64)
            n_gt += tl.sum(((w < n) & (key > lo)).to(tl.int32), axis=0).to(tl.int32)
    run = off
    eq_seen = 0
    for w0 in range(0, n, BR):
        w = w0 + tl.arange(0, BR)
        ok = w < n
        key = _key(tl.load(base + w, mask=ok, other=0.0)).to(tl.int64)
        eq = ok & (key == lo)
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        pick = ok & ((key > lo) | (eq & (eq_rank < K - n_gt)))
        at = run + tl.cumsum(pick.to(tl.int32), axis=0) - 1
        blk = tl.maximum(tl.load(bt_ptr + b * BT_S + w // PER_BLOCK, mask=pick, other=0), 0)
        tl.store(indices_ptr + at, blk * ENV + w % PER_BLOCK, mask=pick)
        run += tl.sum(pick.to(tl.int32), axis=0).to(tl.int32)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0).to(tl.int32)


def specialise(op_name, operands, results, attrs):
    assert op_name == "indexer_select", op_name
    q, wts, pos, bt = operands["q"], operands["weights"], operands["pos"], operands["block_table"]
    planes = [operands.get("p0"), operands.get("p1")]
    B, T, HI, DI = q.shape
    L = B * T
    MAXR, K, ratio = attrs["max_rows"], attrs["k"], attrs["ratio"]
    assert q.strides[3] == 1 and wts.strides[2] == 1 and pos.strides == (T, 1) and bt.strides[1] == 1
    pc = plane_consts(attrs["fmt"], planes, DI)
    c1 = dict(T=T, L=L, HI=HI, HIP=max(pow2(HI), 16), DI=DI, DIP=pow2(DI), BR=BR, RATIO=ratio, MAXR=MAXR,
              PER_BLOCK=attrs["block_tokens"] // ratio, IENV=attrs["index_envelope_rows"],
              BT_S=bt.strides[0], Q_S=q.strides[:3], W_S=wts.strides[:2], Q_SCALE=float(attrs["q_scale"]),
              W_SCALE=float(attrs["w_scale"]), **pc,
              # bf16 MMA when it is exact: a bf16 query and keys that bf16 holds exactly (an fp32 FMA dot
              # of this size spills on sm_90, which has no fp32 MMA).
              EXACT_BF16=q.dtype == "bf16" and (attrs["fmt"] in ("fp4", "fp8") or planes[0].dtype == "bf16"))
    p1 = [ptr("p1", "operand", "p1", planes[1])] if planes[1] is not None else []
    if planes[1] is None:
        c1["p1"] = None
    c1.update(K=K, ENV=attrs["envelope_rows"], BL=64)
    scratch = {"scores": L * MAXR * 4, "ix_arrivals": L * 4}  # one arrival counter per lane
    return [KernelCall(
        name=call_name("indexer_select", c1, f"l{L}_h{HI}_r{MAXR}_k{K}_{attrs['fmt']}"), fn=indexer_select_kernel,
        constexprs=c1, pointers=[ptr("q_ptr", "operand", "q", q), ptr("w_ptr", "operand", "weights", wts),
                                 ptr("pos_ptr", "operand", "pos", pos), ptr("bt_ptr", "operand", "block_table", bt),
                                 ptr("p0", "operand", "p0", planes[0]), *p1, ptr("sc_ptr", "scratch", "scores", "*fp32"),
                                 ptr("sem_ptr", "semaphore", "ix_arrivals", "*i32"),
                                 ptr("indptr_ptr", "result", "indptr", results["indptr"]),
                                 ptr("indices_ptr", "result", "indices", results["indices"])],
        grid=(L, triton.cdiv(MAXR, BR), 1), num_warps=4, scratch_bytes=scratch,
        unaligned=unaligned({"p0": any_row(planes[0]), "p1": any_row(planes[1])}),
        offsets=row_offsets({"p0": planes[0], "p1": planes[1]}, attrs["index_offset"]),
        flops=2 * L * HI * DI * MAXR,
        # the rows and the scores written once; the pick's bisection reads a lane's scores up to 34 times
        bytes_moved=L * MAXR * (planes[0].type.nbytes // planes[0].shape[0] + 4) + 34 * L * MAXR * 4)]
