"""moe_router family: `moe_router_experts_shared` (router + shared expert + routed experts, one op) in two
launches instead of three.

Decode-sized P (the moe family's "scan" mode): the router runs as the first phase of the routed gate / up
launch. Its programs are, in the order they start (`phases.ticket`):
  tickets [0, NR)            the router (`router.route_rows`, one per BR token rows) -> the routing weights
                             and expert ids, scratch `route_weights` / `route_indices`; each then publishes;
  tickets [NR, NR + ST)      the shared expert's gate / up I tiles (they need no routing, so they run
                             while the router does);
  tickets [NR + ST, ...)     the routed experts' (expert, I tile) programs, which first wait for all NR
                             router programs (`phases.wait_for`), then rank their pairs in the ids.
The last program to finish resets the three counters (`semaphore` `moe_phase`). The routed down + shared
down + combine launch is the moe family's own, reading the routing from the scratch.
Prefill-sized P (the "grouped" mode) keeps the router as its own launch, writing the same scratch, then the
moe family's launches (grouping, up, down): the grouping needs every pair's expert before any up program.
Every kernel computes what the router and moe kernels compute, in the same order, so the results are
bit-identical to the two ops run apart.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...ir.registry import Layout
from ...ir.types import TensorType
from . import KernelCall, TensorArg, call_name, ptr
from . import moe, router
from .arrival import last_to_arrive
from .moe import _up
from .pdl import pdl_enter
from .phases import publish, ticket, wait_for
from .router import route_rows

# router kernel params -> the fused kernel's (x and the ids it writes are the up programs' own pointers)
ROUTER_PARAMS = {"x_ptr": "x_ptr", "w_ptr": "r_w_ptr", "b_ptr": "r_b_ptr", "t_ptr": "r_t_ptr", "ids_ptr": "r_ids_ptr",
                 "wo_ptr": "r_wo_ptr", "io_ptr": "idx_ptr"}
# the op's names of the routing as the router / moe calls see them -> the fused op's
RENAMED = {("result", "weights"): ("scratch", "route_weights"), ("result", "indices"): ("scratch", "route_indices"),
           ("operand", "weights"): ("scratch", "route_weights"), ("operand", "indices"): ("scratch", "route_indices"),
           ("operand", "w"): ("operand", "gate")}


@triton.jit(noinline=True)
def _route_phase(rb, x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr,
                 R: tl.constexpr, D: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr,
                 X_RS: tl.constexpr, W_RS: tl.constexpr, T_RS: tl.constexpr, I_S: tl.constexpr,
                 WO_RS: tl.constexpr, IO_RS: tl.constexpr, ROUTE_SCALE: tl.constexpr, DENOM_EPS: tl.constexpr,
                 SUM_IN_DT: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr):
    """`route_rows` as a function of its own: inlined next to the MMA tiles of the up programs, its [BR, E]
    register arrays made sm_90a spill (720 B at V4-Pro); called, its registers are allocated apart."""
    route_rows(rb, x_ptr, w_ptr, b_ptr, t_ptr, ids_ptr, wo_ptr, io_ptr, R, D, E, KSEL, X_RS, W_RS, T_RS, I_S, WO_RS,
               IO_RS, ROUTE_SCALE, DENOM_EPS, SUM_IN_DT, BR, BE, BK, BKS)


# the same, inlined: on gfx950 a call would give the kernel hidden kernel arguments (kernels/__init__.py: CALLS_PARAM)
_route_phase_inlined = triton.jit(_route_phase.fn)


@triton.jit
def moe_router_up_kernel(x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr,
                         sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr,
                         r_w_ptr, r_b_ptr, r_t_ptr, r_ids_ptr, r_wo_ptr, phase_ptr,
                         P: tl.constexpr, E: tl.constexpr, KSEL: tl.constexpr, MODE: tl.constexpr, PB: tl.constexpr,
                         I: tl.constexpr, D: tl.constexpr,
                         X_RS: tl.constexpr, IDX_RS: tl.constexpr, H_RS: tl.constexpr,
                         W_ES: tl.constexpr, W_RS: tl.constexpr, S_ES: tl.constexpr, S_RS: tl.constexpr,
                         W_FMT: tl.constexpr, S_E8M0: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                         CDT: tl.constexpr, LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr,
                         S_M: tl.constexpr, S_I: tl.constexpr, S_W_RS: tl.constexpr, S_S_RS: tl.constexpr,
                         S_W_FMT: tl.constexpr, S_S_E8M0: tl.constexpr, S_BLOCK: tl.constexpr, S_ACT: tl.constexpr,
                         S_BM: tl.constexpr, S_BN: tl.constexpr, S_BK: tl.constexpr,
                         R_R: tl.constexpr, R_D: tl.constexpr, R_E: tl.constexpr, R_KSEL: tl.constexpr,
                         R_X_RS: tl.constexpr, R_W_RS: tl.constexpr, R_T_RS: tl.constexpr, R_I_S: tl.constexpr,
                         R_WO_RS: tl.constexpr, R_IO_RS: tl.constexpr, R_ROUTE_SCALE: tl.constexpr,
                         R_DENOM_EPS: tl.constexpr, R_SUM_IN_DT: tl.constexpr, R_BR: tl.constexpr, R_BE: tl.constexpr,
                         R_BK: tl.constexpr, R_BKS: tl.constexpr,
                         NR: tl.constexpr, ST: tl.constexpr, RT: tl.constexpr, PDL: tl.constexpr = False,
                         CALLS: tl.constexpr = True):
    """Programs by ticket: NR router row blocks, ST shared gate / up tiles, E x RT routed (expert, I tile)."""
    pdl_enter(PDL)
    v = ticket(phase_ptr)
    if v < NR:
        if CALLS:  # sm_90a: a call, its registers allocated apart (kernels/__init__.py: CALLS_PARAM)
            _route_phase(v, x_ptr, r_w_ptr, r_b_ptr, r_t_ptr, r_ids_ptr, r_wo_ptr, idx_ptr, R_R, R_D, R_E, R_KSEL,
                         R_X_RS, R_W_RS, R_T_RS, R_I_S, R_WO_RS, R_IO_RS, R_ROUTE_SCALE, R_DENOM_EPS, R_SUM_IN_DT, R_BR,
                         R_BE, R_BK, R_BKS)
        else:  # gfx950: inlined (a call would add hidden kernel arguments)
            _route_phase_inlined(v, x_ptr, r_w_ptr, r_b_ptr, r_t_ptr, r_ids_ptr, r_wo_ptr, idx_ptr, R_R, R_D, R_E,
                                 R_KSEL, R_X_RS, R_W_RS, R_T_RS, R_I_S, R_WO_RS, R_IO_RS, R_ROUTE_SCALE, R_DENOM_EPS,
                                 R_SUM_IN_DT, R_BR, R_BE, R_BK, R_BKS)
        publish(phase_ptr + 1)
    elif v < NR + ST:
        _up(v * 0, v - NR, x_ptr, None, None,  # expert 0 of 1 (a tensor: _up casts it)
            sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, hs_ptr, S_M, 1, 1, "all", 1, S_I, D,
            X_RS, 0, S_I, 0, S_W_RS, 0, S_S_RS, S_W_FMT, S_S_E8M0, S_BLOCK, S_ACT, CDT, LIMIT, S_BM, S_BN, S_BK)
    else:
        wait_for(phase_ptr + 1, NR)
        w = v - NR - ST
        _up(w // RT, w % RT, x_ptr, idx_ptr, grp_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, P, E, KSEL, MODE, PB, I, D,
            X_RS, IDX_RS, H_RS, W_ES, W_RS, S_ES, S_RS, W_FMT, S_E8M0, BLOCK, ACT, CDT, LIMIT, BM, BN, BK)
    if last_to_arrive(phase_ptr + 2, NR + ST + E * RT):  # every program has its ticket and is past its wait
        tl.store(phase_ptr, 0)
        tl.store(phase_ptr + 1, 0)
        tl.store(phase_ptr + 2, 0)


def _renamed(call: KernelCall, extra_scratch: dict[str, int], params: dict[str, str] | None = None) -> KernelCall:
    """`call` with the routing as scratch and the router weight as `gate` (params renamed by `params`)."""
    params = params or {}
    pts = []
    for p, kind, name, ty in call.pointers:
        kind, name = RENAMED.get((kind, name), (kind, name))
        pts.append((params.get(p, p), kind, name, ty))
    call.pointers = pts
    call.scratch_bytes.update(extra_scratch)
    call.unaligned = tuple(sorted(params.get(p, p) for p in call.unaligned))
    return call


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "moe_router_experts_shared":
        raise KeyError(f"moe_router family has no op '{op_name}'")
    from ...ops.fused import ROUTER_ATTRS

    x = operands["x"]
    r_ops = {"x": x, "w": operands["gate"], "bias": operands.get("bias"), "tid2eid": operands.get("tid2eid"),
             "ids": operands.get("ids")}
    r_attrs = {n: attrs[n] for n in ROUTER_ATTRS}
    k = r_attrs["k"]
    lead = x.shape[:-1]
    wt = TensorType((*lead, k), "fp32" if r_attrs["fp32"] else x.dtype)
    it = TensorType((*lead, k), "i64")
    strides = Layout.contiguous(wt.shape).strides  # the routing as dense scratch
    wa, ia = TensorArg(wt, strides), TensorArg(it, strides)
    extra = {"route_weights": wt.nbytes, "route_indices": it.nbytes}
    rcall = _renamed(router.specialise("router", r_ops, {"weights": wa, "indices": ia}, r_attrs)[0], extra)
    m_ops = {n: v for n, v in operands.items() if n not in r_ops}
    m_ops.update(x=x, weights=wa, indices=ia)
    m_attrs = {n: v for n, v in attrs.items() if n not in ROUTER_ATTRS}
    mcalls = [_renamed(c, extra) for c in moe.specialise("moe_experts_shared", m_ops, results, m_attrs)]
    up = mcalls[0]
    if up.fn is not moe.moe_up_kernel:  # grouped mode: the grouping launch needs the routing first
        return [rcall, *mcalls]
    # one launch: the up call's constexprs and pointers, the router's as R_* and renamed (x and the ids it
    # writes are the up call's own pointers)
    ce = {n: v for n, v in up.constexprs.items() if n not in ("PDL", "CALLS")}
    ce.update({ROUTER_PARAMS.get(n, "R_" + n): v for n, v in rcall.constexprs.items() if n not in ("PDL", "CALLS")})
    RT = triton.cdiv(ce["I"], ce["BN"])
    ST = triton.cdiv(ce["S_I"], ce["S_BN"]) if "sw1_ptr" not in up.constexprs else 0  # shared: a pointer
    ce.update(NR=rcall.grid[0], RT=RT, ST=ST)
    have = {p[0] for p in up.pointers}
    pts = up.pointers + [(ROUTER_PARAMS[p], kind, name, ty) for p, kind, name, ty in rcall.pointers
                         if ROUTER_PARAMS[p] not in have]
    pts.append(ptr("phase_ptr", "semaphore", "moe_phase", "*i32"))  # ticket, router programs done, finished
    tag = up.name[len("moe_up_"):].rsplit("_", 1)[0]  # the up call's readable shape tag (name = prefix_tag_hash)
    fused = KernelCall(call_name("moe_router_up", ce, tag), moe_router_up_kernel, ce, pts,
                       (ce["NR"] + ST + ce["E"] * RT, 1, 1), num_warps=max(up.num_warps, rcall.num_warps),
                       scratch_bytes=dict(up.scratch_bytes, moe_phase=3 * 4),
                       unaligned=tuple(sorted(set(up.unaligned) | {ROUTER_PARAMS[p] for p in rcall.unaligned})),
                       flops=up.flops + rcall.flops, mma_dtype=up.mma_dtype,
                       bytes_moved=up.bytes_moved + rcall.bytes_moved)
    return [fused, *mcalls[1:]]

