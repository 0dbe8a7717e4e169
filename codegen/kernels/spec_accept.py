"""spec_accept family: the greedy speculative acceptance between a verify and the MTP block (the op's reference
states the rule): one program per sequence, each lane's argmax over the vocabulary streamed in chunks of BV
(ties to the lowest id, as torch.argmax), then the lanes in order: draft t survives while every earlier one did
and it equals lane t - 1's argmax (and its position is real)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, unaligned
from .pdl import pdl_enter


@triton.jit
def spec_accept_kernel(l_ptr, ids_ptr, pos_ptr, next_ptr, kept_ptr, T: tl.constexpr, V: tl.constexpr,
                       L_BS: tl.constexpr, L_TS: tl.constexpr, L_VS: tl.constexpr, I_BS: tl.constexpr,
                       I_TS: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr, N_BS: tl.constexpr,
                       N_TS: tl.constexpr, K_BS: tl.constexpr, K_TS: tl.constexpr, BV: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BV)
    keep = 1
    prev = 0
    for t in tl.static_range(T):
        lane = l_ptr + b * L_BS + t * L_TS
        best = float("-inf")
        bi = 0
        for v0 in range(0, V, BV):
            v = tl.load(lane + (v0 + r) * L_VS, mask=v0 + r < V, other=float("-inf")).to(tl.float32)
            cm = tl.max(v, axis=0)
            ci = tl.min(tl.where(v == cm, v0 + r, V), axis=0)
            take = cm > best
            bi = tl.where(take, ci, bi)
            best = tl.where(take, cm, best)
        p = tl.load(pos_ptr + b * P_BS + t * P_TS)
        if t > 0:
            d = tl.load(ids_ptr + b * I_BS + t * I_TS)
            keep = keep * ((d == prev) & (p >= 0)).to(tl.int32)
        tl.store(next_ptr + b * N_BS + t * N_TS, bi.to(next_ptr.dtype.element_ty))
        tl.store(kept_ptr + b * K_BS + t * K_TS, tl.where(keep > 0, p, -1))
        prev = bi


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "spec_accept":
        raise KeyError(f"spec_accept family has no op '{op_name}'")
    lg, ids, pos = operands["logits"], operands["ids"], operands["pos"]
    nxt, kept = results["next_ids"], results["kept_pos"]
    if lg.type.rank != 3:
        raise ValueError(f"spec_accept: logits must be [B, T, V], got {lg.shape}")
    B, T, V = lg.shape
    BV = min(1024, triton.next_power_of_2(V))
    ce = dict(T=T, V=V, L_BS=lg.strides[0], L_TS=lg.strides[1], L_VS=lg.strides[2], I_BS=ids.strides[0],
              I_TS=ids.strides[1], P_BS=pos.strides[0], P_TS=pos.strides[1], N_BS=nxt.strides[0],
              N_TS=nxt.strides[1], K_BS=kept.strides[0], K_TS=kept.strides[1], BV=BV)
    pointers = [ptr("l_ptr", "operand", "logits", lg), ptr("ids_ptr", "operand", "ids", ids),
                ptr("pos_ptr", "operand", "pos", pos), ptr("next_ptr", "result", "next_ids", nxt),
                ptr("kept_ptr", "result", "kept_pos", kept)]
    return [KernelCall(call_name("spec_accept", ce, f"b{B}_t{T}_v{V}_{lg.dtype}"), spec_accept_kernel, ce, pointers,
                       (B, 1, 1), num_warps=4,
                       unaligned=unaligned({"l_ptr": lg, "ids_ptr": ids, "pos_ptr": pos, "next_ptr": nxt,
                                            "kept_ptr": kept}),
                       bytes_moved=lg.type.nbytes + ids.type.nbytes + 2 * pos.type.nbytes + nxt.type.nbytes)]
