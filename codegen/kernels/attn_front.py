"""attn_front family: `pair_norm_linear` (the attention input's `linear_pair`, or one `linear`, and the
`norm_linear` of one of its outputs) in one launch of `pair_norm_kernel`.

Its programs, in the order they start (`phases.ticket`):
  tickets [0, P0)             the pair's first GEMM (`gemm._pair_half`, the grid `linear_pair` launches);
  tickets [P0, P0 + P1)       its second (none for one `linear`: P1 = 0); the programs of the half that
                              writes y<SRC> each publish when done (a K split's reducing program after it
                              stored its tile of y);
  then PB                     the norm GEMM's programs (`gemm.gemm_program` with its RMSNorm prologue, the grid
                              `norm_linear` launches): each first waits (`phases.wait_for`) for every program of
                              that half, since the RMS is over the whole row of columns [COL, COL + K) of y<SRC>.
A program waits only for programs that took earlier tickets (see `phases`), so no schedule deadlocks. The last
program to finish (`arrival.last_to_arrive`) resets the phase counters; the GEMMs' own split arrival counters
are reset by their reducing programs, as in their own launches. Every program runs the code the two unfused
launches run, with the same constexprs, so the results are bit-identical to `linear_pair` then `norm_linear`
(FP8 activation quantisation included: it happens inside `gemm.mma_step`, as there).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from . import BYTES_OF, KernelCall, TensorArg, call_name, ptr, unaligned
from .allreduce import UNFOLDED, folded, oneshot_tiles
from .arrival import last_to_arrive
from .gemm import PAIR_SIDE, _pair_half, gemm_call, gemm_pair_call, gemm_pair_kernel, gemm_program, tile_group_bytes
from .mhc import mhc_rows
from .pdl import pdl_enter
from .phases import publish, ticket, wait_for

# the semaphore's int32 counters: the ticket, the y<SRC> programs done, programs finished (COUNTERS slots, a
# power of two); then the pair's split arrival counters, then the norm GEMM's
TICKET, WRITTEN, FINISHED = (tl.constexpr(i) for i in range(3))
COUNTERS = tl.constexpr(8)
# the norm GEMM's `gemm_call` constexprs the fused kernel takes (as B_*); M, BM and STAGES are the pair's
NORM_SIDE = ("N", "K", "SPLIT", "KS", "NT", "X_RS", "X_CS", "Y_RS", "Y_CS", "W_RS", "W_CS", "S_RS", "S_CS", "W_FMT",
             "S_E8M0", "BLOCK", "ACT", "EPS", "CDT", "BN", "BK")


@triton.jit
def _pair_norm_program(v, x_ptr, w0_ptr, s0_ptr, y0_ptr, w1_ptr, s1_ptr, y1_ptr, bn_ptr, bw_ptr, bs_ptr, by_ptr,
                       part_ptr, phase_ptr,
                       M: tl.constexpr, K: tl.constexpr, X_RS: tl.constexpr, X_CS: tl.constexpr, BM: tl.constexpr,
                       STAGES: tl.constexpr, P0: tl.constexpr,
                       N0: tl.constexpr, SPLIT0: tl.constexpr, KS0: tl.constexpr, NT0: tl.constexpr,
                       Y_RS0: tl.constexpr, Y_CS0: tl.constexpr, W_RS0: tl.constexpr, W_CS0: tl.constexpr,
                       S_RS0: tl.constexpr, S_CS0: tl.constexpr, W_FMT0: tl.constexpr, S_E8M00: tl.constexpr,
                       BLOCK0: tl.constexpr, ACT0: tl.constexpr, CDT0: tl.constexpr, BN0: tl.constexpr,
                       BK0: tl.constexpr,
                       N1: tl.constexpr, SPLIT1: tl.constexpr, KS1: tl.constexpr, NT1: tl.constexpr,
                       Y_RS1: tl.constexpr, Y_CS1: tl.constexpr, W_RS1: tl.constexpr, W_CS1: tl.constexpr,
                       S_RS1: tl.constexpr, S_CS1: tl.constexpr, W_FMT1: tl.constexpr, S_E8M01: tl.constexpr,
                       BLOCK1: tl.constexpr, ACT1: tl.constexpr, CDT1: tl.constexpr, BN1: tl.constexpr,
                       BK1: tl.constexpr,
                       PART1: tl.constexpr, SEM1: tl.constexpr,
                       B_N: tl.constexpr, B_K: tl.constexpr, B_SPLIT: tl.constexpr, B_KS: tl.constexpr,
                       B_NT: tl.constexpr, B_X_RS: tl.constexpr, B_X_CS: tl.constexpr, B_Y_RS: tl.constexpr,
                       B_Y_CS: tl.constexpr, B_W_RS: tl.constexpr, B_W_CS: tl.constexpr, B_S_RS: tl.constexpr,
                       B_S_CS: tl.constexpr, B_W_FMT: tl.constexpr, B_S_E8M0: tl.constexpr, B_BLOCK: tl.constexpr,
                       B_ACT: tl.constexpr, B_EPS: tl.constexpr, B_CDT: tl.constexpr, B_BN: tl.constexpr,
                       B_BK: tl.constexpr, B_PART: tl.constexpr, B_SEM: tl.constexpr,
                       SRC: tl.constexpr, COL: tl.constexpr, P1: tl.constexpr, PB: tl.constexpr):
    """Program v of `pair_norm_kernel` (after its ticket; `seam_pair_norm_kernel`'s after the seam's): the pair's
    P0 + P1 (as `gemm_pair_kernel`), then PB of the norm GEMM reading columns [COL, COL + B_K) of y<SRC> once every
    program of that half has published."""
    TN: tl.constexpr = (B_N + B_BN - 1) // B_BN  # the norm GEMM's grid: N tiles, M tiles, K splits
    TM: tl.constexpr = (M + BM - 1) // BM
    sem_ptr = phase_ptr + COUNTERS  # the GEMMs' split arrival counters follow the phase counters
    if v < P0:
        _pair_half(v, x_ptr, w0_ptr, s0_ptr, y0_ptr, part_ptr, sem_ptr, M, K, X_RS, X_CS, BM, STAGES, N0, SPLIT0,
                   KS0, NT0, Y_RS0, Y_CS0, W_RS0, W_CS0, S_RS0, S_CS0, W_FMT0, S_E8M00, BLOCK0, ACT0, CDT0, BN0, BK0,
                   0, 0)
        if SRC == 0:
            publish(phase_ptr + WRITTEN)
    elif v < P0 + P1:  # (P1 = 0: one GEMM, `linear`, and no second half to compile)
        if P1 > 0:
            _pair_half(v - P0, x_ptr, w1_ptr, s1_ptr, y1_ptr, part_ptr, sem_ptr, M, K, X_RS, X_CS, BM, STAGES, N1,
                       SPLIT1, KS1, NT1, Y_RS1, Y_CS1, W_RS1, W_CS1, S_RS1, S_CS1, W_FMT1, S_E8M01, BLOCK1, ACT1, CDT1,
                       BN1, BK1, PART1, SEM1)
        if SRC == 1:
            publish(phase_ptr + WRITTEN)
    else:
        if SRC == 0:
            wait_for(phase_ptr + WRITTEN, P0)
            bx_ptr = y0_ptr + COL * Y_CS0
        else:
            wait_for(phase_ptr + WRITTEN, P1)
            bx_ptr = y1_ptr + COL * Y_CS1
        if B_SPLIT > 1:
            b_part_ptr = part_ptr + B_PART
        else:
            b_part_ptr = part_ptr
        b = v - P0 - P1
        gemm_program(b % TN, (b // TN) % TM, b // (TN * TM), bx_ptr, None, bw_ptr, bs_ptr, bn_ptr, None, by_ptr,
                     b_part_ptr, sem_ptr + B_SEM, M, B_N, B_K, 0, 0, B_SPLIT, B_KS, B_NT, B_X_RS, B_X_CS, B_Y_RS,
                     B_Y_CS, B_W_RS, B_W_CS, B_S_RS, B_S_CS, B_W_FMT, B_S_E8M0, B_BLOCK, B_ACT, True, B_EPS, B_CDT,
                     BM, B_BN, B_BK, STAGES, 1, 0, 0, 0, 0, 0, -1.0)


@triton.jit
def pair_norm_kernel(x_ptr, w0_ptr, s0_ptr, y0_ptr, w1_ptr, s1_ptr, y1_ptr, bn_ptr, bw_ptr, bs_ptr, by_ptr,
                     part_ptr, phase_ptr,
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
                     PART1: tl.constexpr, SEM1: tl.constexpr,
                     B_N: tl.constexpr, B_K: tl.constexpr, B_SPLIT: tl.constexpr, B_KS: tl.constexpr,
                     B_NT: tl.constexpr, B_X_RS: tl.constexpr, B_X_CS: tl.constexpr, B_Y_RS: tl.constexpr,
                     B_Y_CS: tl.constexpr, B_W_RS: tl.constexpr, B_W_CS: tl.constexpr, B_S_RS: tl.constexpr,
                     B_S_CS: tl.constexpr, B_W_FMT: tl.constexpr, B_S_E8M0: tl.constexpr, B_BLOCK: tl.constexpr,
                     B_ACT: tl.constexpr, B_EPS: tl.constexpr, B_CDT: tl.constexpr, B_BN: tl.constexpr,
                     B_BK: tl.constexpr, B_PART: tl.constexpr, B_SEM: tl.constexpr,
                     SRC: tl.constexpr, COL: tl.constexpr, P1: tl.constexpr, PB: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Programs by ticket: the pair's P0 + P1 (as `gemm_pair_kernel`), then PB of the norm GEMM reading
    columns [COL, COL + B_K) of y<SRC> once every program of that half has published."""
    pdl_enter(PDL)
    v = ticket(phase_ptr + TICKET)
    _pair_norm_program(v, x_ptr, w0_ptr, s0_ptr, y0_ptr, w1_ptr, s1_ptr, y1_ptr, bn_ptr, bw_ptr, bs_ptr, by_ptr,
                       part_ptr, phase_ptr, M, K, X_RS, X_CS, BM, STAGES, P0, N0, SPLIT0, KS0, NT0, Y_RS0, Y_CS0,
                       W_RS0, W_CS0, S_RS0, S_CS0, W_FMT0, S_E8M00, BLOCK0, ACT0, CDT0, BN0, BK0, N1, SPLIT1, KS1,
                       NT1, Y_RS1, Y_CS1, W_RS1, W_CS1, S_RS1, S_CS1, W_FMT1, S_E8M01, BLOCK1, ACT1, CDT1, BN1, BK1,
                       PART1, SEM1, B_N, B_K, B_SPLIT, B_KS, B_NT, B_X_RS, B_X_CS, B_Y_RS, B_Y_CS, B_W_RS, B_W_CS,
                       B_S_RS, B_S_CS, B_W_FMT, B_S_E8M0, B_BLOCK, B_ACT, B_EPS, B_CDT, B_BN, B_BK, B_PART, B_SEM,
                       SRC, COL, P1, PB)
    if last_to_arrive(phase_ptr + FINISHED, P0 + P1 + PB):  # every program is past its wait
        tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)


