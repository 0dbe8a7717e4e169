"""moe_router family: `moe_router_experts_shared` (router + shared expert + routed experts, one op), and with
the seam after it (`moe_mhc_post_pre`) and the seam before it too (`mhc_moe_mhc`), in one launch at decode.

Decode-sized P (the moe family's "scan" mode): the router, both expert GEMMs of both kinds of expert and the
combine run in one launch. Its programs are, in the order they start (`phases.ticket`):
  tickets [0, NO)            (`ar_mhc_moe_ep`) the one-shot all-reduce of the attention's partial output
                             (`allreduce.oneshot_tiles`, across the ranks) into scratch, the seam before's input;
                             each publishes; every seam-before program waits for all NO (`allreduce.fold`);
                             or (`ag_moe_router_experts_dp_rs`, AR_GATHER) the one-shot all-gather of every rank's
                             tokens (`allreduce.rows_tiles`) into the router's x, scratch, every router program
                             waiting for all NO (`allreduce.fold_rows`);
  then NA                    (`mhc_moe_mhc`) the seam before the MoE (`mhc.mhc_rows`, one per BT tokens: the
                             attention output's hc_post into the streams, hc_pre, ffn_norm) -> the MoE's
                             input x and the streams / post / comb the seam after reads, all scratch; each
                             publishes; every router and shared program waits for all NA first (the routed
                             and combining programs follow them, so they see x too). `moe_mhc_post_pre` (the
                             first MoE layer: no seam before it) launches the same binary with the seam's
                             weights null: these programs then copy its x / streams / post / comb there
                             (`_copy_rows`), and the first layer and the others have one binary.
                             `mhc_ag_moe_router_experts_dp_rs` (DP): these NA programs come first, writing the
                             rank's own tokens (scratch `seam_x`, xs_ptr) and the seam's streams / post / comb
                             results; the NO all-gather programs after them wait for all NA and gather that x;
                             the seam's inputs and weights come through the call's pointer table (`TABLED`);
  tickets [0, NR)            the router (`router.route_rows`, one per BR token rows) -> the routing weights
                             and expert ids, scratch `route_weights` / `route_indices`; each then publishes;
  tickets [NR, NR + NG)      (`moe_router_experts_dp`, 64 < P <= FUSED_MAX_PAIRS) the grouping (`moe._group_block`, the
                             blocks `moe_group_kernel` launches apart): once every router program has published,
                             the pairs' list sorted by expert into scratch `grp`; each publishes; the routed
                             gate / up programs wait for all NG (none in "scan" mode: NG = 0);
  then ST                    the shared expert's gate / up I tiles -> hs (they need no routing, so they run
                             while the router does); each publishes;
  then E x RT                the routed experts' (expert, I tile) gate / up programs -> h: they first wait
                             for all NR router programs (`phases.wait_for`), then rank their pairs in the
                             ids; each publishes to its expert's count;
  then E x ND                the routed (expert, D tile) down programs -> yr: each waits for its expert's RT
                             I tiles; the last of a D tile's E programs to arrive (`arrival.last_to_arrive`)
                             waits for the ST shared tiles and combines the tile (the shared down GEMM and
                             the ordered sum, `moe._combine_column`) into y;
  with the MoE's all-reduce folded in (`mhc_moe_ep_ar`, `moe_router_experts_ep_ar`; `allreduce.fold_trailing`,
  whose docstring gives the deadlock-freedom argument) the shared expert moves after the routed work
  (ST0 = 0) and the combine writes the routed sum alone, then:
  then NP                    once every D tile is combined, the routed partial published to the peers
                             (`allreduce.publish_tiles`: slot, flags); each publishes;
  then ST                    the shared expert's gate / up, as above (its weights' bytes now overlap the peers);
  then SD = ND               the shared expert's down GEMM per D tile into its own output (`_combine_column`,
                             ROUTED False), after the ST tiles;
  then NP                    after the NP publishers: the peers' flags waited for and the partials summed in
                             rank order into y (`allreduce.gather_tiles`, in place; with DP's reduce-scatter folded
                             in, `ag_moe_router_experts_dp_rs`, TR_SCATTER: this rank's rows alone, from the
                             partial in scratch into `tr_y_ptr`, `allreduce.scatter_tiles`);
  then NH                    (`moe_mhc_post_pre`, `mhc_moe_mhc`) the seam after the MoE, one per BT tokens,
                             once every D tile is combined.
A program waits only for programs that took earlier tickets (see `phases`; a folded all-reduce's programs also
for their peers': `allreduce.fold` and `fold_trailing` say why that is safe), so no schedule deadlocks; what
it reads was published along that chain (the router's ids reach the down programs through the up programs'
acquire / release). The last program to finish resets the counters (one `semaphore`, `moe_phase`).
Grouped otherwise (the other ops; above FUSED_MAX_PAIRS pairs) the router keeps its own launch, writing the same scratch, then
the moe family's launches (grouping, up, down); the seams keep their launches too.
`moe_router_experts_dp` (data parallel): the router and the routed experts run on the gathered tokens `x`,
the shared expert's gate / up on the rank's own `xs_ptr` (S_M rows) and the combine's shared down GEMM on
the first C_SM rows of its output (`moe._combine`).
Every kernel computes what the router and moe kernels compute, in the same order, so the results are
bit-identical to the two ops run apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton
import triton.language as tl

from ...ir.registry import Layout
from ...ir.types import TensorType
from . import CALLS_PARAM, PDL_PARAM, KernelCall, TensorArg, call_name, ptr
from .call import in_kernel_order
from . import mhc, moe, router
from .arrival import last_to_arrive
from .mhc import _given, mhc_rows
from .moe import _combine_column, _down, _group_block, _or, _up
from .allreduce import (UNFOLDED, UNGATHERED, UNTRAILED, fold_rows, fold_trailing, folded, gather_tiles, gathered,
                        oneshot_in_place, oneshot_tiles, publish_tiles, rows_call, rows_tiles, scatter_tiles)
from .pdl import pdl_enter
from .peers import Region
from .phases import publish, ticket, wait_for
from .router import route_rows

# router kernel params -> the fused kernel's (x and the ids it writes are the up programs' own pointers)
ROUTER_PARAMS = {"x_ptr": "x_ptr", "w_ptr": "r_w_ptr", "b_ptr": "r_b_ptr", "t_ptr": "r_t_ptr", "ids_ptr": "r_ids_ptr",
                 "wo_ptr": "r_wo_ptr", "io_ptr": "idx_ptr", "o_ptr": "r_o_ptr"}
# the op's names of the routing as the router / moe calls see them -> the fused op's
RENAMED = {("result", "weights"): ("scratch", "route_weights"), ("result", "indices"): ("scratch", "route_indices"),
           ("operand", "weights"): ("scratch", "route_weights"), ("operand", "indices"): ("scratch", "route_indices"),
           ("operand", "w"): ("operand", "gate")}
# with a seam: the MoE's output as the MoE kernels write it and the mhc kernel reads it -> scratch
SEAM_RENAMED = {**RENAMED, ("result", "y"): ("scratch", "moe_y"), ("operand", "y"): ("scratch", "moe_y")}
# moe_down kernel params -> the fused kernel's (the routing it reads is the router's scratch, its counters
# the fused call's one semaphore)
DOWN_PARAMS = {"h_ptr": "h_ptr", "idx_ptr": "idx_ptr", "grp_ptr": "grp_ptr", "wt_ptr": "r_wo_ptr", "w2_ptr": "w2_ptr",
               "s2_ptr": "s2_ptr", "y_ptr": "yr_ptr", "cidx_ptr": "idx_ptr", "hs_ptr": "hs_ptr", "cw2_ptr": "cw2_ptr",
               "cs2_ptr": "cs2_ptr", "out_ptr": "out_ptr", "sy_ptr": "sy_ptr"}
# the down call's constexprs that are the up call's too (the same pairs, experts and formats)
SHARED_CONSTEXPRS = ("P", "E", "KSEL", "MODE", "PB", "I", "D", "IDX_RS", "ACT", "CDT", "BM")
# `moe_mhc_post_pre`: the seam's operands, and its mhc kernel's params -> the fused kernel's (the MoE's
# output it reads is the combine's `out_ptr`)
SEAM_OPERANDS = ("streams", "post", "comb", "fn", "base", "scale", "norm")
SEAM_PARAMS = {"y_ptr": "out_ptr", "s_ptr": "m_s_ptr", "post_ptr": "m_post_ptr", "comb_ptr": "m_comb_ptr",
               "fn_ptr": "m_fn_ptr", "base_ptr": "m_base_ptr", "scale_ptr": "m_scale_ptr", "norm_ptr": "m_norm_ptr",
               "so_ptr": "m_so_ptr", "yo_ptr": "m_yo_ptr", "posto_ptr": "m_posto_ptr", "combo_ptr": "m_combo_ptr"}
# `mhc_moe_mhc`: the seam before the MoE as the mhc kernel sees it -> the fused op's names (its results are
# scratch, read back as the MoE's x and the seam after's streams / post / comb) ...
FRONT_RENAMED = {("result", "streams_out"): ("scratch", "seam_streams"), ("result", "y_next"): ("scratch", "seam_x"),
                 ("result", "post_next"): ("scratch", "seam_post"), ("result", "comb_next"): ("scratch", "seam_comb"),
                 **{("operand", n): ("operand", "in_" + n) for n in ("fn", "base", "scale", "norm")}}
# ... and those scratch buffers where the MoE's calls and the seam after read them as operands
INNER_RENAMED = {("operand", n): ("scratch", "seam_" + r) for n, r in
                 (("x", "x"), ("streams", "streams"), ("post", "post"), ("comb", "comb"))}
# the seam before's mhc kernel params -> the fused kernel's (its outputs are the MoE's x and the seam after's
# inputs: one buffer each, the same params)
FRONT_PARAMS = {"y_ptr": "a_y_ptr", "s_ptr": "a_s_ptr", "post_ptr": "a_post_ptr", "comb_ptr": "a_comb_ptr",
                "fn_ptr": "a_fn_ptr", "base_ptr": "a_base_ptr", "scale_ptr": "a_scale_ptr", "norm_ptr": "a_norm_ptr",
                "so_ptr": "m_s_ptr", "yo_ptr": "x_ptr", "posto_ptr": "m_post_ptr", "combo_ptr": "m_comb_ptr"}
# the seam's constexprs when there is none (`moe_router_experts_shared`: NH = 0 programs run it)
NO_SEAM = {**{p: None for p in SEAM_PARAMS if p != "y_ptr"}, "M": 0, "N": 1, "D": 16, "BD": 16, "BT": 16,
           "POST": False, "MIX": "", "NORM": False, "NM": 16, "EPS": 0.0, "HC_EPS": 0.0, "ITERS": 1, "NORM_EPS": 0.0,
           "Y_S": 0, "S_S": 0, "S_SN": 0, "SO_S": 0, "SO_SN": 0, "YO_S": 0, "DT": tl.float32}
# no seam before the MoE (NA = 0 programs; the branch is compiled out)
NO_FRONT = {**{p: None for p in FRONT_PARAMS.values() if p.startswith("a_")},
            **{"A_" + n: v for n, v in NO_SEAM.items() if not n.endswith("_ptr")}, "NA": 0}
# the semaphore's int32 counters: the ticket, router programs done, shared gate / up tiles done, D tiles
# combined, programs finished, seam-before blocks done, grouping blocks done, all-reduce programs done, the
# MoE's all-reduce's publishers done (COUNTERS slots, a power of two);
# then one arrival
# counter per D tile and one count of finished I tiles per expert
TICKET, ROUTED, SHARED_UP, COMBINED, FINISHED, SEAM_IN, GROUPED, REDUCED, PUBLISHED = (tl.constexpr(i)
                                                                                      for i in range(9))
COUNTERS = tl.constexpr(16)
G_BP, G_BQ = tl.constexpr(moe.GROUP_BP), tl.constexpr(moe.GROUP_BQ)  # the grouping's blocks (`moe_group_kernel`'s)
# Up to this many (token, slot) pairs the grouped MoE of `moe_router_experts_dp` is one launch too, its grouping
# a phase after the router's (a decode step of every rank's tokens: V4-Pro, 8 ranks x 8 tokens x top-6 = 384);
# above it (prefill chunks) the router, the grouping and the experts keep their launches, a few us next to a
# chunk's. The other ops keep their grouped launches apart (their programs unchanged; they could take the same
# phase: a single-rank decode batch past 10 tokens is grouped too).
FUSED_MAX_PAIRS = 512
# Params that may be scratch: where they are, the call carves them from its one scratch pointer (`scr_ptr`,
# `<param>_AT`: the byte offset, `<param>_DT`: the element type) instead of taking a pointer each. Every
# pointer argument holds two scalar registers for the whole kernel on gfx950, and with the seam before's
# eight pointers the one-launch MoE ran out of them (16 SGPRs spilled at V4-Pro).
CARVED = ("x_ptr", "idx_ptr", "h_ptr", "hs_ptr", "r_wo_ptr", "yr_ptr", "out_ptr", "m_s_ptr", "m_post_ptr",
          "m_comb_ptr", "xs_ptr", "grp_ptr")
# The seam before's pointers, which its phase alone reads: under DP (`mhc_ag_moe_router_experts_dp_rs`) they come
# through the call's pointer table (`KernelCall.tabled`, `tab_ptr`: the runtime fills it), loaded in that phase,
# since as arguments their 16 scalar registers made the gfx950 binary spill (8 spills at V4-Pro DP8).
TABLED = ("a_y_ptr", "a_s_ptr", "a_post_ptr", "a_comb_ptr", "a_fn_ptr", "a_base_ptr", "a_scale_ptr", "a_norm_ptr")
UNTABLED = {"tab_ptr": None, **{p + "_TI": -1 for p in TABLED}, **{p + "_DT": None for p in TABLED}}
CARVE_ALIGN = 256  # bytes: every part starts aligned as a buffer of its own would
TL_OF = {"fp32": tl.float32, "bf16": tl.bfloat16, "i64": tl.int64, "i32": tl.int32}


@triton.jit
def _carve(p, base, AT: tl.constexpr, DT: tl.constexpr):
    """`p`, or (AT >= 0) the part of the scratch at `base` that starts AT bytes in, as a pointer to DT."""
    if AT >= 0:
        return (base + AT).to(tl.pointer_type(DT))
    else:
        return p


@triton.jit
def _tabled(p, tab, TI: tl.constexpr, DT: tl.constexpr):
    """`p`, or (TI >= 0) entry TI of the call's pointer table `tab` (`KernelCall.tabled`) as a pointer to DT, 16-byte
    aligned as an argument's would be (`_tabulate` tables aligned pointers only)."""
    if TI >= 0:
        return tl.multiple_of(tl.load(tab + TI).to(tl.pointer_type(DT)), 16)
    else:
        return p


