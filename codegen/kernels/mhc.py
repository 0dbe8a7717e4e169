"""Manifold-constrained hyper-connection seams (`ops.mhc`, `ops.fused`): hc_expand, hc_pre, hc_pre_norm,
hc_post, mhc_post_pre, hc_head, mhc_post_head.

One token-batched kernel (BT tokens per program; the mixing projection is a `tl.dot`), in passes over the
hidden dim D:
  1. (post seams) X = post * y + comb^T X_in, stored as the new streams; the RMS of the flattened n*D
     streams and their projection by `fn` are accumulated on the way (the RMS factor is applied to the
     projection afterwards: linear, so the same value up to fp32 rounding order).
  2. pre / post / comb from the projection; comb by row softmax + hc_eps, one column normalisation and
     `iters - 1` (row, column) pairs, eps in every denominator: the reference's order, all fp32.
  3. y = sum_k pre_k X_k, rounded to the streams' dtype; (norm seams) its RMSNorm in a last pass.
Passes re-read what an earlier pass of the same program stored, after a block barrier.
bf16: post * y, comb^T X and their sum are each rounded to bf16 as the reference's bf16 ops round them.
The loops over the n streams are run-time loops, not unrolled (`tl.static_range`): the same arithmetic in
the same order, but n^2 + 2n fewer loads and stores in the IR. Triton's TritonGPUCoalesce pass walks the
whole dependency graph of the function for every load and store, so its cost grows with (memory ops) x
(function size)^2: unrolled, this seam was most of the one-launch MoE's compile time (issue 40).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ...ir.registry import Layout
from . import KernelCall, TensorArg, call_name, ptr
from .kvrows import TL_DTYPE, pow2
from .pdl import pdl_enter

BT = 16  # tokens per program (tl.dot needs M >= 16)


@triton.jit
def hc_expand_kernel(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                     X_S: tl.constexpr, O_S: tl.constexpr, O_SN: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0)
    for d0 in range(0, D, BD):
        c = d0 + tl.arange(0, BD)
        x = tl.load(x_ptr + t * X_S + c, mask=c < D)
        for k in tl.static_range(N):
            tl.store(out_ptr + t * O_S + k * O_SN + c, x, mask=c < D)


@triton.jit
def _post_chunk(y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, tok, tm, c, cm, k, N: tl.constexpr,
                Y_S: tl.constexpr, S_S: tl.constexpr, S_SN: tl.constexpr, DT: tl.constexpr):
    """Stream k of hc_post on tokens tok [BT] and columns c [BD]: post_k * y + sum_j comb[j, k] X_j (with
    `y2_ptr`, `mhc_post_pre_add`: y is y + y2 rounded to DT, as the `add` it replaces)."""
    m2 = tm[:, None] & cm[None, :]
    y = tl.load(y_ptr + tok[:, None] * Y_S + c[None, :], mask=m2, other=0.0).to(tl.float32)
    if y2_ptr is not None:
        y2 = tl.load(y2_ptr + tok[:, None] * Y_S + c[None, :], mask=m2, other=0.0).to(tl.float32)
        y = (y + y2).to(DT).to(tl.float32)
    pk = tl.load(post_ptr + tok * N + k, mask=tm, other=0.0).to(DT).to(tl.float32)
    acc = tl.zeros_like(y)
    for j in range(N):
        cjk = tl.load(comb_ptr + tok * N * N + j * N + k, mask=tm, other=0.0).to(DT).to(tl.float32)
        xj = tl.load(s_ptr + tok[:, None] * S_S + j * S_SN + c[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += cjk[:, None] * xj
    return ((pk[:, None] * y).to(DT).to(tl.float32) + acc.to(DT).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _dot_fp32_weight(x, w, DT: tl.constexpr):
    """x [BT, K] (values of DT) times an fp32 weight tile [K, NW], fp32 exact products. bf16 streams: the
    weight is split exactly into three bf16 parts (8 + 8 + 8 significant bits) and each part goes through
    a bf16 MMA (x is exact in bf16): the fp32 result up to summation order, on matrix units of both
    targets (sm_90 has no fp32 MMA, and an fp32 FMA dot of this size spills there)."""
    if DT == tl.bfloat16:
        xb = x.to(tl.bfloat16)
        hi = w.to(tl.bfloat16)
        r = w - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(xb, hi) + tl.dot(xb, mid) + tl.dot(xb, lo)
    else:
        return tl.dot(x, w, input_precision="ieee")


@triton.jit
def _given(p):
    """Whether pointer p is bound: None at compile time (a JIT launch, the interpreter), null at run time (AOT)."""
    if p is None:
        return False
    else:
        return p.to(tl.int1)


@triton.jit
def _mix_source(on, so_ptr, s_ptr, tb, SO_S: tl.constexpr, SO_SN: tl.constexpr, S_S: tl.constexpr,
                S_SN: tl.constexpr):
    """(pointer, token stride, stream stride) of the streams the mix reads: the new ones where the post pass
    ran (`on`), else the input's."""
    if on:
        return so_ptr, tb * 0 + SO_S, tb * 0 + SO_SN
    else:
        return s_ptr, tb * 0 + S_S, tb * 0 + S_SN