# `seam_pair_norm_kernel`: the seam's token blocks done, the folded all-reduce's programs done (phase counters
# free in pair_norm_kernel)
SEAM_DONE, REDUCED = tl.constexpr(3), tl.constexpr(4)


@triton.jit(noinline=True)
def _seam_phase(tb, y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr, so_ptr, yo_ptr,
                posto_ptr, combo_ptr, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                BT: tl.constexpr, NM: tl.constexpr, EPS: tl.constexpr, HC_EPS: tl.constexpr, ITERS: tl.constexpr,
                NORM_EPS: tl.constexpr, Y_S: tl.constexpr, S_S: tl.constexpr, S_SN: tl.constexpr, SO_S: tl.constexpr,
                SO_SN: tl.constexpr, YO_S: tl.constexpr, DT: tl.constexpr):
    """The `mhc_post_pre_add` launch's program for token block tb, as a function of its own: its registers are
    allocated apart from the GEMMs' tiles where calls pay (`flags.CALLS_PARAM`: sm_90a; gfx950 inlines it)."""
    mhc_rows(tb, y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr, so_ptr, yo_ptr,
             posto_ptr, combo_ptr, M, N, D, BD, BT, True, "pre", True, NM, EPS, HC_EPS, ITERS, NORM_EPS, Y_S, S_S,
             S_SN, SO_S, SO_SN, YO_S, DT)


