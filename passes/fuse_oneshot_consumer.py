"""Fold each one-shot all-reduce into the launch of its consumer (issue 34): `all_reduce_oneshot` whose result
is the `y` of one phased consumer (`mhc_moe_ep`, `mhc_moe_ep_ar`, `mhc_add_pair_norm_linear`) and used by it alone becomes that
consumer's leading phase, one launch fewer per fold.

Requires: the one-shot all-reduces of `oneshot_allreduce`, the consumers of `fuse_mhc_moe` / `fuse_attn_front`.
Guarantees: each such pair becomes one `ar_<consumer>` (`ops/fused_allreduce.py`) in the consumer's place: the
consumer's operands with `y` the all-reduce's operand (this rank's partial value), its attributes plus the
all-reduce's `group` and `region_bytes`, its results (names kept). Its kernel (the consumer's family) runs the
one-shot protocol in the launch's first programs (`codegen/kernels/allreduce.py: oneshot_tiles`) into scratch;
the programs that read the reduced value wait for them. Numerics bit-identical (the same rank-order sum).
Left as they are: an all-reduce whose value has another use, or whose consumer is another op (layer 0's
`hc_post`, the last layer's `add` before the head); their one-shot keeps its launch. Under `--allreduce nccl`
there is no one-shot all-reduce, so nothing to fold. Kept out of the cpu pipeline (a GPU-only pass, as
`oneshot_allreduce`). Hits: `<func>.folded`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ops.fused_allreduce import AR_ATTRS, CONSUMERS, PREFIX, REDUCED, folded_attrs, producer_of

from .base import function_pass
from .rewrite import Rewrite, make_op, operands_of


def fold_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name not in CONSUMERS:
            continue
        ar = rw.producer(op.operand(REDUCED), "all_reduce_oneshot", only_use=True)
        if ar is None or list(op.operands).count(op.operand(REDUCED)) != 1 or not rw.can_fuse(op, [ar]):
            continue
        if producer_of(op.name) and any(op.attrs[n] != ar.attrs[n] for n in AR_ATTRS):
            continue  # (a producer fold's all-reduce and the leading one share the attributes: one group, one region)
        operands = {**operands_of(op), REDUCED: ar.operand("x")}
        # (`<producer>_ar`'s own AR_ATTRS are the same values, checked above)
        rw.replace(op, make_op(rw.namer, PREFIX + op.name, operands, folded_attrs(op, ar), op.loc, list(op.results)),
                   absorbed=[ar])
    return rw.done("folded")


FuseOneshotConsumer = function_pass("fuse_oneshot_consumer", fold_function, after={
    "oneshot_allreduce": "it folds the one-shot all-reduces that pass makes",
    "fuse_mhc_moe": "it folds into that pass's mhc_moe_ep",
    "fuse_attn_front": "it folds into that pass's mhc_add_pair_norm_linear",
    "fuse_oneshot_producer": "it folds into that pass's mhc_moe_ep_ar (the MoE's all-reduce is then no longer "
                             "the next layer's attention's to fold)",
})
