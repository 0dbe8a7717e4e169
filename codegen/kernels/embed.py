"""embed family: `y[b, t] = table[max(ids[b, t], 0)]` (padding ids -1 read row 0, as the reference)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .pdl import pdl_enter


@triton.jit
def embed_kernel(ids_ptr, t_ptr, y_ptr, R: tl.constexpr, D: tl.constexpr, I_S: tl.constexpr, T_RS: tl.constexpr,
                 Y_RS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rok = rows < R
    ids = tl.maximum(tl.load(ids_ptr + rows * I_S, mask=rok, other=0).to(tl.int64), 0)
    ok = rok[:, None] & (cols[None, :] < D)
    v = tl.load(t_ptr + ids[:, None] * T_RS + cols[None, :], mask=ok)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * Y_RS + cols[None, :], v, mask=ok)


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "embed":
        raise KeyError(f"embed family has no op '{op_name}'")
    ids, table, y = operands["ids"], operands["table"], results["x"]
    R = ids.type.numel
    _, i_rs, i_cs = rows_of(TensorArg(ids.type.with_shape(*ids.shape, 1), (*ids.strides, 1)), "embed ids")
    _, y_rs, y_cs = rows_of(y, "embed result")
    if table.strides[1] != 1 or y_cs != 1:
        raise ValueError("embed: table rows and result rows must be contiguous")
    D = table.shape[1]
    BD = min(1024, triton.next_power_of_2(D))
    BR = max(1, min(16, 4096 // BD))
    ce = dict(R=R, D=D, I_S=i_rs, T_RS=table.strides[0], Y_RS=y_rs, BR=BR, BD=BD)
    pointers = [ptr("ids_ptr", "operand", "ids", ids), ptr("t_ptr", "operand", "table", table),
                ptr("y_ptr", "result", "x", y)]
    return [KernelCall(call_name("embed", ce, f"r{R}_d{D}_{table.dtype}"), embed_kernel, ce, pointers,
                       (triton.cdiv(R, BR), triton.cdiv(D, BD), 1), num_warps=4,
                       unaligned=unaligned({"ids_ptr": ids, "t_ptr": table, "y_ptr": y}),
                       bytes_moved=2 * y.type.nbytes + ids.type.nbytes)]