_seam_phase_inlined = triton.jit(_seam_phase.fn)


@triton.jit
def seam_pair_norm_kernel(h_y_ptr, h_y2_ptr, h_s_ptr, h_post_ptr, h_comb_ptr, h_fn_ptr, h_base_ptr, h_scale_ptr,
                          h_norm_ptr, h_so_ptr, h_posto_ptr, h_combo_ptr,
                          x_ptr, w0_ptr, s0_ptr, y0_ptr, w1_ptr, s1_ptr, y1_ptr, bn_ptr, bw_ptr, bs_ptr, by_ptr,
                          part_ptr, phase_ptr,
                          M: tl.constexpr, K: tl.constexpr, X_RS: tl.constexpr, X_CS: tl.constexpr, BM: tl.constexpr,
                          STAGES: tl.constexpr, P0: tl.constexpr,
                          N0: tl.constexpr, SPLIT0: tl.constexpr, KS0: tl.constexpr, NT0: tl.constexpr,
                          Y_RS0: tl.constexpr, Y_CS0: tl.constexpr, W_RS0: tl.constexpr, W_CS0: tl.constexpr,
                          S_RS0: tl.constexpr, S_CS0: tl.constexpr, W_FMT0: tl.constexpr, S_E8M00: tl.constexpr,
                          BLOCK0: tl.constexpr, ACT0: tl.constexpr, CDT0: tl.constexpr, BN0: tl.constexpr,
                          BK0: tl.constexpr,
                          N1: tl.constexpr, SPLIT1: tl.constexpr, KS1: tl.constexpr, NT1: tl.constexpr,
                          Y_RS1: tl.constexpr, Y_CS1: tl.constexpr, W_RS1: tl.constexpr, W_CS1: tl.constexpr,
                          S_RS1: tl.constexpr, S_CS1: tl.constexpr, W_FMT1: tl.constexpr, S_E8M01: tl.constexpr,
                          BLOCK1: tl.constexpr, ACT1: tl.constexpr, CDT1: tl.constexpr, BN1: tl.constexpr,
                          BK1: tl.constexpr, PART1: tl.constexpr, SEM1: tl.constexpr,
                          B_N: tl.constexpr, B_K: tl.constexpr, B_SPLIT: tl.constexpr, B_KS: tl.constexpr,
                          B_NT: tl.constexpr, B_X_RS: tl.constexpr, B_X_CS: tl.constexpr, B_Y_RS: tl.constexpr,
                          B_Y_CS: tl.constexpr, B_W_RS: tl.constexpr, B_W_CS: tl.constexpr, B_S_RS: tl.constexpr,
                          B_S_CS: tl.constexpr, B_W_FMT: tl.constexpr, B_S_E8M0: tl.constexpr, B_BLOCK: tl.constexpr,
                          B_ACT: tl.constexpr, B_EPS: tl.constexpr, B_CDT: tl.constexpr, B_BN: tl.constexpr,
                          B_BK: tl.constexpr, B_PART: tl.constexpr, B_SEM: tl.constexpr,
                          SRC: tl.constexpr, COL: tl.constexpr, P1: tl.constexpr, PB: tl.constexpr,
                          H_M: tl.constexpr, H_N: tl.constexpr, H_D: tl.constexpr, H_BD: tl.constexpr,
                          H_BT: tl.constexpr, H_NM: tl.constexpr, H_EPS: tl.constexpr, H_HC_EPS: tl.constexpr,
                          H_ITERS: tl.constexpr, H_NORM_EPS: tl.constexpr, H_Y_S: tl.constexpr, H_S_S: tl.constexpr,
                          H_S_SN: tl.constexpr, H_SO_S: tl.constexpr, H_SO_SN: tl.constexpr, H_YO_S: tl.constexpr,
                          H_DT: tl.constexpr, PH: tl.constexpr,
                          ar_x_ptr, peers_ptr, AR_NUMEL: tl.constexpr, AR_GROUP: tl.constexpr, AR_TILE: tl.constexpr,
                          AR_SLOTS_AT: tl.constexpr, AR_SLOT_BYTES: tl.constexpr, AR_FLAGS_AT: tl.constexpr,
                          AR_TILES: tl.constexpr, AR_COUNTS_AT: tl.constexpr, AR_SPIN: tl.constexpr, NO: tl.constexpr,
                          PDL: tl.constexpr = False, CALLS: tl.constexpr = True):
    """Programs by ticket: NO of the one-shot all-reduce of the MoE's routed partial into h_y_ptr
    (`ar_mhc_add_pair_norm_linear`, `allreduce.fold`; else none; each publishes), PH token blocks of the seam
    (`mhc_post_pre_add`: the attention input x into scratch, the streams / post / comb the seam after the
    attention reads as results; each first waits for all NO, then publishes), then `pair_norm_kernel`'s
    P0 + P1 + PB, each first waiting for all PH seam programs (every row of x)."""
    pdl_enter(PDL)
    v = ticket(phase_ptr + TICKET) - NO
    if v < 0:
        if NO > 0:  # the all-reduce the seam reads (`allreduce.fold`: the one-shot's programs)
            oneshot_tiles(v + NO, ar_x_ptr, h_y_ptr, peers_ptr, AR_NUMEL, AR_GROUP, AR_TILE, NO, AR_SLOTS_AT,
                          AR_SLOT_BYTES, AR_FLAGS_AT, AR_TILES, AR_COUNTS_AT, AR_SPIN)
            publish(phase_ptr + REDUCED)
    elif v < PH:
        if NO > 0:
            wait_for(phase_ptr + REDUCED, NO)  # every tile of the reduced MoE output
        if CALLS:
            _seam_phase(v, h_y_ptr, h_y2_ptr, h_s_ptr, h_post_ptr, h_comb_ptr, h_fn_ptr, h_base_ptr, h_scale_ptr,
                        h_norm_ptr, h_so_ptr, x_ptr, h_posto_ptr, h_combo_ptr, H_M, H_N, H_D, H_BD, H_BT, H_NM, H_EPS,
                        H_HC_EPS, H_ITERS, H_NORM_EPS, H_Y_S, H_S_S, H_S_SN, H_SO_S, H_SO_SN, H_YO_S, H_DT)
        else:
            _seam_phase_inlined(v, h_y_ptr, h_y2_ptr, h_s_ptr, h_post_ptr, h_comb_ptr, h_fn_ptr, h_base_ptr,
                                h_scale_ptr, h_norm_ptr, h_so_ptr, x_ptr, h_posto_ptr, h_combo_ptr, H_M, H_N, H_D, H_BD,
                                H_BT, H_NM, H_EPS, H_HC_EPS, H_ITERS, H_NORM_EPS, H_Y_S, H_S_S, H_S_SN, H_SO_S, H_SO_SN,
                                H_YO_S, H_DT)
        publish(phase_ptr + SEAM_DONE)
    else:
        wait_for(phase_ptr + SEAM_DONE, PH)  # every row of x
        _pair_norm_program(v - PH, x_ptr, w0_ptr, s0_ptr, y0_ptr, w1_ptr, s1_ptr, y1_ptr, bn_ptr, bw_ptr, bs_ptr,
                           by_ptr, part_ptr, phase_ptr, M, K, X_RS, X_CS, BM, STAGES, P0, N0, SPLIT0, KS0, NT0, Y_RS0,
                           Y_CS0, W_RS0, W_CS0, S_RS0, S_CS0, W_FMT0, S_E8M00, BLOCK0, ACT0, CDT0, BN0, BK0, N1, SPLIT1,
                           KS1, NT1, Y_RS1, Y_CS1, W_RS1, W_CS1, S_RS1, S_CS1, W_FMT1, S_E8M01, BLOCK1, ACT1, CDT1, BN1,
                           BK1, PART1, SEM1, B_N, B_K, B_SPLIT, B_KS, B_NT, B_X_RS, B_X_CS, B_Y_RS, B_Y_CS, B_W_RS,
                           B_W_CS, B_S_RS, B_S_CS, B_W_FMT, B_S_E8M0, B_BLOCK, B_ACT, B_EPS, B_CDT, B_BN, B_BK, B_PART,
                           B_SEM, SRC, COL, P1, PB)
    if last_to_arrive(phase_ptr + FINISHED, NO + PH + P0 + P1 + PB):  # every program is past its wait
        tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)


