"""router family: `s = sqrt(softplus(x W^T))`, expert choice by hash table (`tid2eid[ids]`) or top-k of
`s + bias` (the bias steers selection only), weights `s[sel] / (sum s[sel] + denom_eps) * route_scale`.

One program per BR tokens: the [BR, E] logits from a K loop of `tl.dot`, then softplus / sqrt, then k
rounds of arg-max (ties to the lowest expert id) in registers. Every step is rounded to x's dtype where
the reference computes in that dtype (bf16 logits, softplus, sqrt, sum, quotient, product), so bf16
results match the reference's roundings. The weights' dtype is that dtype: an `fp32` router (official
numerics) writes fp32 weights, so every step, the logits GEMM included, is fp32.
Indices are written best-first; the reference's `topk(sorted=
False)` order is unspecified, so consumers (and tests) treat the k slots as a set.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .pdl import pdl_enter


@triton.jit
def _softplus(x):
    # torch: x above 20 stays x; else log1p(exp(x)). log1p via log(u) * z / (u - 1) stays accurate for tiny z.
    z = tl.exp(-tl.abs(x))
    u = 1.0 + z
    l1p = tl.where(u == 1.0, z, tl.log(u) * z / (u - 1.0))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)


@triton.jit
def _hashed(t_ptr, ids_ptr, rows, r_ok, j, KSEL: tl.constexpr, T_RS: tl.constexpr, I_S: tl.constexpr):
    """Expert ids `tid2eid[ids]` of token rows `rows` ([BR, BKS] int32; padding id -1 reads row 0)."""
    tok = tl.maximum(tl.load(ids_ptr + rows * I_S, mask=r_ok, other=0).to(tl.int64), 0)
    return tl.load(t_ptr + tok[:, None] * T_RS + j[None, :], mask=r_ok[:, None] & (j[None, :] < KSEL),
                   other=0).to(tl.int32)


@triton.jit
def _learned(sc, b_ptr, e, e_ok, j, dt: tl.constexpr, KSEL: tl.constexpr, SUM_IN_DT: tl.constexpr, BR: tl.constexpr,
             BE: tl.constexpr, BKS: tl.constexpr):
    """Expert ids of the k largest `s + bias` per row, best first, ties to the lowest id ([BR, BKS] int32)."""
    idx = tl.zeros([BR, BKS], dtype=tl.int32)
    bias = tl.load(b_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    sel = sc + bias[None, :]
    if SUM_IN_DT:
        sel = sel.to(dt).to(tl.float32)
    sel = tl.where(e_ok[None, :], sel, float("-inf"))
    for s in tl.static_range(KSEL):
        m = tl.max(sel, axis=1)
        pick = tl.min(tl.where(sel == m[:, None], e[None, :], BE), axis=1)
        idx = tl.where(j[None, :] == s, pick[:, None], idx)
        sel = tl.where(e[None, :] == pick[:, None], float("-inf"), sel)
    return idx


@triton.jit
def router_kernel(x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr, o_ptr,
                  R: tl.constexpr, D: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr,
                  X_RS: tl.constexpr, W_RS: tl.constexpr, T_RS: tl.constexpr, I_S: tl.constexpr,
                  WO_RS: tl.constexpr, IO_RS: tl.constexpr, ROUTE_SCALE: tl.constexpr, DENOM_EPS: tl.constexpr,
                  SUM_IN_DT: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_enter(PDL)
    route_rows(tl.program_id(0), x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr, o_ptr, R, D, E, KSEL, X_RS, W_RS,
               T_RS, I_S, WO_RS, IO_RS, ROUTE_SCALE, DENOM_EPS, SUM_IN_DT, BR, BE, BK, BKS)


@triton.jit
def route_rows(rb, x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr, o_ptr,
               R: tl.constexpr, D: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr,
               X_RS: tl.constexpr, W_RS: tl.constexpr, T_RS: tl.constexpr, I_S: tl.constexpr,
               WO_RS: tl.constexpr, IO_RS: tl.constexpr, ROUTE_SCALE: tl.constexpr, DENOM_EPS: tl.constexpr,
               SUM_IN_DT: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr):
    """Route token rows [rb * BR, rb * BR + BR): the router's whole computation for one row block (also the
    first phase of the fused MoE launch, `moe_router.py`). With `o_ptr` (an expert-parallel rank's owner
    table, `moe_router_experts_ep`) the routing is then masked as `local_experts` masks it: each slot's id
    becomes the rank's local index (-1: another rank's expert), its weight 0 where it is -1."""
    rows = rb * BR + tl.arange(0, BR)
    r_ok = rows < R
    e = tl.arange(0, BE)
    e_ok = e < E
    dt = wo_ptr.dtype.element_ty
    acc = tl.zeros([BR, BE], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        xa = tl.load(x_ptr + rows[:, None].to(tl.int64) * X_RS + kk[None, :], mask=r_ok[:, None] & (kk[None, :] < D),
                     other=0.0)
        wt = tl.load(w_ptr + e[None, :] * W_RS + kk[:, None], mask=e_ok[None, :] & (kk[:, None] < D), other=0.0)
        acc = tl.dot(xa.to(dt), wt.to(dt), acc, input_precision="ieee")
    logits = acc.to(dt).to(tl.float32)
    sp = _softplus(logits).to(dt).to(tl.float32)
    sc = tl.sqrt_rn(sp).to(dt).to(tl.float32)
    j = tl.arange(0, BKS)
    if t_ptr is None:  # None at compile time (a JIT launch, the interpreter): learned
        idx = _learned(sc, b_ptr, e, e_ok, j, dt, KSEL, SUM_IN_DT, BR, BE, BKS)
    elif b_ptr is None:
        idx = _hashed(t_ptr, ids_ptr, rows, r_ok, j, KSEL, T_RS, I_S)
    elif ids_ptr is None:  # (a JIT launch, the interpreter: no token ids, no hash routing)
        idx = _learned(sc, b_ptr, e, e_ok, j, dt, KSEL, SUM_IN_DT, BR, BE, BKS)
    elif ids_ptr.to(tl.int1):  # one binary for both routings (AOT): token ids (and tid2eid) given at run time
        idx = _hashed(t_ptr, ids_ptr, rows, r_ok, j, KSEL, T_RS, I_S)
    else:
        idx = _learned(sc, b_ptr, e, e_ok, j, dt, KSEL, SUM_IN_DT, BR, BE, BKS)
    # gather s at the chosen experts: [BR, BKS]
    wts = tl.zeros([BR, BKS], dtype=tl.float32)
    for s in tl.static_range(KSEL):
        pick = tl.sum(tl.where(j[None, :] == s, idx, 0), axis=1)
        v = tl.sum(tl.where(e[None, :] == pick[:, None], sc, 0.0), axis=1)
        wts = tl.where(j[None, :] == s, v[:, None], wts)
    total = tl.sum(tl.where(j[None, :] < KSEL, wts, 0.0), axis=1).to(dt).to(tl.float32)
    den = (total + DENOM_EPS).to(dt).to(tl.float32)
    out = ((wts / den[:, None]).to(dt).to(tl.float32) * ROUTE_SCALE).to(dt)
    ok = r_ok[:, None] & (j[None, :] < KSEL)
    if o_ptr is not None:
        known = ok & (idx >= 0) & (idx < E)
        idx = tl.load(o_ptr + tl.where(known, idx, 0), mask=known, other=-1).to(tl.int32)
        out = tl.where(idx >= 0, out, tl.zeros_like(out))
    tl.store(wo_ptr + rows[:, None].to(tl.int64) * WO_RS + j[None, :], out, mask=ok)
    tl.store(io_ptr + rows[:, None].to(tl.int64) * IO_RS + j[None, :], idx.to(io_ptr.dtype.element_ty), mask=ok)


# The routing's optional operands: every call binds all three, an absent one is a null pointer at run time
# (`route_rows` picks the routing by whether token ids are given: an op takes them with tid2eid only, its
# `hash` variant, which the IR verifier holds it to), so the hash-routed and the learned layers of a model
# launch one binary. An absent one's type is what the model's would be: tid2eid and ids i64 (the checkpoint's
# and the trace's), the bias in the weights' dtype.
ROUTE_OPERANDS = (("b_ptr", "bias"), ("t_ptr", "tid2eid"), ("ids_ptr", "ids"))


def route_pointers(bias: TensorArg | None, tid2eid: TensorArg | None, ids: TensorArg | None,
                   wo: TensorArg) -> list[tuple[str, str, str, str]]:
    given = {"bias": bias, "tid2eid": tid2eid, "ids": ids}
    default = {"bias": wo.ptr_type, "tid2eid": "*i64", "ids": "*i64"}
    return [ptr(p, "operand", n, given[n] if given[n] is not None else default[n]) for p, n in ROUTE_OPERANDS]


def route_types(pointers) -> str:
    """The routing pointers' types, for a call's name: two calls of one name must be one binary."""
    return ",".join(t for p, _, n, t in pointers if n in dict(ROUTE_OPERANDS).values())


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "router":
        raise KeyError(f"router family has no op '{op_name}'")
    x, w, bias, tid2eid, ids = (operands.get(n) for n in ("x", "w", "bias", "tid2eid", "ids"))
    wo, io = results["weights"], results["indices"]
    R, x_rs, x_cs = rows_of(x, "router x")
    _, wo_rs, wo_cs = rows_of(wo, "router weights")
    _, io_rs, io_cs = rows_of(io, "router indices")
    if x_cs != 1 or w.strides[1] != 1 or wo_cs != 1 or io_cs != 1:
        raise ValueError("router: x, w and the results need unit column stride")
    E, D = w.shape
    k = attrs["k"]
    hashed = tid2eid is not None
    if hashed:
        _, i_rs, _ = rows_of(TensorArg(ids.type.with_shape(*ids.shape, 1), (*ids.strides, 1)), "router ids")
        t_rs = tid2eid.strides[0]
    else:  # what a contiguous tid2eid [vocab, k] and token ids would take (unused): see `route_types`
        i_rs, t_rs = 1, k
    ce = dict(R=R, D=D, E=E, KSEL=k, X_RS=x_rs, W_RS=w.strides[0], T_RS=t_rs, I_S=i_rs, WO_RS=wo_rs, IO_RS=io_rs,
              ROUTE_SCALE=float(attrs["route_scale"]), DENOM_EPS=float(attrs["denom_eps"]),
              # (unused by hash routing: there the value a bias in the weights' dtype gives)
              SUM_IN_DT=hashed or bias.dtype == wo.dtype,
              BR=16, BE=max(16, triton.next_power_of_2(E)),
              # the [BK, BE] weight tile is the big one: keep it near 32 KB of bf16
              BK=min(max(16, 16384 // max(16, triton.next_power_of_2(E))), 128, max(16, triton.next_power_of_2(D))),
              BKS=triton.next_power_of_2(k), o_ptr=None)  # o_ptr: the owner table of `moe_router_experts_ep`
    pointers = [ptr("x_ptr", "operand", "x", x), ptr("w_ptr", "operand", "w", w), *route_pointers(bias, tid2eid, ids, wo),
                ptr("wo_ptr", "result", "weights", wo), ptr("io_ptr", "result", "indices", io)]
    return [KernelCall(call_name("router", {**ce, "route_types": route_types(pointers)}, f"r{R}_e{E}_d{D}_k{k}_{x.dtype}"),
                       router_kernel, ce, pointers,
                       (triton.cdiv(R, 16), 1, 1), num_warps=8 if ce["BE"] >= 256 else 4,
                       unaligned=unaligned({"x_ptr": x, "w_ptr": w, "b_ptr": bias, "t_ptr": tid2eid, "ids_ptr": ids,
                                            "wo_ptr": wo, "io_ptr": io}),
                       flops=2 * R * E * D, bytes_moved=w.type.nbytes + x.type.nbytes + wo.type.nbytes + io.type.nbytes)]