@triton.jit
def mhc_kernel(y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr,
               so_ptr, yo_ptr, posto_ptr, combo_ptr,
               M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
               POST: tl.constexpr, MIX: tl.constexpr, NORM: tl.constexpr, NM: tl.constexpr,
               EPS: tl.constexpr, HC_EPS: tl.constexpr, ITERS: tl.constexpr, NORM_EPS: tl.constexpr,
               Y_S: tl.constexpr, S_S: tl.constexpr, S_SN: tl.constexpr, SO_S: tl.constexpr, SO_SN: tl.constexpr,
               YO_S: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False):
    """MIX: "pre" (fn [(2+N)N, ND]: pre, post, comb), "head" (fn [N, ND]: pre only) or "" (hc_post only).
    NM = the padded width (>= 16) of the pre / post projections; N*N is the comb width."""
    pdl_enter(PDL)
    # POST: the binary holds the post pass; it runs where y is given (`hc_pre_norm` launches the
    # `mhc_post_pre` binary with y null: `_as_post_pre`)
    if POST:
        on = _given(y_ptr)
    else:
        on = False
    _mhc_rows(tl.program_id(0), on, y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr,
              so_ptr, yo_ptr, posto_ptr, combo_ptr, M, N, D, BD, BT, POST, MIX, NORM, NM, EPS, HC_EPS, ITERS, NORM_EPS,
              Y_S, S_S, S_SN, SO_S, SO_SN, YO_S, DT)


@triton.jit
def mhc_rows(tb, y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr,
             so_ptr, yo_ptr, posto_ptr, combo_ptr,
             M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
             POST: tl.constexpr, MIX: tl.constexpr, NORM: tl.constexpr, NM: tl.constexpr,
             EPS: tl.constexpr, HC_EPS: tl.constexpr, ITERS: tl.constexpr, NORM_EPS: tl.constexpr,
             Y_S: tl.constexpr, S_S: tl.constexpr, S_SN: tl.constexpr, SO_S: tl.constexpr, SO_SN: tl.constexpr,
             YO_S: tl.constexpr, DT: tl.constexpr):
    """The seam for token block tb (tokens [tb * BT, tb * BT + BT)): the whole computation of one program
    (also a phase of the fused launches, `moe_router.py`, `attn_front.py`: the post pass as POST says)."""
    _mhc_rows(tb, POST, y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr, so_ptr, yo_ptr,
              posto_ptr, combo_ptr, M, N, D, BD, BT, POST, MIX, NORM, NM, EPS, HC_EPS, ITERS, NORM_EPS, Y_S, S_S, S_SN,
              SO_S, SO_SN, YO_S, DT)


