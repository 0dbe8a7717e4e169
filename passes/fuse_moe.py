"""Fuse the routed experts and the shared expert into one op.

Requires: the traced FFN (`moe_experts`, and the shared expert as `linear` w1, `linear` w3, `swiglu`,
`linear` w2 on the same input, summed by `add`); run it before `merge_sibling_gemms`, which would
otherwise merge the shared expert's w1 / w3.
Guarantees: `y = add(moe_experts(x, ...), w2(swiglu(w1 x, w3 x)))` becomes one `moe_experts_shared`
(the router stays its own op here: `fuse_moe_router` folds it in on the gpu pipeline; role
`ffn.experts+ffn.shared`; `act` is the routed experts' activation format, `shared_act` the shared
expert's). Result names kept; numerics bit-identical.
Expert-parallel modules: the routed experts' output goes through `all_reduce{ep}` before the shared expert's
add, so the add is not this pattern and nothing fires here; `fuse_moe_router` fuses that FFN (router, mask,
routed and shared experts) in one step on the gpu pipeline, `shared_expert` / `shared_operands` shared with it.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function, Op, Value

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, tags_of


def shared_expert(rw: Rewrite, y: Value, x: Value) -> list[Op] | None:
    """The shared expert `w2(swiglu(w1 x, w3 x))` whose output is `y` ([down, swiglu, gate, up], each used
    by the chain alone), if that is what produces `y` from `x`."""
    down = rw.producer(y, "linear")
    sw = rw.producer(down.operand("x"), "swiglu") if down is not None else None
    if sw is None:
        return None
    gate, up = rw.producer(sw.operand("gate"), "linear"), rw.producer(sw.operand("up"), "linear")
    if gate is None or up is None or gate.operand("x") is not x or up.operand("x") is not x:
        return None
    if not rw.used_once(down, sw, gate, up):
        return None
    lin = {(g.attrs["block"], g.attrs["act"], g.attrs["acc"], g.attrs["out_dtype"]) for g in (gate, up, down)}
    if len(lin) != 1 or gate.attrs["out_dtype"]:
        return None  # the fused op has one shared-expert numerics, results in the activation dtype
    return [down, sw, gate, up]


def shared_operands(chain: list[Op]) -> tuple[dict, dict]:
    """The fused op's shared-expert operands and attributes from `shared_expert`'s chain."""
    down, _, gate, up = chain
    return ({"s1": gate.operand("w"), "s2": down.operand("w"), "s3": up.operand("w"), "s1_scale": gate.operand("scale"),
             "s2_scale": down.operand("scale"), "s3_scale": up.operand("scale")},
            {"shared_block": gate.attrs["block"], "shared_act": gate.attrs["act"]})


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != "add":
            continue
        moe = rw.producer(op.operand("a"), "moe_experts", only_use=True)
        if moe is None:
            continue
        x = moe.operand("x")
        chain = shared_expert(rw, op.operand("b"), x)
        if chain is None or chain[2].attrs["acc"] != moe.attrs["acc"]:
            continue
        operands = {k: moe.operand(k) for k in ("x", "weights", "indices", "w1", "w2", "w3", "w1_scale", "w2_scale",
                                                "w3_scale")}
        s_ops, s_attrs = shared_operands(chain)
        operands.update(s_ops)
        attrs = {"limit": moe.attrs["limit"], "block": moe.attrs["block"], "act": moe.attrs["act"],
                 "acc": moe.attrs["acc"], "out_dtype": moe.attrs["out_dtype"],
                 "route_weight": moe.attrs["route_weight"], **s_attrs, **tags_of(moe, role=join_roles(moe, op))}
        rw.replace(op, make_op(rw.namer, "moe_experts_shared", operands, attrs, moe.loc, [op.result]),
                   absorbed=[moe, *chain])
    return rw.done("fused")


FuseMoe = function_pass("fuse_moe", fuse_function)