@triton.jit
def _table(p, tab, DT: tl.constexpr):
    """`p`, or (DT given) the routing table `tab` (tid2eid or the bias, as bytes) as a pointer to DT."""
    if DT is not None:
        return tab.to(tl.pointer_type(DT))
    else:
        return p


@triton.jit
def _copy_rows(tb, y_ptr, s_ptr, post_ptr, comb_ptr, so_ptr, yo_ptr, posto_ptr, combo_ptr,
               M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, NM: tl.constexpr,
               Y_S: tl.constexpr, S_S: tl.constexpr, S_SN: tl.constexpr, SO_S: tl.constexpr, SO_SN: tl.constexpr,
               YO_S: tl.constexpr):
    """Token block tb of y, the streams, post and comb copied to where the seam before would write its results
    (`mhc_rows`' layouts: post and comb dense): the first MoE layer's one launch takes its inputs as the seam
    before's results, bit for bit."""
    tok = tb * BT + tl.arange(0, BT)
    tm = tok < M
    for d0 in range(0, D, BD):
        c = d0 + tl.arange(0, BD)
        m2 = tm[:, None] & (c < D)[None, :]
        tl.store(yo_ptr + tok[:, None] * YO_S + c[None, :], tl.load(y_ptr + tok[:, None] * Y_S + c[None, :], mask=m2),
                 mask=m2)
        for k in range(N):
            x = tl.load(s_ptr + tok[:, None] * S_S + k * S_SN + c[None, :], mask=m2)
            tl.store(so_ptr + tok[:, None] * SO_S + k * SO_SN + c[None, :], x, mask=m2)
    n = tl.arange(0, NM)[None, :]
    m2 = tm[:, None] & (n < N)
    tl.store(posto_ptr + tok[:, None] * N + n, tl.load(post_ptr + tok[:, None] * N + n, mask=m2), mask=m2)
    n = tl.arange(0, N * N)[None, :]
    m2 = tm[:, None] & (n < N * N)
    tl.store(combo_ptr + tok[:, None] * (N * N) + n, tl.load(comb_ptr + tok[:, None] * (N * N) + n, mask=m2), mask=m2)


@triton.jit(noinline=True)
def _route_phase(rb, x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr, o_ptr,
                 R: tl.constexpr, D: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr,
                 X_RS: tl.constexpr, W_RS: tl.constexpr, T_RS: tl.constexpr, I_S: tl.constexpr,
                 WO_RS: tl.constexpr, IO_RS: tl.constexpr, ROUTE_SCALE: tl.constexpr, DENOM_EPS: tl.constexpr,
                 SUM_IN_DT: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr):
    """`route_rows` as a function of its own: inlined next to the MMA tiles of the up programs, its [BR, E]
    register arrays made sm_90a spill (720 B at V4-Pro); called, its registers are allocated apart."""
    route_rows(rb, x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr, o_ptr, R, D, E, KSEL, X_RS, W_RS, T_RS, I_S, WO_RS,
               IO_RS, ROUTE_SCALE, DENOM_EPS, SUM_IN_DT, BR, BE, BK, BKS)