@triton.jit
def _mhc_rows(tb, on, y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, norm_ptr,
              so_ptr, yo_ptr, posto_ptr, combo_ptr,
              M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
              POST: tl.constexpr, MIX: tl.constexpr, NORM: tl.constexpr, NM: tl.constexpr,
              EPS: tl.constexpr, HC_EPS: tl.constexpr, ITERS: tl.constexpr, NORM_EPS: tl.constexpr,
              Y_S: tl.constexpr, S_S: tl.constexpr, S_SN: tl.constexpr, SO_S: tl.constexpr, SO_SN: tl.constexpr,
              YO_S: tl.constexpr, DT: tl.constexpr):
    """`mhc_rows`, the post pass run where `on` (POST's value, or a run-time flag where the binary has it)."""
    tok = tb * BT + tl.arange(0, BT)
    tm = tok < M
    # the streams the mix reads: the new ones, or the input's
    if POST:
        src, sst, ssn = _mix_source(on, so_ptr, s_ptr, tb, SO_S, SO_SN, S_S, S_SN)
    else:  # (so_ptr may be None here, which no call's argument can be in a compiled kernel)
        src, sst, ssn = s_ptr, tb * 0 + S_S, tb * 0 + S_SN
    # Pass 1: (post) new streams; RMS and projection of the flattened streams.
    ssq = tl.zeros([BT], tl.float32)
    a_pre = tl.zeros([BT, NM], tl.float32)
    a_post = tl.zeros([BT, NM], tl.float32)
    a_comb = tl.zeros([BT, N * N], tl.float32)
    f = tl.arange(0, N * BD)  # flattened (stream, column) index of a chunk
    fk = f // BD
    fj = f % BD
    rn = tl.arange(0, NM)[None, :]
    rc = tl.arange(0, N * N)[None, :]
    for d0 in range(0, D, BD):
        c = d0 + tl.arange(0, BD)
        cm = c < D
        if POST:  # (without it no post branch is compiled: `on` reaches here as a run-time value even when
            if on:  # POST is False, and the branch would read y_ptr None)
                for k in range(N):
                    x = _post_chunk(y_ptr, y2_ptr, s_ptr, post_ptr, comb_ptr, tok, tm, c, cm, k, N, Y_S, S_S, S_SN, DT)
                    tl.store(so_ptr + tok[:, None] * SO_S + k * SO_SN + c[None, :], x.to(DT),
                             mask=tm[:, None] & cm[None, :])
        if MIX != "":
            fc = d0 + fj
            fmask = fc < D
            if POST:
                tl.debug_barrier()
            x = tl.load(src + tok[:, None] * sst + fk[None, :] * ssn + fc[None, :],
                        mask=tm[:, None] & fmask[None, :], other=0.0).to(tl.float32)  # [BT, N*BD]
            ssq += tl.sum(x * x, axis=1)
            col = (fk * D + fc)[:, None]
            w = tl.load(fn_ptr + rn * (N * D) + col, mask=fmask[:, None] & (rn < N), other=0.0)
            a_pre += _dot_fp32_weight(x, w, DT)
            if MIX == "pre":
                w = tl.load(fn_ptr + (N + rn) * (N * D) + col, mask=fmask[:, None] & (rn < N), other=0.0)
                a_post += _dot_fp32_weight(x, w, DT)
                w = tl.load(fn_ptr + (2 * N + rc) * (N * D) + col, mask=fmask[:, None], other=0.0)
                a_comb += _dot_fp32_weight(x, w, DT)
    if MIX != "":
        # Pass 2: the mixing weights.
        r = 1.0 / tl.sqrt_rn(ssq / (N * D) + EPS)
        cn = tl.arange(0, NM)
        pre = tl.sigmoid(a_pre * r[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + cn, mask=cn < N, other=0.0)[None, :]) + HC_EPS
        if MIX == "pre":
            post = 2.0 * tl.sigmoid(a_post * r[:, None] * tl.load(scale_ptr + 1)
                                    + tl.load(base_ptr + N + cn, mask=cn < N, other=0.0)[None, :])
            tl.store(posto_ptr + tok[:, None] * N + cn[None, :], post, mask=tm[:, None] & (cn[None, :] < N))
            cc = tl.arange(0, N * N)
            z = a_comb * r[:, None] * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cc)[None, :]
            z = tl.reshape(z, [BT, N, N])  # [token, row i, column j]
            z = tl.exp(z - tl.max(z, axis=2)[:, :, None])
            z = z / tl.sum(z, axis=2)[:, :, None] + HC_EPS
            z = z / (tl.sum(z, axis=1)[:, None, :] + HC_EPS)
            for _ in range(ITERS - 1):
                z = z / (tl.sum(z, axis=2)[:, :, None] + HC_EPS)
                z = z / (tl.sum(z, axis=1)[:, None, :] + HC_EPS)
            tl.store(combo_ptr + tok[:, None] * (N * N) + cc[None, :], tl.reshape(z, [BT, N * N]), mask=tm[:, None])
        # Pass 3: y = sum_k pre_k X_k (+ its RMS for the norm).
        if POST:
            tl.debug_barrier()
        ysq = tl.zeros([BT], tl.float32)
        for d0 in range(0, D, BD):
            c = d0 + tl.arange(0, BD)
            m2 = tm[:, None] & (c[None, :] < D)
            y = tl.zeros([BT, BD], tl.float32)
            for k in range(N):
                pk = tl.sum(tl.where(cn[None, :] == k, pre, 0.0), axis=1)
                xk = tl.load(src + tok[:, None] * sst + k * ssn + c[None, :], mask=m2, other=0.0).to(tl.float32)
                y += pk[:, None] * xk
            y = y.to(DT).to(tl.float32)
            ysq += tl.sum(tl.where(m2, y * y, 0.0), axis=1)
            tl.store(yo_ptr + tok[:, None] * YO_S + c[None, :], y.to(DT), mask=m2)
        if NORM:
            tl.debug_barrier()
            r2 = 1.0 / tl.sqrt_rn(ysq / D + NORM_EPS)
            for d0 in range(0, D, BD):
                c = d0 + tl.arange(0, BD)
                m2 = tm[:, None] & (c[None, :] < D)
                y = tl.load(yo_ptr + tok[:, None] * YO_S + c[None, :], mask=m2, other=0.0).to(tl.float32)
                w = tl.load(norm_ptr + c, mask=c < D, other=0.0).to(tl.float32)
                tl.store(yo_ptr + tok[:, None] * YO_S + c[None, :], (w[None, :] * (y * r2[:, None])).to(DT), mask=m2)


