"""Fold the seam after the MoE into it: `moe_router_experts_shared` and the `mhc_post_pre` that reads its
output become one op, so at decode the whole FFN and the next attention's mHC front are one launch.

Requires: `moe_router_experts_shared` (from `fuse_moe_router`) whose output `y` is the `y` of one
`mhc_post_pre` (from `fuse_mhc_post_pre`, its RMSNorm folded: the `norm` variant) and used by it alone.
Guarantees: the pair becomes one `moe_mhc_post_pre` in the seam's place (the MoE's operands then the
seam's, both attribute sets, the MoE's layer tag, roles joined), its results the seam's values (names
kept); the MoE's output never leaves the op. Its kernel runs the seam as the last phase of the MoE's one
decode launch (`codegen/kernels/moe_router.py`). Numerics bit-identical (the reference is the composition).
The last layer's `mhc_post_head` and layer 0's unfused seam are left as they are.
Expert-parallel modules: the seam after `moe_router_experts_ep` (from `fuse_moe_router`) reads
`add(all_reduce(partial), shared)`; the add (its result used by the seam alone) folds into the seam, which
becomes one `mhc_post_pre_add(reduced, shared, ...)` (results the seam's values; numerics bit-identical:
the add rounds in the value's dtype first, as `add` did). The all-reduce stays a launch beside it. Likewise
on data-parallel modules: `add(reduce_scatter_rows(partial), shared)` of a `moe_router_experts_dp`. (The seam
then becomes the first phase of the next attention's front launch: `fuse_attn_front`.)
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != "mhc_post_pre" or op.operand("norm") is None:
            continue
        moe = rw.producer(op.operand("y"), "moe_router_experts_shared", only_use=True)
        if moe is not None:
            operands = {**operands_of(moe), **{n: v for n, v in operands_of(op).items() if n != "y"}}
            attrs = {n: v for n, v in moe.attrs.items() if n in get_op(moe.name).attrs}
            attrs.update({n: v for n, v in op.attrs.items() if n in get_op(op.name).attrs and n != "variant"})
            attrs.update(tags_of(moe, role=join_roles(moe, op)))  # the MoE's layer: its weights are the launch's bulk
            rw.replace(op, make_op(rw.namer, "moe_mhc_post_pre", operands, attrs, op.loc, list(op.results)),
                       absorbed=[moe])
        else:
            _fold_add(rw, op)
    return rw.done("fused")


def _fold_add(rw: Rewrite, seam) -> None:
    """The seam after an expert-parallel MoE: `mhc_post_pre(add(all_reduce(partial), shared))` -> one op."""
    add = rw.producer(seam.operand("y"), "add", only_use=True)
    red = rw.producer(add.operand("a")) if add is not None else None
    if red is None or red.name not in ("all_reduce", "reduce_scatter_rows"):
        return
    moe = rw.producer(add.operand("b"))
    if moe is None or moe.name not in ("moe_router_experts_ep", "moe_router_experts_dp"):
        return
    if red.operand("x") is not moe.out("partial") or add.operand("b") is not moe.out("shared"):
        return
    operands = {"y": red.result, "y2": add.operand("b"),
                **{n: v for n, v in operands_of(seam).items() if n != "y"}}
    attrs = {n: v for n, v in seam.attrs.items() if n in get_op(seam.name).attrs and n != "variant"}
    attrs.update(tags_of(seam, role=join_roles(add, seam)))
    rw.replace(seam, make_op(rw.namer, "mhc_post_pre_add", operands, attrs, seam.loc, list(seam.results)),
               absorbed=[add])


FuseMoeMhc = function_pass("fuse_moe_mhc", fuse_function, after={
    "fuse_moe_router": "it fuses fuse_moe_router's op with the seam after it",
    "fuse_mhc_post_pre": "it fuses fuse_mhc_post_pre's seam into the MoE's op",
})
