"""Fold the MoE's one-shot all-reduce into the launch that produces it (issue 34): `all_reduce_oneshot` whose value
is the `partial` of one-launch EP MoE (`mhc_moe_ep`, `moe_router_experts_ep`) and used by it alone becomes a
trailing part of that launch, so its wait for the peers hides behind the shared expert's weights.

Requires: the one-shot all-reduces of `oneshot_allreduce`, the EP MoE of `fuse_mhc_moe` (`partition` makes
`moe_router_experts_ep`).
Guarantees: each such pair becomes one `<producer>_ar` (`ops/fused_allreduce.py`) in the producer's place: its
operands and attributes, plus the all-reduce's `group` and `region_bytes`; its results, `partial` the all-reduce's
(reduced) value. Its kernel (`codegen/kernels/moe_router.py`) publishes the routed partial to the peers, then runs
the shared expert, then waits and sums in rank order: numerics bit-identical (the same rank-order sum).
Runs before `fuse_oneshot_consumer`, which then folds the attention's all-reduce into `mhc_moe_ep_ar` as its leading
phase (one group, one region) and no longer finds the MoE's all-reduce in front of the next layer's attention: the
launch count is the consumer fold's, the MoE's all-reduce now overlapped. Left as they are: a partial with another
use. GPU-only (as `oneshot_allreduce`). Hits: `<func>.folded`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op
from v4compile.ops.fused_allreduce import PRODUCED, PRODUCERS, SUFFIX, folded_attrs

from .base import function_pass
from .rewrite import Rewrite, make_op, operands_of


def fold_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for ar in fn.ops:
        if ar.name != "all_reduce_oneshot":
            continue
        op = rw.producer(ar.operand("x"), only_use=True)
        if op is None or op.name not in PRODUCERS or rw.gone(op) or id(op) in rw.replaced:
            continue
        at = get_op(op.name).results.index(PRODUCED)
        if op.results[at] is not ar.operand("x") or not rw.can_fuse(op, [ar]):
            continue
        results = [ar.results[0] if i == at else r for i, r in enumerate(op.results)]
        rw.replace(op, make_op(rw.namer, op.name + SUFFIX, operands_of(op), folded_attrs(op, ar), op.loc, results),
                   absorbed=[ar])
    return rw.done("folded")


FuseOneshotProducer = function_pass("fuse_oneshot_producer", fold_function, after={
    "oneshot_allreduce": "it folds the one-shot all-reduces that pass makes",
    "fuse_mhc_moe": "it folds into that pass's mhc_moe_ep",
})