# the same, inlined: on gfx950 a call would give the kernel hidden kernel arguments (kernels/flags.py: CALLS_PARAM)
_route_phase_inlined = triton.jit(_route_phase.fn)


@triton.jit
def moe_fused_kernel(x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                     sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr,
                     r_w_ptr, r_b_ptr, r_t_ptr, r_ids_ptr, r_wo_ptr, r_o_ptr,
                     w2_ptr, s2_ptr, yr_ptr, cw2_ptr, cs2_ptr, out_ptr, sy_ptr,
                     m_s_ptr, m_post_ptr, m_comb_ptr, m_fn_ptr, m_base_ptr, m_scale_ptr, m_norm_ptr,
                     m_so_ptr, m_yo_ptr, m_posto_ptr, m_combo_ptr,
                     a_y_ptr, a_s_ptr, a_post_ptr, a_comb_ptr, a_fn_ptr, a_base_ptr, a_scale_ptr, a_norm_ptr,
                     scr_ptr, phase_ptr,
                     P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, MODE: tl.constexpr, PB: tl.constexpr,
                     I: tl.constexpr, D: tl.constexpr,
                     X_RS: tl.constexpr, IDX_RS: tl.constexpr, H_RS: tl.constexpr,
                     W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
                     W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                     CDT: tl.constexpr, LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr,
                     S_M: tl.constexpr, S_I: tl.constexpr, S_W_RS: tl.constexpr, S_S_RS: tl.constexpr,
                     S_W_FMT: tl.constexpr, S_S_E8M0: tl.constexpr, S_BLOCK: tl.constexpr, S_ACT: tl.constexpr,
                     S_BM: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                     R_R: tl.constexpr, R_D: tl.constexpr, R_E: tl.constexpr, R_KSEL: tl.constexpr,
                     R_X_RS: tl.constexpr, R_W_RS: tl.constexpr, R_T_RS: tl.constexpr, R_I_S: tl.constexpr,
                     R_WO_RS: tl.constexpr, R_IO_RS: tl.constexpr, R_ROUTE_SCALE: tl.constexpr,
                     R_DENOM_EPS: tl.constexpr, R_SUM_IN_DT: tl.constexpr, R_BR: tl.constexpr, R_BE: tl.constexpr,
                     R_BK: tl.constexpr, R_BKS: tl.constexpr,
                     D_H_RS: tl.constexpr, D_WT_RS: tl.constexpr, D_Y_RS: tl.constexpr, D_W_ES: tl.constexpr,
                     D_W_RS: tl.constexpr, D_S_ES: tl.constexpr, D_S_RS: tl.constexpr, D_W_FMT: tl.constexpr,
                     D_S_E8M0: tl.constexpr, D_BLOCK: tl.constexpr, D_ROUTE: tl.constexpr, D_BN: tl.constexpr,
                     D_BK: tl.constexpr,
                     C_M: tl.constexpr, C_IS: tl.constexpr, C_HS_RS: tl.constexpr, C_Y_RS: tl.constexpr,
                     C_W_RS: tl.constexpr, C_S_RS: tl.constexpr, C_W_FMT: tl.constexpr, C_S_E8M0: tl.constexpr,
                     C_BLOCK: tl.constexpr, C_ACT: tl.constexpr, C_BK: tl.constexpr, C_BKS: tl.constexpr,
                     H_M: tl.constexpr, H_N: tl.constexpr, H_D: tl.constexpr, H_BD: tl.constexpr,
                     H_BT: tl.constexpr, H_POST: tl.constexpr, H_MIX: tl.constexpr, H_NORM: tl.constexpr,
                     H_NM: tl.constexpr, H_EPS: tl.constexpr, H_HC_EPS: tl.constexpr, H_ITERS: tl.constexpr,
                     H_NORM_EPS: tl.constexpr, H_Y_S: tl.constexpr, H_S_S: tl.constexpr, H_S_SN: tl.constexpr,
                     H_SO_S: tl.constexpr, H_SO_SN: tl.constexpr, H_YO_S: tl.constexpr, H_DT: tl.constexpr,
                     A_M: tl.constexpr, A_N: tl.constexpr, A_D: tl.constexpr, A_BD: tl.constexpr,
                     A_BT: tl.constexpr, A_POST: tl.constexpr, A_MIX: tl.constexpr, A_NORM: tl.constexpr,
                     A_NM: tl.constexpr, A_EPS: tl.constexpr, A_HC_EPS: tl.constexpr, A_ITERS: tl.constexpr,
                     A_NORM_EPS: tl.constexpr, A_Y_S: tl.constexpr, A_S_S: tl.constexpr, A_S_SN: tl.constexpr,
                     A_SO_S: tl.constexpr, A_SO_SN: tl.constexpr, A_YO_S: tl.constexpr, A_DT: tl.constexpr,
                     NA: tl.constexpr, NR: tl.constexpr,
                     x_ptr_AT: tl.constexpr, x_ptr_DT: tl.constexpr, idx_ptr_AT: tl.constexpr, idx_ptr_DT: tl.constexpr,
                     h_ptr_AT: tl.constexpr, h_ptr_DT: tl.constexpr, hs_ptr_AT: tl.constexpr, hs_ptr_DT: tl.constexpr,
                     r_wo_ptr_AT: tl.constexpr, r_wo_ptr_DT: tl.constexpr, yr_ptr_AT: tl.constexpr,
                     yr_ptr_DT: tl.constexpr, out_ptr_AT: tl.constexpr, out_ptr_DT: tl.constexpr,
                     m_s_ptr_AT: tl.constexpr, m_s_ptr_DT: tl.constexpr, m_post_ptr_AT: tl.constexpr,
                     m_post_ptr_DT: tl.constexpr, m_comb_ptr_AT: tl.constexpr, m_comb_ptr_DT: tl.constexpr,
                     ST: tl.constexpr, RT: tl.constexpr, ND: tl.constexpr, NH: tl.constexpr, EB: tl.constexpr,
                     xs_ptr, C_SM: tl.constexpr, NG: tl.constexpr, G_NRB: tl.constexpr,
                     R_B_DT: tl.constexpr, R_T_DT: tl.constexpr,
                     ar_x_ptr, peers_ptr, AR_NUMEL: tl.constexpr, AR_GROUP: tl.constexpr, AR_TILE: tl.constexpr,
                     AR_SLOTS_AT: tl.constexpr, AR_SLOT_BYTES: tl.constexpr, AR_FLAGS_AT: tl.constexpr,
                     AR_TILES: tl.constexpr, AR_COUNTS_AT: tl.constexpr, AR_SPIN: tl.constexpr, NO: tl.constexpr,
                     TR_NUMEL: tl.constexpr, TR_GROUP: tl.constexpr, TR_TILE: tl.constexpr,
                     TR_SLOTS_AT: tl.constexpr, TR_SLOT_BYTES: tl.constexpr, TR_FLAGS_AT: tl.constexpr,
                     TR_TILES: tl.constexpr, TR_COUNTS_AT: tl.constexpr, TR_SPIN: tl.constexpr, NP: tl.constexpr,
                     ST0: tl.constexpr, SD: tl.constexpr, tr_y_ptr, TR_SCATTER: tl.constexpr, AR_GATHER: tl.constexpr,
                     xs_ptr_AT: tl.constexpr, xs_ptr_DT: tl.constexpr, grp_ptr_AT: tl.constexpr,
                     grp_ptr_DT: tl.constexpr, tab_ptr, a_y_ptr_TI: tl.constexpr, a_y_ptr_DT: tl.constexpr,
                     a_s_ptr_TI: tl.constexpr, a_s_ptr_DT: tl.constexpr, a_post_ptr_TI: tl.constexpr,
                     a_post_ptr_DT: tl.constexpr, a_comb_ptr_TI: tl.constexpr, a_comb_ptr_DT: tl.constexpr,
                     a_fn_ptr_TI: tl.constexpr, a_fn_ptr_DT: tl.constexpr, a_base_ptr_TI: tl.constexpr,
                     a_base_ptr_DT: tl.constexpr, a_scale_ptr_TI: tl.constexpr, a_scale_ptr_DT: tl.constexpr,
                     a_norm_ptr_TI: tl.constexpr, a_norm_ptr_DT: tl.constexpr,
                     PDL: tl.constexpr = False, CALLS: tl.constexpr = True):
    """Programs by ticket: NO of the one-shot all-reduce of the attention's partial output into a_y_ptr
    (`ar_mhc_moe_ep`, `allreduce.fold`; AR_GATHER: the all-gather of xs_ptr's tokens into x_ptr, `allreduce.fold_rows`;
    else none), NA token blocks of the seam before the MoE (`mhc_moe_mhc`;
    copying its inputs where its weights are null, `moe_mhc_post_pre`; else none), NR router row blocks, ST0
    shared gate / up tiles (ST, or 0 with the MoE's all-reduce folded in),
    E x RT routed (expert, I tile) gate / up, E x ND routed (expert, D tile) down (the last down program of a
    D tile combines it), with the MoE's all-reduce folded in (`allreduce.fold_trailing`: NP > 0) NP publishers,
    the ST shared gate / up tiles, SD shared down tiles and NP gatherers (TR_SCATTER: a reduce-scatter's, into
    tr_y_ptr, `allreduce.fold_rows`), then NH token blocks of the seam after
    the MoE (`moe_mhc_post_pre`, `mhc_moe_mhc`; none for `moe_router_experts_shared`)."""
    pdl_enter(PDL)
    x_ptr = _carve(x_ptr, scr_ptr, x_ptr_AT, x_ptr_DT)
    idx_ptr = _carve(idx_ptr, scr_ptr, idx_ptr_AT, idx_ptr_DT)
    h_ptr = _carve(h_ptr, scr_ptr, h_ptr_AT, h_ptr_DT)
    hs_ptr = _carve(hs_ptr, scr_ptr, hs_ptr_AT, hs_ptr_DT)
    r_wo_ptr = _carve(r_wo_ptr, scr_ptr, r_wo_ptr_AT, r_wo_ptr_DT)
    yr_ptr = _carve(yr_ptr, scr_ptr, yr_ptr_AT, yr_ptr_DT)
    out_ptr = _carve(out_ptr, scr_ptr, out_ptr_AT, out_ptr_DT)
    m_s_ptr = _carve(m_s_ptr, scr_ptr, m_s_ptr_AT, m_s_ptr_DT)
    m_post_ptr = _carve(m_post_ptr, scr_ptr, m_post_ptr_AT, m_post_ptr_DT)
    m_comb_ptr = _carve(m_comb_ptr, scr_ptr, m_comb_ptr_AT, m_comb_ptr_DT)
    xs_ptr = _carve(xs_ptr, scr_ptr, xs_ptr_AT, xs_ptr_DT)
    grp_ptr = _carve(grp_ptr, scr_ptr, grp_ptr_AT, grp_ptr_DT)
    r_b_ptr = _table(r_b_ptr, r_t_ptr, R_B_DT)  # (before r_t_ptr takes its own type)
    r_t_ptr = _table(r_t_ptr, r_t_ptr, R_T_DT)
    t = ticket(phase_ptr + TICKET) - NA - NO
    v = tl.where(t >= NR + NG, t - NG, t)  # the phases after the grouping numbered as if it were not there
    # the leading phases, tickets [0, NO + NA): the collective's NO programs first, the seam's NA after them (its
    # input the all-reduce's result), or with DP's all-gather (AR_GATHER) the seam's first (its output the gather's)
    c = v + NO + NA - NA * AR_GATHER  # the collective's program
    if (v < 0) & (c >= 0) & (c < NO):
        if NO > 0:
            if AR_GATHER:  # every rank's tokens, the router's and the routed experts' (`allreduce.fold_rows`)
                if NA > 0:
                    wait_for(phase_ptr + SEAM_IN, NA)  # this rank's tokens, the seam's output
                rows_tiles(c, xs_ptr, x_ptr, peers_ptr, AR_NUMEL, AR_GROUP, AR_TILE, NO, AR_SLOTS_AT, AR_SLOT_BYTES,
                           AR_FLAGS_AT, AR_TILES, AR_COUNTS_AT, AR_SPIN, True)
            else:  # the all-reduce the seam before reads (`allreduce.fold`: the one-shot's programs)
                oneshot_tiles(c, ar_x_ptr, a_y_ptr, peers_ptr, AR_NUMEL, AR_GROUP, AR_TILE, NO, AR_SLOTS_AT,
                              AR_SLOT_BYTES, AR_FLAGS_AT, AR_TILES, AR_COUNTS_AT, AR_SPIN)
            publish(phase_ptr + REDUCED)
    elif v < 0:
        if NA > 0:  # the seam before: x (DP: xs, the rank's own), and the streams / post / comb the seam after
            s = v + NA + NO * AR_GATHER  # reads, into scratch
            if NO > 0:
                if AR_GATHER:
                    pass  # (the gather waits for this phase instead)
                else:
                    wait_for(phase_ptr + REDUCED, NO)  # every tile of the reduced attention output
            # (DP: the seam's pointers from the call's table, `TABLED`: loaded here, not held by the whole kernel)
            a_y = _tabled(a_y_ptr, tab_ptr, a_y_ptr_TI, a_y_ptr_DT)
            a_s = _tabled(a_s_ptr, tab_ptr, a_s_ptr_TI, a_s_ptr_DT)
            a_post = _tabled(a_post_ptr, tab_ptr, a_post_ptr_TI, a_post_ptr_DT)
            a_comb = _tabled(a_comb_ptr, tab_ptr, a_comb_ptr_TI, a_comb_ptr_DT)
            a_fn = _tabled(a_fn_ptr, tab_ptr, a_fn_ptr_TI, a_fn_ptr_DT)
            a_base = _tabled(a_base_ptr, tab_ptr, a_base_ptr_TI, a_base_ptr_DT)
            a_scale = _tabled(a_scale_ptr, tab_ptr, a_scale_ptr_TI, a_scale_ptr_DT)
            a_norm = _tabled(a_norm_ptr, tab_ptr, a_norm_ptr_TI, a_norm_ptr_DT)
            if _given(a_fn):
                mhc_rows(s, a_y, None, a_s, a_post, a_comb, a_fn, a_base, a_scale, a_norm, m_s_ptr, _or(xs_ptr, x_ptr),
                         m_post_ptr, m_comb_ptr, A_M, A_N, A_D, A_BD, A_BT, A_POST, A_MIX, A_NORM, A_NM, A_EPS,
                         A_HC_EPS, A_ITERS, A_NORM_EPS, A_Y_S, A_S_S, A_S_SN, A_SO_S, A_SO_SN, A_YO_S, A_DT)
            else:  # no seam before this MoE (null weights, `_as_both_seams`): its inputs are what it would write
                _copy_rows(s, a_y, a_s, a_post, a_comb, m_s_ptr, x_ptr, m_post_ptr, m_comb_ptr,
                           A_M, A_N, A_D, A_BD, A_BT, A_NM, A_Y_S, A_S_S, A_S_SN, A_SO_S, A_SO_SN, A_YO_S)
            publish(phase_ptr + SEAM_IN)
    elif v < NR:
        if AR_GATHER:
            wait_for(phase_ptr + REDUCED, NO)  # every rank's tokens gathered (after the seam; the routed follow)
        elif NA > 0:
            wait_for(phase_ptr + SEAM_IN, NA)  # every token's x
        if CALLS:  # sm_90a: a call, its registers allocated apart (kernels/flags.py: CALLS_PARAM)
            _route_phase(v, x_ptr, r_w_ptr, r_b_ptr, r_t_ptr, r_ids_ptr, r_wo_ptr, idx_ptr, r_o_ptr, R_R, R_D, R_E, R_KSEL,
                         R_X_RS, R_W_RS, R_T_RS, R_I_S, R_WO_RS, R_IO_RS, R_ROUTE_SCALE, R_DENOM_EPS, R_SUM_IN_DT, R_BR,
                         R_BE, R_BK, R_BKS)
        else:  # gfx950: inlined (a call would add hidden kernel arguments)
            _route_phase_inlined(v, x_ptr, r_w_ptr, r_b_ptr, r_t_ptr, r_ids_ptr, r_wo_ptr, idx_ptr, r_o_ptr, R_R, R_D, R_E,
                                 R_KSEL, R_X_RS, R_W_RS, R_T_RS, R_I_S, R_WO_RS, R_IO_RS, R_ROUTE_SCALE, R_DENOM_EPS,
                                 R_SUM_IN_DT, R_BR, R_BE, R_BK, R_BKS)
        publish(phase_ptr + ROUTED)
    elif t < NR + NG:  # (MODE "grouped") the pairs' list sorted by expert, once every row is routed
        if NG > 0:
            wait_for(phase_ptr + ROUTED, NR)
            _group_block(t - NR, idx_ptr, grp_ptr, P, E, KSEL, IDX_RS, G_NRB, G_BP, G_BQ)
            publish(phase_ptr + GROUPED)
    elif v < NR + ST0:  # (the shared gate / up here unless the all-reduce is folded in: ST0 = ST)
        if ST0 > 0:
            if NA > 0:
                wait_for(phase_ptr + SEAM_IN, NA)  # every token's x
            _up(v * 0, v - NR, _or(xs_ptr, x_ptr), None, None,  # expert 0 of 1 (a tensor: _up casts it)
                sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr, S_M, 1, 1, "all", 1, S_I, D,
                X_RS, 0, S_I, 0, S_W_RS, 0, S_S_RS, S_W_FMT, S_S_E8M0, S_BLOCK, S_ACT, CDT, LIMIT, S_BM, S_BN, S_BK)
            publish(phase_ptr + SHARED_UP)
    elif v < NR + ST0 + E * RT:
        wait_for(phase_ptr + ROUTED, NR)
        if NG > 0:
            wait_for(phase_ptr + GROUPED, NG)  # the expert's place in the grouped list
        w = v - NR - ST0
        _up(w // RT, w % RT, x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, P, E, KSEL, MODE, PB, I, D,
            X_RS, IDX_RS, H_RS, W_ES, W_RS, S_ES, S_RS, W_FMT, S_E8M0, BLOCK, ACT, CDT, LIMIT, BM, BN, BK)
        publish(phase_ptr + COUNTERS + ND + w // RT)  # one more of expert e's I tiles in h
    elif v < NR + ST0 + E * RT + E * ND:
        d = v - NR - ST0 - E * RT
        e = d // ND
        n_tile = d % ND
        wait_for(phase_ptr + COUNTERS + ND + e, RT)  # expert e's h rows, every I tile (the routing came first)
        _down(e, n_tile, h_ptr, idx_ptr, grp_ptr, r_wo_ptr, w2_ptr, s2_ptr, yr_ptr, P, E, KSEL, MODE, PB, I, D, D_H_RS,
              IDX_RS, D_WT_RS, D_Y_RS, D_W_ES, D_W_RS, D_S_ES, D_S_RS, D_W_FMT, D_S_E8M0, D_BLOCK, ACT, CDT, D_ROUTE, BM,
              D_BN, D_BK)
        if last_to_arrive(phase_ptr + COUNTERS + n_tile, E):  # every expert's rows of this D tile are in yr
            if NP > 0:  # the routed sum alone: the shared expert's down GEMM runs after the publishers (SD below)
                _combine_column(n_tile, hs_ptr, yr_ptr, idx_ptr, None, None, out_ptr, sy_ptr, C_M, C_SM, E, KSEL, C_IS,
                                D, C_HS_RS, D_Y_RS, IDX_RS, C_Y_RS, C_W_RS, C_S_RS, C_W_FMT, C_S_E8M0, C_BLOCK, C_ACT,
                                CDT, BM, D_BN, C_BK, C_BKS)
            else:
                wait_for(phase_ptr + SHARED_UP, ST)  # the shared expert's hs, for its down GEMM
                _combine_column(n_tile, hs_ptr, yr_ptr, idx_ptr, cw2_ptr, cs2_ptr, out_ptr, sy_ptr, C_M, C_SM, E, KSEL,
                                C_IS, D, C_HS_RS, D_Y_RS, IDX_RS, C_Y_RS, C_W_RS, C_S_RS, C_W_FMT, C_S_E8M0, C_BLOCK,
                                C_ACT, CDT, BM, D_BN, C_BK, C_BKS)
            tl.store(phase_ptr + COUNTERS + n_tile, 0)
            publish(phase_ptr + COMBINED)
    elif v < NR + ST0 + E * RT + E * ND + NP:  # (the MoE's all-reduce folded in: `allreduce.fold_trailing`)
        if NP > 0:  # the routed partial, every D tile combined, to the peers (the protocol's first half)
            wait_for(phase_ptr + COMBINED, ND)
            publish_tiles(v - NR - ST0 - E * RT - E * ND, out_ptr, peers_ptr, TR_NUMEL, TR_GROUP, TR_TILE, NP,
                          TR_SLOTS_AT, TR_SLOT_BYTES, TR_FLAGS_AT, TR_TILES, TR_COUNTS_AT)
            publish(phase_ptr + PUBLISHED)
    elif v < NR + E * RT + E * ND + NP + ST:
        if NP > 0:  # the shared gate / up, after the publishers: its weights' bytes hide the peers' wait
            if NA > 0:
                wait_for(phase_ptr + SEAM_IN, NA)  # every token's x
            _up(v * 0, v - NR - E * RT - E * ND - NP, _or(xs_ptr, x_ptr), None, None,  # expert 0 of 1
                sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr, S_M, 1, 1, "all", 1, S_I, D,
                X_RS, 0, S_I, 0, S_W_RS, 0, S_S_RS, S_W_FMT, S_S_E8M0, S_BLOCK, S_ACT, CDT, LIMIT, S_BM, S_BN, S_BK)
            publish(phase_ptr + SHARED_UP)
    elif v < NR + E * RT + E * ND + NP + ST + SD:
        if NP > 0:  # the shared expert's down GEMM of D tile n into its output (the routed sum is the peers')
            wait_for(phase_ptr + SHARED_UP, ST)
            _combine_column(v - NR - E * RT - E * ND - NP - ST, hs_ptr, yr_ptr, idx_ptr, cw2_ptr, cs2_ptr, out_ptr,
                            sy_ptr, C_M, C_SM, E, KSEL, C_IS, D, C_HS_RS, D_Y_RS, IDX_RS, C_Y_RS, C_W_RS, C_S_RS,
                            C_W_FMT, C_S_E8M0, C_BLOCK, C_ACT, CDT, BM, D_BN, C_BK, C_BKS, False)
    elif v < NR + E * RT + E * ND + 2 * NP + ST + SD:
        if NP > 0:  # the peers' partials, waited for and summed in rank order into the result (the second half)
            wait_for(phase_ptr + PUBLISHED, NP)
            if TR_SCATTER:  # this rank's rows alone, into the result (`allreduce.fold_rows`)
                scatter_tiles(v - NR - E * RT - E * ND - NP - ST - SD, tr_y_ptr, peers_ptr, TR_NUMEL, TR_GROUP, TR_TILE,
                              NP, TR_SLOTS_AT, TR_SLOT_BYTES, TR_FLAGS_AT, TR_TILES, TR_COUNTS_AT, TR_SPIN)
            else:
                gather_tiles(v - NR - E * RT - E * ND - NP - ST - SD, out_ptr, peers_ptr, TR_NUMEL, TR_GROUP, TR_TILE,
                             NP, TR_SLOTS_AT, TR_SLOT_BYTES, TR_FLAGS_AT, TR_TILES, TR_COUNTS_AT, TR_SPIN)
    else:
        wait_for(phase_ptr + COMBINED, ND)  # every D tile of the MoE's output is in y
        mhc_rows(v - NR - ST - E * RT - E * ND - SD - 2 * NP, out_ptr, None, m_s_ptr, m_post_ptr, m_comb_ptr, m_fn_ptr,
                 m_base_ptr, m_scale_ptr, m_norm_ptr, m_so_ptr, m_yo_ptr, m_posto_ptr, m_combo_ptr, H_M, H_N, H_D, H_BD,
                 H_BT, H_POST, H_MIX, H_NORM, H_NM, H_EPS, H_HC_EPS, H_ITERS, H_NORM_EPS, H_Y_S, H_S_S, H_S_SN, H_SO_S,
                 H_SO_SN, H_YO_S, H_DT)
    # every program is past its waits
    if last_to_arrive(phase_ptr + FINISHED, NO + NA + NR + NG + ST + E * RT + E * ND + 2 * NP + SD + NH):
        tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)
        eb = tl.arange(0, EB)
        tl.store(phase_ptr + COUNTERS + ND + eb, 0, mask=eb < E)


