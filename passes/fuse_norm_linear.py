"""Fold a weighted RMSNorm into the one GEMM that reads it (`q_norm` into the merged `wq_b`, the final
norm into the LM head).

Requires: `linear(rms_norm(x, w))` with the norm's result used only by that linear.
Guarantees: one `norm_linear(x, w, W, scale)`: the norm is the GEMM's prologue. Result names kept;
numerics identical (the reference composes the two).
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import make_op, Namer, rebuild, use_counts


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    namer = Namer(fn)
    prod = fn.producers()
    uses = use_counts(fn)
    replace, drop = {}, set()
    for op in fn.ops:
        if op.name != "linear":
            continue
        n = prod.get(id(op.operand("x")))
        if n is None or n.name != "rms_norm" or n.operand("weight") is None or uses.get(id(n.result)) != 1:
            continue
        replace[id(op)] = make_op(namer, "norm_linear", {"x": n.operand("x"), "norm": n.operand("weight"),
                                                         "w": op.operand("w"), "scale": op.operand("scale")},
                                  {**op.attrs, "eps": n.attrs["eps"]}, op.loc, [op.result])
        drop.add(id(n))
    return rebuild(fn, replace, drop), {"fused": len(replace)}


FuseNormLinear = function_pass("fuse_norm_linear", fuse_function)
