"""compress_paged / compress_pair: the KV compressor on the paged pool (`ops.paged.compress_paged`,
`ops.compressor`): pool every window this chunk closes (softmax over the window's slots per channel, gate + position bias),
RMSNorm, RoPE at the window's first position, official rounding (FP8 on the NoPE dims, or Hadamard +
FP4), store the row at its physical pool row in the plane format; then push the chunk's tokens into the
per-slot state rings. HCA (c = 1) and CSA (c = 2, overlapping halves) and the indexer's compressor
(index planes) are the same kernel with other constexprs. `compress_pair` (a CSA layer's two compressors,
`passes/pair_compressors.py`, decode steps) runs both in one launch: the first's programs, then the second's;
`rope_compress.py` runs `compress_program` after a decode step's query prologue in one launch.

One program per sequence: it reads the ring before it overwrites it (a block barrier separates the two).
The window softmax runs over slot chunks of BS in two passes (max / sum, then the weighted sum), so a
128-slot HCA window never sits in registers whole.
bf16: the softmax weights, each product and the pooled sum are rounded to bf16 as the reference rounds.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ...targets import KERNEL_SCHEDULES
from . import KernelCall, any_row, call_name, ptr, row_offsets, unaligned
from .kvrows import (TL_DTYPE, fp4_qdq, fp8_qdq, fwht, hadamard_scale, plane_consts, pow2, ring_keep, rope,
                     rope_table, store_rows)
from .pdl import pdl_enter


@triton.jit
def _slot_tile(kv_ptr, gate_ptr, ape_ptr, skv_ptr, sg_ptr, b, sb, start, w, s0, j,
               M: tl.constexpr, OVERLAP: tl.constexpr, CM: tl.constexpr, S: tl.constexpr, BS: tl.constexpr,
               DK: tl.constexpr, KV_S: tl.constexpr, G_S: tl.constexpr, SKV_S: tl.constexpr, SG_S: tl.constexpr,
               DT: tl.constexpr):
    """Values and gate logits [BS, DKP] of pooling slots s0 .. s0 + BS of window w (-inf / 0 when absent)."""
    s = s0 + tl.arange(0, BS)
    if OVERLAP:
        p = M * (w - 1) + s
        half = (s >= M).to(tl.int32)
    else:
        p = M * w + s
        half = s * 0
    ok = (s < CM) & (p >= 0)
    st = ok & (p < start)
    ch = ok & (p >= start)
    col = (half * DK)[:, None] + j[None, :]
    cm = (j < DK)[None, :]
    ring = (tl.maximum(p, 0) % S)[:, None]
    lane = (p - start)[:, None]
    v_st = tl.load(skv_ptr + sb * SKV_S[0] + ring * SKV_S[1] + col, mask=st[:, None] & cm, other=0.0)
    v_ch = tl.load(kv_ptr + b * KV_S[0] + lane * KV_S[1] + col, mask=ch[:, None] & cm, other=0.0)
    v = tl.where(st[:, None], v_st.to(DT).to(tl.float32), v_ch.to(tl.float32))
    g_st = tl.load(sg_ptr + sb * SG_S[0] + ring * SG_S[1] + col, mask=st[:, None] & cm, other=0.0)
    g_ch = (tl.load(gate_ptr + b * G_S[0] + lane * G_S[1] + col, mask=ch[:, None] & cm, other=0.0).to(tl.float32)
            + tl.load(ape_ptr + (tl.maximum(p, 0) % M)[:, None] * (DK * (1 + OVERLAP)) + col,
                      mask=ch[:, None] & cm, other=0.0).to(tl.float32))
    g = tl.where(st[:, None], g_st.to(tl.float32), g_ch)
    g = tl.where(ok[:, None] & cm, g, float("-inf"))
    return tl.where(ok[:, None], v, 0.0), g


# Rows this wide or wider spill with 4 warps on some target: their schedule there is targets.KERNEL_SCHEDULES.
WIDE_ROW = 512
WIDE_ROW_SHAPE = KERNEL_SCHEDULES["compress.wide_row"]


# The constexprs of one compressor, in `compress_program`'s order (a `compress_pair` launch takes them twice).
HALF = ("T", "TP", "M", "OVERLAP", "CM", "S", "BS", "DK", "DKP", "CW", "CWP", "BT", "EPS", "ROPE_DIM", "F", "ROUND",
        "RBLK", "HS", "PER_BLOCK", "ENV", "BT_S", "KV_S", "G_S", "SKV_S", "SG_S", "FMT", "NPLANES", "NOPE", "BLK", "S0",
        "S1", "S2", "DT")
HALF_POINTERS = ("kv_ptr", "gate_ptr", "ape_ptr", "norm_ptr", "skv_ptr", "sg_ptr", "p0", "p1", "p2")


@triton.jit
def compress_kernel(kv_ptr, gate_ptr, ape_ptr, norm_ptr, skv_ptr, sg_ptr, pos_ptr, slot_ptr, bt_ptr, p0, p1, p2,
                    T: tl.constexpr, TP: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, CM: tl.constexpr,
                    S: tl.constexpr, BS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, CW: tl.constexpr,
                    CWP: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, ROPE_DIM: tl.constexpr,
                    F: tl.constexpr, ROUND: tl.constexpr, RBLK: tl.constexpr, HS: tl.constexpr,
                    PER_BLOCK: tl.constexpr, ENV: tl.constexpr, BT_S: tl.constexpr,
                    KV_S: tl.constexpr, G_S: tl.constexpr, SKV_S: tl.constexpr, SG_S: tl.constexpr,
                    FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    compress_program(tl.program_id(0), kv_ptr, gate_ptr, ape_ptr, norm_ptr, skv_ptr, sg_ptr, pos_ptr, slot_ptr, bt_ptr,
                     p0, p1, p2, T, TP, M, OVERLAP, CM, S, BS, DK, DKP, CW, CWP, BT, EPS, ROPE_DIM, F, ROUND, RBLK, HS,
                     PER_BLOCK, ENV, BT_S, KV_S, G_S, SKV_S, SG_S, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT)


@triton.jit
def compress_pair_kernel(kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0, skv_ptr_0, sg_ptr_0, p0_0, p1_0, p2_0,
                         kv_ptr_1, gate_ptr_1, ape_ptr_1, norm_ptr_1, skv_ptr_1, sg_ptr_1, p0_1, p1_1, p2_1,
                         pos_ptr, slot_ptr, bt_ptr, B: tl.constexpr,
                         T_0: tl.constexpr, TP_0: tl.constexpr, M_0: tl.constexpr, OVERLAP_0: tl.constexpr,
                         CM_0: tl.constexpr, S_0: tl.constexpr, BS_0: tl.constexpr, DK_0: tl.constexpr,
                         DKP_0: tl.constexpr, CW_0: tl.constexpr, CWP_0: tl.constexpr, BT_0: tl.constexpr,
                         EPS_0: tl.constexpr, ROPE_DIM_0: tl.constexpr, F_0: tl.constexpr, ROUND_0: tl.constexpr,
                         RBLK_0: tl.constexpr, HS_0: tl.constexpr, PER_BLOCK_0: tl.constexpr, ENV_0: tl.constexpr,
                         BT_S_0: tl.constexpr, KV_S_0: tl.constexpr, G_S_0: tl.constexpr, SKV_S_0: tl.constexpr,
                         SG_S_0: tl.constexpr, FMT_0: tl.constexpr, NPLANES_0: tl.constexpr, NOPE_0: tl.constexpr,
                         BLK_0: tl.constexpr, S0_0: tl.constexpr, S1_0: tl.constexpr, S2_0: tl.constexpr,
                         DT_0: tl.constexpr,
                         T_1: tl.constexpr, TP_1: tl.constexpr, M_1: tl.constexpr, OVERLAP_1: tl.constexpr,
                         CM_1: tl.constexpr, S_1: tl.constexpr, BS_1: tl.constexpr, DK_1: tl.constexpr,
                         DKP_1: tl.constexpr, CW_1: tl.constexpr, CWP_1: tl.constexpr, BT_1: tl.constexpr,
                         EPS_1: tl.constexpr, ROPE_DIM_1: tl.constexpr, F_1: tl.constexpr, ROUND_1: tl.constexpr,
                         RBLK_1: tl.constexpr, HS_1: tl.constexpr, PER_BLOCK_1: tl.constexpr, ENV_1: tl.constexpr,
                         BT_S_1: tl.constexpr, KV_S_1: tl.constexpr, G_S_1: tl.constexpr, SKV_S_1: tl.constexpr,
                         SG_S_1: tl.constexpr, FMT_1: tl.constexpr, NPLANES_1: tl.constexpr, NOPE_1: tl.constexpr,
                         BLK_1: tl.constexpr, S0_1: tl.constexpr, S1_1: tl.constexpr, S2_1: tl.constexpr,
                         DT_1: tl.constexpr, PDL: tl.constexpr = False):
    """`compress_pair`: programs [0, B) are the first compressor's sequences, [B, 2B) the second's (disjoint
    rings and planes, so the halves never wait on each other)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < B:
        compress_program(pid, kv_ptr_0, gate_ptr_0, ape_ptr_0, norm_ptr_0, skv_ptr_0, sg_ptr_0, pos_ptr, slot_ptr,
                         bt_ptr, p0_0, p1_0, p2_0, T_0, TP_0, M_0, OVERLAP_0, CM_0, S_0, BS_0, DK_0, DKP_0, CW_0,
                         CWP_0, BT_0, EPS_0, ROPE_DIM_0, F_0, ROUND_0, RBLK_0, HS_0, PER_BLOCK_0, ENV_0, BT_S_0, KV_S_0,
                         G_S_0, SKV_S_0, SG_S_0, FMT_0, NPLANES_0, NOPE_0, BLK_0, S0_0, S1_0, S2_0, DT_0)
    else:
        compress_program(pid - B, kv_ptr_1, gate_ptr_1, ape_ptr_1, norm_ptr_1, skv_ptr_1, sg_ptr_1, pos_ptr, slot_ptr,
                         bt_ptr, p0_1, p1_1, p2_1, T_1, TP_1, M_1, OVERLAP_1, CM_1, S_1, BS_1, DK_1, DKP_1, CW_1,
                         CWP_1, BT_1, EPS_1, ROPE_DIM_1, F_1, ROUND_1, RBLK_1, HS_1, PER_BLOCK_1, ENV_1, BT_S_1, KV_S_1,
                         G_S_1, SKV_S_1, SG_S_1, FMT_1, NPLANES_1, NOPE_1, BLK_1, S0_1, S1_1, S2_1, DT_1)


