"""pool_write_window: this chunk's raw kv rows into each sequence's window ring of the paged pool
(`ops.paged.pool_write_window`; planes native / bf16 / fp8 nope+scale+rope), updated in place.

One program per (sequence, block of BT lanes); only the sequence's last `window` positions are written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, any_row, call_name, ptr, row_offsets, unaligned
from .kvrows import plane_consts, pow2, ring_keep, store_rows
from .pdl import pdl_enter


@triton.jit
def pool_write_window_kernel(kv_ptr, pos_ptr, slot_ptr, p0, p1, p2,
                             T: tl.constexpr, TP: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                             DP: tl.constexpr, KV_SB: tl.constexpr, KV_ST: tl.constexpr,
                             WINDOW: tl.constexpr, SLOT_ROWS: tl.constexpr, N_ROWS: tl.constexpr,
                             FMT: tl.constexpr, NPLANES: tl.constexpr,
                             NOPE: tl.constexpr, BLK: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                             S2: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    lane = tl.program_id(1) * BT + tl.arange(0, BT)
    keep, p = ring_keep(pos_ptr, b, lane, T, TP, WINDOW)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    rows = N_ROWS - (slot + 1) * SLOT_ROWS + (tl.maximum(p, 0) % WINDOW)  # planes start at the layer's row
    col = tl.arange(0, DP)[None, :]
    x = tl.load(kv_ptr + b * KV_SB + lane[:, None] * KV_ST + col, mask=keep[:, None] & (col < D),
                other=0.0).to(tl.float32)
    store_rows(p0, p1, p2, rows, keep, x, FMT, NPLANES, BT, DP, D, NOPE, BLK, S0, S1, S2)


def specialise(op_name, operands, results, attrs):
    assert op_name == "pool_write_window", op_name
    kv, pos, slot = operands["kv"], operands["pos"], operands["slot"]
    planes = [operands.get(f"p{i}") for i in range(3)]
    B, T, D = kv.shape
    assert kv.strides[2] == 1 and pos.strides == (T, 1), "pool_write_window: kv rows and pos must be contiguous"
    BT = min(pow2(T), 16)
    c = dict(T=T, TP=pow2(T), BT=BT, D=D, DP=pow2(D), KV_SB=kv.strides[0], KV_ST=kv.strides[1],
             WINDOW=attrs["window"], SLOT_ROWS=attrs["slot_rows"], N_ROWS=attrs["n_rows"],
             **plane_consts(attrs["fmt"], planes, D))
    pointers = [ptr("kv_ptr", "operand", "kv", kv), ptr("pos_ptr", "operand", "pos", pos),
                ptr("slot_ptr", "operand", "slot", slot)]
    for i, p in enumerate(planes):
        # Tied results: the planes are updated in place, so the kernel writes through the operand pointers.
        pointers.append(ptr(f"p{i}", "operand", f"p{i}", p) if p is not None else None)
    pointers = [p for p in pointers if p is not None]
    for i, p in enumerate(planes):
        if p is None:
            c[f"p{i}"] = None
    return [KernelCall(name=call_name("pool_write_window", c, f"b{B}_t{T}_d{D}_{attrs['fmt']}"),
                       fn=pool_write_window_kernel, constexprs=c, pointers=pointers,
                       grid=(B, triton.cdiv(T, BT), 1), num_warps=4,
                       unaligned=unaligned({"kv_ptr": kv, **{f"p{i}": any_row(p) for i, p in enumerate(planes)}}),
                       offsets=row_offsets({f"p{i}": p for i, p in enumerate(planes)}, attrs["layer_row"]),
                       bytes_moved=B * T * D * 2 * (2 if kv.dtype == "bf16" else 4))]
