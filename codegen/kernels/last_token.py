"""last_token family: `y[b] = x[b, n_b - 1]` with n_b the count of valid lanes (pos >= 0) of sequence b
(lane 0 when none), read from the positions buffer inside the kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, unaligned
from .pdl import pdl_enter


@triton.jit
def last_token_kernel(x_ptr, pos_ptr, y_ptr, T: tl.constexpr, D: tl.constexpr, X_BS: tl.constexpr,
                      X_TS: tl.constexpr, X_CS: tl.constexpr, P_BS: tl.constexpr, P_TS: tl.constexpr,
                      Y_BS: tl.constexpr, Y_CS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    t = tl.arange(0, BT)
    pos = tl.load(pos_ptr + b * P_BS + t * P_TS, mask=t < T, other=-1)
    n = tl.sum((pos >= 0).to(tl.int32), axis=0)
    idx = tl.maximum(n - 1, 0)
    v = tl.load(x_ptr + b.to(tl.int64) * X_BS + idx * X_TS + cols * X_CS, mask=cols < D)
    tl.store(y_ptr + b.to(tl.int64) * Y_BS + cols * Y_CS, v, mask=cols < D)


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "last_token":
        raise KeyError(f"last_token family has no op '{op_name}'")
    x, pos, y = operands["x"], operands["pos"], results["y"]
    if x.type.rank != 3:
        raise ValueError(f"last_token: x must be [B, T, D], got {x.shape}")
    B, T, D = x.shape
    BD = min(1024, triton.next_power_of_2(D))
    ce = dict(T=T, D=D, X_BS=x.strides[0], X_TS=x.strides[1], X_CS=x.strides[2], P_BS=pos.strides[0],
              P_TS=pos.strides[1], Y_BS=y.strides[0], Y_CS=y.strides[1], BT=triton.next_power_of_2(T), BD=BD)
    pointers = [ptr("x_ptr", "operand", "x", x), ptr("pos_ptr", "operand", "pos", pos), ptr("y_ptr", "result", "y", y)]
    return [KernelCall(call_name("last_token", ce, f"b{B}_t{T}_d{D}_{x.dtype}"), last_token_kernel, ce, pointers,
                       (B, triton.cdiv(D, BD), 1), num_warps=4,
                       unaligned=unaligned({"x_ptr": x, "pos_ptr": pos, "y_ptr": y}),
                       bytes_moved=2 * y.type.nbytes + pos.type.nbytes)]
