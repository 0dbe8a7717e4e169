"""qkv_norm_rope: the attention's query / key prologue in one launch (`ops.fused.qkv_norm_rope`).

Per query lane: q per-head unweighted RMSNorm (rsqrt rounded to the activation dtype, as HF) + RoPE
(YaRN frequencies from the reference's table); kv weighted RMSNorm + RoPE (+ official FP8 rounding of
its first `kv_round_dims` channels); the indexer query's RoPE (+ Walsh-Hadamard rotation and FP4
rounding); and in decode the new kv row's write into the layer's window ring (pool planes updated in
place, any plane format). Grid: (lane, block of BH heads); the first head block also does kv, qi and
the write. The body is `qkv_norm_rope_program` (one lane and head block), also the first programs of a decode
step's `rope_compress` launch (the prologue with its layer's compressor).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, any_row, call_name, ptr, row_offsets, unaligned
from .kvrows import (TL_DTYPE, fp4_qdq, fp8_qdq, fwht, hadamard_scale, plane_consts, pow2, ring_keep, rope,
                     rope_table, store_rows)
from .pdl import pdl_enter


@triton.jit
def qkv_norm_rope_kernel(q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0, p1, p2, qo_ptr, kvo_ptr, qio_ptr,
                         T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                         HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr,
                         EPS: tl.constexpr, Q_MEAN_DT: tl.constexpr, ROPE_DIM: tl.constexpr, F: tl.constexpr,
                         KV_ROUND_DIMS: tl.constexpr, KV_ROUND_BLOCK: tl.constexpr, QI_FP4: tl.constexpr,
                         HS: tl.constexpr, Q_S: tl.constexpr, KV_S: tl.constexpr, QI_S: tl.constexpr,
                         QO_S: tl.constexpr, KVO_S: tl.constexpr, QIO_S: tl.constexpr,
                         WINDOW: tl.constexpr, SLOT_ROWS: tl.constexpr, N_ROWS: tl.constexpr,
                         TP: tl.constexpr, FMT: tl.constexpr, NPLANES: tl.constexpr,
                         NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                         S2: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    qkv_norm_rope_program(tl.program_id(0), tl.program_id(1), q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0,
                          p1, p2, qo_ptr, kvo_ptr, qio_ptr, T, H, D, DP, BH, HI, HIP, DI, DIP, EPS, Q_MEAN_DT,
                          ROPE_DIM, F, KV_ROUND_DIMS, KV_ROUND_BLOCK, QI_FP4, HS, Q_S, KV_S, QI_S, QO_S, KVO_S, QIO_S,
                          WINDOW, SLOT_ROWS, N_ROWS, TP, FMT, NPLANES, NOPE, BLK, S0, S1, S2, DT)


@triton.jit
def qkv_norm_rope_program(lane, hb, q_ptr, kv_ptr, norm_ptr, pos_ptr, qi_ptr, slot_ptr, p0, p1, p2, qo_ptr, kvo_ptr,
                          qio_ptr,
                          T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr,
                          HI: tl.constexpr, HIP: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr,
                          EPS: tl.constexpr, Q_MEAN_DT: tl.constexpr, ROPE_DIM: tl.constexpr, F: tl.constexpr,
                          KV_ROUND_DIMS: tl.constexpr, KV_ROUND_BLOCK: tl.constexpr, QI_FP4: tl.constexpr,
                          HS: tl.constexpr, Q_S: tl.constexpr, KV_S: tl.constexpr, QI_S: tl.constexpr,
                          QO_S: tl.constexpr, KVO_S: tl.constexpr, QIO_S: tl.constexpr,
                          WINDOW: tl.constexpr, SLOT_ROWS: tl.constexpr, N_ROWS: tl.constexpr,
                          TP: tl.constexpr, FMT: tl.constexpr, NPLANES: tl.constexpr,
                          NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                          S2: tl.constexpr, DT: tl.constexpr):
    """Query lane `lane`, head block `hb` (the body of `qkv_norm_rope_kernel` and of the first programs of
    `rope_compress`'s kernels). Strides: *_S = (batch, token, head) element strides; rows are dense."""
    b = lane // T
    tq = lane % T
    posf = tl.load(pos_ptr + lane).to(tl.float32)
    col = tl.arange(0, DP)[None, :]
    cm = col < D

    h = hb * BH + tl.arange(0, BH)[:, None]
    m = (h < H) & cm
    x = tl.load(q_ptr + b * Q_S[0] + tq * Q_S[1] + h * Q_S[2] + col, mask=m, other=0.0).to(tl.float32)
    if Q_MEAN_DT:  # squares, their mean, + eps and the rsqrt each rounded to DT (rms_norm mean "dtype")
        ms = (tl.sum((x * x).to(DT).to(tl.float32), axis=1) / D).to(DT).to(tl.float32)
        r = (1.0 / tl.sqrt_rn((ms + EPS).to(DT).to(tl.float32))).to(DT).to(tl.float32)
    else:
        r = (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + EPS)).to(DT).to(tl.float32)
    y = (x * r[:, None]).to(DT).to(tl.float32)
    y = rope(y, tl.full([BH], 0.0, tl.float32) + posf, F, BH, DP, D, ROPE_DIM, DT)
    tl.store(qo_ptr + b * QO_S[0] + tq * QO_S[1] + h * QO_S[2] + col, y.to(DT), mask=m)

    if hb == 0:
        xk = tl.load(kv_ptr + b * KV_S[0] + tq * KV_S[1] + col, mask=cm, other=0.0).to(tl.float32)
        wk = tl.load(norm_ptr + col, mask=cm, other=0.0).to(tl.float32)
        rk = 1.0 / tl.sqrt_rn(tl.sum(xk * xk, axis=1) / D + EPS)
        yk = (wk * (xk * rk[:, None])).to(DT).to(tl.float32)
        yk = rope(yk, tl.full([1], 0.0, tl.float32) + posf, F, 1, DP, D, ROPE_DIM, DT)
        if KV_ROUND_DIMS > 0:
            yk = fp8_qdq(yk, KV_ROUND_DIMS, 1, DP, KV_ROUND_BLOCK).to(DT).to(tl.float32)
        tl.store(kvo_ptr + b * KVO_S[0] + tq * KVO_S[1] + col, yk.to(DT), mask=cm)
        if p0 is not None:
            keep, p = ring_keep(pos_ptr, b, tq + tl.arange(0, 1), T, TP, WINDOW)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            rows = N_ROWS - (slot + 1) * SLOT_ROWS + (tl.maximum(p, 0) % WINDOW)  # planes start at the layer's row
            store_rows(p0, p1, p2, rows, keep, yk, FMT, NPLANES, 1, DP, D, NOPE, BLK, S0, S1, S2)
        if qi_ptr is not None:
            hi = tl.arange(0, HIP)[:, None]
            ci = tl.arange(0, DIP)[None, :]
            mi = (hi < HI) & (ci < DI)
            xi = tl.load(qi_ptr + b * QI_S[0] + tq * QI_S[1] + hi * QI_S[2] + ci, mask=mi, other=0.0).to(tl.float32)
            yi = rope(xi, tl.full([HIP], 0.0, tl.float32) + posf, F, HIP, DIP, DI, ROPE_DIM, DT)
            if QI_FP4:
                yi = fwht(yi, HIP, DIP, HS).to(DT).to(tl.float32)
                yi = fp4_qdq(yi, HIP, DIP).to(DT).to(tl.float32)
            tl.store(qio_ptr + b * QIO_S[0] + tq * QIO_S[1] + hi * QIO_S[2] + ci, yi.to(DT), mask=mi)