def _rows(arg, lead: int) -> int:
    """Element stride between consecutive tokens of a value whose leading `lead` dims are the tokens."""
    st = arg.strides[:lead]
    for i in range(lead - 1):
        assert st[i] == st[i + 1] * arg.shape[i + 1], "mhc: token dims must be mergeable"
    return st[lead - 1] if lead else 0


# op -> (reads a sub-layer output and applies hc_post, mixing kind, RMSNorm on y)
MODES = {"hc_post": (True, "", False), "hc_pre": (False, "pre", False), "hc_pre_norm": (False, "pre", True),
         "mhc_post_pre": (True, "pre", True), "mhc_post_pre_add": (True, "pre", True), "hc_head": (False, "head", False), "mhc_post_head": (True, "head", False)}
RESULTS = {"hc_post": ("streams_out", None, None, None), "hc_pre": (None, "y", "post", "comb"),
           "hc_pre_norm": (None, "y", "post", "comb"), "mhc_post_pre": ("streams_out", "y_next", "post_next", "comb_next"),
           "mhc_post_pre_add": ("streams_out", "y_next", "post_next", "comb_next"),
           "hc_head": (None, "y", None, None), "mhc_post_head": (None, "h", None, None)}


def specialise(op_name, operands, results, attrs):
    if op_name == "hc_expand":
        x, out = operands["x"], results["streams"]
        *lead, D = x.shape
        M, n = math.prod(lead), attrs["n"]
        assert x.strides[-1] == 1 and out.strides[-1] == 1
        c = dict(M=M, N=n, D=D, BD=min(pow2(D), 1024), X_S=_rows(x, len(lead)), O_S=_rows(out, len(lead)),
                 O_SN=out.strides[-2])
        return [KernelCall(name=call_name("hc_expand", c, f"m{M}_d{D}"), fn=hc_expand_kernel, constexprs=c,
                           pointers=[ptr("x_ptr", "operand", "x", x), ptr("out_ptr", "result", "streams", out)],
                           grid=(M, 1, 1), num_warps=4, bytes_moved=(1 + n) * x.type.nbytes)]
    post, mix, norm = MODES[op_name]
    s = operands["streams"]
    *lead, n, D = s.shape
    M = math.prod(lead)
    assert n == pow2(n), "mhc: the stream count must be a power of two"
    so_name, y_name, post_name, comb_name = RESULTS[op_name]
    has_norm = norm and operands.get("norm") is not None
    if op_name == "hc_pre_norm" and has_norm:
        return [_as_post_pre(operands, results, attrs)]
    if mix == "" and post:
        so_name = "streams_out"
    so = results.get(so_name) if so_name else None
    # hc_post without a mix: the kernel's "streams_out" pass alone; mhc_post_head keeps the new streams in
    # a scratch buffer (the op does not return them).
    if op_name == "mhc_post_head":
        so = None
    yv = operands.get("y")
    c = dict(M=M, N=n, D=D, BD=min(pow2(D), max(16, 128 // n)), BT=BT, POST=post, MIX=mix, NORM=has_norm,
             NM=max(pow2(n), 16), EPS=float(attrs.get("eps", 0.0)), HC_EPS=float(attrs.get("hc_eps", 0.0)),
             ITERS=int(attrs.get("iters", 1)), NORM_EPS=float(attrs.get("norm_eps", 0.0)),
             Y_S=_rows(yv, len(lead)) if yv is not None else 0, S_S=_rows(s, len(lead)), S_SN=s.strides[-2],
             SO_S=0, SO_SN=0, YO_S=0, DT=TL_DTYPE[s.dtype])
    pointers = [ptr("s_ptr", "operand", "streams", s)]
    scratch = {}
    y2 = operands.get("y2")
    if y2 is None:
        c["y2_ptr"] = None
    else:  # mhc_post_pre_add: y2 is read with y's row stride
        assert y2.strides == yv.strides, "mhc_post_pre_add: y and y2 must share their layout"
        pointers.append(ptr("y2_ptr", "operand", "y2", y2))
    for param, name in (("y_ptr", "y"), ("post_ptr", "post"), ("comb_ptr", "comb"), ("fn_ptr", "fn"),
                        ("base_ptr", "base"), ("scale_ptr", "scale"), ("norm_ptr", "norm")):
        a = operands.get(name) if (post or name not in ("y", "post", "comb")) else None
        if name == "norm" and not has_norm:
            a = None
        if a is None:
            c[param] = None
        else:
            assert a.strides[-1] == 1
            pointers.append(ptr(param, "operand", name, a))
    if so is not None:
        c.update(SO_S=_rows(so, len(lead)), SO_SN=so.strides[-2])
        pointers.append(ptr("so_ptr", "result", so_name, so))
    elif post:
        es = {"fp32": 4, "bf16": 2}[s.dtype]
        scratch["streams_new"] = M * n * D * es
        c.update(SO_S=n * D, SO_SN=D)
        pointers.append(ptr("so_ptr", "scratch", "streams_new", "*" + s.dtype))
    else:
        c["so_ptr"] = None
    for param, name in (("yo_ptr", y_name), ("posto_ptr", post_name), ("combo_ptr", comb_name)):
        if name is None:
            c[param] = None
        else:
            r = results[name]
            assert r.strides[-1] == 1 and (param != "yo_ptr" or True)
            if param != "yo_ptr":
                assert r.strides[-2] == r.shape[-1] or r.type.rank == len(lead) + 1, f"mhc: {name} must be dense"
            pointers.append(ptr(param, "result", name, r))
    if y_name is not None:
        c["YO_S"] = _rows(results[y_name], len(lead))
    fnw = operands.get("fn")
    return [KernelCall(name=call_name(op_name, c, f"m{M}_n{n}_d{D}"), fn=mhc_kernel, constexprs=c, pointers=pointers,
                       grid=(triton.cdiv(M, BT), 1, 1), num_warps=4, scratch_bytes=scratch,
                       flops=2 * M * n * D * (fnw.shape[0] if fnw is not None else 0),
                       bytes_moved=s.type.nbytes * (3 if post else 2) + (fnw.type.nbytes if fnw is not None else 0)
                       + (y2.type.nbytes if y2 is not None else 0))]


def _as_post_pre(operands, results, attrs) -> KernelCall:
    """`hc_pre_norm` as `mhc_post_pre`'s binary with its post pass skipped (y, post, comb and the new streams
    null at run time: `mhc_rows`' `_given`): its call binds them to names the launch lacks, with the types and
    strides an `mhc_post_pre` of these streams has, so both calls have one binary (the AOT cache keys on the
    binary's inputs alone) and a V4-Pro compile builds one kernel fewer per row count and target. Its cost
    (flops, bytes) stays the pre pass's."""
    s, y = operands["streams"], results["y"]
    *lead, n, D = s.shape
    fake = dict(operands, y=TensorArg(y.type, Layout.contiguous(y.shape).strides),
                post=results["post"], comb=results["comb"])
    outs = dict(y_next=y, post_next=results["post"], comb_next=results["comb"],
                streams_out=TensorArg(s.type, Layout.contiguous(s.shape).strides))
    (c,) = specialise("mhc_post_pre", fake, outs, attrs)
    absent = {n: "absent_" + n for n in ("y", "post", "comb", "streams_out")}
    back = {"y_next": "y", "post_next": "post", "comb_next": "comb"}
    pointers = []
    for p, kind, name, ty in c.pointers:
        if kind == "operand" and name in absent or kind == "result" and name == "streams_out":
            name = absent[name]  # no such value at the launch: a null pointer
        elif kind == "result":
            name = back[name]
        pointers.append((p, kind, name, ty))
    pre = 2 * math.prod(lead) * n * D * operands["fn"].shape[0]
    return KernelCall(name=call_name("hc_pre_norm", c.constexprs, f"m{math.prod(lead)}_n{n}_d{D}"), fn=mhc_kernel,
                      constexprs=c.constexprs, pointers=pointers, grid=c.grid, num_warps=c.num_warps,
                      flops=pre, bytes_moved=s.type.nbytes * 2 + operands["fn"].type.nbytes)