@triton.jit
def compress_program(b, kv_ptr, gate_ptr, ape_ptr, norm_ptr, skv_ptr, sg_ptr, pos_ptr, slot_ptr, bt_ptr, p0, p1, p2,
                     T: tl.constexpr, TP: tl.constexpr, M: tl.constexpr, OVERLAP: tl.constexpr, CM: tl.constexpr,
                     S: tl.constexpr, BS: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr, CW: tl.constexpr,
                     CWP: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr, ROPE_DIM: tl.constexpr,
                     F: tl.constexpr, ROUND: tl.constexpr, RBLK: tl.constexpr, HS: tl.constexpr,
                     PER_BLOCK: tl.constexpr, ENV: tl.constexpr, BT_S: tl.constexpr,
                     KV_S: tl.constexpr, G_S: tl.constexpr, SKV_S: tl.constexpr, SG_S: tl.constexpr,
                     FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                     S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, DT: tl.constexpr):
    """Sequence b of one compressor (the body of `compress_kernel` and of each half of `compress_pair_kernel`)."""
    sb = tl.load(slot_ptr + b).to(tl.int64)
    t = tl.arange(0, TP)
    allp = tl.load(pos_ptr + b * T + t, mask=t < T, other=-1)
    n = tl.sum((allp >= 0).to(tl.int32), axis=0)
    start = tl.maximum(tl.max(tl.where(t == 0, allp, -1), axis=0), 0)
    n_closed = tl.where(n > 0, (start + n) // M - start // M, 0)
    j = tl.arange(0, DKP)
    for i in range(0, n_closed):
        w = start // M + i
        mx = tl.full([DKP], -1e30, tl.float32)
        den = tl.zeros([DKP], tl.float32)
        for s0 in range(0, CM, BS):
            v, g = _slot_tile(kv_ptr, gate_ptr, ape_ptr, skv_ptr, sg_ptr, b, sb, start, w, s0, j, M, OVERLAP, CM, S,
                              BS, DK, KV_S, G_S, SKV_S, SG_S, DT)
            mx_new = tl.maximum(mx, tl.max(g, axis=0))
            den = den * tl.exp(mx - mx_new) + tl.sum(tl.exp(g - mx_new[None, :]), axis=0)
            mx = mx_new
        den = tl.where(j < DK, den, 1.0)  # padded columns have no slot at all
        h = tl.zeros([DKP], tl.float32)
        for s0 in range(0, CM, BS):
            v, g = _slot_tile(kv_ptr, gate_ptr, ape_ptr, skv_ptr, sg_ptr, b, sb, start, w, s0, j, M, OVERLAP, CM, S,
                              BS, DK, KV_S, G_S, SKV_S, SG_S, DT)
            wt = (tl.exp(g - mx[None, :]) / den[None, :]).to(DT).to(tl.float32)
            h += tl.sum((v * wt).to(DT).to(tl.float32), axis=0)
        h = tl.where(j < DK, h.to(DT).to(tl.float32), 0.0)
        r = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / DK + EPS)
        h = (tl.load(norm_ptr + j, mask=j < DK, other=0.0).to(tl.float32) * (h * r)).to(DT).to(tl.float32)
        x = rope(tl.reshape(h, [1, DKP]), tl.full([1], 0.0, tl.float32) + (M * w).to(tl.float32), F, 1, DKP, DK,
                 ROPE_DIM, DT)
        if ROUND == "fp8":
            x = fp8_qdq(x, DK - ROPE_DIM, 1, DKP, RBLK).to(DT).to(tl.float32)
        elif ROUND == "fp4":
            x = fp4_qdq(fwht(x, 1, DKP, HS).to(DT).to(tl.float32), 1, DKP).to(DT).to(tl.float32)
        blk = tl.load(bt_ptr + b * BT_S + w // PER_BLOCK).to(tl.int64)
        row = blk * ENV + w % PER_BLOCK + tl.zeros([1], tl.int64)  # planes start at the layer's offset
        store_rows(p0, p1, p2, row, row >= 0, x, FMT, NPLANES, 1, DKP, DK, NOPE, BLK, S0, S1, S2)
    tl.debug_barrier()  # every window above read the ring; now overwrite it
    c = tl.arange(0, CWP)[None, :]
    for i0 in range(0, T, BT):
        lane = i0 + tl.arange(0, BT)
        keep, p = ring_keep(pos_ptr, b, lane, T, TP, S)
        ring = (tl.maximum(p, 0) % S)[:, None]
        m2 = keep[:, None] & (c < CW)
        x = tl.load(kv_ptr + b * KV_S[0] + lane[:, None] * KV_S[1] + c, mask=m2, other=0.0)
        g = (tl.load(gate_ptr + b * G_S[0] + lane[:, None] * G_S[1] + c, mask=m2, other=0.0).to(tl.float32)
             + tl.load(ape_ptr + (tl.maximum(p, 0) % M)[:, None] * CW + c, mask=m2, other=0.0).to(tl.float32))
        tl.store(skv_ptr + sb * SKV_S[0] + ring * SKV_S[1] + c, x.to(skv_ptr.dtype.element_ty), mask=m2)
        tl.store(sg_ptr + sb * SG_S[0] + ring * SG_S[1] + c, g.to(sg_ptr.dtype.element_ty), mask=m2)


def specialise(op_name, operands, results, attrs):
    if op_name == "compress_pair":
        return _pair(operands, results, attrs)
    assert op_name == "compress_paged", op_name
    kv, gate, skv, sg, bt = (operands[n] for n in ("kv", "gate", "state_kv", "state_gate", "block_table"))
    planes = [operands.get(f"p{i}") for i in range(3)]
    B, T, CW = kv.shape
    m, overlap = attrs["ratio"], bool(attrs["overlap"])
    c_ = 2 if overlap else 1
    DK = CW // c_
    S = skv.shape[1]
    for a in (kv, gate, skv, sg, operands["ape"], bt):
        assert a.strides[-1] == 1, "compress_paged: rows must be dense"
    assert operands["ape"].strides[0] == CW
    rnd = attrs.get("round", "none")
    rope_dim = attrs["rope_dim"]
    assert rnd != "fp4" or DK == pow2(DK), "the Hadamard rotation needs a power-of-two row"
    CM = c_ * m
    c = dict(T=T, TP=pow2(T), M=m, OVERLAP=overlap, CM=CM, S=S, BS=min(pow2(CM), max(1, 4096 // pow2(DK)), 32),
             DK=DK, DKP=pow2(DK), CW=CW, CWP=pow2(CW), BT=min(pow2(T), max(1, 4096 // pow2(CW))),
             EPS=float(attrs["eps"]), ROPE_DIM=rope_dim, F=rope_table(rope_dim, attrs["theta"], attrs["yarn"]),
             ROUND=rnd, RBLK=math.gcd(64, DK - rope_dim), HS=hadamard_scale(pow2(DK)),
             PER_BLOCK=attrs["block_tokens"] // m, ENV=attrs["envelope_rows"],
             BT_S=bt.strides[0], KV_S=kv.strides[:2], G_S=gate.strides[:2], SKV_S=skv.strides[:2],
             SG_S=sg.strides[:2], **plane_consts(attrs["fmt"], planes, DK), DT=TL_DTYPE[kv.dtype])
    names = [("kv_ptr", "kv"), ("gate_ptr", "gate"), ("ape_ptr", "ape"), ("norm_ptr", "norm"),
             ("skv_ptr", "state_kv"), ("sg_ptr", "state_gate"), ("pos_ptr", "pos"), ("slot_ptr", "slot"),
             ("bt_ptr", "block_table")]
    # Tied results (state rings, planes) are updated in place through the operand pointers.
    pointers = [ptr(p, "operand", n, operands[n]) for p, n in names]
    for i, p in enumerate(planes):
        if p is None:
            c[f"p{i}"] = None
        else:
            pointers.append(ptr(f"p{i}", "operand", f"p{i}", p))
    return [KernelCall(name=call_name("compress_paged", c, f"b{B}_t{T}_m{m}_{'csa' if overlap else 'hca'}_{attrs['fmt']}"),
                       fn=compress_kernel, constexprs=c, pointers=pointers, grid=(B, 1, 1), num_warps=4,
                       per_target=WIDE_ROW_SHAPE if c["DKP"] >= WIDE_ROW else {},
                       unaligned=unaligned({"kv_ptr": kv, "gate_ptr": gate,
                                            **{f"p{i}": any_row(p) for i, p in enumerate(planes)}}),
                       offsets=row_offsets({f"p{i}": p for i, p in enumerate(planes)}, attrs["layer_offset"]),
                       bytes_moved=2 * (kv.type.nbytes + gate.type.nbytes) + B * 2 * CM * CW * 4)]


def _pair(operands, results, attrs):
    """`compress_pair`: each half specialised as the `compress_paged` it replaces, then the two grids laid end to
    end in one launch of `compress_pair_kernel` (every constexpr and pointer of half i suffixed `_i`)."""
    names = ("kv", "gate", "ape", "norm", "state_kv", "state_gate", "pos", "slot", "block_table", "p0", "p1", "p2")
    halves = []
    for i in (0, 1):
        ops = {n: operands.get(n if n in ("pos", "slot", "block_table") else f"{n}_{i}") for n in names}
        half_attrs = {k[:-2]: v for k, v in attrs.items() if k.endswith(f"_{i}")}
        halves.append(specialise("compress_paged", ops, {}, half_attrs)[0])
    a, b = halves
    if a.grid != b.grid or a.num_warps != b.num_warps:
        raise ValueError(f"compress pair: the halves must have one grid and warp count, got {a.grid} / {b.grid}")
    c = {"B": a.grid[0]}
    pointers, offsets = [], {}
    for i, h in enumerate(halves):
        c.update({f"{k}_{i}": h.constexprs[k] for k in HALF})
        c.update({f"{k}_{i}": None for k in HALF_POINTERS if h.constexprs.get(k, 0) is None})
        for param, kind, name, ty in h.pointers:
            if param in HALF_POINTERS:
                pointers.append((f"{param}_{i}", kind, f"{name}_{i}", ty))
            elif i == 0:
                pointers.append((param, kind, name, ty))
        offsets.update({f"{p}_{i}": off for p, off in h.offsets.items()})
    tag = "_".join(h.name.split("_", 2)[2].rsplit("_", 1)[0] for h in halves)
    return [KernelCall(name=call_name("compress_pair", c, tag), fn=compress_pair_kernel, constexprs=c,
                       pointers=pointers, grid=(2 * a.grid[0], 1, 1), num_warps=a.num_warps,
                       # both halves in the larger half's warps on each target
                       per_target={t: {"num_warps": max(a.for_target(t)[0], b.for_target(t)[0])}
                                   for t in sorted({*a.per_target, *b.per_target})},
                       unaligned=tuple(f"{p}_{i}" for i, h in enumerate(halves) for p in h.unaligned),
                       offsets=offsets, bytes_moved=a.bytes_moved + b.bytes_moved)]