def specialise(op_name, operands, results, attrs):
    assert op_name == "qkv_norm_rope", op_name
    q, kv, qi = operands["q"], operands["kv"], operands.get("qi")
    # qi_out exists iff qi does (a caller that zips result names positionally may mislabel a plane as it).
    qo, kvo, qio = results["q_out"], results["kv_out"], (results.get("qi_out") if qi is not None else None)
    planes = [operands.get(f"p{i}") for i in range(3)]
    B, T, H, D = q.shape
    for a in (q, kv, qo, kvo, qi, qio):
        assert a is None or a.strides[-1] == 1, "qkv_norm_rope: rows must be dense"
    dim = attrs["dim"]
    HI, DI = (qi.shape[2], qi.shape[3]) if qi is not None else (1, 1)
    qi_fp4 = attrs.get("qi_round", "none") == "fp4"
    assert not qi_fp4 or DI == pow2(DI), "the Hadamard rotation needs a power-of-two indexer head dim"
    BH = min(pow2(H), 16)
    c = dict(T=T, H=H, D=D, DP=pow2(D), BH=BH, HI=HI, HIP=pow2(HI), DI=DI, DIP=pow2(DI),
             EPS=float(attrs["eps"]), Q_MEAN_DT=attrs["q_mean"] == "dtype", ROPE_DIM=dim,
             F=rope_table(dim, attrs["theta"], attrs["yarn"]),
             KV_ROUND_DIMS=attrs.get("kv_round_dims", 0), KV_ROUND_BLOCK=attrs.get("kv_round_block", 64),
             QI_FP4=qi_fp4, HS=hadamard_scale(pow2(DI)),
             Q_S=q.strides[:3], KV_S=kv.strides[:2] + (0,), QI_S=qi.strides[:3] if qi is not None else (0, 0, 0),
             QO_S=qo.strides[:3], KVO_S=kvo.strides[:2] + (0,), QIO_S=qio.strides[:3] if qio is not None else (0, 0, 0),
             WINDOW=max(attrs.get("window", 0), 1), SLOT_ROWS=attrs.get("slot_rows", 0), N_ROWS=attrs.get("n_rows", 0),
             TP=pow2(T),
             **plane_consts(attrs.get("fmt") or "native", planes, D), DT=TL_DTYPE[q.dtype])
    pointers = [ptr("q_ptr", "operand", "q", q), ptr("kv_ptr", "operand", "kv", kv),
                ptr("norm_ptr", "operand", "norm", operands["norm"]), ptr("pos_ptr", "operand", "pos", operands["pos"])]
    opt = {"qi_ptr": ("qi", qi), "slot_ptr": ("slot", operands.get("slot")),
           **{f"p{i}": (f"p{i}", planes[i]) for i in range(3)}}
    for param, (name, a) in opt.items():
        if a is None:
            c[param] = None
        else:
            pointers.append(ptr(param, "operand", name, a))
    pointers += [ptr("qo_ptr", "result", "q_out", qo), ptr("kvo_ptr", "result", "kv_out", kvo)]
    if qio is None:
        c["qio_ptr"] = None
    else:
        pointers.append(ptr("qio_ptr", "result", "qi_out", qio))
    return [KernelCall(name=call_name("qkv_norm_rope", c, f"b{B}_t{T}_h{H}_d{D}"), fn=qkv_norm_rope_kernel,
                       constexprs=c, pointers=pointers, grid=(B * T, triton.cdiv(H, BH), 1), num_warps=4,
                       unaligned=unaligned({"q_ptr": q, "kv_ptr": kv, "qi_ptr": qi, "qo_ptr": qo, "kvo_ptr": kvo,
                                            "qio_ptr": qio, **{f"p{i}": any_row(p) for i, p in enumerate(planes)}}),
                       offsets=row_offsets({f"p{i}": p for i, p in enumerate(planes)}, attrs.get("layer_row", 0)),
                       bytes_moved=2 * (q.type.nbytes + kv.type.nbytes + (qi.type.nbytes if qi is not None else 0)))]
