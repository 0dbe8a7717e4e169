"""rope_compress: a decode step's query prologue (`qkv_norm_rope`, with the window-ring write) and the same layer's
compressor launch (`compress_paged`, or a CSA layer's `compress_pair`) in one launch (`ops.rope_compress.qkv_rope_compress`,
`passes/pair_rope_compress.py`). Each part is specialised as the op it replaces (its family's `specialise`), and
its programs run that op's own program body (`qkv_norm_rope_program`, `compress_program`) on a range of the
flattened program id: [0, A) the prologue's (lane, head block) grid, then B programs per compressor. Results are
those of the separate launches bit for bit (the same bodies on the same constexprs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...targets import KERNEL_SCHEDULES
from . import KernelCall, call_name, compress, qkv_norm_rope
from .compress import compress_program
from .pdl import pdl_enter
from .qkv_norm_rope import qkv_norm_rope_program

# The pair's schedule on targets where its parts' warps spill (targets.KERNEL_SCHEDULES).
PAIR_SHAPE = KERNEL_SCHEDULES["rope_compress.pair"]


@triton.jit
def rope_compress_kernel(q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0, p1, p2, qo_ptr, kvo_ptr, qio_ptr,
                         kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0, skv_ptr_0, sg_ptr_0, p0_0, p1_0, p2_0, bt_ptr,
                         T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                         HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, EPS: tl.constexpr,
                         Q_MEAN_DT: tl.constexpr, ROPE_DIM: tl.constexpr, F: tl.constexpr,
                         KV_ROUND_DIMS: tl.constexpr, KV_ROUND_BLOCK: tl.constexpr, QI_FP4: tl.constexpr,
                         HS: tl.constexpr, Q_S: tl.constexpr, KV_S: tl.constexpr, QI_S: tl.constexpr,
                         QO_S: tl.constexpr, KVO_S: tl.constexpr, QIO_S: tl.constexpr, WINDOW: tl.constexpr,
                         SLOT_ROWS: tl.constexpr, N_ROWS: tl.constexpr, TP: tl.constexpr, FMT: tl.constexpr,
                         NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr,
                         S1: tl.constexpr, S2: tl.constexpr, DT: tl.constexpr, A: tl.constexpr, NHB: tl.constexpr,
                         B: tl.constexpr, T_0: tl.constexpr, TP_0: tl.constexpr, M_0: tl.constexpr,
                         OVERLAP_0: tl.constexpr, CM_0: tl.constexpr, S_0: tl.constexpr, BS_0: tl.constexpr,
                         DK_0: tl.constexpr, DKP_0: tl.constexpr, CW_0: tl.constexpr, CWP_0: tl.constexpr,
                         BT_0: tl.constexpr, EPS_0: tl.constexpr, ROPE_DIM_0: tl.constexpr, F_0: tl.constexpr,
                         ROUND_0: tl.constexpr, RBLK_0: tl.constexpr, HS_0: tl.constexpr, PER_BLOCK_0: tl.constexpr,
                         ENV_0: tl.constexpr, BT_S_0: tl.constexpr, KV_S_0: tl.constexpr, G_S_0: tl.constexpr,
                         SKV_S_0: tl.constexpr, SG_S_0: tl.constexpr, FMT_0: tl.constexpr, NPLANES_0: tl.constexpr,
                         NOPE_0: tl.constexpr, BLK_0: tl.constexpr, S0_0: tl.constexpr, S1_0: tl.constexpr,
                         S2_0: tl.constexpr, DT_0: tl.constexpr, PDL: tl.constexpr = False):
    """`qkv_rope_compress`: programs [0, A) run the query prologue, (lane, head block) = (pid // NHB, pid % NHB),
    programs [A, A + B) the compressor's sequences. The two write disjoint pool rows and neither reads one, so no
    program waits on another."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < A:
        qkv_norm_rope_program(pid // NHB, pid % NHB, q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0, p1, p2,
                              qo_ptr, kvo_ptr, qio_ptr, T, H, D, DP, BH, HI, HIP, DI, DIP, EPS, Q_MEAN_DT, ROPE_DIM,
                              F, KV_ROUND_DIMS, KV_ROUND_BLOCK, QI_FP4, HS, Q_S, KV_S, QI_S, QO_S, KVO_S, QIO_S,
                              WINDOW, SLOT_ROWS, N_ROWS, TP, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT)
    else:
        compress_program(pid - A, kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0, skv_ptr_0, sg_ptr_0, pos_ptr, slot_ptr,
                         bt_ptr, p0_0, p1_0, p2_0, T_0, TP_0, M_0, OVERLAP_0, CM_0, S_0, BS_0, DK_0, DKP_0, CW_0,
                         CWP_0, BT_0, EPS_0, ROPE_DIM_0, F_0, ROUND_0, RBLK_0, HS_0, PER_BLOCK_0, ENV_0, BT_S_0,
                         KV_S_0, G_S_0, SKV_S_0, SG_S_0, FMT_0, NPLANES_0, NOPE_0, BLK_0, S0_0, S1_0, S2_0, DT_0)


@triton.jit
def rope_compress_pair_kernel(q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0, p1, p2, qo_ptr, kvo_ptr,
                              qio_ptr, kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0, skv_ptr_0, sg_ptr_0, p0_0, p1_0,
                              p2_0, kv_ptr_1, gate_ptr_1, ape_ptr_1, norm_ptr_1, skv_ptr_1, sg_ptr_1, p0_1, p1_1,
                              p2_1, bt_ptr, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                              BH: tl.constexpr, HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr,
                              DIP: tl.constexpr, EPS: tl.constexpr, Q_MEAN_DT: tl.constexpr, ROPE_DIM: tl.constexpr,
                              F: tl.constexpr, KV_ROUND_DIMS: tl.constexpr, KV_ROUND_BLOCK: tl.constexpr,
                              QI_FP4: tl.constexpr, HS: tl.constexpr, Q_S: tl.constexpr, KV_S: tl.constexpr,
                              QI_S: tl.constexpr, QO_S: tl.constexpr, KVO_S: tl.constexpr, QIO_S: tl.constexpr,
                              WINDOW: tl.constexpr, SLOT_ROWS: tl.constexpr, N_ROWS: tl.constexpr, TP: tl.constexpr,
                              FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                              S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, DT: tl.constexpr, A: tl.constexpr,
                              NHB: tl.constexpr, B: tl.constexpr, T_0: tl.constexpr, TP_0: tl.constexpr,
                              M_0: tl.constexpr, OVERLAP_0: tl.constexpr, CM_0: tl.constexpr, S_0: tl.constexpr,
                              BS_0: tl.constexpr, DK_0: tl.constexpr, DKP_0: tl.constexpr, CW_0: tl.constexpr,
                              CWP_0: tl.constexpr, BT_0: tl.constexpr, EPS_0: tl.constexpr, ROPE_DIM_0: tl.constexpr,
                              F_0: tl.constexpr, ROUND_0: tl.constexpr, RBLK_0: tl.constexpr, HS_0: tl.constexpr,
                              PER_BLOCK_0: tl.constexpr, ENV_0: tl.constexpr, BT_S_0: tl.constexpr,
                              KV_S_0: tl.constexpr, G_S_0: tl.constexpr, SKV_S_0: tl.constexpr, SG_S_0: tl.constexpr,
                              FMT_0: tl.constexpr, NPLANES_0: tl.constexpr, NOPE_0: tl.constexpr, BLK_0: tl.constexpr,
                              S0_0: tl.constexpr, S1_0: tl.constexpr, S2_0: tl.constexpr, DT_0: tl.constexpr,
                              T_1: tl.constexpr, TP_1: tl.constexpr, M_1: tl.constexpr, OVERLAP_1: tl.constexpr,
                              CM_1: tl.constexpr, S_1: tl.constexpr, BS_1: tl.constexpr, DK_1: tl.constexpr,
                              DKP_1: tl.constexpr, CW_1: tl.constexpr, CWP_1: tl.constexpr, BT_1: tl.constexpr,
                              EPS_1: tl.constexpr, ROPE_DIM_1: tl.constexpr, F_1: tl.constexpr, ROUND_1: tl.constexpr,
                              RBLK_1: tl.constexpr, HS_1: tl.constexpr, PER_BLOCK_1: tl.constexpr,
                              ENV_1: tl.constexpr, BT_S_1: tl.constexpr, KV_S_1: tl.constexpr, G_S_1: tl.constexpr,
                              SKV_S_1: tl.constexpr, SG_S_1: tl.constexpr, FMT_1: tl.constexpr,
                              NPLANES_1: tl.constexpr, NOPE_1: tl.constexpr, BLK_1: tl.constexpr, S0_1: tl.constexpr,
                              S1_1: tl.constexpr, S2_1: tl.constexpr, DT_1: tl.constexpr, PDL: tl.constexpr = False):
    """`qkv_rope_compress_pair`: programs [0, A) the query prologue, [A, A + B) the attention compressor's
    sequences, [A + B, A + 2B) the indexer compressor's."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < A:
        qkv_norm_rope_program(pid // NHB, pid % NHB, q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0, p1, p2,
                              qo_ptr, kvo_ptr, qio_ptr, T, H, D, DP, BH, HI, HIP, DI, DIP, EPS, Q_MEAN_DT, ROPE_DIM,
                              F, KV_ROUND_DIMS, KV_ROUND_BLOCK, QI_FP4, HS, Q_S, KV_S, QI_S, QO_S, KVO_S, QIO_S,
                              WINDOW, SLOT_ROWS, N_ROWS, TP, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT)
    elif pid < A + B:
        compress_program(pid - A, kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0, skv_ptr_0, sg_ptr_0, pos_ptr, slot_ptr,
                         bt_ptr, p0_0, p1_0, p2_0, T_0, TP_0, M_0, OVERLAP_0, CM_0, S_0, BS_0, DK_0, DKP_0, CW_0,
                         CWP_0, BT_0, EPS_0, ROPE_DIM_0, F_0, ROUND_0, RBLK_0, HS_0, PER_BLOCK_0, ENV_0, BT_S_0,
                         KV_S_0, G_S_0, SKV_S_0, SG_S_0, FMT_0, NPLANES_0, NOPE_0, BLK_0, S0_0, S1_0, S2_0, DT_0)
    else:
        compress_program(pid - A - B, kv_ptr_1, gate_ptr_1, ape_ptr_1, norm_ptr_1, skv_ptr_1, sg_ptr_1, pos_ptr,
                         slot_ptr, bt_ptr, p0_1, p1_1, p2_1, T_1, TP_1, M_1, OVERLAP_1, CM_1, S_1, BS_1, DK_1, DKP_1,
                         CW_1, CWP_1, BT_1, EPS_1, ROPE_DIM_1, F_1, ROUND_1, RBLK_1, HS_1, PER_BLOCK_1, ENV_1, BT_S_1,
                         KV_S_1, G_S_1, SKV_S_1, SG_S_1, FMT_1, NPLANES_1, NOPE_1, BLK_1, S0_1, S1_1, S2_1, DT_1)


def specialise(op_name, operands, results, attrs):
    from ...ops.rope_compress import ROPE_COMPRESS  # (torch: here, not at the top, as in kvrows.py)

    rc = ROPE_COMPRESS[op_name]
    second = rc.second.name
    q_ops = {n: operands.get(n) for n in ("q", "kv", "norm", "pos", "qi", "slot", "p0", "p1", "p2")}
    q_res = {n: results[n] for n in ("q_out", "kv_out", "qi_out") if n in results}
    c_ops = {n: operands.get(f) for n, f in rc.operand_map.items()}
    q_attrs = {k: v for k, v in attrs.items() if not k.startswith("c_")}
    c_attrs = {k[2:]: v for k, v in attrs.items() if k.startswith("c_")}
    (qc,) = qkv_norm_rope.specialise("qkv_norm_rope", q_ops, q_res, q_attrs)
    (cc,) = compress.specialise(second, c_ops, {}, c_attrs)
    pair = second == "compress_pair"
    B = cc.grid[0] // (2 if pair else 1)
    A, NHB = qc.grid[0] * qc.grid[1], qc.grid[1]
    c = {**qc.constexprs, "A": A, "NHB": NHB, "B": B}
    pointers = list(qc.pointers)
    offsets = dict(qc.offsets)
    theirs = [(p, kind, rc.operand_map[name], ty) for p, kind, name, ty in cc.pointers
              if p not in ("pos_ptr", "slot_ptr")]  # the positions and slots: the prologue's pointers
    if pair:  # compress_pair_kernel's parameters already carry the halves' suffixes
        c.update({k: v for k, v in cc.constexprs.items() if k != "B"})
        pointers += theirs
        offsets.update(cc.offsets)
        unaligned = (*qc.unaligned, *cc.unaligned)
    else:  # compress_kernel's suffixed _0 (but the shared block table)
        c.update({f"{k}_0": v for k, v in cc.constexprs.items() if k in compress.HALF or k in compress.HALF_POINTERS})
        pointers += [(p if p == "bt_ptr" else f"{p}_0", *rest) for p, *rest in theirs]
        offsets.update({f"{p}_0": off for p, off in cc.offsets.items()})
        unaligned = (*qc.unaligned, *(f"{p}_0" for p in cc.unaligned))
    c.pop("PDL", None)
    fn = rope_compress_pair_kernel if pair else rope_compress_kernel
    own = PAIR_SHAPE if pair else {}
    targets = sorted({*qc.per_target, *cc.per_target, *own})
    tag = f"{qc.name.split('_', 3)[3].rsplit('_', 1)[0]}_{cc.name.split('_', 2)[2].rsplit('_', 1)[0]}"
    return [KernelCall(name=call_name(op_name, c, tag), fn=fn, constexprs=c, pointers=pointers,
                       grid=(A + cc.grid[0], 1, 1), num_warps=max(qc.num_warps, cc.num_warps),
                       # both parts in the larger part's warps on each target (or the pair's own, where more)
                       per_target={t: {"num_warps": max(qc.for_target(t)[0], cc.for_target(t)[0],
                                                        own.get(t, {}).get("num_warps", 0))} for t in targets},
                       unaligned=tuple(sorted(set(unaligned))), offsets=offsets,
                       bytes_moved=qc.bytes_moved + cc.bytes_moved)]
