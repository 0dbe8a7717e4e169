"""Fuse the routed experts and the shared expert into one op.

Requires: the traced FFN (`moe_experts`, and the shared expert as `linear` w1, `linear` w3, `swiglu`,
`linear` w2 on the same input, summed by `add`); run it before `merge_sibling_gemms`, which would
otherwise merge the shared expert's w1 / w3.
Guarantees: `y = add(moe_experts(x, ...), w2(swiglu(w1 x, w3 x)))` becomes one `moe_experts_shared`
(the router stays its own op). Result names kept; numerics bit-identical.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.ir.core import Function

from .base import FunctionPass, register
from .rewrite import make_op, Namer, rebuild, use_counts


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    namer = Namer(fn)
    prod = fn.producers()
    uses = use_counts(fn)
    replace, drop, n = {}, set(), 0
    for op in fn.ops:
        if op.name != "add":
            continue
        a, b = op.operands
        moe, down = prod.get(id(a)), prod.get(id(b))
        if moe is None or down is None or moe.name != "moe_experts" or down.name != "linear":
            continue
        sw = prod.get(id(down.operands[0]))
        if sw is None or sw.name != "swiglu":
            continue
        gate, up = prod.get(id(sw.operands[0])), prod.get(id(sw.operands[1]))
        x = moe.operands[0]
        if (gate is None or up is None or gate.name != "linear" or up.name != "linear" or gate.operands[0] is not x
                or up.operands[0] is not x):
            continue
        inner = [moe, down, sw, gate, up]
        if any(uses.get(id(o.result)) != 1 for o in inner):
            continue
        new = make_op(namer, "moe_experts_shared",
                      [*moe.operands[:6], gate.operands[1], down.operands[1], up.operands[1], *moe.operands[6:9],
                       gate.operands[2], down.operands[2], up.operands[2]],
                      {"limit": moe.attrs["limit"], "block": moe.attrs["block"], "shared_block": gate.attrs["block"]},
                      moe.loc, [op.result])
        replace[id(op)] = new
        drop.update(id(o) for o in inner)
        n += 1
    return rebuild(fn, replace, drop), {"fused": n}


@register
@dataclass(frozen=True)
class FuseMoe(FunctionPass):
    name = "fuse_moe"

    def rewrite(self, fn):
        return fuse_function(fn)
