"""moe family: `moe_experts_shared` (routed experts + the shared expert, one op) and `moe_experts`.

Numerics follow the op reference exactly, rounding to x's dtype wherever it does: each expert GEMM's
output, silu and the SwiGLU product, the routing weight's product (with w2's output or input, as
`route_weight` says), then the per-token sum
over the selected experts in ascending expert id (the reference's `index_add_` order), then `+ shared`.

Launches, scratch buffers between them (h, yr in x's dtype; P = tokens x k (token, slot) pairs, pair
p = token * k + slot); 2 runs inside 1's launch and 4 inside 3's, in the last expert program of each D tile to arrive (an
arrival counter per D tile, a `semaphore` pointer):
  0. (grouped mode only) group: per-expert offsets and the pair ids sorted by expert -> grp (int32).
  1. routed gate/up + SwiGLU, expert-major: program (expert e, I tile) walks the compact list of e's
     pairs in tiles of BM rows -> h[P, I] (row = pair id). Each weight tile is read once per BM pairs
     routed to e; an expert without pairs runs no tile.
  2. shared gate/up + SwiGLU (programs (E, I tile) of 1's launch, every token "routed" to the one shared
     expert) -> hs[M, Is].
  3. routed down, same walk -> yr[P, D] (row = pair id): round(round(W2_e h) * weight) (route_weight
     "after_w2") or round(W2_e round(weight * h)) ("before_w2": the weight inside w2's activation
     quantisation, `v4-reference.md` 10).
  4. shared down + combine: y = round(sum over slots by ascending expert id (rounded each add) + W2_s hs).
A slot whose expert id lies outside [0, E) (expert parallelism: another rank's slot, id -1 from
`local_experts`) is in no expert's list and is skipped by the combine: no weight read, no FLOPs, no row.
Every row of h / yr depends only on its own pair, so the order of the pairs inside an expert's list and
how they are cut into tiles do not change a bit of the result; only the set of pairs per expert matters.

How an expert's pair list is found (chosen per shape in `specialise`, same results either way):
  "scan"    (P <= SCAN_MAX_PAIRS, decode): each program loads all P expert ids once (as the kernels
            always did), ranks its own pairs with a prefix sum and picks each tile's pair ids from the
            ranks in registers. No extra launch, no scratch.
  "grouped" (larger P, prefill chunks): one small launch first computes, for every pair, its place in
            the list sorted by (expert, pair id) (a stable counting by comparison: the number of pairs
            with a smaller key), and off[e] = #pairs with expert < e. Programs then read off[e], off[e+1]
            and the pair ids from grp; an idle expert reads two ints and exits. The grouping is
            deterministic (no atomics), O(P^2 + P E) comparisons spread over cdiv(P, BP) + cdiv(E+1, BP)
            programs; expert ids outside [0, E) fall outside every expert's range, as in the scan.
The GEMM tiles are `gemm.mma_step` (swap-AB; FP4 experts via `tl.dot_scaled`, FP8 128x128 / float
shared expert; `act="fp8"` quantises each GEMM's input per 128 K values as `linear` does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...ops.moe import expected_active_experts
from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .arrival import last_to_arrive
from .gemm import W_FMT, _tl_dtype, mma_step, tiles
from .pdl import pdl_enter

BM = 16  # pair rows per MMA tile (the MMA's N side under swap-AB)
# Up to this many pairs every expert program ranks its pairs itself (one [P] scan per program, as decode did
# before grouping, and a [BM, P] one-hot pick per tile, small enough to stay in registers next to the MMA
# tiles); above it one grouping launch (~2-3 us under graph replay) is cheaper than E x tiles scans of P ids.
SCAN_MAX_PAIRS = 64
GROUP_BP, GROUP_BQ, GROUP_WARPS = 64, 32, 4  # grouping: pairs (experts) per program, compare block (0 spills on gfx950)
BIG = tl.constexpr(2 ** 30)


@triton.jit
def _swiglu(g, u, LIMIT: tl.constexpr, DT: tl.constexpr):
    g = tl.minimum(g.to(DT).to(tl.float32), LIMIT)
    u = tl.minimum(tl.maximum(u.to(DT).to(tl.float32), -LIMIT), LIMIT)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (s * u).to(DT)


@triton.jit
def _expert_of(idx_ptr, p, ok, KSEL: tl.constexpr, IDX_RS: tl.constexpr):
    """Expert id of pairs p (int32), BIG where not ok (sorts after every real expert)."""
    return tl.load(idx_ptr + (p // KSEL) * IDX_RS + p % KSEL, mask=ok, other=BIG).to(tl.int32)


@triton.jit
def moe_group_kernel(idx_ptr, grp_ptr, P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, IDX_RS: tl.constexpr,
                     NRB: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr, PDL: tl.constexpr = False):
    """grp[0 : E+1] = off (off[e] = #pairs with expert < e), grp[E+1 : E+1+P] = pair ids sorted by
    (expert, pair id). Programs [0, NRB) place BP pairs each; the rest compute BP offsets each; both
    compare against all pairs in blocks of BQ."""
    pdl_enter(PDL)
    _group_block(tl.program_id(0), idx_ptr, grp_ptr, P, E, KSEL, IDX_RS, NRB, BP, BQ)


@triton.jit
def _group_block(pid, idx_ptr, grp_ptr, P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, IDX_RS: tl.constexpr,
                 NRB: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr):
    """Program `pid` of the grouping (`moe_group_kernel`; a phase of the one-launch MoE, `moe_router.py`)."""
    rq = tl.arange(0, BQ)
    if pid < NRB:
        p = pid * BP + tl.arange(0, BP)
        p_ok = p < P
        ep = _expert_of(idx_ptr, p, p_ok, KSEL, IDX_RS)
        pos = tl.zeros([BP], dtype=tl.int32)
        for q0 in range(0, P, BQ):
            q = q0 + rq
            eq = _expert_of(idx_ptr, q, q < P, KSEL, IDX_RS)
            before = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None]))
            pos += tl.sum(before.to(tl.int32), axis=1)
        tl.store(grp_ptr + (E + 1) + pos, p, mask=p_ok)
    else:
        e = (pid - NRB) * BP + tl.arange(0, BP)
        off = tl.zeros([BP], dtype=tl.int32)
        for q0 in range(0, P, BQ):
            q = q0 + rq
            eq = _expert_of(idx_ptr, q, q < P, KSEL, IDX_RS)
            off += tl.sum((eq[None, :] < e[:, None]).to(tl.int32), axis=1)
        tl.store(grp_ptr + e, off, mask=e <= E)


@triton.jit
def _span(e, idx_ptr, grp_ptr, P: tl.constexpr, KSEL: tl.constexpr, IDX_RS: tl.constexpr, MODE: tl.constexpr,
          PB: tl.constexpr):
    """Expert e's pairs as list positions [lo, hi), plus what `_tile` needs in "scan" mode (pair index,
    selection, rank among e's pairs). MODE "all": every pair (the shared expert)."""
    pa = tl.arange(0, PB)
    if MODE == "grouped":
        lo = tl.load(grp_ptr + e)
        hi = tl.load(grp_ptr + e + 1)
        sel = pa < 0
        rank = pa
    elif MODE == "scan":
        sel = _expert_of(idx_ptr, pa, pa < P, KSEL, IDX_RS) == e
        rank = tl.cumsum(sel.to(tl.int32), 0) - 1
        lo = 0
        hi = tl.sum(sel.to(tl.int32), 0)
    else:
        sel = pa < P
        rank = pa
        lo = 0
        hi = P
    return lo, hi, pa, sel, rank


@triton.jit
def _tile(j, hi, grp_ptr, pa, sel, rank, E: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr):
    """Pair ids of list positions [j, j + BM) and which of them exist."""
    r = j + tl.arange(0, BM)
    ok = r < hi
    if MODE == "grouped":
        pr = tl.load(grp_ptr + (E + 1) + r, mask=ok, other=0)
    elif MODE == "scan":
        hit = sel[None, :] & (rank[None, :] == r[:, None])
        pr = tl.sum(tl.where(hit, pa[None, :], 0), axis=1)
    else:
        pr = r
    return pr, ok


@triton.jit
def moe_up_kernel(x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                  sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr, xs_ptr,
                  P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, MODE: tl.constexpr, PB: tl.constexpr,
                  I: tl.constexpr, D: tl.constexpr,
                  X_RS: tl.constexpr, IDX_RS: tl.constexpr, H_RS: tl.constexpr,
                  W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
                  W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                  CDT: tl.constexpr, LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  S_M: tl.constexpr, S_I: tl.constexpr, S_W_RS: tl.constexpr, S_S_RS: tl.constexpr,
                  S_W_FMT: tl.constexpr, S_S_E8M0: tl.constexpr, S_BLOCK: tl.constexpr, S_ACT: tl.constexpr,
                  S_BM: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr, PDL: tl.constexpr = False):
    """Gate / up + SwiGLU: programs (e < E, I tile) the routed experts -> h; with a shared expert
    (sw1_ptr set), programs (E, I tile) run it over every token -> hs, in the same launch (its S_M tokens
    are xs_ptr's where set: `moe_router_experts_dp`, the rank's own tokens, the routed ones every rank's)."""
    pdl_enter(PDL)
    e = tl.program_id(0)
    nt = tl.program_id(1)
    if e < E:
        if nt * BN < I:
            _up(e, nt, x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, P, E, KSEL, MODE, PB, I, D,
                X_RS, IDX_RS, H_RS, W_ES, W_RS, S_ES, S_RS, W_FMT, S_E8M0, BLOCK, ACT, CDT, LIMIT, BM, BN, BK)
    elif sw1_ptr is not None:
        if nt * S_BN < S_I:
            _up(e - E, nt, _or(xs_ptr, x_ptr), None, None, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr, S_M, 1, 1, "all",
                1, S_I, D, X_RS, 0, S_I, 0, S_W_RS, 0, S_S_RS, S_W_FMT, S_S_E8M0, S_BLOCK, S_ACT, CDT, LIMIT, S_BM, S_BN,
                S_BK)


@triton.jit
def _or(p, q):
    """`p` where it is set, else `q` (a compile-time choice: an unset pointer is a None constexpr)."""
    if p is not None:
        return p
    else:
        return q


@triton.jit
def _up(e, nt, x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
        P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, MODE: tl.constexpr, PB: tl.constexpr,
        I: tl.constexpr, D: tl.constexpr,
        X_RS: tl.constexpr, IDX_RS: tl.constexpr, H_RS: tl.constexpr,
        W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
        W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
        CDT: tl.constexpr, LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Expert e's I tile nt: h[pairs of e, tile] = SwiGLU(x W1_e^T, x W3_e^T), rounded as the reference."""
    offs_n = nt * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    rk = tl.arange(0, BK)
    w1 = w1_ptr + e.to(tl.int64) * W_ES
    w3 = w3_ptr + e.to(tl.int64) * W_ES
    s1 = s1_ptr + e.to(tl.int64) * S_ES if s1_ptr is not None else s1_ptr
    s3 = s3_ptr + e.to(tl.int64) * S_ES if s3_ptr is not None else s3_ptr
    dt = h_ptr.dtype.element_ty
    lo, hi, pa, sel, rank = _span(e, idx_ptr, grp_ptr, P, KSEL, IDX_RS, MODE, PB)
    for j in range(lo, hi, BM):
        pr, ok = _tile(j, hi, grp_ptr, pa, sel, rank, E, MODE, BM)
        tok = pr // KSEL
        g = tl.zeros([BN, BM], dtype=tl.float32)
        u = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, D, BK):
            kk = k0 + rk
            k_ok = kk < D
            xt = tl.load(x_ptr + tok[None, :].to(tl.int64) * X_RS + kk[:, None],
                         mask=ok[None, :] & k_ok[:, None], other=0.0)
            g = mma_step(g, xt, None, w1, s1, offs_n, n_ok, kk, k_ok, k0, D, W_RS, 1, S_RS, 1, W_FMT, S_E8M0, BLOCK,
                         ACT, CDT, BK)
            u = mma_step(u, xt, None, w3, s3, offs_n, n_ok, kk, k_ok, k0, D, W_RS, 1, S_RS, 1, W_FMT, S_E8M0, BLOCK,
                         ACT, CDT, BK)
        h = _swiglu(g, u, LIMIT, dt)
        tl.store(h_ptr + pr[None, :].to(tl.int64) * H_RS + offs_n[:, None], h, mask=ok[None, :] & n_ok[:, None])


@triton.jit
def moe_down_kernel(h_ptr, idx_ptr, grp_ptr, wt_ptr, w2_ptr, s2_ptr, y_ptr,
                    sem_ptr, cidx_ptr, hs_ptr, cw2_ptr, cs2_ptr, out_ptr, sy_ptr,
                    P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, MODE: tl.constexpr, PB: tl.constexpr,
                    I: tl.constexpr, D: tl.constexpr,
                    H_RS: tl.constexpr, IDX_RS: tl.constexpr, WT_RS: tl.constexpr, Y_RS: tl.constexpr,
                    W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
                    W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                    CDT: tl.constexpr, ROUTE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    C_M: tl.constexpr, C_IS: tl.constexpr, C_HS_RS: tl.constexpr, C_Y_RS: tl.constexpr,
                    C_W_RS: tl.constexpr, C_S_RS: tl.constexpr, C_W_FMT: tl.constexpr, C_S_E8M0: tl.constexpr,
                    C_BLOCK: tl.constexpr, C_ACT: tl.constexpr, C_BK: tl.constexpr, C_BKS: tl.constexpr,
                    C_SM: tl.constexpr, PDL: tl.constexpr = False):
    """Routed down (expert e, D tile) -> yr rows; the last of a D tile's E expert programs to arrive then
    combines that tile for every token (`_combine`: the shared expert's down GEMM and the ordered sum)."""
    pdl_enter(PDL)
    n_tile = tl.program_id(1)
    _down(tl.program_id(0), n_tile, h_ptr, idx_ptr, grp_ptr, wt_ptr, w2_ptr, s2_ptr, y_ptr, P, E, KSEL, MODE, PB, I,
          D, H_RS, IDX_RS, WT_RS, Y_RS, W_ES, W_RS, S_ES, S_RS, W_FMT, S_E8M0, BLOCK, ACT, CDT, ROUTE, BM, BN, BK)
    if last_to_arrive(sem_ptr + n_tile, E):  # codegen/kernels/arrival.py
        _combine_column(n_tile, hs_ptr, y_ptr, cidx_ptr, cw2_ptr, cs2_ptr, out_ptr, sy_ptr, C_M, C_SM, E, KSEL, C_IS, D, C_HS_RS,
                        Y_RS, IDX_RS, C_Y_RS, C_W_RS, C_S_RS, C_W_FMT, C_S_E8M0, C_BLOCK, C_ACT, CDT, BM, BN, C_BK, C_BKS)
        tl.store(sem_ptr + n_tile, 0)


@triton.jit
def _down(e, n_tile, h_ptr, idx_ptr, grp_ptr, wt_ptr, w2_ptr, s2_ptr, y_ptr,
          P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, MODE: tl.constexpr, PB: tl.constexpr,
          I: tl.constexpr, D: tl.constexpr,
          H_RS: tl.constexpr, IDX_RS: tl.constexpr, WT_RS: tl.constexpr, Y_RS: tl.constexpr,
          W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
          W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
          CDT: tl.constexpr, ROUTE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Expert e's D tile n_tile: yr[pairs of e, tile] = the routed down GEMM and its routing weight."""
    offs_n = n_tile * BN + tl.arange(0, BN)
    n_ok = offs_n < D
    rk = tl.arange(0, BK)
    w2 = w2_ptr + e.to(tl.int64) * W_ES
    s2 = s2_ptr + e.to(tl.int64) * S_ES if s2_ptr is not None else s2_ptr
    dt = y_ptr.dtype.element_ty
    lo, hi, pa, sel, rank = _span(e, idx_ptr, grp_ptr, P, KSEL, IDX_RS, MODE, PB)
    for j in range(lo, hi, BM):
        pr, ok = _tile(j, hi, grp_ptr, pa, sel, rank, E, MODE, BM)
        wt = tl.load(wt_ptr + (pr // KSEL) * WT_RS + pr % KSEL, mask=ok, other=0.0).to(tl.float32)
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + rk
            k_ok = kk < I
            ht = tl.load(h_ptr + pr[None, :].to(tl.int64) * H_RS + kk[:, None], mask=ok[None, :] & k_ok[:, None],
                         other=0.0)
            if ROUTE == "before_w2":  # the weight scales w2's input, before its activation quantisation
                ht = (ht.to(tl.float32) * wt[None, :]).to(dt)
            acc = mma_step(acc, ht, None, w2, s2, offs_n, n_ok, kk, k_ok, k0, I, W_RS, 1, S_RS, 1, W_FMT, S_E8M0,
                           BLOCK, ACT, CDT, BK)
        if ROUTE == "before_w2":
            ye = acc.to(dt)
        else:
            ye = (acc.to(dt).to(tl.float32) * wt[None, :]).to(dt)
        tl.store(y_ptr + pr[None, :].to(tl.int64) * Y_RS + offs_n[:, None], ye, mask=ok[None, :] & n_ok[:, None])


@triton.jit
def _combine_column(n_tile, hs_ptr, yr_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr, sy_ptr,
                    M: tl.constexpr, SM: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, IS: tl.constexpr, D: tl.constexpr,
                    HS_RS: tl.constexpr, YR_RS: tl.constexpr, IDX_RS: tl.constexpr, Y_RS: tl.constexpr,
                    W_RS: tl.constexpr, S_RS: tl.constexpr, W_FMT: tl.constexpr, S_E8M0: tl.constexpr,
                    BLOCK: tl.constexpr, ACT: tl.constexpr, CDT: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, ROUTED: tl.constexpr = True):
    """`_combine` of D tile n_tile for every token, BM tokens at a time."""
    for m_tile in range(0, (M + BM - 1) // BM):
        _combine(n_tile, m_tile, hs_ptr, yr_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr, sy_ptr, M, SM, E, KSEL, IS, D, HS_RS, YR_RS,
                 IDX_RS, Y_RS, W_RS, S_RS, W_FMT, S_E8M0, BLOCK, ACT, CDT, BM, BN, BK, BKS, ROUTED)


@triton.jit
def _combine(n_tile, m_tile, hs_ptr, yr_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr, sy_ptr,
             M: tl.constexpr, SM: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, IS: tl.constexpr, D: tl.constexpr,
             HS_RS: tl.constexpr, YR_RS: tl.constexpr, IDX_RS: tl.constexpr, Y_RS: tl.constexpr,
             W_RS: tl.constexpr, S_RS: tl.constexpr, W_FMT: tl.constexpr, S_E8M0: tl.constexpr,
             BLOCK: tl.constexpr, ACT: tl.constexpr, CDT: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, ROUTED: tl.constexpr = True):
    """y[tokens of m_tile, columns of n_tile] = the routed rows summed by ascending expert id + W2_s hs.
    A slot whose expert id lies outside [0, E) (another rank's, `local_experts`) has no row: it adds nothing.
    With `sy_ptr` (`moe_router_experts_ep`) the two sums stay apart: y gets the routed sum (the rank's partial,
    which the all-reduce after the launch adds up) and sy the shared expert's output, for its SM tokens
    (`moe_router_experts_dp`: the rank's own, the first SM of the M; else SM = M). The two apart can run apart
    too: w2_ptr None, the routed sum alone; ROUTED False (with sy_ptr), the shared output alone (the producer fold
    of `moe_router.moe_fused_kernel`: the routed sum goes to the peers before the shared weights are read)."""
    offs_n = n_tile * BN + tl.arange(0, BN)
    tok = m_tile * BM + tl.arange(0, BM)
    n_ok = offs_n < D
    t_ok = tok < M
    dt = y_ptr.dtype.element_ty
    out = tl.zeros([BN, BM], dtype=tl.float32)
    if ROUTED:  # routed: slots in ascending expert id (ties by slot), each add rounded to dt as index_add_ does
        j = tl.arange(0, BKS)
        ex = tl.load(idx_ptr + tok[:, None] * IDX_RS + j[None, :], mask=t_ok[:, None] & (j[None, :] < KSEL),
                     other=2 ** 30).to(tl.int32)
        for r in range(KSEL):  # (not unrolled: fewer loads in the IR for Triton's Coalesce pass, mhc.py's note)
            m = tl.min(ex, axis=1)
            slot = tl.min(tl.where(ex == m[:, None], j[None, :], BKS), axis=1)
            ex = tl.where(j[None, :] == slot[:, None], 2 ** 30 + 1, ex)
            pr = tok * KSEL + slot
            live = t_ok & (m >= 0) & (m < E)
            v = tl.load(yr_ptr + pr[None, :].to(tl.int64) * YR_RS + offs_n[:, None], mask=live[None, :] & n_ok[:, None],
                        other=0.0).to(tl.float32)
            out = (out + v).to(dt).to(tl.float32)
    if w2_ptr is not None:
        s_ok = tok < SM
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, IS, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < IS
            ht = tl.load(hs_ptr + tok[None, :].to(tl.int64) * HS_RS + kk[:, None], mask=s_ok[None, :] & k_ok[:, None],
                         other=0.0)
            acc = mma_step(acc, ht, None, w2_ptr, s2_ptr, offs_n, n_ok, kk, k_ok, k0, IS, W_RS, 1, S_RS, 1, W_FMT, S_E8M0,
                           BLOCK, ACT, CDT, BK)
        if sy_ptr is not None:
            tl.store(sy_ptr + tok[None, :].to(tl.int64) * Y_RS + offs_n[:, None], acc.to(dt),
                     mask=s_ok[None, :] & n_ok[:, None])
        else:
            out = out + acc.to(dt).to(tl.float32)
    if ROUTED:
        tl.store(y_ptr + tok[None, :].to(tl.int64) * Y_RS + offs_n[:, None], out.to(dt),
                 mask=t_ok[None, :] & n_ok[:, None])


def _routed_work(E: int, k: int, M: int, ep: int = 1) -> tuple[float, int]:
    """Modeled routed work of one launch: (expected active experts, MMA rows run).

    The routing is data, so the model assumes uniform routing (each token picks k distinct experts, as
    learned and hash routing do on average; the registry's cost rule counts the same). Each active
    expert's weights are read once per BM routed pairs, and nearly always once (V4-Pro, 64 tokens:
    ~243 of 384 experts active, <= a few pairs each). MMA rows: every expert pads its last tile to BM,
    so rows <= P + active * (BM - 1), the bound used for `flops` (what the MMA units run, padding
    included). With `ep` > 1 the stack is one rank's 1 / ep of the experts: the other ranks' slots (id
    -1) run nothing, so P / ep pairs are expected here (k M / ep) and the active experts among them."""
    active = expected_active_experts(E, k, M, ep)
    return active, round(M * k / ep + active * (BM - 1))


def _wfmt(w: TensorArg, s: TensorArg | None, block: int, K: int, act: str, cdt: str):
    fmt = W_FMT[w.dtype]
    return fmt, tiles(fmt, K, block, act, cdt), (s is not None and s.dtype == "e8m0")


def _contig_last(a: TensorArg | None, what: str) -> None:
    if a is not None and a.strides[-1] != 1:
        raise ValueError(f"moe: {what} needs unit stride on its last axis")


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name not in ("moe_experts_shared", "moe_experts"):
        raise KeyError(f"moe family has no op '{op_name}'")
    o = operands
    x, wts, idx, y = o["x"], o["weights"], o["indices"], results["y"]
    shared = op_name == "moe_experts_shared"
    act = attrs.get("act", "native")
    sact = attrs.get("shared_act", "native")  # the shared expert's activation format (its own attribute)
    limit, block, sblock = float(attrs["limit"]), attrs["block"], attrs.get("shared_block", 128)
    M, x_rs, x_cs = rows_of(x, "moe x")
    _, y_rs, y_cs = rows_of(y, "moe y")
    _, idx_rs, idx_cs = rows_of(idx, "moe indices")
    _, wt_rs, wt_cs = rows_of(wts, "moe weights")
    for a, n in ((x, "x"), (y, "y"), (idx, "indices"), (wts, "weights"), (o["w1"], "w1"), (o["w2"], "w2"),
                 (o["w3"], "w3"), (o.get("w1_scale"), "w1_scale"), (o.get("w2_scale"), "w2_scale")):
        _contig_last(a, n)
    k = idx.shape[-1]
    P = M * k
    D = x.shape[-1]
    E, I = o["w1"].shape[0], o["w1"].shape[1]
    cdt = x.dtype
    dsize = {"fp32": 4, "bf16": 2}[cdt]
    BNI = 64 if I <= 64 else 128
    BND = 64 if D <= 64 else 128
    mode = "scan" if P <= SCAN_MAX_PAIRS else "grouped"
    PB = triton.next_power_of_2(P) if mode == "scan" else 1
    calls = []
    scratch = {"h": P * I * dsize, "yr": P * D * dsize}
    common = dict(ACT=act, CDT=_tl_dtype(cdt), BM=BM)
    # The shared gate/up program loops over all tokens: token tiles as wide as `linear` uses, so a prefill
    # chunk passes over the weight tile once per 64 tokens, not once per 16 (same program count). The
    # combine keeps BM-token tiles: its token axis is in the grid, and it has few programs already.
    BMS = min(64, max(BM, triton.next_power_of_2(M)))
    warps_s = 8 if BMS * 128 >= 8192 else 4
    ep = attrs.get("ep", 1)
    active, rows = _routed_work(E, k, M, ep)
    pl = P / ep  # the pairs expected on this rank's experts (all of them unless expert parallel)

    def wce(w, s, K, blk, a=act):
        fmt, BK, e8 = _wfmt(w, s, blk, K, a, cdt)
        return {"W_FMT": fmt, "S_E8M0": e8, "BLOCK": blk, "BK": BK,
                "W_RS": w.strides[-2], "S_RS": s.strides[-2] if s is not None else 0}

    def per_expert(w, s):  # bytes of one expert's weight (+ scales)
        return (w.type.nbytes + (s.type.nbytes if s is not None else 0)) // E

    # where the routed kernels find each expert's pairs: the ids themselves (scan) or the grouped list
    if mode == "grouped":
        scratch["grp"] = (E + 1 + P) * 4
        nrb = triton.cdiv(P, GROUP_BP)
        ce = dict(P=P, E=E, KSEL=k, IDX_RS=idx_rs, NRB=nrb, BP=GROUP_BP, BQ=GROUP_BQ)
        calls.append(KernelCall(call_name("moe_group", ce, f"e{E}_p{P}"), moe_group_kernel, ce,
                                [ptr("idx_ptr", "operand", "indices", idx), ptr("grp_ptr", "scratch", "grp", "*i32")],
                                (nrb + triton.cdiv(E + 1, GROUP_BP), 1, 1), num_warps=GROUP_WARPS,
                                scratch_bytes=scratch,
                                unaligned=unaligned({"idx_ptr": idx}), bytes_moved=idx.type.nbytes + scratch["grp"]))
        find = [("grp_ptr", "scratch", "grp", "*i32")]
        find_ce = dict(idx_ptr=None)
    else:
        find = [("idx_ptr", "operand", "indices", idx)]
        find_ce = dict(grp_ptr=None)
    routed = dict(P=P, E=E, KSEL=k, MODE=mode, PB=PB, IDX_RS=idx_rs, **find_ce)

    # 1. routed gate / up, and 2. in programs (E, I tile) of the same launch the shared gate / up
    w1, w3, s1, s3 = o["w1"], o["w3"], o.get("w1_scale"), o.get("w3_scale")
    xs = o.get("xs")  # the shared expert's own tokens (`moe_router_experts_dp`), else x's
    SM = M
    if xs is not None:
        SM, xs_rs, _ = rows_of(xs, "moe xs")
        if xs_rs != x_rs or xs.dtype != x.dtype or SM > M:
            raise ValueError("moe: the shared expert's tokens xs must be laid out as x's rows, at most as many")
    ce = dict(I=I, D=D, X_RS=x_rs, H_RS=I, W_ES=w1.strides[0], S_ES=s1.strides[0] if s1 is not None else 0,
              LIMIT=limit, BN=BNI, **routed, **common, **wce(w1, s1, D, block))
    pts = [("x_ptr", "operand", "x", x), *find, ("w1_ptr", "operand", "w1", w1), ("w3_ptr", "operand", "w3", w3)]
    if xs is not None:
        pts.append(("xs_ptr", "operand", "xs", xs))
    else:
        ce["xs_ptr"] = None
    if s1 is not None:
        pts += [("s1_ptr", "operand", "w1_scale", s1), ("s3_ptr", "operand", "w3_scale", s3)]
    else:
        ce.update(s1_ptr=None, s3_ptr=None)
    pts.append(("h_ptr", "scratch", "h", "*" + cdt))
    tiles_n, warps = triton.cdiv(I, BNI), 4
    flops, wbytes = 4 * rows * I * D, round(active * (per_expert(w1, s1) + per_expert(w3, s3)))
    g1 = g3 = t1 = t3 = None
    if shared:
        g1, g3, t1, t3 = o["s1"], o["s3"], o.get("s1_scale"), o.get("s3_scale")
        IS = g1.shape[0]
        scratch["hs"] = SM * IS * dsize
        BNS = 64 if IS <= 64 else 128
        ce.update(S_M=SM, S_I=IS, S_BM=BMS, S_BN=BNS, S_ACT=sact,
                  **{"S_" + n: v for n, v in wce(g1, t1, D, sblock, sact).items()})
        pts += [("sw1_ptr", "operand", "s1", g1), ("sw3_ptr", "operand", "s3", g3), ("hs_ptr", "scratch", "hs", "*" + cdt)]
        if t1 is not None:
            pts += [("ss1_ptr", "operand", "s1_scale", t1), ("ss3_ptr", "operand", "s3_scale", t3)]
        else:
            ce.update(ss1_ptr=None, ss3_ptr=None)
        tiles_n, warps = max(tiles_n, triton.cdiv(IS, BNS)), warps_s
        flops += 4 * SM * IS * D
        wbytes += 2 * g1.type.nbytes + (2 * t1.type.nbytes if t1 else 0) + (xs or x).type.nbytes
    else:
        ce.update(S_M=0, S_I=0, S_BM=BM, S_BN=BNI, S_ACT=act, S_W_FMT="float", S_S_E8M0=False, S_BLOCK=128, S_BK=32,
                  S_W_RS=0, S_S_RS=0, sw1_ptr=None, sw3_ptr=None, ss1_ptr=None, ss3_ptr=None, hs_ptr=None)
    calls.append(KernelCall(call_name("moe_up", ce, f"e{E}_p{P}_i{I}_d{D}_{ce['W_FMT']}_{cdt}_{mode}"), moe_up_kernel,
                            ce, [ptr(*p) for p in pts], (E + int(shared), tiles_n, 1), num_warps=warps,
                            scratch_bytes=scratch,
                            unaligned=unaligned({"x_ptr": x, "xs_ptr": xs, "idx_ptr": idx if mode == "scan" else None, "w1_ptr": w1,
                                                 "w3_ptr": w3, "s1_ptr": s1, "s3_ptr": s3, "sw1_ptr": g1, "sw3_ptr": g3,
                                                 "ss1_ptr": t1, "ss3_ptr": t3}),
                            # routed and shared GEMMs in one call: the fp8 peak only if both run fp8
                            flops=flops, mma_dtype="fp8" if act == "fp8" and (not shared or sact == "fp8") else "bf16",
                            bytes_moved=wbytes + x.type.nbytes + round(pl * I * dsize)))
    # 3. routed down, and in each D tile's last expert program 4. shared down + combine
    w2, s2 = o["w2"], o.get("w2_scale")
    ce = dict(I=I, D=D, H_RS=I, WT_RS=wt_rs, Y_RS=D, W_ES=w2.strides[0], S_ES=s2.strides[0] if s2 is not None else 0,
              ROUTE=attrs["route_weight"], BN=BND, **routed, **common, **wce(w2, s2, I, block))
    pts = [("h_ptr", "scratch", "h", "*" + cdt), *find, ("wt_ptr", "operand", "weights", wts),
           ("w2_ptr", "operand", "w2", w2)]
    if s2 is not None:
        pts.append(("s2_ptr", "operand", "w2_scale", s2))
    else:
        ce["s2_ptr"] = None
    pts.append(("y_ptr", "scratch", "yr", "*" + cdt))
    ce.update(C_M=M, C_SM=SM, C_Y_RS=y_rs, C_BKS=triton.next_power_of_2(k), C_ACT=sact,
              sy_ptr=None)  # sy_ptr: the shared expert's own output (`moe_router_experts_ep`, moe_router.py)
    pts += [("cidx_ptr", "operand", "indices", idx), ("out_ptr", "result", "y", y)]
    if shared:
        g2, t2 = o["s2"], o.get("s2_scale")
        IS = g2.shape[1] * (2 if g2.dtype == "fp4x2" else 1)
        ce.update(C_IS=IS, C_HS_RS=IS, **{"C_" + n: v for n, v in wce(g2, t2, IS, sblock, sact).items()})
        pts += [("hs_ptr", "scratch", "hs", "*" + cdt), ("cw2_ptr", "operand", "s2", g2)]
        if t2 is not None:
            pts.append(("cs2_ptr", "operand", "s2_scale", t2))
        else:
            ce["cs2_ptr"] = None
        sbytes = g2.type.nbytes + (t2.type.nbytes if t2 else 0)
    else:
        ce.update(C_IS=0, C_HS_RS=0, C_W_FMT="float", C_S_E8M0=False, C_BLOCK=128, C_BK=32, C_W_RS=0, C_S_RS=0,
                  hs_ptr=None, cw2_ptr=None, cs2_ptr=None)
        g2 = t2 = None
        sbytes = 0
    nd = triton.cdiv(D, BND)
    scratch["moe_arrivals"] = nd * 4  # one arrival counter per D tile
    pts.append(("sem_ptr", "semaphore", "moe_arrivals", "*i32"))
    calls.append(KernelCall(call_name("moe_down", ce, f"e{E}_p{P}_i{I}_d{D}_{ce['W_FMT']}_{cdt}_{mode}"),
                            moe_down_kernel, ce, [ptr(*p) for p in pts], (E, nd, 1), num_warps=4,
                            scratch_bytes=scratch,
                            unaligned=unaligned({"idx_ptr": idx if mode == "scan" else None, "wt_ptr": wts,
                                                 "w2_ptr": w2, "s2_ptr": s2, "cidx_ptr": idx, "cw2_ptr": g2,
                                                 "cs2_ptr": t2, "out_ptr": y}),
                            flops=2 * rows * I * D + 2 * SM * D * ce["C_IS"],
                            mma_dtype="fp8" if act == "fp8" and (not shared or sact == "fp8") else "bf16",
                            # yr written here and read back by the combining programs
                            bytes_moved=round(active * per_expert(w2, s2)) + wts.type.nbytes
                            + round(pl * (I + 2 * D) * dsize)
                            + sbytes + y.type.nbytes))
    return calls
