"""The one-shot all-reduce folded into its consumer (`passes/fuse_oneshot_consumer.py`, issue 34): `ar_<op>` is
`<op>` whose operand `REDUCED` (`y`) is this rank's partial value, all-reduced over the group first.

`ar_<op>(y, ...)` = `<op>(all_reduce_oneshot(y), ...)`: the same operands, results and attributes as `<op>`, plus
the one-shot's `group` and `region_bytes`. Its reference across ranks (`spmd`) is that composition, the sum in
rank order in the value's dtype (`collective._rank_sum`), so the fold never changes a value. Its kernel is the
consumer's family: the consumer's one launch with a leading phase that runs the one-shot all-reduce's per-tile
protocol (`codegen/kernels/allreduce.py`) into scratch, every program that reads the reduced value waiting for
that phase first. It is still a collective (the parallel model counts it with the all-reduces), not a launch
of its own.
"""

from __future__ import annotations

from ..ir.registry import Cost, OpDef, defop, get_op, require
from .collective import _groups, _one_rank, _rank_sum, _require_group, all_reduce
from . import fused_ep  # noqa: F401  (the consumers)

PREFIX = "ar_"
REDUCED = "y"  # the consumers' operand that is the all-reduce's result
AR_ATTRS = {"group": int, "region_bytes": int}
# the consumers the fold may take: phased kernels whose leading phase reads `y` (`codegen/kernels/moe_router.py`,
# `attn_front.py`)
CONSUMERS = ("mhc_moe_ep", "mhc_add_pair_norm_linear")


def consumer_of(name: str) -> str | None:
    """The consumer op that `name` folds an all-reduce into (`ar_mhc_moe_ep` -> `mhc_moe_ep`), else None."""
    return name[len(PREFIX):] if name.startswith(PREFIX) and name[len(PREFIX):] in CONSUMERS else None


def inner_attrs(attrs: dict) -> dict:
    """The consumer's attributes of a folded op's."""
    return {k: v for k, v in attrs.items() if k not in AR_ATTRS}


def _fold(consumer: OpDef) -> OpDef:
    sig = PREFIX + consumer.sig.strip()
    attrs = {**{k: (a.type if a.required else (a.type, a.default)) for k, a in consumer.attrs.items()
                if k != "variant"}, **AR_ATTRS}
    variants = {k: tuple(v) for k, v in consumer.variants.items()} or None

    def ref(*operands, group, region_bytes, **kw):
        _one_rank(PREFIX + consumer.name, group)
        return consumer.ref(*operands, **kw)

    ref.__doc__ = f"`{consumer.name}` on the one-shot all-reduce (over `group` ranks) of its operand `{REDUCED}`."
    op = defop(sig, attrs, kernel=consumer.kernel, follows=consumer.follows or None, variants=variants)(ref)
    at = consumer.operand_index(REDUCED)

    @op.infer
    def _(*operands, group, region_bytes, **kw):
        y = operands[at]
        _require_group(op.name, group)
        require(y.dtype in ("fp32", "bf16"), f"{op.name} sums floating-point values", found=y.dtype)
        require(0 < y.nbytes <= region_bytes, f"{op.name}: the value must fit the region",
                found=(y.nbytes, region_bytes))
        return consumer.result_types(list(operands), kw)

    @op.spmd
    def _(per_rank, attrs):
        out: list = [None] * len(per_rank)
        inner = inner_attrs(attrs)
        for ranks in _groups(per_rank, attrs["group"], op.name):
            total = _rank_sum([[ops[at]] for ops in per_rank], ranks)
            for r in ranks:
                ops = list(per_rank[r])
                ops[at] = total.clone()
                out[r] = consumer.run(ops, inner)
        return out

    @op.cost
    def _(operands, results, attrs):
        # the consumer's, plus the all-reduce's ideal (the one-shot's own time is the parallel model's)
        inner = inner_attrs(attrs)
        c = consumer.cost_of(list(operands), list(results), inner)
        a = all_reduce._cost([operands[at]], [operands[at]], {"group": attrs["group"]})
        return Cost(c.flops + a.flops, c.bytes_read + a.bytes_read, c.bytes_written + a.bytes_written)

    return op


FOLDED = {name: _fold(get_op(name)) for name in CONSUMERS}