def norm_input(y: TensorArg, col: int, k: int) -> TensorArg:
    """Columns [col, col + k) of y, as the norm GEMM reads them (y's strides; the base moved col elements)."""
    moved = col * y.strides[-1] * BYTES_OF[y.ptr_type[1:]]
    align = min(y.align, moved & -moved) if moved else y.align
    return TensorArg(y.type.with_shape(*y.shape[:-1], k), y.strides, align)


# one GEMM (`linear`) as the pair's first half: its gemm_call params -> the fused kernel's
ONE_PARAMS = {"x_ptr": "x_ptr", "w_ptr": "w0_ptr", "s_ptr": "s0_ptr", "y_ptr": "y0_ptr"}


def first_gemms(x: TensorArg, operands: dict, results: dict, attrs: dict) -> tuple[dict, KernelCall]:
    """(the fused kernel's constexprs of the first GEMMs, their call): the pair's `gemm_pair_call`, or without
    w1 the one GEMM's `gemm_call`, laid out as a pair whose second half has no programs (P1 = 0)."""
    sides = [{"w": operands.get(f"w{i}"), "scale": operands.get(f"scale{i}"), "y": results.get(f"y{i}"),
              "block": attrs[f"block{i}"], "act": attrs[f"act{i}"]} for i in (0, 1)]
    if sides[1]["w"] is not None:
        call = gemm_pair_call(x, sides)[0]
        pc = call.constexprs
        ce = {n: pc[n] for n in ("M", "K", "X_RS", "X_CS", "BM", "STAGES", "P0", "PART1", "SEM1", "s0_ptr",
                                 "s1_ptr") if n in pc}
        ce.update({f"{k}{i}": pc[f"{k}{i}"] for i in (0, 1) for k in PAIR_SIDE}, P1=call.grid[0] - pc["P0"])
        return ce, call
    s = sides[0]
    call = gemm_call("gemm", x, s["w"], s["scale"], s["y"], None, block=s["block"], act=s["act"], eps=0.0,
                     names={"x": "x", "w": "w0", "s": "scale0", "y": "y0"})[0]
    c = call.constexprs
    ce = {n: c[n] for n in ("M", "K", "X_RS", "X_CS", "BM", "STAGES")}
    ce.update({f"{k}{i}": c[k] for i in (0, 1) for k in PAIR_SIDE}, P0=math.prod(call.grid), P1=0, PART1=0, SEM1=0,
              w1_ptr=None, s1_ptr=None, y1_ptr=None)
    if "s_ptr" in c:
        ce["s0_ptr"] = None
    call.pointers = [(ONE_PARAMS.get(p, p), *rest) for p, *rest in call.pointers]
    call.unaligned = tuple(ONE_PARAMS.get(p, p) for p in call.unaligned)
    call.reuse_bytes = (tile_group_bytes(x, s["w"], s["scale"], s["y"], c),)  # in `_pair_half`'s order, as the pair's
    return ce, call


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name == "mhc_add_pair_norm_linear":
        return _with_seam(operands, results, attrs)
    if op_name == "ar_mhc_add_pair_norm_linear":  # the all-reduce of the MoE's partial its leading phase
        return folded(op_name, operands, results, attrs, specialise, "h_y_ptr")
    if op_name != "pair_norm_linear":
        raise KeyError(f"attn_front family has no op '{op_name}'")
    ce, pair = first_gemms(operands["x"], operands, results, attrs)
    src, col, norm = attrs["src"], attrs["col"], operands["norm"]
    a = norm_input(results[f"y{src}"], col, norm.shape[0])
    lin = gemm_call("gemm", a, operands["w"], operands.get("scale"), results["y"], norm, block=attrs["block"],
                    act=attrs["act"], eps=attrs["eps"], names={"x": f"y{src}", "w": "w", "s": "scale", "n": "norm",
                                                               "y": "y"})[0]
    lc = lin.constexprs
    if lc["M"] != ce["M"] or lc["BM"] != ce["BM"]:
        raise ValueError(f"pair_norm_linear: the norm GEMM must share the first GEMMs' rows and row tiling, got M "
                         f"{lc['M']}/{ce['M']}, BM {lc['BM']}/{ce['BM']}")
    ce.update({"B_" + k: lc[k] for k in NORM_SIDE})
    if "s_ptr" in lc:
        ce["bs_ptr"] = None
    part = pair.scratch_bytes.get("gemm_partial", 0)
    arrivals = pair.scratch_bytes.get("gemm_arrivals", 0)
    ce.update(B_PART=part // 4, B_SEM=arrivals // 4, SRC=src, COL=col, PB=math.prod(lin.grid))
    scratch = {"front_phase": (int(COUNTERS) * 4 + arrivals + lin.scratch_bytes.get("gemm_arrivals", 0))}
    partials = part + lin.scratch_bytes.get("gemm_partial", 0)
    pointers = [p for p in pair.pointers if p[1] not in ("scratch", "semaphore")]
    pointers += [ptr("bn_ptr", "operand", "norm", norm), ptr("bw_ptr", "operand", "w", operands["w"])]
    if operands.get("scale") is not None:
        pointers.append(ptr("bs_ptr", "operand", "scale", operands["scale"]))
    pointers.append(ptr("by_ptr", "result", "y", results["y"]))
    if partials:
        scratch["front_partial"] = partials
        pointers.append(ptr("part_ptr", "scratch", "front_partial", "*fp32"))
    else:
        ce["part_ptr"] = None
    pointers.append(ptr("phase_ptr", "semaphore", "front_phase", "*i32"))
    tag = f"{pair.name.split('_', 2 if pair.fn is gemm_pair_kernel else 1)[-1].rsplit('_', 1)[0]}__" \
        f"{lin.name.split('_', 1)[1].rsplit('_', 1)[0]}"
    return [KernelCall(
        name=call_name("pair_norm", ce, tag), fn=pair_norm_kernel, constexprs=ce, pointers=pointers,
        grid=(ce["P0"] + ce["P1"] + ce["PB"], 1, 1), num_warps=max(pair.num_warps, lin.num_warps), num_stages=2,
        scratch_bytes=scratch,
        unaligned=tuple(sorted({*pair.unaligned, *unaligned({"bn_ptr": norm, "bw_ptr": operands["w"],
                                                             "bs_ptr": operands.get("scale"), "by_ptr": results["y"]})})),
        flops=pair.flops + lin.flops, mma_dtype="fp8" if "fp8" in (pair.mma_dtype, lin.mma_dtype) else "bf16",
        # the two launches' bytes; the norm GEMM's first read of its input is a re-read too (this launch wrote it)
        bytes_moved=pair.bytes_moved + lin.bytes_moved,
        reread_bytes=pair.reread_bytes + lin.reread_bytes + a.type.nbytes,
        # the norm GEMM's programs start once every pair program is done: each phase's footprint meets the cache;
        # the pair's re-reads come within its tile groups (`_pair_half`'s order)
        phases=((pair.bytes_moved, pair.reread_bytes), (lin.bytes_moved, lin.reread_bytes + a.type.nbytes)),
        reuse_bytes=pair.reuse_bytes)]


# the seam's mhc call (`mhc_post_pre_add`) -> the fused kernel's params (its x output is the pair's x, scratch)
SEAM_POINTERS = {"y_ptr": "h_y_ptr", "y2_ptr": "h_y2_ptr", "s_ptr": "h_s_ptr", "post_ptr": "h_post_ptr",
                 "comb_ptr": "h_comb_ptr", "fn_ptr": "h_fn_ptr", "base_ptr": "h_base_ptr", "scale_ptr": "h_scale_ptr",
                 "norm_ptr": "h_norm_ptr", "so_ptr": "h_so_ptr", "posto_ptr": "h_posto_ptr", "combo_ptr": "h_combo_ptr"}
SEAM_CE = ("M", "N", "D", "BD", "BT", "NM", "EPS", "HC_EPS", "ITERS", "NORM_EPS", "Y_S", "S_S", "S_SN", "SO_S", "SO_SN",
           "YO_S", "DT")


def _with_seam(operands, results, attrs) -> list[KernelCall]:
    """`mhc_add_pair_norm_linear`: the `mhc_post_pre_add` launch's call writing x to dense scratch (`seam_x`) as
    the first phase, then `pair_norm_linear`'s call on that scratch. Each phase's program is its unfused
    launch's, so the results are bit-identical."""
    from ...ir.registry import Layout, get_op
    from . import mhc

    seam_ops = {n: operands[n] for n in ("y", "y2", "streams", "post", "comb")}
    seam_ops.update({n: operands["in_" + n] for n in ("fn", "base", "scale", "norm")})
    s_attrs = {n[len("in_"):]: attrs[n] for n in attrs if n.startswith("in_")}
    xt = get_op("mhc_post_pre_add").result_types([seam_ops[n].type if seam_ops.get(n) is not None else None
                                                  for n in get_op("mhc_post_pre_add").operand_names], s_attrs)[1]
    x = TensorArg(xt, Layout.contiguous(xt.shape).strides)
    s_res = {"streams_out": results["streams_out"], "y_next": x, "post_next": results["post_next"],
             "comb_next": results["comb_next"]}
    (seam,) = mhc.specialise("mhc_post_pre_add", seam_ops, s_res, s_attrs)
    sc = seam.constexprs
    if (sc["POST"], sc["MIX"], sc["NORM"]) != (True, "pre", True):
        raise ValueError(f"mhc_add_pair_norm_linear: the seam must be a norm seam, got {sc['MIX']!r} {sc['NORM']}")
    f_ops = {n: v for n, v in operands.items() if n in get_op("pair_norm_linear").operand_names}
    f_res = {"y0": results["y0"], "y1": results.get("y1"), "y": results["y_front"]}
    (front,) = specialise("pair_norm_linear", {**f_ops, "x": x}, {n: v for n, v in f_res.items() if v is not None},
                          {n: v for n, v in attrs.items() if not n.startswith("in_")})
    ce = dict(front.constexprs)
    ce.update({"H_" + k: sc[k] for k in SEAM_CE}, PH=seam.grid[0])
    ce.update(UNFOLDED)  # (`ar_mhc_add_pair_norm_linear`: `allreduce.fold` sets them)
    pointers = []
    for p, kind, name, ty in front.pointers:
        if p == "x_ptr":
            pointers.append(ptr("x_ptr", "scratch", "seam_x", x))
        else:
            pointers.append((p, kind, "y_front" if (kind, name) == ("result", "y") else name, ty))
    for p, kind, name, ty in seam.pointers:
        if p != "yo_ptr":
            pointers.append((SEAM_POINTERS[p], kind, {"fn": "in_fn", "base": "in_base", "scale": "in_scale",
                                                      "norm": "in_norm"}.get(name, name), ty))
    scratch = {**front.scratch_bytes, "seam_x": xt.nbytes}
    (pair_moved, pair_reread), norm_phase = front.phases
    B = math.prod(xt.shape[:-1])
    return [KernelCall(
        name=call_name("seam_pair_norm", ce, f"m{B}_n{sc['N']}_d{sc['D']}_" + front.name.split("_", 2)[-1].rsplit("_", 1)[0]),
        fn=seam_pair_norm_kernel, constexprs=ce, pointers=pointers, grid=(front.grid[0] + seam.grid[0], 1, 1),
        num_warps=front.num_warps, num_stages=front.num_stages, scratch_bytes=scratch,
        unaligned=tuple(p for p in front.unaligned if p != "x_ptr"), flops=front.flops + seam.flops,
        mma_dtype=front.mma_dtype,
        # the seam's bytes, then the front's; the pair's first read of x is a re-read too (this launch wrote it)
        bytes_moved=seam.bytes_moved + front.bytes_moved,
        reread_bytes=seam.reread_bytes + front.reread_bytes + xt.nbytes,
        phases=((seam.bytes_moved, seam.reread_bytes), (pair_moved, pair_reread + xt.nbytes), norm_phase),
        # the pair's first reads of x come after the rest of the seam phase and within the first tile group
        reuse_bytes=(None, seam.bytes_moved + front.reuse_bytes[0], None))]