def _carve_scratch(pts: list, scratch: dict[str, int], ce: dict) -> tuple[list, int]:
    """The CARVED scratch pointers of `pts` as parts of one scratch buffer (`moe_scratch`, in `scratch`
    instead of theirs): their `_AT` / `_DT` constexprs set, the pointers left out. Returns the other pointers
    and the carved bytes."""
    kept, at = [], 0
    for p, kind, name, ty in pts:
        if kind == "scratch" and p in CARVED:
            ce.update({p: None, p + "_AT": at, p + "_DT": TL_OF[ty[1:]]})
            at += triton.cdiv(scratch.pop(name), CARVE_ALIGN) * CARVE_ALIGN
        else:
            kept.append((p, kind, name, ty))
    for p in CARVED:
        if p + "_AT" not in ce:
            ce.update({p + "_AT": -1, p + "_DT": tl.float32})
    if at:
        scratch["moe_scratch"] = at
    return kept, at


@dataclass(frozen=True)
class RouteIds:
    """Where a call leaves its launch's router picks (`route_indices`: dense i64 `[rows, k]`, the expert ids the
    experts phase reads): `offset` bytes into the call's scratch `scratch` (a scratch param's role, resolved to
    the program's scratch buffer + the call's region by the schedule). After the launch they still hold its picks."""

    scratch: str
    offset: int
    rows: int
    k: int
    dtype: str = "i64"

    @property
    def nbytes(self) -> int:
        return self.rows * self.k * 8


