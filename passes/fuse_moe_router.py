"""Fold the router into the fused MoE op: router, shared expert and routed experts become one op.

Requires: `moe_experts_shared` (from `fuse_moe`) whose `weights` and `indices` are the two results of one
`router` on the same `x`, each used by that op alone.
Guarantees: the pair becomes one `moe_router_experts_shared` (the router's weight as `gate`, its bias or
hash table + ids, its attributes next to the experts'; role joined), so the routing never leaves the op
and its kernel computes it as the first phase of the routed gate / up launch (`codegen/kernels/
moe_router.py`). Result name kept; numerics bit-identical (the op's reference is the composition).
Expert-parallel modules (`partition{ep>1}`): the FFN is `add(all_reduce(moe_experts(x, local_experts(router(x),
owner))), w2(swiglu(w1 x, w3 x)))`, which `fuse_moe` leaves alone (the shared expert's add waits for the
all-reduce). Here the router, the mask, the routed experts and the shared expert become one
`moe_router_experts_ep` in the routed experts' place, its results the routed partial sum (the value the
`all_reduce` reads, name kept) and the shared expert's output (the value the `add` reads, name kept): the
all-reduce stays a launch of its own beside it, and the add (folded into the seam after it by
`fuse_moe_mhc`) reads the all-reduce's output. Numerics bit-identical (`ops/fused_ep.py`).
Data-parallel modules (`partition{dp, ep}`): the same FFN with the routed part on `xg = all_gather_rows(x)` and
`reduce_scatter_rows` in the all-reduce's place, the shared expert on the rank's own `x`: one
`moe_router_experts_dp(x, xg, ...)` in the routed experts' place (the gather and the reduce-scatter stay
launches beside it).
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused` (single-rank and expert-parallel forms together).
"""

from __future__ import annotations

from v4compile.ir.core import Function, Op
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
    for op in fn.ops:
        if op.name == "moe_experts" and not rw.gone(op):
            _fuse_ep(rw, op)
    return rw.done("fused")


def _fuse_ep(rw: Rewrite, moe: Op) -> None:
    """`moe_experts` of an expert-parallel module with its router, mask and the shared expert beside it."""
    from .fuse_moe import shared_expert, shared_operands
    red = rw.sole_user(moe.result, "all_reduce") or rw.sole_user(moe.result, "reduce_scatter_rows")
    mask = rw.producer(moe.operand("weights"), "local_experts", only_use=True)
    if red is None or mask is None or rw.producer(moe.operand("indices"), "local_experts", only_use=True) is not mask:
        return
    if mask.out("weights_out") is not moe.operand("weights"):
        return
    r = rw.producer(mask.operand("weights"), "router", only_use=True)
    x = moe.operand("x")
    if r is None or rw.producer(mask.operand("indices"), "router", only_use=True) is not r or r.operand("x") is not x \
            or r.out("weights") is not mask.operand("weights"):
        return
    add = rw.sole_user(red.result, "add")
    if add is None or add.operand("a") is not red.result:
        return
    own = x  # the shared expert's tokens: with data parallelism the rank's own, which the gather brought to xg
    if red.name == "reduce_scatter_rows":
        gather = rw.producer(x, "all_gather_rows")
        if gather is None:
            return
        own = gather.operand("x")
    chain = shared_expert(rw, add.operand("b"), own)
    if chain is None or chain[2].attrs["acc"] != moe.attrs["acc"] or not rw.can_fuse(moe, [r, mask, *chain]):
        return
    operands = {k: moe.operand(k) for k in ("x", "w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")}
    if own is not x:
        operands.update(x=own, xg=x)
    s_ops, s_attrs = shared_operands(chain)
    operands.update(s_ops, owner=mask.operand("owner"), gate=r.operand("w"), bias=r.operand("bias"),
                    tid2eid=r.operand("tid2eid"), ids=r.operand("ids"))
    attrs = {n: moe.attrs[n] for n in ("limit", "block", "act", "acc", "out_dtype", "route_weight", "ep")}
    attrs.update(s_attrs, **{n: r.attrs[n] for n in ROUTER_ATTRS}, **tags_of(moe, role=join_roles(r, moe, add)))
    kind = "moe_router_experts_ep" if own is x else "moe_router_experts_dp"
    rw.replace(moe, make_op(rw.namer, kind, operands, attrs, moe.loc,
                            [moe.result, chain[0].result]), absorbed=[r, mask, *chain])


FuseMoeRouter = function_pass("fuse_moe_router", fuse_function, after={
    "fuse_moe": "it folds the router into fuse_moe's op",
})
