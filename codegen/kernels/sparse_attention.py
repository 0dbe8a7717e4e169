"""sparse_attention: sparse MQA over CSR rows of the paged pool plus the chunk's own kv rows, the
attention sink in the denominator only (`ops.paged.sparse_attention`).

One program per (query lane, block of BH heads: `blocking`, 32 at V4's d = 512, so the lane's rows are read
once per 32 heads). Keys = values = the d-wide latent: pool rows of the
window CSR and of the compressed CSR, read in the plane format (native, or
fp8: e4m3 NoPE groups x UE8M0 + RoPE plane, dequantised in the RoPE dtype as the reference does), then
the chunk's rows at positions in (t - window, t]. Every loop is bounded by the lane's real row count.
The planes come twice, as window pointers `p*` (moved on by `win_base` rows at launch) and compressed
pointers `c*` (moved on by `comp_base` rows): the layer's place in the pool is not a constexpr, so every
layer of a kind shares one binary.

Online softmax with the sink trick: the running max starts at the sink logit and the running sum at 1,
so the sink lands in the denominator only and a lane with no rows (padding) yields exactly 0.
bf16: scores are rounded to bf16 before and after the scale, as the reference's bf16 einsum and scalar
multiply do, so the softmax sees the same logits; probabilities feed the PV dot as bf16.

Decode (T == 1) runs split-KV instead: one program per (lane, block of heads, split) walks a static
slice of RS entries of the lane's row list (window rows then compressed rows, counts read in the kernel;
the own kv row goes to split 0) and writes an fp32 partial (m, l, acc) to the scratch `sa_partial`; its
running max starts at the sink logit only as a finite reference point, l at 0, so a split past the end
writes the neutral partial (sink, 0, 0). The last split of a (lane, head block) to arrive (an arrival
counter, a `semaphore` pointer) merges its partials with the LSE rule and adds the sink to the
denominator once, in the same launch. `split_plan` picks the splits. The cost is honest about the trade: a
partial is an [H, d] fp32 tile (V4-Pro: 256 KiB, written and read back), so splits buy parallelism with
bytes; larger head blocks buy back the re-reads of the rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, any_row, call_name, ptr, row_offsets, unaligned
from .arrival import last_to_arrive
from .kvrows import TL_DTYPE, load_rows, plane_consts, pow2
from .pdl import pdl_enter


@triton.jit
def _step(q, k, ok, m, l, acc, SCALE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if DT == tl.bfloat16:
        s = (s.to(tl.bfloat16).to(tl.float32) * SCALE).to(tl.bfloat16).to(tl.float32)
    else:
        s = s * SCALE
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), k, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _csr_rows(q, m, l, acc, indptr_ptr, indices_ptr, lane, p0, p1, p2,
              FMT: tl.constexpr, NPLANES: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, D: tl.constexpr,
              NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
              SCALE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    lo = tl.load(indptr_ptr + lane)
    hi = tl.load(indptr_ptr + lane + 1)
    return _row_range(q, m, l, acc, indices_ptr, lo, hi, p0, p1, p2, FMT, NPLANES, BN, DP, D, NOPE, BLK, S0, S1, S2,
                      SCALE, DT, PREC)


@triton.jit
def _row_range(q, m, l, acc, indices_ptr, lo, hi, p0, p1, p2,
               FMT: tl.constexpr, NPLANES: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, D: tl.constexpr,
               NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
               SCALE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The rows indices[lo:hi] of one CSR."""
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        ok = j < hi
        rows = tl.load(indices_ptr + j, mask=ok, other=0)
        k = load_rows(p0, p1, p2, rows, ok, FMT, NPLANES, BN, DP, D, NOPE, BLK, S0, S1, S2).to(DT)
        m, l, acc = _step(q, k, ok, m, l, acc, SCALE, DT, PREC)
    return m, l, acc