def route_ids_at(call: KernelCall) -> RouteIds | None:
    """`RouteIds` of a call of a moe_router launch: in the one-launch form the carved part of `moe_scratch`
    (`_carve_scratch`'s `idx_ptr_AT`); where the router keeps its call (grouped) its own scratch `route_indices`.
    None for a call that holds no router (a learned or hashed one alike: `route_rows` writes both)."""
    ce = call.constexprs
    if ce.get("idx_ptr_AT", -1) >= 0 and "R_R" in ce:
        return RouteIds("moe_scratch", int(ce["idx_ptr_AT"]), int(ce["R_R"]), int(ce["R_KSEL"]))
    if call.fn is router.router_kernel and any(p == ("io_ptr", "scratch", "route_indices") for p in
                                               (q[:3] for q in call.pointers)):
        return RouteIds("route_indices", 0, int(ce["R"]), int(ce["KSEL"]))
    return None


def _renamed(call: KernelCall, extra_scratch: dict[str, int], renamed: dict = RENAMED) -> KernelCall:
    """`call` with the routing (and with SEAM_RENAMED the MoE's output) as scratch and the router weight as
    `gate`."""
    call.pointers = [(p, *renamed.get((kind, name), (kind, name)), ty) for p, kind, name, ty in call.pointers]
    call.scratch_bytes.update(extra_scratch)
    return call


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name == "mhc_moe_mhc":
        return _with_seam_before(operands, results, attrs)
    if op_name == "moe_mhc_post_pre" and (calls := _as_both_seams(operands, results, attrs)) is not None:
        return calls
    if op_name in ("ar_mhc_moe_ep", "ar_mhc_moe_ep_ar"):  # the all-reduce of the attention's output its leading phase
        return folded(op_name, operands, results, attrs, specialise, "a_y_ptr")
    if op_name in ("mhc_moe_ep_ar", "moe_router_experts_ep_ar"):  # the MoE's all-reduce a trailing part
        return _produced(op_name, operands, results, attrs)
    if op_name in ("ag_moe_router_experts_dp_rs", "mhc_ag_moe_router_experts_dp_rs"):  # DP: the all-gather its
        return _rows_folded(op_name, operands, results, attrs)  # leading phase, the reduce-scatter trailing
    if op_name in ("moe_router_experts_ep", "mhc_moe_ep", "moe_router_experts_dp"):
        return _expert_parallel(op_name, operands, results, attrs)
    if op_name not in ("moe_router_experts_shared", "moe_mhc_post_pre"):
        raise KeyError(f"moe_router family has no op '{op_name}'")
    return _specialise(op_name, operands, results, attrs)


