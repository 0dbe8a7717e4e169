"""Fold `wo_b` into `wo_a`'s launch: the attention's output projection becomes one op, one launch fewer per
layer.

Requires: `fuse_inv_rope_wo_a` has run: a `rope_out_proj` (wo_a reading the attention output through its
inverse RoPE) whose result `z` has no user but one `linear` (wo_b, as its `x`) of the same accumulation.
Guarantees: the pair becomes one `rope_out_proj_linear(o, pos, w, scale, wb, wb_scale)` in the linear's
place (wo_a's attributes as they were, wo_b's as `block_b` / `act_b` / `out_dtype_b`, wo_a's layer tag),
its result the linear's value (name kept); `z` never leaves the op. Its kernel (`codegen/kernels/
out_proj.py`) runs wo_a's programs and then wo_b's as two ticketed phases of one launch, each the unfused
launch's GEMM body with its own roundings, so numerics are bit-identical (the reference is the composition).
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, tags_of


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != "linear":
            continue
        wo_a = rw.producer(op.operand("x"), "rope_out_proj", only_use=True)
        if wo_a is None or wo_a.attrs["acc"] != op.attrs["acc"]:
            continue
        attrs = {n: wo_a.attrs[n] for n in ("dim", "theta", "yarn", "groups", "block", "act", "acc", "out_dtype")}
        attrs.update(block_b=op.attrs["block"], act_b=op.attrs["act"], out_dtype_b=op.attrs["out_dtype"])
        attrs.update(tags_of(wo_a, role=join_roles(wo_a, op)))
        operands = {"o": wo_a.operand("o"), "pos": wo_a.operand("pos"), "w": wo_a.operand("w"),
                    "scale": wo_a.operand("scale"), "wb": op.operand("w"), "wb_scale": op.operand("scale")}
        rw.replace(op, make_op(rw.namer, "rope_out_proj_linear", operands, attrs, op.loc, [op.result]),
                   absorbed=[wo_a])
    return rw.done("fused")


FuseOutProj = function_pass("fuse_out_proj", fuse_function)
