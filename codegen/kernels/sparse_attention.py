"""sparse_attention: sparse MQA over CSR rows of the paged pool plus the chunk's own kv rows, the
attention sink in the denominator only (`ops.paged.sparse_attention`).

One program per (query lane, block of BH heads). Keys = values = the d-wide latent: pool rows of the
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
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, any_row, call_name, ptr, row_offsets, unaligned
from .kvrows import TL_DTYPE, load_rows, plane_consts, pow2


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
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        ok = j < hi
        rows = tl.load(indices_ptr + j, mask=ok, other=0)
        k = load_rows(p0, p1, p2, rows, ok, FMT, NPLANES, BN, DP, D, NOPE, BLK, S0, S1, S2).to(DT)
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
                            DT: tl.constexpr, PREC: tl.constexpr):
    lane = tl.program_id(0)
    b = lane // T
    tq = lane % T
    h = tl.program_id(1) * BH + tl.arange(0, BH)
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
    # The chunk's own rows: lanes s with pos in (t - window, t] are the lanes (tq - window, tq].
    t = tl.load(pos_ptr + lane)
    first = tl.where(t >= 0, tl.maximum(tq - WINDOW + 1, 0), tq + 1)
    for s0 in range(first, tq + 1, BN):
        s = s0 + tl.arange(0, BN)
        ps = tl.load(pos_ptr + b * T + s, mask=s <= tq, other=-1)
        ok = (s <= tq) & (ps >= 0) & (ps <= t) & (ps > t - WINDOW)
        k = tl.load(kv_ptr + b * KV_SB + s[:, None] * KV_ST + col[None, :], mask=ok[:, None] & (col[None, :] < D),
                    other=0.0)
        m, l, acc = _step(q, k, ok, m, l, acc, SCALE, DT, PREC)
    out = acc / l[:, None]
    tl.store(out_ptr + b * O_SB + tq * O_ST + h[:, None] * O_SH + col[None, :], out.to(DT),
             mask=hm[:, None] & (col[None, :] < D))


def specialise(op_name, operands, results, attrs):
    assert op_name == "sparse_attention", op_name
    q, kv, out = operands["q"], operands["kv"], results["out"]
    planes = [operands.get(f"p{i}") for i in range(3)]
    B, T, H, D = q.shape
    assert q.strides[3] == 1 and kv.strides[2] == 1 and out.strides[3] == 1, "sparse_attention: rows must be dense"
    BH = 16 if H >= 16 else 16  # tl.dot needs M >= 16; fewer heads are masked lanes
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
    n_rows = B * T * (attrs["window"] - 1 + (operands["comp_indices"].shape[0] // (B * T) if has_comp else 0))
    return [KernelCall(name=call_name("sparse_attention", c, f"b{B}_t{T}_h{H}_d{D}_{attrs['fmt']}"),
                       fn=sparse_attention_kernel, constexprs=c, pointers=pointers,
                       grid=(B * T, triton.cdiv(H, BH), 1), num_warps=8 if D > 256 else 4,
                       unaligned=unaligned({"q_ptr": q, "kv_ptr": kv, "out_ptr": out,
                                            **{f"{pre}{i}": any_row(p) for i, p in enumerate(planes)
                                               for pre in ("p", "c")}}),
                       offsets=offsets,
                       # every block of BH heads reads the lane's rows again (L2 may catch it; HBM does not promise)
                       flops=4 * B * T * H * D * n_rows,
                       bytes_moved=n_rows * row_bytes * triton.cdiv(H, BH) + 2 * q.type.nbytes)]