def _front(operands, attrs) -> tuple[dict, dict, dict[str, TensorArg]]:
    """`mhc_moe_mhc`'s seam before: its operands and attributes (by `mhc_post_pre`'s names), and its results as
    dense scratch (the MoE's x, the seam after's streams / post / comb), by the seam's result names."""
    from ...ir.registry import get_op
    from ...ops.fused import MHC_ATTRS

    opdef = get_op("mhc_post_pre")
    f_ops = {n: operands[n] for n in ("y", "streams", "post", "comb")}
    f_ops.update({n: operands["in_" + n] for n in ("fn", "base", "scale", "norm")})
    f_attrs = {n: attrs["in_" + n] for n in MHC_ATTRS}
    types = opdef.result_types([f_ops[n].type for n in opdef.operand_names], f_attrs)
    return f_ops, f_attrs, {n: TensorArg(t, Layout.contiguous(t.shape).strides) for n, t in zip(opdef.results, types)}


def _with_seam_before(operands, results, attrs, copied: bool = False) -> list[KernelCall]:
    """`mhc_moe_mhc`: the mhc kernel's call of the seam before (its results dense scratch), then
    `moe_mhc_post_pre` on that scratch with the call as its first phase. `copied`: that phase copies the
    seam's inputs to its results' places instead (`_as_both_seams`)."""
    from ...ops.fused import IN_MHC_ATTRS

    f_ops, f_attrs, mid = _front(operands, attrs)
    front = _renamed(mhc.specialise("mhc_post_pre", f_ops, mid, f_attrs)[0],
                     {FRONT_RENAMED[("result", n)][1]: a.type.nbytes for n, a in mid.items()}, FRONT_RENAMED)
    if copied:  # (its cost: the copy's)
        front.flops, front.bytes_moved = 0, 2 * sum(f_ops[n].type.nbytes for n in ("y", "streams", "post", "comb"))
    m_ops = {n: v for n, v in operands.items() if n not in ("y", "streams", "post", "comb") and not n.startswith("in_")}
    m_ops.update(x=mid["y_next"], streams=mid["streams_out"], post=mid["post_next"], comb=mid["comb_next"])
    return _specialise("moe_mhc_post_pre", m_ops, results, {n: v for n, v in attrs.items() if n not in IN_MHC_ATTRS},
                       front, copied=copied)


# `moe_mhc_post_pre` as `mhc_moe_mhc`: the seam before's inputs (`y`: the attention's output) -> the names the
# launch binds to its params (its own x; the seam's weights absent: null, so its programs copy)
AS_FRONT = {"y": "x", **{"in_" + n: "absent_in_" + n for n in ("fn", "base", "scale", "norm")}}


def _as_both_seams(operands, results, attrs) -> list[KernelCall] | None:
    """`moe_mhc_post_pre` (the first MoE layer's: no seam before it) at decode as `mhc_moe_mhc`'s one launch,
    so the two ops have one binary: the seam before stands in with the seam after's weights and attributes
    (the shapes every layer's seams share), its inputs `y`, `streams`, `post` and `comb` bound to the op's x,
    streams, post and comb and its weights null, so its programs copy those where its results would be
    (`moe_fused_kernel`: `_copy_rows`, bit for bit; chosen in the kernel instead, the MoE reading either, the
    pointers held longer made gfx950 spill SGPRs). None where a copy would convert (a dtype other than the
    results') and for a grouped launch: the op's own calls."""
    from ...ops.fused import MHC_ATTRS

    fake = {"y": operands["x"], **{n: v for n, v in operands.items() if n != "x"},
            **{"in_" + n: operands[n] for n in ("fn", "base", "scale", "norm")}}
    f_attrs = {**attrs, **{"in_" + n: attrs[n] for n in MHC_ATTRS}}
    mid = _front(fake, f_attrs)[2]
    if any(operands[n].dtype != mid[m].dtype for n, m in (("x", "y_next"), ("streams", "streams_out"),
                                                           ("post", "post_next"), ("comb", "comb_next"))):
        return None
    calls = _with_seam_before(fake, results, f_attrs, copied=True)
    if len(calls) != 1:
        return None
    calls[0].pointers = [(p, kind, AS_FRONT.get(name, name) if kind == "operand" else name, ty)
                         for p, kind, name, ty in calls[0].pointers]
    return calls


# `mhc_moe_ep`: only the seam before's MoE input is scratch; its streams / post / comb are the op's results
EP_FRONT_RENAMED = {("result", "y_next"): ("scratch", "seam_x"),
                    **{("operand", n): ("operand", "in_" + n) for n in ("fn", "base", "scale", "norm")}}


# `moe_router_experts_dp`: the single-rank calls' operand names -> the op's
DP_NAMES = {"x": "xg", "xs": "x"}


