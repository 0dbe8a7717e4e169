"""CSR index construction over query lanes `L = b * T + t` (`ops.paged.csr_window`, `csr_compressed`,
`csr_selected`): per lane the pool rows it attends to, packed in order, `indptr [L + 1]` i32.

One program per lane. A lane's offset is the sum of the counts of the lanes before it; the window and
compressed counts are closed-form in the positions, the selected count is recounted from the picks
(K per lane), so no second pass or global scan is needed. Each lane writes only its own entries: the
tail of `indices` past `indptr[L]` is left as it was (the op says it is unused).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, call_name, ptr
from .kvrows import pow2
from .pdl import pdl_enter

BL = 64  # lanes per chunk of the prefix sum
BW = 64  # entries per chunk of a lane's list


@triton.jit
def _lane_pos(pos_ptr, lane, L: tl.constexpr, T: tl.constexpr):
    """(position, first position of its sequence clamped at 0) of each lane."""
    ok = lane < L
    t = tl.load(pos_ptr + lane, mask=ok, other=-1)
    start = tl.maximum(tl.load(pos_ptr + (lane // T) * T, mask=ok, other=0), 0)
    return t, start


@triton.jit
def _count(pos_ptr, sel_ptr, lane, KIND: tl.constexpr, L: tl.constexpr, T: tl.constexpr, WINDOW: tl.constexpr,
           RATIO: tl.constexpr, MAXR: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    t, start = _lane_pos(pos_ptr, lane, L, T)
    if KIND == "window":  # kept positions are the run max(t - W + 1, 0) .. start - 1
        n = start - tl.maximum(t - WINDOW + 1, 0)
    elif KIND == "compressed":
        n = tl.minimum((t + 1) // RATIO, MAXR)
    else:
        k = tl.arange(0, KP)[None, :]
        s = tl.load(sel_ptr + lane.to(tl.int64)[:, None] * K + k, mask=(lane[:, None] < L) & (k < K), other=-1)
        n = tl.sum((s >= 0).to(tl.int32), axis=1)
    return tl.where((t >= 0) & (lane < L), tl.maximum(n, 0), 0)


@triton.jit
def _comp_row(bt_ptr, b, w, BT_S: tl.constexpr, PER_BLOCK: tl.constexpr, ENV: tl.constexpr, mask):
    """`ops.paged.compressed_row` (block table entries < 0 read as block 0, as the reference clamps)."""
    blk = tl.maximum(tl.load(bt_ptr + b * BT_S + w // PER_BLOCK, mask=mask, other=0), 0)
    return blk * ENV + w % PER_BLOCK


@triton.jit
def csr_kernel(pos_ptr, slot_ptr, bt_ptr, sel_ptr, indptr_ptr, indices_ptr,
               KIND: tl.constexpr, L: tl.constexpr, T: tl.constexpr, WINDOW: tl.constexpr,
               SLOT_ROWS: tl.constexpr, N_ROWS: tl.constexpr, RATIO: tl.constexpr, MAXR: tl.constexpr,
               PER_BLOCK: tl.constexpr, ENV: tl.constexpr, BT_S: tl.constexpr, K: tl.constexpr,
               KP: tl.constexpr, BL: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    lane = tl.program_id(0)
    off = 0
    for c in range(0, lane, BL):
        prev = c + tl.arange(0, BL)
        n = _count(pos_ptr, sel_ptr, prev, KIND, L, T, WINDOW, RATIO, MAXR, K, KP)
        off += tl.sum(tl.where(prev < lane, n, 0), axis=0).to(tl.int32)
    me = lane + tl.arange(0, 1)
    cnt = tl.sum(_count(pos_ptr, sel_ptr, me, KIND, L, T, WINDOW, RATIO, MAXR, K, KP), axis=0).to(tl.int32)
    tl.store(indptr_ptr + lane, off)
    if lane == L - 1:
        tl.store(indptr_ptr + L, off + cnt)
    b = lane // T
    t = tl.load(pos_ptr + lane)
    if KIND == "window":
        start = tl.maximum(tl.load(pos_ptr + b * T), 0)
        lo = tl.maximum(t - WINDOW + 1, 0)
        base = N_ROWS - (tl.load(slot_ptr + b).to(tl.int32) + 1) * SLOT_ROWS
        for j0 in range(0, cnt, BW):
            j = j0 + tl.arange(0, BW)
            tl.store(indices_ptr + off + j, base + (lo + j) % WINDOW, mask=j < cnt)
    elif KIND == "compressed":
        for j0 in range(0, cnt, BW):
            j = j0 + tl.arange(0, BW)
            m = j < cnt
            tl.store(indices_ptr + off + j, _comp_row(bt_ptr, b, j, BT_S, PER_BLOCK, ENV, m), mask=m)
    else:
        run = off
        for k0 in range(0, K, BW):
            k = k0 + tl.arange(0, BW)
            s = tl.load(sel_ptr + lane.to(tl.int64) * K + k, mask=k < K, other=-1).to(tl.int32)
            keep = (s >= 0) & ((s * 0 + t) >= 0)  # (a 0-d operand of & breaks the interpreter's mask)
            at = run + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            row = _comp_row(bt_ptr, b, tl.maximum(s, 0), BT_S, PER_BLOCK, ENV, keep)
            tl.store(indices_ptr + at, row, mask=keep)
            run += tl.sum(keep.to(tl.int32), axis=0).to(tl.int32)


def specialise(op_name, operands, results, attrs):
    pos = operands["pos"]
    B, T = pos.shape
    L = B * T
    assert pos.strides == (T, 1), f"{op_name}: pos must be contiguous"
    c = dict(KIND=op_name[len("csr_"):], L=L, T=T, WINDOW=attrs.get("window", 1), SLOT_ROWS=attrs.get("slot_rows", 0),
             N_ROWS=attrs.get("n_rows", 0), RATIO=attrs.get("ratio", 1), MAXR=attrs.get("max_rows", 0),
             PER_BLOCK=attrs["block_tokens"] // attrs["ratio"] if "ratio" in attrs else 1,
             ENV=attrs.get("envelope_rows", 0), BT_S=0, K=1, KP=1, BL=BL, BW=BW,
             slot_ptr=None, bt_ptr=None, sel_ptr=None)
    pointers = [ptr("pos_ptr", "operand", "pos", pos)]
    if op_name == "csr_window":
        pointers.append(ptr("slot_ptr", "operand", "slot", operands["slot"]))
        del c["slot_ptr"]
    else:
        bt = operands["block_table"]
        assert bt.strides[1] == 1
        c["BT_S"] = bt.strides[0]
        pointers.append(ptr("bt_ptr", "operand", "block_table", bt))
        del c["bt_ptr"]
    if op_name == "csr_selected":
        sel = operands["selected"]
        K = sel.shape[2]
        assert sel.strides == (T * K, K, 1)
        c.update(K=K, KP=pow2(K))
        pointers.append(ptr("sel_ptr", "operand", "selected", sel))
        del c["sel_ptr"]
    pointers += [ptr("indptr_ptr", "result", "indptr", results["indptr"]),
                 ptr("indices_ptr", "result", "indices", results["indices"])]
    return [KernelCall(name=call_name(op_name, c, f"l{L}"), fn=csr_kernel, constexprs=c, pointers=pointers,
                       grid=(L, 1, 1), num_warps=1, bytes_moved=results["indices"].type.nbytes)]
