"""local_experts family: expert parallelism's ownership mask (`ops/collective.py`), one small launch.

For every routed slot (token, k) with expert e = indices[token, k]: local = owner[e] (this rank's index of
e in its expert stack, -1 where another rank owns it); indices_out = local, weights_out = weights where
local >= 0, else 0. The MoE launch after it (`moe` family) skips a slot with id -1: it is in no expert's
pair list and the combine adds nothing for it, so another rank's slot costs no weight read and no FLOPs
(at EP 8, 7/8 of the slots).

Why a launch of its own rather than an expert range inside the MoE kernels: the mask is what the cpu
target's ONNX lowering and the reference run too (one op, one meaning on every target), and the rank's
expert range is data (the `owner` table is a per-rank weight: one program and one kernel set serve
every rank), not a compile-time constant of the MoE kernels. Its cost: one launch of a few hundred bytes
per layer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .pdl import pdl_enter


@triton.jit
def local_experts_kernel(w_ptr, idx_ptr, owner_ptr, wo_ptr, io_ptr, R: tl.constexpr, K: tl.constexpr,
                         E: tl.constexpr, W_RS: tl.constexpr, W_CS: tl.constexpr, I_RS: tl.constexpr,
                         I_CS: tl.constexpr, WO_RS: tl.constexpr, WO_CS: tl.constexpr, IO_RS: tl.constexpr,
                         IO_CS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    ok = (rows[:, None] < R) & (cols[None, :] < K)
    r64 = rows[:, None].to(tl.int64)
    e = tl.load(idx_ptr + r64 * I_RS + cols[None, :] * I_CS, mask=ok, other=0)
    # an expert id outside [0, E) would read outside the table: no rank owns it (weight 0, as a GPU cannot fault)
    known = ok & (e >= 0) & (e < E)
    local = tl.load(owner_ptr + tl.where(known, e, 0), mask=known, other=-1)
    w = tl.load(w_ptr + r64 * W_RS + cols[None, :] * W_CS, mask=ok, other=0.0)
    mine = local >= 0
    tl.store(wo_ptr + r64 * WO_RS + cols[None, :] * WO_CS, tl.where(mine, w, tl.zeros_like(w)), mask=ok)
    tl.store(io_ptr + r64 * IO_RS + cols[None, :] * IO_CS, local.to(io_ptr.dtype.element_ty), mask=ok)


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "local_experts":
        raise KeyError(f"local_experts family has no op '{op_name}'")
    w, idx, owner = operands["weights"], operands["indices"], operands["owner"]
    wo, io = results["weights_out"], results["indices_out"]
    R, w_rs, w_cs = rows_of(w, "local_experts weights")
    _, i_rs, i_cs = rows_of(idx, "local_experts indices")
    _, wo_rs, wo_cs = rows_of(wo, "local_experts weights_out")
    _, io_rs, io_cs = rows_of(io, "local_experts indices_out")
    if owner.type.rank != 1 or owner.strides[0] != 1:
        raise ValueError("local_experts: the owner table must be a contiguous [n_experts] vector")
    K, E = w.shape[-1], owner.shape[0]
    BK = triton.next_power_of_2(K)
    BR = max(1, min(64, 1024 // BK))
    ce = dict(R=R, K=K, E=E, W_RS=w_rs, W_CS=w_cs, I_RS=i_rs, I_CS=i_cs, WO_RS=wo_rs, WO_CS=wo_cs, IO_RS=io_rs,
              IO_CS=io_cs, BR=BR, BK=BK)
    params = {"w_ptr": w, "idx_ptr": idx, "owner_ptr": owner, "wo_ptr": wo, "io_ptr": io}
    pointers = [ptr("w_ptr", "operand", "weights", w), ptr("idx_ptr", "operand", "indices", idx),
                ptr("owner_ptr", "operand", "owner", owner), ptr("wo_ptr", "result", "weights_out", wo),
                ptr("io_ptr", "result", "indices_out", io)]
    return [KernelCall(call_name("local_experts", ce, f"r{R}_k{K}_e{E}_{w.dtype}"), local_experts_kernel, ce,
                       pointers, (triton.cdiv(R, BR), 1, 1), num_warps=1, unaligned=unaligned(params),
                       bytes_moved=2 * (w.type.nbytes + idx.type.nbytes) + owner.type.nbytes)]
