"""Fold a weighted RMSNorm into the one GEMM that reads it (`q_norm` into the merged `wq_b`, the final
norm into the LM head).

Requires: `linear(rms_norm(x, w))` with the norm's result used only by that linear, and no op left outside on a path
between them (`Rewrite.can_fuse`).
Guarantees: one `norm_linear(x, w, W, scale)`: the norm is the GEMM's prologue. Result names kept;
numerics identical (the reference composes the two).
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import Rewrite, make_op


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != "linear":
            continue
        n = rw.producer(op.operand("x"), "rms_norm", only_use=True)
        if n is None or n.operand("weight") is None or not rw.can_fuse(op, [n]):
            continue
        rw.replace(op, make_op(rw.namer, "norm_linear", {"x": n.operand("x"), "norm": n.operand("weight"),
                                                         "w": op.operand("w"), "scale": op.operand("scale")},
                               {**op.attrs, "eps": n.attrs["eps"]}, op.loc, [op.result]), absorbed=[n])
    return rw.done("fused")


FuseNormLinear = function_pass("fuse_norm_linear", fuse_function)