@triton.jit
def _chunk_rows(q, m, l, acc, kv_ptr, pos_ptr, b, tq, t, first, T: tl.constexpr, BN: tl.constexpr,
                DP: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr, KV_SB: tl.constexpr, KV_ST: tl.constexpr,
                SCALE: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The chunk's own rows: lanes s with pos in (t - window, t] are among the lanes [first, tq]."""
    col = tl.arange(0, DP)
    for s0 in range(first, tq + 1, BN):
        s = s0 + tl.arange(0, BN)
        ps = tl.load(pos_ptr + b * T + s, mask=s <= tq, other=-1)
        ok = (s <= tq) & (ps >= 0) & (ps <= t) & (ps > t - WINDOW)
        k = tl.load(kv_ptr + b * KV_SB + s[:, None] * KV_ST + col[None, :], mask=ok[:, None] & (col[None, :] < D),
                    other=0.0)
        m, l, acc = _step(q, k, ok, m, l, acc, SCALE, DT, PREC)
    return m, l, acc


@triton.jit
def sparse_attention_kernel(q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr, comp_indices,
                            p0, p1, p2, c0, c1, c2, out_ptr,
                            T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            BH: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr,
                            Q_SB: tl.constexpr, Q_ST: tl.constexpr, Q_SH: tl.constexpr,
                            KV_SB: tl.constexpr, KV_ST: tl.constexpr,
                            O_SB: tl.constexpr, O_ST: tl.constexpr, O_SH: tl.constexpr,
                            FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                            S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                            DT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    attend_program(tl.program_id(0), tl.program_id(1), q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices,
                   comp_indptr, comp_indices, p0, p1, p2, c0, c1, c2, out_ptr, T, H, D, DP, BH, BN, WINDOW, SCALE,
                   Q_SB, Q_ST, Q_SH, KV_SB, KV_ST, O_SB, O_ST, O_SH, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT, PREC)


@triton.jit
def attend_program(lane, hblk, q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr, comp_indices,
                   p0, p1, p2, c0, c1, c2, out_ptr,
                   T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                   BH: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr,
                   Q_SB: tl.constexpr, Q_ST: tl.constexpr, Q_SH: tl.constexpr,
                   KV_SB: tl.constexpr, KV_ST: tl.constexpr,
                   O_SB: tl.constexpr, O_ST: tl.constexpr, O_SH: tl.constexpr,
                   FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                   S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                   DT: tl.constexpr, PREC: tl.constexpr):
    """Query lane `lane`, heads [hblk * BH, +BH): the one-pass attention (the body of
    `sparse_attention_kernel`, and a phase of the out_proj family's one-launch attention tail)."""
    b = lane // T
    tq = lane % T
    h = hblk * BH + tl.arange(0, BH)
    col = tl.arange(0, DP)
    hm = h < H
    q = tl.load(q_ptr + b * Q_SB + tq * Q_ST + h[:, None] * Q_SH + col[None, :],
                mask=hm[:, None] & (col[None, :] < D), other=0.0)
    m = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
    l = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    m, l, acc = _csr_rows(q, m, l, acc, win_indptr, win_indices, lane, p0, p1, p2, FMT, NPLANES, BN, DP,
                          D, NOPE, BLK, S0, S1, S2, SCALE, DT, PREC)
    if comp_indptr is not None:
        m, l, acc = _csr_rows(q, m, l, acc, comp_indptr, comp_indices, lane, c0, c1, c2, FMT, NPLANES,
                              BN, DP, D, NOPE, BLK, S0, S1, S2, SCALE, DT, PREC)
    t = tl.load(pos_ptr + lane)
    first = tl.where(t >= 0, tl.maximum(tq - WINDOW + 1, 0), tq + 1)
    m, l, acc = _chunk_rows(q, m, l, acc, kv_ptr, pos_ptr, b, tq, t, first, T, BN, DP, D, WINDOW, KV_SB, KV_ST,
                            SCALE, DT, PREC)
    out = acc / l[:, None]
    tl.store(out_ptr + b * O_SB + tq * O_ST + h[:, None] * O_SH + col[None, :], out.to(DT),
             mask=hm[:, None] & (col[None, :] < D))


@triton.jit
def sparse_attention_split_kernel(q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr,
                                  comp_indices, p0, p1, p2, c0, c1, c2, part_ptr, sem_ptr, out_ptr,
                                  H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                                  BN: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr,
                                  Q_SB: tl.constexpr, Q_SH: tl.constexpr, KV_SB: tl.constexpr,
                                  O_SB: tl.constexpr, O_SH: tl.constexpr,
                                  NS: tl.constexpr, RS: tl.constexpr, ACC0: tl.constexpr,
                                  FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                                  S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                                  DT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    split_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr,
                  win_indices, comp_indptr, comp_indices, p0, p1, p2, c0, c1, c2, part_ptr, sem_ptr, out_ptr, H, D, DP,
                  BH, BN, WINDOW, SCALE, Q_SB, Q_SH, KV_SB, O_SB, O_SH, NS, RS, ACC0, FMT, NPLANES, NOPE, BLK, S0, S1,
                  S2, DT, PREC)


@triton.jit
def split_program(lane, hblk, sp, q_ptr, kv_ptr, pos_ptr, sink_ptr, win_indptr, win_indices, comp_indptr,
                  comp_indices, p0, p1, p2, c0, c1, c2, part_ptr, sem_ptr, out_ptr,
                  H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                  BN: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr,
                  Q_SB: tl.constexpr, Q_SH: tl.constexpr, KV_SB: tl.constexpr,
                  O_SB: tl.constexpr, O_SH: tl.constexpr,
                  NS: tl.constexpr, RS: tl.constexpr, ACC0: tl.constexpr,
                  FMT: tl.constexpr, NPLANES: tl.constexpr, NOPE: tl.constexpr, BLK: tl.constexpr,
                  S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                  DT: tl.constexpr, PREC: tl.constexpr):
    """Decode (T == 1): split `sp` of lane `lane` takes the slice [sp*RS, sp*RS + RS) of the lane's
    row list (window CSR rows, then compressed CSR rows; the last split also takes anything past NS*RS) and
    writes its partial (m, l, acc) without the sink. Split 0 also takes the lane's own kv row. A split past
    the end runs no loop and writes the neutral partial (m = sink, l = 0, acc = 0). The last of the NS
    splits of a (lane, head block) to arrive merges their partials (`_merge`) and writes out. (The body of
    `sparse_attention_split_kernel`, and a phase of the out_proj family's one-launch attention tail.)"""
    h = hblk * BH + tl.arange(0, BH)
    col = tl.arange(0, DP)
    hm = h < H
    q = tl.load(q_ptr + lane * Q_SB + h[:, None] * Q_SH + col[None, :], mask=hm[:, None] & (col[None, :] < D),
                other=0.0)
    # The running max starts at the sink logit as a finite reference point (no -inf - -inf); the sink itself
    # joins the denominator once, in the merge.
    m = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    w_lo = tl.load(win_indptr + lane)
    nw = tl.load(win_indptr + lane + 1) - w_lo
    if comp_indptr is not None:
        c_lo = tl.load(comp_indptr + lane)
        nc = tl.load(comp_indptr + lane + 1) - c_lo
    else:
        nc = 0
    a = sp * RS
    e = tl.where(sp == NS - 1, nw + nc, tl.minimum(a + RS, nw + nc))
    m, l, acc = _row_range(q, m, l, acc, win_indices, w_lo + tl.minimum(a, nw), w_lo + tl.minimum(e, nw), p0, p1, p2,
                           FMT, NPLANES, BN, DP, D, NOPE, BLK, S0, S1, S2, SCALE, DT, PREC)
    if comp_indptr is not None:
        m, l, acc = _row_range(q, m, l, acc, comp_indices, c_lo + tl.minimum(tl.maximum(a - nw, 0), nc),
                               c_lo + tl.minimum(tl.maximum(e - nw, 0), nc), c0, c1, c2,
                               FMT, NPLANES, BN, DP, D, NOPE, BLK, S0, S1, S2, SCALE, DT, PREC)
    t = tl.load(pos_ptr + lane)
    first = tl.where((t >= 0) & (sp == 0), 0, 1)
    m, l, acc = _chunk_rows(q, m, l, acc, kv_ptr, pos_ptr, lane, 0, t, first, 1, BN, DP, D, WINDOW, KV_SB, 0,
                            SCALE, DT, PREC)
    part = lane * NS + sp
    tl.store(part_ptr + (part * 2) * H + h, m, mask=hm)
    tl.store(part_ptr + (part * 2 + 1) * H + h, l, mask=hm)
    tl.store(part_ptr + ACC0 + (part * H + h[:, None]).to(tl.int64) * D + col[None, :], acc,
             mask=hm[:, None] & (col[None, :] < D))
    group = lane * ((H + BH - 1) // BH) + hblk  # (not tl.num_programs: hidden kernargs on AMD)
    if last_to_arrive(sem_ptr + group, NS):  # codegen/kernels/arrival.py
        _merge(sink_ptr, part_ptr, out_ptr, lane, h, col, hm, H, D, BH, DP, NS, ACC0, O_SB, O_SH, DT)
        tl.store(sem_ptr + group, 0)


@triton.jit
def _merge(sink_ptr, part_ptr, out_ptr, lane, h, col, hm, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
           DP: tl.constexpr, NS: tl.constexpr, ACC0: tl.constexpr, O_SB: tl.constexpr, O_SH: tl.constexpr,
           DT: tl.constexpr):
    """The LSE merge of a lane's NS partials for heads h: M = max(sink, m_s),
    out = sum_s acc_s e^(m_s - M) / (e^(sink - M) + sum_s l_s e^(m_s - M)), the sink counted once."""
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
    mx = sink
    for sp in range(NS):
        mx = tl.maximum(mx, tl.load(part_ptr + ((lane * NS + sp) * 2) * H + h, mask=hm, other=0.0))
    den = tl.exp(sink - mx)
    acc = tl.zeros([BH, DP], tl.float32)
    for sp in range(NS):
        part = lane * NS + sp
        w = tl.exp(tl.load(part_ptr + (part * 2) * H + h, mask=hm, other=0.0) - mx)
        den += tl.load(part_ptr + (part * 2 + 1) * H + h, mask=hm, other=0.0) * w
        a = tl.load(part_ptr + ACC0 + (part * H + h[:, None]).to(tl.int64) * D + col[None, :],
                    mask=hm[:, None] & (col[None, :] < D), other=0.0)
        acc += a * w[:, None]
    out = acc / den[:, None]
    tl.store(out_ptr + lane * O_SB + h[:, None] * O_SH + col[None, :], out.to(DT),
             mask=hm[:, None] & (col[None, :] < D))


# Decode split-KV plan. The programs aim at 2 x the larger CU count of the targets (gfx950: 256 CUs;
# sm_90a: 132 SMs) without giving a split fewer than MIN_SPLIT_ROWS rows: every split costs an [H, d]
# fp32 partial round trip (512 KiB at V4-Pro), as much as ~900 fp8 pool rows. One split: one pass.
TARGET_PROGRAMS = 512
MIN_SPLIT_ROWS = 256  # (128 doubles the programs but adds ~0.5 GB of partial traffic per V4-Pro step)
# Heads per program above a head dim of WIDE_D (V4: d = 512), prefill and decode alike: every head block reads
# the lane's rows once more, so the blocks are as wide as registers allow. 32 heads x 8 warps: 0 spills on both
# targets (64 heads: 676 B of spills on sm_90a; 16 warps spill on both). V4-Pro's 128 heads read each row 4x
# (16-head blocks read it 8x).
WIDE_D = 256
WIDE_BH = 32
WIDE_WARPS = 8


def blocking(D: int) -> tuple[int, int]:
    """(heads per program, warps) at head dim D: wide blocks above WIDE_D; else 16 heads (tl.dot needs
    M >= 16; fewer heads are masked lanes) and 4 warps."""
    return (WIDE_BH, WIDE_WARPS) if D > WIDE_D else (16, 4)


def split_plan(max_rows: int, lanes: int, head_blocks: int, bn: int) -> tuple[int, int]:
    """(splits, rows per split) for a lane row list of static capacity `max_rows`."""
    ns = max(1, min(triton.cdiv(TARGET_PROGRAMS, lanes * head_blocks), max_rows // MIN_SPLIT_ROWS))
    rs = triton.cdiv(max(max_rows, 1), ns)
    if rs > bn:
        rs = triton.cdiv(rs, bn) * bn
    return triton.cdiv(max(max_rows, 1), rs), rs


def specialise(op_name, operands, results, attrs):
    assert op_name == "sparse_attention", op_name
    q, kv, out = operands["q"], operands["kv"], results["out"]
    planes = [operands.get(f"p{i}") for i in range(3)]
    B, T, H, D = q.shape
    assert q.strides[3] == 1 and kv.strides[2] == 1 and out.strides[3] == 1, "sparse_attention: rows must be dense"
    BH, warps = blocking(D)
    BN = 16 if D > 256 else 32
    has_comp = operands.get("comp_indptr") is not None
    c = dict(T=T, H=H, D=D, DP=pow2(D), BH=BH, BN=BN, WINDOW=attrs["window"], SCALE=float(attrs["scale"]),
             Q_SB=q.strides[0], Q_ST=q.strides[1], Q_SH=q.strides[2], KV_SB=kv.strides[0], KV_ST=kv.strides[1],
             O_SB=out.strides[0], O_ST=out.strides[1], O_SH=out.strides[2],
             **plane_consts(attrs["fmt"], planes, D), DT=TL_DTYPE[q.dtype],
             PREC="ieee")  # fp32 tests need exact products; bf16 operands ignore it (gfx950 has no tf32)
    names = ["q", "kv", "pos", "sink", "win_indptr", "win_indices"] + (["comp_indptr", "comp_indices"] if has_comp else [])
    params = {"q": "q_ptr", "kv": "kv_ptr", "pos": "pos_ptr", "sink": "sink_ptr"}
    pointers = [ptr(params.get(n, n), "operand", n, operands[n]) for n in names]
    if not has_comp:
        c.update(comp_indptr=None, comp_indices=None)
    for pre in ("p", "c"):
        for i, p in enumerate(planes):
            if p is None or (pre == "c" and not has_comp):
                c[f"{pre}{i}"] = None
            else:
                pointers.append(ptr(f"{pre}{i}", "operand", f"p{i}", p))
    pointers.append(ptr("out_ptr", "result", "out", out))
    offsets = row_offsets({f"p{i}": p for i, p in enumerate(planes)}, attrs["win_base"])
    if has_comp:
        offsets.update(row_offsets({f"c{i}": p for i, p in enumerate(planes)}, attrs["comp_base"]))
    row_bytes = sum(p.type.nbytes // p.shape[0] for p in planes if p is not None)
    L = B * T
    w_cap = operands["win_indices"].shape[0] // max(L, 1)
    c_cap = operands["comp_indices"].shape[0] // max(L, 1) if has_comp else 0
    n_rows = L * (w_cap + c_cap)  # static capacity of the CSR rows (what the cost model counts)
    flops = 4 * L * H * D * (n_rows // max(L, 1) + T)
    aligned = unaligned({"q_ptr": q, "kv_ptr": kv, "out_ptr": out,
                         **{f"{pre}{i}": any_row(p) for i, p in enumerate(planes) for pre in ("p", "c")}})
    if T == 1:
        return _decode_calls(c, pointers, offsets, aligned, flops, n_rows, row_bytes, q, kv, out, w_cap + c_cap,
                             attrs)
    return [KernelCall(name=call_name("sparse_attention", c, f"b{B}_t{T}_h{H}_d{D}_{attrs['fmt']}"),
                       fn=sparse_attention_kernel, constexprs=c, pointers=pointers,
                       grid=(B * T, triton.cdiv(H, BH), 1), num_warps=warps,
                       unaligned=aligned, offsets=offsets,
                       # every block of BH heads reads the lane's rows again: re-reads, cache hits when the launch
                       # fits the target's cache (codegen/roofline.py)
                       flops=flops,
                       bytes_moved=n_rows * row_bytes * triton.cdiv(H, BH) + 2 * q.type.nbytes,
                       reread_bytes=n_rows * row_bytes * (triton.cdiv(H, BH) - 1))]


def _decode_calls(c, pointers, offsets, aligned, flops, n_rows, row_bytes, q, kv, out, max_rows, attrs):
    """T == 1: split-KV over (lane, head block, split), the LSE merge by each group's last split."""
    B, _T, H, D = q.shape
    BH, warps = blocking(D)
    HB = triton.cdiv(H, BH)
    NS, RS = split_plan(max_rows, B, HB, c["BN"])
    if NS == 1:  # nothing to split: the one-pass kernel, no partials and no second launch
        c = dict(c, BH=BH)
        return [KernelCall(name=call_name("sparse_attention", c, f"b{B}_t1_h{H}_d{D}_{attrs['fmt']}"),
                           fn=sparse_attention_kernel, constexprs=c, pointers=pointers, grid=(B, HB, 1),
                           num_warps=warps, unaligned=aligned, offsets=offsets, flops=flops,
                           bytes_moved=n_rows * row_bytes * HB + 2 * q.type.nbytes,
                           reread_bytes=n_rows * row_bytes * (HB - 1))]
    ACC0 = B * NS * 2 * H
    part_bytes = (ACC0 + B * NS * H * D) * 4
    sc = {k: v for k, v in c.items() if k not in ("T", "Q_ST", "KV_ST", "O_ST")}
    sc.update(BH=BH, NS=NS, RS=RS, ACC0=ACC0)
    part = ptr("part_ptr", "scratch", "sa_partial", "*fp32")
    sem = ptr("sem_ptr", "semaphore", "sa_arrivals", "*i32")  # one counter per (lane, head block)
    return [KernelCall(name=call_name("sparse_attention_split", sc, f"b{B}_h{H}_d{D}_s{NS}_{attrs['fmt']}"),
                       fn=sparse_attention_split_kernel, constexprs=sc, pointers=pointers + [part, sem],
                       grid=(B, HB, NS), num_warps=warps,
                       scratch_bytes={"sa_partial": part_bytes, "sa_arrivals": B * HB * 4},
                       unaligned=aligned, offsets=offsets, flops=flops + 3 * B * NS * H * D,
                       # each head block reads the lane's rows; every program reads its q block; the partials
                       # are written once and read once by the merging programs. Re-reads: the rows past the
                       # first head block, q past the first split, the partials' read-back.
                       bytes_moved=n_rows * row_bytes * HB + NS * q.type.nbytes + kv.type.nbytes + 2 * part_bytes
                       + out.type.nbytes + 4 * H,
                       reread_bytes=n_rows * row_bytes * (HB - 1) + (NS - 1) * q.type.nbytes + part_bytes)]
