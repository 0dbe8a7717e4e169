"""rms_norm family: RMSNorm over the last axis in fp32.

Weighted: `(w * (x * r)).to(dtype)` with r = 1 / sqrt(mean(x^2) + eps) (the reference's order of fp32
products). Unweighted (the per-head q norm): `x * r.to(dtype)` rounded once more, as the reference does;
with mean "dtype" the squares, their mean and the sum with eps are rounded to the dtype too.
One program per BR rows, the whole row (BD = next power of two of D) in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr, rows_of, unaligned
from .pdl import pdl_enter


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, R: tl.constexpr, D: tl.constexpr, X_RS: tl.constexpr, X_CS: tl.constexpr,
                    Y_RS: tl.constexpr, Y_CS: tl.constexpr, EPS: tl.constexpr, MEAN_DT: tl.constexpr, BR: tl.constexpr,
                    BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    ok = (rows[:, None] < R) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * X_RS + cols[None, :] * X_CS, mask=ok, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    if MEAN_DT:  # squares, their mean, + eps and the rsqrt each rounded to dt (mean "dtype", unweighted only)
        ms = (tl.sum((x * x).to(dt).to(tl.float32), axis=1) / D).to(dt).to(tl.float32)
        r = 1.0 / tl.sqrt_rn((ms + EPS).to(dt).to(tl.float32))
    else:
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + EPS)
    if w_ptr is None:
        y = x * r.to(dt).to(tl.float32)[:, None]
    else:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = w[None, :] * (x * r[:, None])
    tl.store(y_ptr + rows[:, None].to(tl.int64) * Y_RS + cols[None, :] * Y_CS, y.to(dt), mask=ok)


def rms_norm_call(x: TensorArg, w: TensorArg | None, y: TensorArg, eps: float, mean: str = "fp32") -> KernelCall:
    R, x_rs, x_cs = rows_of(x, "rms_norm x")
    _, y_rs, y_cs = rows_of(y, "rms_norm y")
    D = x.shape[-1]
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 4096 // BD))
    ce = dict(R=R, D=D, X_RS=x_rs, X_CS=x_cs, Y_RS=y_rs, Y_CS=y_cs, EPS=float(eps), MEAN_DT=mean == "dtype", BR=BR,
              BD=BD)
    pointers = [ptr("x_ptr", "operand", "x", x)]
    if w is None:
        ce["w_ptr"] = None
    else:
        pointers.append(ptr("w_ptr", "operand", "weight", w))
    pointers.append(ptr("y_ptr", "result", "y", y))
    return KernelCall(call_name("rms_norm", ce, f"r{R}_d{D}_{x.dtype}"), rms_norm_kernel, ce, pointers,
                      (triton.cdiv(R, BR), 1, 1), num_warps=4 if BD <= 2048 else 8,
                      unaligned=unaligned({"x_ptr": x, "w_ptr": w, "y_ptr": y}),
                      bytes_moved=x.type.nbytes + y.type.nbytes + (w.type.nbytes if w else 0))


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name != "rms_norm":
        raise KeyError(f"rms_norm family has no op '{op_name}'")
    return [rms_norm_call(operands["x"], operands.get("weight"), results["y"], attrs["eps"], attrs["mean"])]
