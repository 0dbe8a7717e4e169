"""out_proj family: the attention's tail in one launch. `rope_out_proj_linear`: the output projection (`wo_a`,
grouped, reading the attention output through its inverse RoPE, then `wo_b` on every group's output);
`sparse_attention_out_proj` (decode): the sparse attention, its split merge included, then the same.

`wo_b` needs the whole row of `wo_a`'s output (all groups), and `wo_a`'s group the whole attention output of
its heads, so the stages are ticketed phases of one launch (`phases`): the programs, in the order they start,
  tickets [0, PS)        (`attn_out_proj_kernel` only) the attention's decode grid (lane x head block x KV
                         split: `sparse_attention.split_program`, the last split of a group merging it; or
                         one pass, `attend_program`), writing its output to scratch `attn_out`; each then
                         publishes;
  next PA tickets        `wo_a`'s grid (N tiles x M tiles x groups x K splits), each the unfused
                         `rope_out_proj` launch's `gemm_program` (its K splits finished by the tile's last
                         arriving program, as apart), first waiting for all PS attention programs, writing
                         `wo_a`'s output to scratch `wo_a_out`; each then publishes;
  last PB tickets        `wo_b`'s grid (N tiles x M tiles x K splits): each waits for all PA `wo_a` programs
                         (the last of a split `wo_a` tile publishes after its reduction), then runs the
                         unfused `linear` launch's `gemm_program` on the scratch.
A program waits only on programs with earlier tickets, so no schedule deadlocks. One semaphore,
`out_proj_phase`: the phase counters (reset by the last program to finish), then the attention's merge
counters, `wo_a`'s and `wo_b`'s split arrival counters (each reset by its group's reducing program); one
`gemm_partial` scratch holds both GEMMs' split partials end to end. Each phase is the unfused call's
specialisation (its tiles, splits, activation quantisation and roundings; the attention's output and
`wo_a`'s rounded to their dtypes in scratch as they were in the buffers between the launches), so the result
is bit-identical to the launches apart. Each phase loads nothing before the phase before is done, so the
cost model takes each phase's re-reads against that phase's footprint (`KernelCall.phases`).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ...ir.registry import Layout, get_op
from ...targets import KERNEL_SCHEDULES
from . import KernelCall, TensorArg, call_name, ptr
from . import grouped_gemm
from .arrival import last_to_arrive
from .gemm import gemm_call, gemm_program
from .pdl import pdl_enter
from .phases import publish, ticket, wait_for
from .sparse_attention import attend_program, split_program

# the semaphore's phase counters (COUNTERS int32 slots), then the two GEMMs' split arrival counters
TICKET, WO_A_DONE, FINISHED, ATTN_DONE = (tl.constexpr(i) for i in range(4))
COUNTERS = tl.constexpr(4)
# each phase's constexprs: the gemm_program constexprs of its unfused call, prefixed A_ (wo_a) / B_ (wo_b);
# the rope prologue's (wo_a's only) keep their names
SIDE = ("M", "N", "K", "SPLIT", "KS", "NT", "X_RS", "X_CS", "Y_RS", "Y_CS", "W_RS", "W_CS", "S_RS", "S_CS", "W_FMT",
        "S_E8M0", "BLOCK", "ACT", "CDT", "BM", "BN", "BK", "STAGES")
ROPE = ("G_K", "ROPE_T", "P_BS", "P_TS", "D", "DIM", "FREQS", "SIGN")


# The projection's wide tiles spill on some target with the default launch shape: from A_BM >= VERIFY_BM (a
# verify step's 24-32 tokens) on sm_90a, from A_BM >= PREFILL_BM on gfx950; their schedules there are
# targets.KERNEL_SCHEDULES, each from its threshold up (`schedule`).
VERIFY_BM = 32
PREFILL_BM = 64
SCHEDULES = ((VERIFY_BM, KERNEL_SCHEDULES["out_proj.verify"]), (PREFILL_BM, KERNEL_SCHEDULES["out_proj.prefill"]))


def schedule(bm: int) -> dict[str, dict]:
    """The `KernelCall.per_target` of a projection whose wo_a tile is BM tokens: every schedule whose threshold
    it reaches, merged per target (a later one's warps, stages and constexprs over an earlier one's)."""
    out: dict[str, dict] = {}
    for least, table in SCHEDULES:
        for t, o in table.items() if bm >= least else ():
            prev = out.get(t, {})
            out[t] = {**prev, **o, "constexprs": {**prev.get("constexprs", {}), **o.get("constexprs", {})}}
    return out


@triton.jit
def _grid_program(v, x_ptr, w_ptr, s_ptr, pos_ptr, y_ptr, part_ptr, sem_ptr,
                  M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr,
                  NT: tl.constexpr, X_RS: tl.constexpr, X_CS: tl.constexpr, Y_RS: tl.constexpr, Y_CS: tl.constexpr,
                  W_RS: tl.constexpr, W_CS: tl.constexpr, S_RS: tl.constexpr, S_CS: tl.constexpr, W_FMT: tl.constexpr,
                  S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr, CDT: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, G_K: tl.constexpr, ROPE_T: tl.constexpr,
                  P_BS: tl.constexpr, P_TS: tl.constexpr, D: tl.constexpr, DIM: tl.constexpr, FREQS: tl.constexpr,
                  SIGN: tl.constexpr):
    """Program v of one GEMM's grid (N tiles, M tiles, groups x K splits), flattened in that order (the
    unfused launch's program (v % TN, v // TN % TM, v // (TN * TM)))."""
    TN: tl.constexpr = (N + BN - 1) // BN
    TM: tl.constexpr = (M + BM - 1) // BM
    gemm_program(v % TN, (v // TN) % TM, v // (TN * TM), x_ptr, None, w_ptr, s_ptr, None, pos_ptr, y_ptr, part_ptr,
                 sem_ptr, M, N, K, G_K, 0, SPLIT, KS, NT, X_RS, X_CS, Y_RS, Y_CS, W_RS, W_CS, S_RS, S_CS, W_FMT, S_E8M0,
                 BLOCK, ACT, False, 0.0, CDT, BM, BN, BK, STAGES, ROPE_T, P_BS, P_TS, D, DIM, FREQS, SIGN)


@triton.jit
def out_proj_kernel(o_ptr, pos_ptr, w_ptr, s_ptr, z_ptr, wb_ptr, sb_ptr, y_ptr, part_ptr, phase_ptr,
                    A_M: tl.constexpr, A_N: tl.constexpr, A_K: tl.constexpr, A_SPLIT: tl.constexpr,
                    A_KS: tl.constexpr, A_NT: tl.constexpr, A_X_RS: tl.constexpr, A_X_CS: tl.constexpr,
                    A_Y_RS: tl.constexpr, A_Y_CS: tl.constexpr, A_W_RS: tl.constexpr, A_W_CS: tl.constexpr,
                    A_S_RS: tl.constexpr, A_S_CS: tl.constexpr, A_W_FMT: tl.constexpr, A_S_E8M0: tl.constexpr,
                    A_BLOCK: tl.constexpr, A_ACT: tl.constexpr, A_CDT: tl.constexpr, A_BM: tl.constexpr,
                    A_BN: tl.constexpr, A_BK: tl.constexpr, A_STAGES: tl.constexpr,
                    G_K: tl.constexpr, ROPE_T: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr, D: tl.constexpr,
                    DIM: tl.constexpr, FREQS: tl.constexpr, SIGN: tl.constexpr,
                    B_M: tl.constexpr, B_N: tl.constexpr, B_K: tl.constexpr, B_SPLIT: tl.constexpr,
                    B_KS: tl.constexpr, B_NT: tl.constexpr, B_X_RS: tl.constexpr, B_X_CS: tl.constexpr,
                    B_Y_RS: tl.constexpr, B_Y_CS: tl.constexpr, B_W_RS: tl.constexpr, B_W_CS: tl.constexpr,
                    B_S_RS: tl.constexpr, B_S_CS: tl.constexpr, B_W_FMT: tl.constexpr, B_S_E8M0: tl.constexpr,
                    B_BLOCK: tl.constexpr, B_ACT: tl.constexpr, B_CDT: tl.constexpr, B_BM: tl.constexpr,
                    B_BN: tl.constexpr, B_BK: tl.constexpr, B_STAGES: tl.constexpr,
                    PA: tl.constexpr, PB: tl.constexpr, PART_B: tl.constexpr, SEM_B: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Programs by ticket: PA of wo_a (-> z, scratch), then PB of wo_b (z -> y), each wo_b program after every
    wo_a program has published."""
    pdl_enter(PDL)
    v = ticket(phase_ptr + TICKET)
    if v < PA:
        _grid_program(v, o_ptr, w_ptr, s_ptr, pos_ptr, z_ptr, part_ptr, phase_ptr + COUNTERS, A_M, A_N, A_K, A_SPLIT,
                      A_KS, A_NT, A_X_RS, A_X_CS, A_Y_RS, A_Y_CS, A_W_RS, A_W_CS, A_S_RS, A_S_CS, A_W_FMT, A_S_E8M0,
                      A_BLOCK, A_ACT, A_CDT, A_BM, A_BN, A_BK, A_STAGES, G_K, ROPE_T, P_BS, P_TS, D, DIM, FREQS, SIGN)
        publish(phase_ptr + WO_A_DONE)
    else:
        wait_for(phase_ptr + WO_A_DONE, PA)  # every group's z columns of every row (split tiles reduced)
        if B_SPLIT > 1:
            part_ptr = part_ptr + PART_B
        _grid_program(v - PA, z_ptr, wb_ptr, sb_ptr, None, y_ptr, part_ptr, phase_ptr + COUNTERS + SEM_B, B_M, B_N,
                      B_K, B_SPLIT, B_KS, B_NT, B_X_RS, B_X_CS, B_Y_RS, B_Y_CS, B_W_RS, B_W_CS, B_S_RS, B_S_CS,
                      B_W_FMT, B_S_E8M0, B_BLOCK, B_ACT, B_CDT, B_BM, B_BN, B_BK, B_STAGES, 0, 1, 0, 0, 0, 0, 0, -1.0)
    if last_to_arrive(phase_ptr + FINISHED, PA + PB):  # every program is past its wait
        tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)


@triton.jit
def _attention_phase(v, q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr, comp_indices, p0, p1,
                     p2, c0, c1, c2, part_ptr, sem_ptr, o_ptr,
                     T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                     BN: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr, Q_SB: tl.constexpr,
                     Q_ST: tl.constexpr, Q_SH: tl.constexpr, KV_SB: tl.constexpr, KV_ST: tl.constexpr,
                     O_SB: tl.constexpr, O_ST: tl.constexpr, O_SH: tl.constexpr, FMT: tl.constexpr,
                     NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr,
                     S1: tl.constexpr, S2: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, NS: tl.constexpr,
                     RS: tl.constexpr, ACC0: tl.constexpr, HB: tl.constexpr):
    """Attention program v (lane x head block x split, or lane x head block in one pass). Inlined: as a
    noinline call (moe_router's way to keep a phase's registers apart) the V4-Pro kernel still spilled on
    sm_90a (32 B, 1.9 KB with its loops pipelined); inlined, with the attention's loops unpipelined
    (num_stages 1, as in its own launch), it takes 254 registers there and spills nothing."""
    if NS == 1:
        attend_program(v // HB, v % HB, q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr,
                       comp_indices, p0, p1, p2, c0, c1, c2, o_ptr, T, H, D, DP, BH, BN, WINDOW, SCALE, Q_SB, Q_ST,
                       Q_SH, KV_SB, KV_ST, O_SB, O_ST, O_SH, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT, PREC)
    else:
        split_program(v // (HB * NS), v // NS % HB, v % NS, q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr,
                      win_indices, comp_indptr, comp_indices, p0, p1, p2, c0, c1, c2, part_ptr, sem_ptr, o_ptr, H, D,
                      DP, BH, BN, WINDOW, SCALE, Q_SB, Q_SH, KV_SB, O_SB, O_SH, NS, RS, ACC0, FMT, NPLANES, NOPE, BLK,
                      S0, S1, S2, DT, PREC)


@triton.jit
def attn_out_proj_kernel(q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr, comp_indices,
                         p0, p1, p2, c0, c1, c2, sa_part_ptr, o_ptr, w_ptr, s_ptr, z_ptr, wb_ptr, sb_ptr, y_ptr,
                         part_ptr, phase_ptr,
                         T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                         BN: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr, Q_SB: tl.constexpr,
                         Q_ST: tl.constexpr, Q_SH: tl.constexpr, KV_SB: tl.constexpr, KV_ST: tl.constexpr,
                         O_SB: tl.constexpr, O_ST: tl.constexpr, O_SH: tl.constexpr, FMT: tl.constexpr,
                         NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr,
                         S1: tl.constexpr, S2: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, NS: tl.constexpr,
                         RS: tl.constexpr, ACC0: tl.constexpr,
                         A_M: tl.constexpr, A_N: tl.constexpr, A_K: tl.constexpr, A_SPLIT: tl.constexpr,
                         A_KS: tl.constexpr, A_NT: tl.constexpr, A_X_RS: tl.constexpr, A_X_CS: tl.constexpr,
                         A_Y_RS: tl.constexpr, A_Y_CS: tl.constexpr, A_W_RS: tl.constexpr, A_W_CS: tl.constexpr,
                         A_S_RS: tl.constexpr, A_S_CS: tl.constexpr, A_W_FMT: tl.constexpr, A_S_E8M0: tl.constexpr,
                         A_BLOCK: tl.constexpr, A_ACT: tl.constexpr, A_CDT: tl.constexpr, A_BM: tl.constexpr,
                         A_BN: tl.constexpr, A_BK: tl.constexpr, A_STAGES: tl.constexpr,
                         G_K: tl.constexpr, ROPE_T: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr,
                         DIM: tl.constexpr, FREQS: tl.constexpr, SIGN: tl.constexpr,
                         B_M: tl.constexpr, B_N: tl.constexpr, B_K: tl.constexpr, B_SPLIT: tl.constexpr,
                         B_KS: tl.constexpr, B_NT: tl.constexpr, B_X_RS: tl.constexpr, B_X_CS: tl.constexpr,
                         B_Y_RS: tl.constexpr, B_Y_CS: tl.constexpr, B_W_RS: tl.constexpr, B_W_CS: tl.constexpr,
                         B_S_RS: tl.constexpr, B_S_CS: tl.constexpr, B_W_FMT: tl.constexpr, B_S_E8M0: tl.constexpr,
                         B_BLOCK: tl.constexpr, B_ACT: tl.constexpr, B_CDT: tl.constexpr, B_BM: tl.constexpr,
                         B_BN: tl.constexpr, B_BK: tl.constexpr, B_STAGES: tl.constexpr,
                         PS: tl.constexpr, HB: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr,
                         SEM_A: tl.constexpr, PART_B: tl.constexpr, SEM_B: tl.constexpr, PDL: tl.constexpr = False):
    """Programs by ticket: PS of the attention (lane, head block[, split]; a split group's last program merges)
    -> o (scratch), PA of wo_a (o -> z, scratch) once every attention program has published, PB of wo_b
    (z -> y) once every wo_a program has. D: the head dim, the attention's and the inverse RoPE's."""
    pdl_enter(PDL)
    v = ticket(phase_ptr + TICKET)
    if v < PS:
        _attention_phase(v, q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr, comp_indices, p0,
                         p1, p2, c0, c1, c2, sa_part_ptr, phase_ptr + COUNTERS, o_ptr, T, H, D, DP, BH, BN, WINDOW,
                         SCALE, Q_SB, Q_ST, Q_SH, KV_SB, KV_ST, O_SB, O_ST, O_SH, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT,
                         PREC, NS, RS, ACC0, HB)
        publish(phase_ptr + ATTN_DONE)
    elif v < PS + PA:
        wait_for(phase_ptr + ATTN_DONE, PS)  # every head of every lane merged into o
        _grid_program(v - PS, o_ptr, w_ptr, s_ptr, pos_ptr, z_ptr, part_ptr, phase_ptr + COUNTERS + SEM_A, A_M, A_N,
                      A_K, A_SPLIT, A_KS, A_NT, A_X_RS, A_X_CS, A_Y_RS, A_Y_CS, A_W_RS, A_W_CS, A_S_RS, A_S_CS,
                      A_W_FMT, A_S_E8M0, A_BLOCK, A_ACT, A_CDT, A_BM, A_BN, A_BK, A_STAGES, G_K, ROPE_T, P_BS, P_TS, D,
                      DIM, FREQS, SIGN)
        publish(phase_ptr + WO_A_DONE)
    else:
        wait_for(phase_ptr + WO_A_DONE, PA)  # every group's z columns of every row (split tiles reduced)
        if B_SPLIT > 1:
            part_ptr = part_ptr + PART_B
        _grid_program(v - PS - PA, z_ptr, wb_ptr, sb_ptr, None, y_ptr, part_ptr, phase_ptr + COUNTERS + SEM_B, B_M,
                      B_N, B_K, B_SPLIT, B_KS, B_NT, B_X_RS, B_X_CS, B_Y_RS, B_Y_CS, B_W_RS, B_W_CS, B_S_RS, B_S_CS,
                      B_W_FMT, B_S_E8M0, B_BLOCK, B_ACT, B_CDT, B_BM, B_BN, B_BK, B_STAGES, 0, 1, 0, 0, 0, 0, 0, -1.0)
    if last_to_arrive(phase_ptr + FINISHED, PS + PA + PB):  # every program is past its wait
        tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)


def _projection(operands: dict[str, TensorArg | None], o: TensorArg, y: TensorArg, attrs: dict):
    """The unfused calls of wo_a (`rope_out_proj` on o) and wo_b (`linear` on wo_a's output as dense scratch, in
    the dtype the unfused launch stored it in), the fused kernel's constexprs of their phases, pointers and
    scratch (`scale` / `wb_scale`: the operand names of the two weights' scales)."""
    from ...ops.attn_tail import wo_a_attrs, wo_b_attrs

    w_scale = operands.get("scale", operands.get("w_scale"))
    zt = get_op("rope_out_proj").result_types([o.type, operands["pos"].type, operands["w"].type,
                                               w_scale.type if w_scale is not None else None], wo_a_attrs(attrs))[0]
    z = TensorArg(zt, Layout.contiguous(zt.shape).strides)
    a = grouped_gemm.specialise("rope_out_proj", {"o": o, "pos": operands["pos"], "w": operands["w"], "scale": w_scale},
                                {"z": z}, wo_a_attrs(attrs))[0]
    ba = wo_b_attrs(attrs)
    b = gemm_call("gemm", z, operands["wb"], operands.get("wb_scale"), y, None, block=ba["block"], act=ba["act"],
                  eps=0.0, names={"x": "z", "w": "wb", "s": "wb_scale", "y": "y"})[0]
    for c in (a, b):
        if c.constexprs["NORM"] or c.constexprs["xs_ptr"] is not None or c.constexprs["XS_RS"]:
            raise ValueError(f"out_proj: {c.name} takes a norm or pre-quantised input the fused kernel lacks")
    ce = {f"A_{k}": a.constexprs[k] for k in SIDE}
    ce.update({k: a.constexprs[k] for k in ROPE})
    ce.update({f"B_{k}": b.constexprs[k] for k in SIDE})
    part_a = a.scratch_bytes.get("gemm_partial", 0)
    sem_a = a.scratch_bytes.get("gemm_arrivals", 0)
    ce.update(PA=math.prod(a.grid), PB=math.prod(b.grid), PART_B=part_a // 4, SEM_B=sem_a // 4)
    partial = part_a + b.scratch_bytes.get("gemm_partial", 0)
    scratch = {"wo_a_out": zt.nbytes}
    arrivals = sem_a + b.scratch_bytes.get("gemm_arrivals", 0)
    pointers = [ptr("pos_ptr", "operand", "pos", operands["pos"]), ptr("w_ptr", "operand", "w", operands["w"]),
                ptr("z_ptr", "scratch", "wo_a_out", z), ptr("wb_ptr", "operand", "wb", operands["wb"]),
                ptr("y_ptr", "result", "y", y)]
    for param, name in (("s_ptr", "scale" if "scale" in operands else "w_scale"), ("sb_ptr", "wb_scale")):
        if operands.get(name) is not None:
            pointers.append(ptr(param, "operand", name, operands[name]))
        else:
            ce[param] = None
    if partial:
        scratch["gemm_partial"] = partial
        pointers.append(ptr("part_ptr", "scratch", "gemm_partial", "*fp32"))
    else:
        ce["part_ptr"] = None
    unaligned = {p for p in a.unaligned if p not in ("x_ptr", "y_ptr")}  # o and z: dense scratch or o_ptr below
    unaligned |= {{"w_ptr": "wb_ptr", "s_ptr": "sb_ptr"}.get(p, p) for p in b.unaligned if p not in ("x_ptr",)}
    tag = a.name[len("grouped_gemm_"):].rsplit("_", 1)[0] + "_" + b.name[len("gemm_"):].rsplit("_", 1)[0]
    return a, b, ce, pointers, scratch, arrivals, unaligned, tag


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name == "sparse_attention_out_proj":
        return _attention_tail(operands, results, attrs)
    if op_name != "rope_out_proj_linear":
        raise KeyError(f"out_proj family has no op '{op_name}'")
    o = operands["o"]
    a, b, ce, pointers, scratch, arrivals, unaligned, tag = _projection(operands, o, results["y"], attrs)
    pointers += [ptr("o_ptr", "operand", "o", o), ptr("phase_ptr", "semaphore", "out_proj_phase", "*i32")]
    scratch["out_proj_phase"] = int(COUNTERS) * 4 + arrivals
    if "x_ptr" in a.unaligned:
        unaligned.add("o_ptr")
    return [KernelCall(call_name("out_proj", ce, tag), out_proj_kernel, ce, pointers, (ce["PA"] + ce["PB"], 1, 1),
                       num_warps=max(a.num_warps, b.num_warps), num_stages=2, scratch_bytes=scratch,
                       per_target=schedule(ce["A_BM"]),
                       unaligned=tuple(sorted(unaligned)), flops=a.flops + b.flops,
                       mma_dtype="fp8" if "fp8" in (a.mma_dtype, b.mma_dtype) else "bf16",
                       # the two launches' bytes (wo_a's output still goes to scratch and back) and re-reads, per
                       # phase: wo_b's programs load nothing before every wo_a program is done, so each phase's
                       # re-reads compete for the cache with that phase's footprint only (roofline.hbm_bytes)
                       bytes_moved=a.bytes_moved + b.bytes_moved, reread_bytes=a.reread_bytes + b.reread_bytes,
                       phases=((a.bytes_moved, a.reread_bytes), (b.bytes_moved, b.reread_bytes)))]


# the attention's constexprs: the one-pass kernel's and the split kernel's (the other's filled in as below)
ATTN = ("T", "H", "D", "DP", "BH", "BN", "WINDOW", "SCALE", "Q_SB", "Q_ST", "Q_SH", "KV_SB", "KV_ST", "O_SB", "O_ST",
        "O_SH", "FMT", "NPLANES", "NOPE", "BLK", "S0", "S1", "S2", "DT", "PREC", "NS", "RS", "ACC0")
ONE_PASS = {"NS": 1, "RS": 0, "ACC0": 0}  # what the split kernel has and the one-pass kernel lacks
SPLIT = {"T": 1, "Q_ST": 0, "KV_ST": 0, "O_ST": 0}  # the reverse (decode: one query per sequence)


def _attention_tail(operands, results, attrs) -> list[KernelCall]:
    """`sparse_attention_out_proj`: the attention's decode call (split-KV with its merge, or one pass) as the
    first phase of the projection's launch, writing its output to scratch `attn_out` that wo_a reads."""
    from ...ops.attn_tail import SPARSE_ATTENTION_OPERANDS
    from . import sparse_attention

    q, y = operands["q"], results["y"]
    if q.shape[1] != 1:
        raise ValueError(f"sparse_attention_out_proj: decode only (one query per sequence), got q {q.shape}")
    o = TensorArg(q.type, Layout.contiguous(q.shape).strides)
    a_attrs = {n: attrs[n] for n in get_op("sparse_attention").attrs if n in attrs}
    (at,) = sparse_attention.specialise("sparse_attention", {n: operands.get(n) for n in SPARSE_ATTENTION_OPERANDS},
                                        {"out": o}, a_attrs)
    a, b, ce, pointers, scratch, arrivals, unaligned, tag = _projection(operands, o, y, attrs)
    split = at.fn is sparse_attention.sparse_attention_split_kernel
    if at.constexprs["D"] != ce["D"]:
        raise ValueError(f"sparse_attention_out_proj: head dim {at.constexprs['D']} != the inverse RoPE's {ce['D']}")
    ce.update({k: at.constexprs.get(k, (SPLIT if split else ONE_PASS).get(k)) for k in ATTN})
    HB = at.grid[1]
    ce.update(PS=math.prod(at.grid), HB=HB, SEM_A=at.scratch_bytes.get("sa_arrivals", 0) // 4)
    ce["SEM_B"] += ce["SEM_A"]
    for p, kind, name, ty in at.pointers:
        if kind == "operand" and p != "pos_ptr":  # pos: the projection's too (the same positions)
            pointers.append((p, kind, name, ty))
    for p in ("comp_indptr", "comp_indices", "p0", "p1", "p2", "c0", "c1", "c2"):
        if p in at.constexprs:  # absent (None) in this variant
            ce[p] = None
    pointers += [ptr("o_ptr", "scratch", "attn_out", o), ptr("phase_ptr", "semaphore", "out_proj_phase", "*i32")]
    scratch.update(attn_out=o.type.nbytes, out_proj_phase=int(COUNTERS) * 4 + at.scratch_bytes.get("sa_arrivals", 0)
                   + arrivals)
    if split:
        pointers.append(ptr("sa_part_ptr", "scratch", "sa_partial", "*fp32"))
        scratch["sa_partial"] = at.scratch_bytes["sa_partial"]
    else:
        ce["sa_part_ptr"] = None
    unaligned |= {p for p in at.unaligned if p != "out_ptr"}
    B, _, H, D = q.shape
    return [KernelCall(call_name("attn_out_proj", ce, f"b{B}_h{H}_d{D}_s{ce['NS']}_{attrs['fmt']}_{tag}"),
                       attn_out_proj_kernel, ce, pointers, (ce["PS"] + ce["PA"] + ce["PB"], 1, 1),
                       # the attention's loops unpipelined as in its own launch (2 stages of its [BN, d] row tiles
                       # spilled ~1.9 KB on sm_90a); the GEMM phases pipeline theirs (tl.range num_stages)
                       num_warps=max(at.num_warps, a.num_warps, b.num_warps), num_stages=at.num_stages,
                       scratch_bytes=scratch,
                       unaligned=tuple(sorted(unaligned)), flops=at.flops + a.flops + b.flops,
                       mma_dtype="fp8" if "fp8" in (a.mma_dtype, b.mma_dtype) else "bf16", offsets=dict(at.offsets),
                       # the three launches' bytes and re-reads, per phase (each phase's programs load nothing
                       # before every program of the phase before is done: roofline.hbm_bytes)
                       bytes_moved=at.bytes_moved + a.bytes_moved + b.bytes_moved,
                       reread_bytes=at.reread_bytes + a.reread_bytes + b.reread_bytes,
                       phases=tuple((c.bytes_moved, c.reread_bytes) for c in (at, a, b)))]
