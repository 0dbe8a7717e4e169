"""Fold the router into the fused MoE op: router, shared expert and routed experts become one op.

Requires: `moe_experts_shared` (from `fuse_moe`) whose `weights` and `indices` are the two results of one
`router` on the same `x`, each used by that op alone.
Guarantees: the pair becomes one `moe_router_experts_shared` (the router's weight as `gate`, its bias or
hash table + ids, its attributes next to the experts'; role joined), so the routing never leaves the op
and its kernel computes it as the first phase of the routed gate / up launch (`codegen/kernels/
moe_router.py`). Result name kept; numerics bit-identical (the op's reference is the composition).
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of

ROUTER_ATTRS = ("k", "route_scale", "denom_eps", "fp32")


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != "moe_experts_shared":
            continue
        r = rw.producer(op.operand("weights"), "router", only_use=True)
        if r is None or rw.producer(op.operand("indices"), "router", only_use=True) is not r:
            continue
        if r.operand("x") is not op.operand("x") or r.out("weights") is not op.operand("weights"):
            continue  # the router must route this op's own tokens, its weights as weights
        operands = {n: v for n, v in operands_of(op).items() if n not in ("weights", "indices")}
        operands.update(gate=r.operand("w"), bias=r.operand("bias"), tid2eid=r.operand("tid2eid"), ids=r.operand("ids"))
        attrs = {n: v for n, v in op.attrs.items() if n in get_op(op.name).attrs}
        attrs.update({n: r.attrs[n] for n in ROUTER_ATTRS}, **tags_of(op, role=join_roles(r, op)))
        rw.replace(op, make_op(rw.namer, "moe_router_experts_shared", operands, attrs, op.loc, [op.result]),
                   absorbed=[r])
    return rw.done("fused")


FuseMoeRouter = function_pass("fuse_moe_router", fuse_function, after={
    "fuse_moe": "it folds the router into fuse_moe's op",
})