def _expert_parallel(op_name, operands, results, attrs, renamed: dict | None = None,
                     scratch: dict[str, int] | None = None, seam: bool = False) -> list[KernelCall]:
    """`moe_router_experts_ep` (and `mhc_moe_ep`, the seam before it as the first phase; `moe_router_experts_dp`,
    the shared expert's gate / up reading the rank's own tokens `xs_ptr` and the combine its first C_SM rows): the single-rank
    calls with the rank's owner table masking the routing in the router phase (`route_rows`' o_ptr) and the
    combine writing the routed partial sum and the shared expert's output apart (`_combine`'s sy_ptr). `renamed`,
    `scratch`: more of the calls' values as scratch (`_rows_folded`), by the single-rank calls' names; `seam`: the
    seam before as `mhc_moe_ep`'s (`moe_router_experts_dp`: its output the rank's own tokens, `xs`)."""
    from ...ir.registry import get_op
    from ...ops.fused import MHC_ATTRS

    front = None
    if op_name == "mhc_moe_ep" or seam:
        f_ops = {n: operands[n] for n in ("y", "streams", "post", "comb")}
        f_ops.update({n: operands["in_" + n] for n in ("fn", "base", "scale", "norm")})
        f_attrs = {n: attrs["in_" + n] for n in MHC_ATTRS}
        opdef = get_op("mhc_post_pre")
        types = opdef.result_types([f_ops[n].type for n in opdef.operand_names], f_attrs)
        x = TensorArg(types[1], Layout.contiguous(types[1].shape).strides)
        f_res = {"streams_out": results["streams_out"], "y_next": x, "post_next": results["post_next"],
                 "comb_next": results["comb_next"]}
        front = _renamed(mhc.specialise("mhc_post_pre", f_ops, f_res, f_attrs)[0], {"seam_x": x.type.nbytes},
                         EP_FRONT_RENAMED)
        operands = {n: v for n, v in operands.items() if n not in f_ops and not n.startswith("in_")}
        operands["x"] = x
        attrs = {n: v for n, v in attrs.items() if not n.startswith("in_")}
        if op_name == "moe_router_experts_dp":  # (the seam's output: the rank's own tokens, scratch at xs_ptr)
            renamed = {**(renamed or {}), ("operand", "xs"): ("scratch", "seam_x")}
    if op_name == "moe_router_experts_dp":  # the routing and the routed experts on xg, the shared expert on x
        operands = {**{n: v for n, v in operands.items() if n != "xg"}, "x": operands["xg"], "xs": operands["x"]}
    partial, shared = results["partial"], results["shared"]
    if partial.strides != shared.strides:
        raise ValueError("moe_router_experts_ep: the partial sum and the shared output must share their layout")
    owner = operands.pop("owner")  # (attrs keep `ep`: the moe calls' cost model, 1 / ep of the slots land here)
    calls = _specialise("moe_router_experts_shared", operands, {"y": partial}, attrs, front,
                        renamed={("result", "y"): ("result", "partial"), **(renamed or {})}, inner_x=front is not None,
                        fuse_grouped=op_name == "moe_router_experts_dp", scratch=scratch)
    for c in calls:
        if op_name == "moe_router_experts_dp":  # back to the op's names: the routed tokens are xg, the shared x
            c.pointers = [(p, kind, DP_NAMES.get(name, name) if kind == "operand" else name, ty)
                          for p, kind, name, ty in c.pointers]
        if "o_ptr" in c.constexprs or "r_o_ptr" in c.constexprs:  # the router phase: masked by the owner table
            p = "o_ptr" if "o_ptr" in c.constexprs else "r_o_ptr"
            del c.constexprs[p]
            c.pointers.append(ptr(p, "operand", "owner", owner))
        if "sy_ptr" in c.constexprs:  # the combine: the shared expert's output apart
            del c.constexprs["sy_ptr"]
            c.pointers.append(ptr("sy_ptr", "result", "shared", shared))
        c.pointers = in_kernel_order(c.name, c.fn, c.pointers, c.constexprs)  # the packed order of a launch
    return calls


def _produced(op_name, operands, results, attrs) -> list[KernelCall]:
    """`<op>_ar` (`ops/fused_allreduce.py`: the EP MoE with its routed partial all-reduced): the one launch with the
    all-reduce folded in as a trailing part (`allreduce.fold_trailing`): the combining programs write the routed sum
    alone, NP programs publish it to the peers, then come the shared expert's gate / up (ST0 = 0: moved here) and
    its down GEMM per D tile (SD = ND programs; `_combine`'s shared output apart), then NP programs wait for the
    peers and sum in rank order into `partial`. A grouped launch (a prefill chunk's) keeps its calls and the one-shot
    follows them as a call of its own, in place."""
    from ...ops.fused_allreduce import AR_ATTRS, producer_of
    from .allreduce import _contiguous

    partial = results["partial"]
    _contiguous(op_name, "partial", partial)
    group, region_bytes = int(attrs["group"]), int(attrs["region_bytes"])
    calls = _expert_parallel(producer_of(op_name), operands, results,
                             {n: v for n, v in attrs.items() if n not in AR_ATTRS})
    if len(calls) == 1 and calls[0].fn is moe_fused_kernel and calls[0].constexprs["NH"] == 0:
        nd = calls[0].constexprs["ND"]
        return [fold_trailing(calls[0], partial, group, region_bytes, nd, {"ST0": 0, "SD": nd})]
    return [*calls, oneshot_in_place(partial, "partial", group, region_bytes)]


def _rows_folded(op_name, operands, results, attrs) -> list[KernelCall]:
    """`ag_moe_router_experts_dp_rs` (`ops/fused_allreduce.py`: DP's MoE with the all-gather of its tokens and the
    reduce-scatter of its routed partial folded in): `moe_router_experts_dp`'s one launch on every rank's tokens and
    partial as scratch (`ag_xg`, `rs_partial`), the all-gather its leading phase and the reduce-scatter into
    `partial` (this rank's rows) its trailing part (`allreduce.fold_rows`: the shared expert between the
    reduce-scatter's publish and wait, as `_produced`'s). `mhc_ag_moe_router_experts_dp_rs`: the seam before as
    `mhc_moe_ep`'s, first, its output (x, the rank's own tokens: scratch `seam_x`) what the gather publishes. A
    grouped launch (a prefill chunk's) keeps its calls, the one-shot all-gather a call before them (after the seam's)
    and the reduce-scatter one after them."""
    from ...ops.fused_allreduce import AR_ATTRS, SEAM_ROWS_FOLDED
    from .allreduce import _contiguous

    seam, partial = op_name == SEAM_ROWS_FOLDED, results["partial"]
    # (x: the op's, or the seam's output, of the shared expert's output's type: the rank's tokens)
    x = TensorArg(results["shared"].type, Layout.contiguous(results["shared"].shape).strides) if seam \
        else operands["x"]
    _contiguous(op_name, "x", x)
    _contiguous(op_name, "partial", partial)
    group, region_bytes = int(attrs["group"]), int(attrs["region_bytes"])
    xg, whole = gathered(x, group), gathered(partial, group)
    calls = _expert_parallel("moe_router_experts_dp", {**operands, "xg": xg}, {**results, "partial": whole},
                             {n: v for n, v in attrs.items() if n not in AR_ATTRS},
                             renamed={("operand", "x"): ("scratch", "ag_xg"),
                                      ("result", "y"): ("scratch", "rs_partial")},
                             scratch={"ag_xg": xg.type.nbytes, "rs_partial": whole.type.nbytes}, seam=seam)
    if len(calls) == 1 and calls[0].fn is moe_fused_kernel and calls[0].constexprs["NH"] == 0:
        nd = calls[0].constexprs["ND"]
        call = fold_rows(calls[0], x, partial, group, region_bytes, nd, {"ST0": 0, "SD": nd})
        return [_tabulate(call) if seam else call]
    region = Region(group, region_bytes)
    gather = rows_call("all_gather_rows", x, xg, group, region)
    scatter = rows_call("reduce_scatter_rows", whole, partial, group, region)
    gather.pointers = [(p, "scratch", "ag_xg", ty) if kind == "result" else (p, "scratch", "seam_x", ty)
                       if kind == "operand" and seam else (p, kind, n, ty) for p, kind, n, ty in gather.pointers]
    scatter.pointers = [(p, "scratch", "rs_partial", ty) if kind == "operand" else (p, kind, "partial", ty)
                        if kind == "result" else (p, kind, n, ty) for p, kind, n, ty in scatter.pointers]
    gather.scratch_bytes.update({"ag_xg": xg.type.nbytes, **({"seam_x": x.type.nbytes} if seam else {})})
    scatter.scratch_bytes["rs_partial"] = whole.type.nbytes
    return [*calls[:seam], gather, *calls[seam:], scatter]  # (the seam's call first)


def _tabulate(call: KernelCall) -> KernelCall:
    """`call` with the seam before's pointers (`TABLED`) moved into its pointer table (`KernelCall.tabled`); one not
    known to be aligned stays an argument (`_tabled` promises the compiler the alignment)."""
    tabled = tuple(p for p in call.pointers if p[0] in TABLED and p[0] not in call.unaligned)
    if not tabled:
        return call
    ce = {n: v for n, v in call.constexprs.items() if n != "tab_ptr"}
    for i, (p, _, _, ty) in enumerate(tabled):
        ce.update({p + "_TI": i, p + "_DT": TL_OF[ty[1:]], p: None})
    pts = [*call.pointers, ptr("tab_ptr", "table", "table", "*i64")]
    return dataclasses.replace(call, name=call.name + "_tab", constexprs=ce,
                               pointers=[p for p in pts if p not in tabled], tabled=tabled)


