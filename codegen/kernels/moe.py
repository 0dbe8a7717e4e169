"""moe family: `moe_experts_shared` (routed experts + the shared expert, one op) and `moe_experts`.

Numerics follow the op reference exactly, rounding to x's dtype wherever it does: each expert GEMM's
output, silu and the SwiGLU product, the routed output times its routing weight, then the per-token sum
over the selected experts in ascending expert id (the reference's `index_add_` order), then `+ shared`.

Four launches, scratch buffers between them (all in x's dtype; P = tokens x k (token, slot) pairs):
  1. routed gate/up + SwiGLU, expert-major: program (expert e, I tile) scans the pairs in chunks of BM,
     and for a chunk with any pair routed to e runs the W1 / W3 tiles against those pairs' rows
     (others masked to zero) -> h[P, I]. A weight tile is read once per chunk that uses it, so a decode
     step reads each active expert about once and an idle expert costs one scan of the indices.
  2. shared gate/up + SwiGLU (same kernel, every token "routed" to the one shared expert) -> hs[M, Is].
  3. routed down, expert-major -> yr[P, D] = round(round(W2_e h) * weight).
  4. shared down + combine: y = round(sum over slots by ascending expert id (rounded each add) + W2_s hs).
The GEMM tiles are `gemm.mma_step` (swap-AB; FP4 experts via `tl.dot_scaled`, FP8 128x128 / float
shared expert; `act="fp8"` quantises each GEMM's input per 128 K values as `linear` does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .gemm import W_FMT, _tl_dtype, mma_step, tiles


@triton.jit
def _swiglu(g, u, LIMIT: tl.constexpr, DT: tl.constexpr):
    g = tl.minimum(g.to(DT).to(tl.float32), LIMIT)
    u = tl.minimum(tl.maximum(u.to(DT).to(tl.float32), -LIMIT), LIMIT)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (s * u).to(DT)


@triton.jit
def moe_up_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                  P: tl.constexpr, KSEL: tl.constexpr, ROUTED: tl.constexpr, I: tl.constexpr, D: tl.constexpr,
                  X_RS: tl.constexpr, IDX_RS: tl.constexpr, H_RS: tl.constexpr,
                  W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
                  W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                  CDT: tl.constexpr, LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    rk = tl.arange(0, BK)
    w1 = w1_ptr + e.to(tl.int64) * W_ES
    w3 = w3_ptr + e.to(tl.int64) * W_ES
    s1 = s1_ptr + e.to(tl.int64) * S_ES if s1_ptr is not None else s1_ptr
    s3 = s3_ptr + e.to(tl.int64) * S_ES if s3_ptr is not None else s3_ptr
    dt = h_ptr.dtype.element_ty
    for c0 in range(0, P, BM):
        pr = c0 + tl.arange(0, BM)
        tok = pr // KSEL
        if ROUTED:
            ex = tl.load(idx_ptr + tok * IDX_RS + pr % KSEL, mask=pr < P, other=-1)
            sel = (pr < P) & (ex == e)
        else:
            sel = pr < P
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            g = tl.zeros([BN, BM], dtype=tl.float32)
            u = tl.zeros([BN, BM], dtype=tl.float32)
            for k0 in range(0, D, BK):
                kk = k0 + rk
                k_ok = kk < D
                xt = tl.load(x_ptr + tok[None, :].to(tl.int64) * X_RS + kk[:, None],
                             mask=sel[None, :] & k_ok[:, None], other=0.0)
                g = mma_step(g, xt, None, w1, s1, offs_n, n_ok, kk, k_ok, k0, D, W_RS, 1, S_RS, 1, W_FMT, S_E8M0, BLOCK,
                             ACT, CDT, BK)
                u = mma_step(u, xt, None, w3, s3, offs_n, n_ok, kk, k_ok, k0, D, W_RS, 1, S_RS, 1, W_FMT, S_E8M0, BLOCK,
                             ACT, CDT, BK)
            h = _swiglu(g, u, LIMIT, dt)
            tl.store(h_ptr + pr[None, :].to(tl.int64) * H_RS + offs_n[:, None], h, mask=sel[None, :] & n_ok[:, None])


@triton.jit
def moe_down_kernel(h_ptr, idx_ptr, wt_ptr, w2_ptr, s2_ptr, y_ptr,
                    P: tl.constexpr, KSEL: tl.constexpr, I: tl.constexpr, D: tl.constexpr,
                    H_RS: tl.constexpr, IDX_RS: tl.constexpr, WT_RS: tl.constexpr, Y_RS: tl.constexpr,
                    W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
                    W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                    CDT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < D
    rk = tl.arange(0, BK)
    w2 = w2_ptr + e.to(tl.int64) * W_ES
    s2 = s2_ptr + e.to(tl.int64) * S_ES if s2_ptr is not None else s2_ptr
    dt = y_ptr.dtype.element_ty
    for c0 in range(0, P, BM):
        pr = c0 + tl.arange(0, BM)
        tok = pr // KSEL
        ex = tl.load(idx_ptr + tok * IDX_RS + pr % KSEL, mask=pr < P, other=-1)
        sel = (pr < P) & (ex == e)
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            acc = tl.zeros([BN, BM], dtype=tl.float32)
            for k0 in range(0, I, BK):
                kk = k0 + rk
                k_ok = kk < I
                ht = tl.load(h_ptr + pr[None, :].to(tl.int64) * H_RS + kk[:, None], mask=sel[None, :] & k_ok[:, None],
                             other=0.0)
                acc = mma_step(acc, ht, None, w2, s2, offs_n, n_ok, kk, k_ok, k0, I, W_RS, 1, S_RS, 1, W_FMT, S_E8M0,
                               BLOCK, ACT, CDT, BK)
            wt = tl.load(wt_ptr + tok * WT_RS + pr % KSEL, mask=sel, other=0.0).to(tl.float32)
            ye = (acc.to(dt).to(tl.float32) * wt[None, :]).to(dt)
            tl.store(y_ptr + pr[None, :].to(tl.int64) * Y_RS + offs_n[:, None], ye, mask=sel[None, :] & n_ok[:, None])


@triton.jit
def moe_combine_kernel(hs_ptr, yr_ptr, idx_ptr, w2_ptr, s2_ptr, y_ptr,
                       M: tl.constexpr, KSEL: tl.constexpr, IS: tl.constexpr, D: tl.constexpr,
                       HS_RS: tl.constexpr, YR_RS: tl.constexpr, IDX_RS: tl.constexpr, Y_RS: tl.constexpr,
                       W_RS: tl.constexpr, S_RS: tl.constexpr, W_FMT: tl.constexpr, S_E8M0: tl.constexpr,
                       BLOCK: tl.constexpr, ACT: tl.constexpr, CDT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    tok = tl.program_id(1) * BM + tl.arange(0, BM)
    n_ok = offs_n < D
    t_ok = tok < M
    dt = y_ptr.dtype.element_ty
    out = tl.zeros([BN, BM], dtype=tl.float32)
    # routed: slots in ascending expert id (ties by slot), each add rounded to dt as index_add_ does
    j = tl.arange(0, BKS)
    ex = tl.load(idx_ptr + tok[:, None] * IDX_RS + j[None, :], mask=t_ok[:, None] & (j[None, :] < KSEL),
                 other=2 ** 30).to(tl.int32)
    for r in tl.static_range(KSEL):
        m = tl.min(ex, axis=1)
        slot = tl.min(tl.where(ex == m[:, None], j[None, :], BKS), axis=1)
        ex = tl.where(j[None, :] == slot[:, None], 2 ** 30 + 1, ex)
        pr = tok * KSEL + slot
        v = tl.load(yr_ptr + pr[None, :].to(tl.int64) * YR_RS + offs_n[:, None], mask=t_ok[None, :] & n_ok[:, None],
                    other=0.0).to(tl.float32)
        out = (out + v).to(dt).to(tl.float32)
    if w2_ptr is not None:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(0, IS, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < IS
            ht = tl.load(hs_ptr + tok[None, :].to(tl.int64) * HS_RS + kk[:, None], mask=t_ok[None, :] & k_ok[:, None],
                         other=0.0)
            acc = mma_step(acc, ht, None, w2_ptr, s2_ptr, offs_n, n_ok, kk, k_ok, k0, IS, W_RS, 1, S_RS, 1, W_FMT, S_E8M0,
                           BLOCK, ACT, CDT, BK)
        out = out + acc.to(dt).to(tl.float32)
    tl.store(y_ptr + tok[None, :].to(tl.int64) * Y_RS + offs_n[:, None], out.to(dt), mask=t_ok[None, :] & n_ok[:, None])


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
    BM = 16
    BNI = 64 if I <= 64 else 128
    BND = 64 if D <= 64 else 128
    calls = []
    scratch = {"h": P * I * dsize, "yr": P * D * dsize}
    common = dict(ACT=act, CDT=_tl_dtype(cdt), BM=BM)
    common_s = dict(ACT=sact, CDT=_tl_dtype(cdt), BM=BM)

    def wce(w, s, K, blk, a=act):
        fmt, BK, e8 = _wfmt(w, s, blk, K, a, cdt)
        return {"W_FMT": fmt, "S_E8M0": e8, "BLOCK": blk, "BK": BK,
                "W_RS": w.strides[-2], "S_RS": s.strides[-2] if s is not None else 0}

    # 1. routed gate / up
    w1, w3, s1, s3 = o["w1"], o["w3"], o.get("w1_scale"), o.get("w3_scale")
    ce = dict(P=P, KSEL=k, ROUTED=True, I=I, D=D, X_RS=x_rs, IDX_RS=idx_rs, H_RS=I, W_ES=w1.strides[0],
              S_ES=s1.strides[0] if s1 is not None else 0, LIMIT=limit, BN=BNI, **common, **wce(w1, s1, D, block))
    pts = [("x_ptr", "operand", "x", x), ("idx_ptr", "operand", "indices", idx), ("w1_ptr", "operand", "w1", w1),
           ("w3_ptr", "operand", "w3", w3)]
    if s1 is not None:
        pts += [("s1_ptr", "operand", "w1_scale", s1), ("s3_ptr", "operand", "w3_scale", s3)]
    else:
        ce.update(s1_ptr=None, s3_ptr=None)
    pts.append(("h_ptr", "scratch", "h", "*" + cdt))
    calls.append(KernelCall(call_name("moe_up", ce, f"e{E}_p{P}_i{I}_d{D}_{ce['W_FMT']}_{cdt}"), moe_up_kernel, ce,
                            [ptr(*p) for p in pts], (E, triton.cdiv(I, BNI), 1), num_warps=4, scratch_bytes=scratch,
                            unaligned=unaligned({"x_ptr": x, "idx_ptr": idx, "w1_ptr": w1, "w3_ptr": w3, "s1_ptr": s1,
                                                 "s3_ptr": s3}),
                            flops=4 * P * I * D, mma_dtype="fp8" if act == "fp8" else "bf16",
                            bytes_moved=min(E, P) * (2 * w1.type.nbytes + (2 * s1.type.nbytes if s1 else 0)) // E
                            + x.type.nbytes + P * I * dsize))
    # 2. shared gate / up
    if shared:
        g1, g3, t1, t3 = o["s1"], o["s3"], o.get("s1_scale"), o.get("s3_scale")
        IS = g1.shape[0]
        scratch["hs"] = M * IS * dsize
        BNS = 64 if IS <= 64 else 128
        ce = dict(P=M, KSEL=1, ROUTED=False, I=IS, D=D, X_RS=x_rs, IDX_RS=0, H_RS=IS, W_ES=0, S_ES=0, LIMIT=limit,
                  BN=BNS, idx_ptr=None, **common_s, **wce(g1, t1, D, sblock, sact))
        pts = [("x_ptr", "operand", "x", x), ("w1_ptr", "operand", "s1", g1), ("w3_ptr", "operand", "s3", g3)]
        if t1 is not None:
            pts += [("s1_ptr", "operand", "s1_scale", t1), ("s3_ptr", "operand", "s3_scale", t3)]
        else:
            ce.update(s1_ptr=None, s3_ptr=None)
        pts.append(("h_ptr", "scratch", "hs", "*" + cdt))
        calls.append(KernelCall(call_name("moe_shared_up", ce, f"m{M}_i{IS}_d{D}_{ce['W_FMT']}_{cdt}"), moe_up_kernel,
                                ce, [ptr(*p) for p in pts], (1, triton.cdiv(IS, BNS), 1), num_warps=4,
                                scratch_bytes=scratch,
                                unaligned=unaligned({"x_ptr": x, "w1_ptr": g1, "w3_ptr": g3, "s1_ptr": t1, "s3_ptr": t3}),
                                flops=4 * M * IS * D, mma_dtype="fp8" if sact == "fp8" else "bf16",
                                bytes_moved=2 * g1.type.nbytes + (2 * t1.type.nbytes if t1 else 0) + x.type.nbytes))
    # 3. routed down
    w2, s2 = o["w2"], o.get("w2_scale")
    ce = dict(P=P, KSEL=k, I=I, D=D, H_RS=I, IDX_RS=idx_rs, WT_RS=wt_rs, Y_RS=D, W_ES=w2.strides[0],
              S_ES=s2.strides[0] if s2 is not None else 0, BN=BND, **common, **wce(w2, s2, I, block))
    pts = [("h_ptr", "scratch", "h", "*" + cdt), ("idx_ptr", "operand", "indices", idx),
           ("wt_ptr", "operand", "weights", wts), ("w2_ptr", "operand", "w2", w2)]
    if s2 is not None:
        pts.append(("s2_ptr", "operand", "w2_scale", s2))
    else:
        ce["s2_ptr"] = None
    pts.append(("y_ptr", "scratch", "yr", "*" + cdt))
    calls.append(KernelCall(call_name("moe_down", ce, f"e{E}_p{P}_i{I}_d{D}_{ce['W_FMT']}_{cdt}"), moe_down_kernel,
                            ce, [ptr(*p) for p in pts], (E, triton.cdiv(D, BND), 1), num_warps=4, scratch_bytes=scratch,
                            unaligned=unaligned({"idx_ptr": idx, "wt_ptr": wts, "w2_ptr": w2, "s2_ptr": s2}),
                            flops=2 * P * I * D, mma_dtype="fp8" if act == "fp8" else "bf16",
                            bytes_moved=min(E, P) * (w2.type.nbytes + (s2.type.nbytes if s2 else 0)) // E
                            + P * (I + D) * dsize))
    # 4. shared down + combine
    ce = dict(M=M, KSEL=k, D=D, HS_RS=0, YR_RS=D, IDX_RS=idx_rs, Y_RS=y_rs, BN=BND,
              BKS=triton.next_power_of_2(k), **common_s)
    pts = [("yr_ptr", "scratch", "yr", "*" + cdt), ("idx_ptr", "operand", "indices", idx)]
    if shared:
        g2, t2 = o["s2"], o.get("s2_scale")
        IS = g2.shape[1] * (2 if g2.dtype == "fp4x2" else 1)
        ce.update(IS=IS, HS_RS=IS, **wce(g2, t2, IS, sblock, sact))
        pts += [("hs_ptr", "scratch", "hs", "*" + cdt), ("w2_ptr", "operand", "s2", g2)]
        if t2 is not None:
            pts.append(("s2_ptr", "operand", "s2_scale", t2))
        else:
            ce["s2_ptr"] = None
        sbytes = g2.type.nbytes + (t2.type.nbytes if t2 else 0)
    else:
        ce.update(IS=0, W_FMT="float", S_E8M0=False, BLOCK=128, BK=32, W_RS=0, S_RS=0, hs_ptr=None, w2_ptr=None,
                  s2_ptr=None)
        g2 = t2 = None
        sbytes = 0
    pts.append(("y_ptr", "result", "y", y))
    calls.append(KernelCall(call_name("moe_combine", ce, f"m{M}_k{k}_d{D}_{ce['W_FMT']}_{cdt}"), moe_combine_kernel,
                            ce, [ptr(*p) for p in pts], (triton.cdiv(D, BND), triton.cdiv(M, BM), 1), num_warps=4,
                            scratch_bytes=scratch,
                            unaligned=unaligned({"idx_ptr": idx, "w2_ptr": g2, "s2_ptr": t2, "y_ptr": y}),
                            flops=2 * M * D * ce["IS"], mma_dtype="fp8" if sact == "fp8" else "bf16",
                            bytes_moved=sbytes + P * D * dsize + y.type.nbytes))
    return calls
