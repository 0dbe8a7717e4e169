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
from .arrival import last_to_arrive
from .gemm import PAIR_SIDE, _pair_half, gemm_call, gemm_pair_call, gemm_pair_kernel, gemm_program
from .pdl import pdl_enter
from .phases import publish, ticket, wait_for

# the semaphore's int32 counters: the ticket, the y<SRC> programs done, programs finished (COUNTERS slots, a
# power of two); then the pair's split arrival counters, then the norm GEMM's
TICKET, WRITTEN, FINISHED = (tl.constexpr(i) for i in range(3))
COUNTERS = tl.constexpr(4)
# the norm GEMM's `gemm_call` constexprs the fused kernel takes (as B_*); M, BM and STAGES are the pair's
NORM_SIDE = ("N", "K", "SPLIT", "KS", "NT", "X_RS", "X_CS", "Y_RS", "Y_CS", "W_RS", "W_CS", "S_RS", "S_CS", "W_FMT",
             "S_E8M0", "BLOCK", "ACT", "EPS", "CDT", "BN", "BK")


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
    TN: tl.constexpr = (B_N + B_BN - 1) // B_BN  # the norm GEMM's grid: N tiles, M tiles, K splits
    TM: tl.constexpr = (M + BM - 1) // BM
    v = ticket(phase_ptr + TICKET)
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
    if last_to_arrive(phase_ptr + FINISHED, P0 + P1 + PB):  # every program is past its wait
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
    return ce, call


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
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
        # the norm GEMM's programs start once every pair program is done: each phase's footprint meets the cache
        phases=((pair.bytes_moved, pair.reread_bytes), (lin.bytes_moved, lin.reread_bytes + a.type.nbytes)))]