def _specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg], attrs: dict,
                front: KernelCall | None = None, renamed: dict | None = None,
                inner_x: bool = False, fuse_grouped: bool = False, copied: bool = False,
                scratch: dict[str, int] | None = None) -> list[KernelCall]:
    """`front`: the seam before the MoE's call (`mhc_moe_mhc`); its scratch is the MoE's x and the seam
    after's streams / post / comb (INNER_RENAMED). `copied`: its programs copy its inputs there instead.
    `scratch`: the bytes of the values `renamed` makes scratch."""
    from ...ops.fused import MHC_ATTRS, ROUTER_ATTRS

    x = operands["x"]
    r_ops = {"x": x, "w": operands["gate"], "bias": operands.get("bias"), "tid2eid": operands.get("tid2eid"),
             "ids": operands.get("ids")}
    r_attrs = {n: attrs[n] for n in ROUTER_ATTRS}
    k = r_attrs["k"]
    lead = x.shape[:-1]
    wt = TensorType((*lead, k), "fp32" if r_attrs["fp32"] else x.dtype)
    it = TensorType((*lead, k), "i64")
    strides = Layout.contiguous(wt.shape).strides  # the routing as dense scratch
    wa, ia = TensorArg(wt, strides), TensorArg(it, strides)
    extra = {"route_weights": wt.nbytes, "route_indices": it.nbytes, **(front.scratch_bytes if front else {}),
             **(scratch or {})}
    seam = op_name == "moe_mhc_post_pre"
    m_results = results
    if seam:  # the MoE's output as dense scratch, read back by the seam
        m_results = {"y": TensorArg(x.type, Layout.contiguous(x.shape).strides)}
        extra["moe_y"] = x.type.nbytes
    names = {**(SEAM_RENAMED if seam else RENAMED), **(INNER_RENAMED if front else {}), **(renamed or {})}
    if inner_x:  # (`mhc_moe_ep`: the seam before's streams / post / comb are results, only x is its scratch)
        names = {k: v for k, v in names.items() if k not in INNER_RENAMED or k == ("operand", "x")}
    rcall = _renamed(router.specialise("router", r_ops, {"weights": wa, "indices": ia}, r_attrs)[0], extra, names)
    m_ops = {n: v for n, v in operands.items() if n not in r_ops and n not in SEAM_OPERANDS}
    m_ops.update(x=x, weights=wa, indices=ia)
    m_attrs = {n: v for n, v in attrs.items() if n not in ROUTER_ATTRS and n not in MHC_ATTRS}
    mcalls = [_renamed(c, extra, names) for c in moe.specialise("moe_experts_shared", m_ops, m_results, m_attrs)]
    hcalls = []
    if seam:
        h_ops = {n: operands[n] for n in SEAM_OPERANDS}
        hcalls = [_renamed(c, extra, names) for c in mhc.specialise("mhc_post_pre", {"y": m_results["y"], **h_ops}, results,
                                                            {n: attrs[n] for n in MHC_ATTRS})]
    group = mcalls[0] if mcalls[0].fn is moe.moe_group_kernel else None
    up, down = mcalls[1 if group else 0], mcalls[-1]
    if group is not None and (not fuse_grouped or group.constexprs["P"] > FUSED_MAX_PAIRS):  # launches apart
        if front:
            front.scratch_bytes.update(extra)
        return [*([front] if front else []), rcall, *mcalls, *hcalls]
    # One binary for the hash-routed and the learned layers: the routing table is one pointer, as bytes
    # (`t_ptr`: tid2eid, or the bias where the layer has none; `_table` gives the kernel both views), and the
    # token ids (a null pointer where learned) pick the routing at run time (`route_rows`). The router's own
    # launch binds bias and tid2eid apart (`router.ROUTE_OPERANDS`); here that third pointer's two scalar
    # registers made the gfx950 binary with both seams spill one (106 SGPRs).
    tid2eid, bias = operands.get("tid2eid"), operands.get("bias")
    table = [q for q in rcall.pointers if q[0] == ("t_ptr" if tid2eid is not None else "b_ptr")][0]
    rcall.pointers = [("t_ptr", table[1], table[2], "*u8") if q[0] == "t_ptr" else q for q in rcall.pointers
                      if q[0] != "b_ptr"]
    rcall.unaligned = tuple(sorted({*rcall.unaligned, *(["t_ptr"] if table[0] in rcall.unaligned else [])}))
    types = {p: t for p, _, _, t in router.route_pointers(bias, tid2eid, None, wa)}  # (an absent one's default)
    rcall.constexprs.update(b_ptr=None, T_DT=TL_OF[types["t_ptr"][1:]], B_DT=TL_OF[types["b_ptr"][1:]])
    # one launch: the up call's constexprs and pointers, the router's as R_*, the down call's as D_* (its
    # combine's C_* as they are), the seam's as H_*, each renamed onto the fused kernel's parameters (x, the
    # routing, h / hs and the MoE's output are one buffer each, whoever reads or writes them); the seam before's
    # as A_* (its outputs are the MoE's x and the seam after's inputs)
    flags = (PDL_PARAM, CALLS_PARAM)
    ce = {n: v for n, v in up.constexprs.items() if n not in flags}
    ce.update({ROUTER_PARAMS.get(n, "R_" + n): v for n, v in rcall.constexprs.items() if n not in flags})
    ce.update({DOWN_PARAMS.get(n, n if n.startswith("C_") else "D_" + n): v for n, v in down.constexprs.items()
               if n not in flags and n not in SHARED_CONSTEXPRS})
    hce = {n: v for n, v in hcalls[0].constexprs.items() if n != "y2_ptr"} if seam else NO_SEAM
    ce.update({SEAM_PARAMS.get(n, "H_" + n): v for n, v in hce.items() if n not in flags})
    ce.update(UNFOLDED, **UNGATHERED)  # (`ar_mhc_moe_ep`: `allreduce.fold` sets them; DP's `fold_rows` too)
    ce.update(UNTABLED)  # (DP's seam: `_tabulate` sets them)
    ce.update(UNTRAILED)  # (`mhc_moe_ep_ar`: `allreduce.fold_trailing` sets them, and ST0 / SD; DP's `fold_rows` too)
    if front:  # (its pointers are the a_* params and the MoE's own, below)
        ce.update({"A_" + n: v for n, v in front.constexprs.items() if n not in flags and n != "y2_ptr"},
                  NA=front.grid[0])
    else:
        ce.update(NO_FRONT)
    RT, ND = triton.cdiv(ce["I"], ce["BN"]), triton.cdiv(ce["D"], ce["D_BN"])
    ST = triton.cdiv(ce["S_I"], ce["S_BN"]) if "sw1_ptr" not in up.constexprs else 0  # shared: a pointer
    E = ce["E"]
    NH = hcalls[0].grid[0] if seam else 0
    NA = ce["NA"]
    ce.update(NR=rcall.grid[0], RT=RT, ST=ST, ST0=ST, SD=0, ND=ND, NH=NH, EB=triton.next_power_of_2(E),
              NG=group.grid[0] if group else 0, G_NRB=group.constexprs["NRB"] if group else 0)
    calls = (*([front] if front else []), rcall, *([group] if group else []), up, down, *hcalls)
    # (DP: the seam's output is the rank's own tokens, the shared expert's xs, not the router's x)
    front_params = {**FRONT_PARAMS, "yo_ptr": "xs_ptr"} if "xs" in operands else FRONT_PARAMS
    pts, have = [], set()
    for call in calls:
        names = ROUTER_PARAMS if call is rcall else DOWN_PARAMS if call is down else SEAM_PARAMS if hcalls \
            and call is hcalls[0] else front_params if call is front else {}
        for p, kind, name, ty in call.pointers:
            if kind == "semaphore" or names.get(p, p) in have:
                continue
            have.add(names.get(p, p))
            pts.append((names.get(p, p), kind, name, ty))
    tag = up.name[len("moe_up_"):].rsplit("_", 1)[0]  # the up call's readable shape tag (name = prefix_tag_hash)
    scratch = {n: b for c in calls for n, b in c.scratch_bytes.items() if n != "moe_arrivals"}
    for p, *_ in pts:  # a pointer here is no constexpr (`mhc_moe_ep`: the seam's results where NO_SEAM has none)
        ce.pop(p, None)
    pts, carved = _carve_scratch(pts, scratch, ce)
    if carved:
        pts.append(ptr("scr_ptr", "scratch", "moe_scratch", "*u8"))
    else:
        ce["scr_ptr"] = None
    pts.append(ptr("phase_ptr", "semaphore", "moe_phase", "*i32"))
    scratch["moe_phase"] = (int(COUNTERS) + ND + E) * 4  # phase counters, the D tiles' arrivals, the experts' tiles
    renamed = {**ROUTER_PARAMS, **DOWN_PARAMS, **SEAM_PARAMS}
    unaligned = {renamed.get(p, p) for c in calls if c is not front for p in c.unaligned}
    unaligned |= {front_params.get(p, p) for p in (front.unaligned if front else ())}
    # (the routing table's operand in the name: the hash-routed and the learned layers' calls bind different
    # operands, so each has its sidecar, of one binary: codegen/aot.py compiles it once)
    # (`copied` in the name: calls of one binary bound apart have names of their own)
    return [KernelCall(call_name("moe_fused", {**ce, "route_types": router.route_types(rcall.pointers),
                                               "route_table": table[2], **({"copied": True} if copied else {})},
                                 tag + ("_seam" if copied else "_seams" if front else "_seam" if seam else "")),
                       moe_fused_kernel, ce, pts, (NA + ce["NR"] + ce["NG"] + ST + E * RT + E * ND + NH, 1, 1),
                       num_warps=max(c.num_warps for c in calls),
                       scratch_bytes=scratch,
                       unaligned=tuple(sorted(unaligned)),
                       flops=sum(c.flops for c in calls), mma_dtype=up.mma_dtype,
                       bytes_moved=sum(c.bytes_moved for c in calls))]
