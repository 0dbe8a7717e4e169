"""The one-shot all-reduce folded into its consumer (`passes/fuse_oneshot_consumer.py`, issue 34): `ar_<op>` is
`<op>` whose operand `REDUCED` (`y`) is this rank's partial value, all-reduced over the group first.

`ar_<op>(y, ...)` = `<op>(all_reduce_oneshot(y), ...)`: the same operands, results and attributes as `<op>`, plus
the one-shot's `group` and `region_bytes`. Its reference across ranks (`spmd`) is that composition, the sum in
rank order in the value's dtype (`collective._rank_sum`), so the fold never changes a value. Its kernel is the
consumer's family: the consumer's one launch with a leading phase that runs the one-shot all-reduce's per-tile
protocol (`codegen/kernels/allreduce.py`) into scratch, every program that reads the reduced value waiting for
that phase first. It is still a collective (the parallel model counts it with the all-reduces), not a launch
of its own.

`<op>_ar` (the producer fold, `passes/fuse_oneshot_producer.py`) is `<op>` whose result `PRODUCED` (`partial`)
comes out all-reduced over the group: `<op>_ar(...)` = `all_reduce_oneshot(<op>(...).partial)`, the other results
as they are. Its kernel is the producer's one launch with the protocol's two halves as phases of their own: the
routed partial published to the peers first, the producer's independent work (the shared expert) next, the wait
and the rank-order sum last (`codegen/kernels/moe_router.py`), so the peers' lateness hides behind that work.
A producer fold may be a consumer too (`ar_mhc_moe_ep_ar`: the attention's all-reduce its leading phase).

`ag_moe_router_experts_dp_rs` (data parallelism's one-shot rows collectives folded into its MoE,
`passes/fuse_oneshot_rows.py`) is `moe_router_experts_dp` without its operand `xg`: `ag_..._rs(x, ...)` =
`(reduce_scatter_rows_oneshot(p), shared)` with `p, shared = moe_router_experts_dp(x, all_gather_rows_oneshot(x),
...)`, so `partial` is this rank's rows of the ranks' routed sum (in rank order). Its kernel is the MoE's one launch
with the all-gather as its leading phase and the reduce-scatter as its trailing part, the shared expert between the
latter's publish and wait (`codegen/kernels/moe_router.py`, `allreduce.fold_rows`). `mhc_ag_moe_router_experts_dp_rs`
is the same with the seam before the MoE (`mhc_post_pre`, its operands first and its attributes as `in_*`, as
`mhc_moe_ep`'s) giving `x`: `x` never leaves the op, the seam's streams / post / comb are results after the MoE's; its
launch runs the seam first, then the all-gather of its output.
"""

from __future__ import annotations

from ..ir.registry import Cost, OpDef, defop, get_op, require
from .collective import (_groups, _one_rank, _rank_sum, _require_group, all_gather_rows, all_reduce,
                         reduce_scatter_rows)
from . import fused_ep  # noqa: F401  (the consumers)

PREFIX = "ar_"
REDUCED = "y"  # the consumers' operand that is the all-reduce's result
SUFFIX = "_ar"
PRODUCED = "partial"  # the producers' result that the all-reduce sums
# the producers the fold may take: the one-launch EP MoE, whose shared expert does not need the routed sum
PRODUCERS = ("mhc_moe_ep", "moe_router_experts_ep")
# what a producer fold's launch reads after publishing its partial and before waiting for the peers: the shared
# expert's weights (`codegen/kernels/moe_router.py` orders its programs so); the parallel model hides the one-shot's
# time behind these bytes (`codegen/parallel_model.py`)
AFTER_PUBLISH = ("s1", "s3", "s2", "s1_scale", "s3_scale", "s2_scale")


def hidden_bytes(op) -> int:
    """Bytes a producer fold's launch reads between publishing and waiting (an IR op `<producer>_ar`, or the
    consumer fold of one): its AFTER_PUBLISH operands'."""
    opdef = get_op(op.name)
    return sum(op.operands[opdef.operand_index(n)].type.nbytes for n in AFTER_PUBLISH
               if op.operands[opdef.operand_index(n)] is not None)
AR_ATTRS = {"group": int, "region_bytes": int}
# the consumers the fold may take: phased kernels whose leading phase reads `y` (`codegen/kernels/moe_router.py`,
# `attn_front.py`)
CONSUMERS = ("mhc_moe_ep", "mhc_add_pair_norm_linear", "mhc_moe_ep" + SUFFIX)


def consumer_of(name: str) -> str | None:
    """The consumer op that `name` folds an all-reduce into (`ar_mhc_moe_ep` -> `mhc_moe_ep`), else None."""
    return name[len(PREFIX):] if name.startswith(PREFIX) and name[len(PREFIX):] in CONSUMERS else None


def producer_of(name: str) -> str | None:
    """The producer op that `name` folds its all-reduce into (`mhc_moe_ep_ar` -> `mhc_moe_ep`), else None."""
    return name[:-len(SUFFIX)] if name.endswith(SUFFIX) and name[:-len(SUFFIX)] in PRODUCERS else None


def folded_attrs(op, ar) -> dict:
    """The attributes of `op` with the one-shot all-reduce `ar` folded in (either fold): `op`'s declared ones (not
    its `variant`), `ar`'s `AR_ATTRS`, and the tags `layer` / `role` the cost models and reports group by."""
    attrs = {n: v for n, v in op.attrs.items() if n in get_op(op.name).attrs and n != "variant"}
    attrs.update({n: ar.attrs[n] for n in AR_ATTRS})
    attrs.update({n: v for n, v in op.attrs.items() if n in ("layer", "role")})
    return attrs


def inner_attrs(attrs: dict, inner: str = "") -> dict:
    """The consumer's (`inner`'s) attributes of a folded op's: all of them where the consumer is a producer fold
    itself (its all-reduce and the folded one are over one group, through one region: the pass checks)."""
    return dict(attrs) if producer_of(inner) else {k: v for k, v in attrs.items() if k not in AR_ATTRS}


def _fold(consumer: OpDef) -> OpDef:
    sig = PREFIX + consumer.sig.strip()
    attrs = {**{k: (a.type if a.required else (a.type, a.default)) for k, a in consumer.attrs.items()
                if k != "variant"}, **AR_ATTRS}
    variants = {k: tuple(v) for k, v in consumer.variants.items()} or None

    def ref(*operands, group, region_bytes, **kw):
        _one_rank(PREFIX + consumer.name, group)
        return consumer.ref(*operands, **inner_attrs({**kw, "group": group, "region_bytes": region_bytes},
                                                     consumer.name))

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
        return consumer.result_types(list(operands), inner_attrs({**kw, "group": group, "region_bytes": region_bytes},
                                                                 consumer.name))

    @op.spmd
    def _(per_rank, attrs):
        inner = inner_attrs(attrs, consumer.name)
        reduced = [list(ops) for ops in per_rank]
        for ranks in _groups(per_rank, attrs["group"], op.name):
            total = _rank_sum([[ops[at]] for ops in per_rank], ranks)
            for r in ranks:
                reduced[r][at] = total.clone()
        if consumer.collective:  # a producer fold (its all-reduce across the ranks too)
            return consumer.spmd_ref(reduced, inner)
        return [consumer.run(ops, inner) for ops in reduced]

    @op.cost
    def _(operands, results, attrs):
        # the consumer's, plus the all-reduce's ideal (the one-shot's own time is the parallel model's)
        inner = inner_attrs(attrs, consumer.name)
        c = consumer.cost_of(list(operands), list(results), inner)
        a = all_reduce._cost([operands[at]], [operands[at]], {"group": attrs["group"]})
        return Cost(c.flops + a.flops, c.bytes_read + a.bytes_read, c.bytes_written + a.bytes_written)

    return op


def _fold_trailing(producer: OpDef) -> OpDef:
    name, rest = producer.sig.strip().split("(", 1)
    attrs = {**{k: (a.type if a.required else (a.type, a.default)) for k, a in producer.attrs.items()
                if k != "variant"}, **AR_ATTRS}
    variants = {k: tuple(v) for k, v in producer.variants.items()} or None
    at = producer.results.index(PRODUCED)

    def ref(*operands, group, region_bytes, **kw):
        _one_rank(name + SUFFIX, group)
        return producer.ref(*operands, **kw)

    ref.__doc__ = f"`{producer.name}` with its result `{PRODUCED}` all-reduced (one-shot) over `group` ranks."
    op = defop(name + SUFFIX + "(" + rest, attrs, kernel=producer.kernel, follows=producer.follows or None,
               variants=variants)(ref)

    @op.infer
    def _(*operands, group, region_bytes, **kw):
        types = producer.result_types(list(operands), kw)
        _require_group(op.name, group)
        require(types[at].dtype in ("fp32", "bf16"), f"{op.name} sums floating-point values", found=types[at].dtype)
        require(0 < types[at].nbytes <= region_bytes, f"{op.name}: the value must fit the region",
                found=(types[at].nbytes, region_bytes))
        return types

    @op.spmd
    def _(per_rank, attrs):
        inner = inner_attrs(attrs)
        out = [list(producer.run(list(ops), inner)) for ops in per_rank]
        for ranks in _groups(per_rank, attrs["group"], op.name):
            total = _rank_sum([[res[at]] for res in out], ranks)
            for r in ranks:
                out[r][at] = total.clone()
        return [tuple(res) for res in out]

    @op.cost
    def _(operands, results, attrs):
        # the producer's, plus the all-reduce's ideal (the one-shot's own time is the parallel model's)
        c = producer.cost_of(list(operands), list(results), inner_attrs(attrs))
        a = all_reduce._cost([results[at]], [results[at]], {"group": attrs["group"]})
        return Cost(c.flops + a.flops, c.bytes_read + a.bytes_read, c.bytes_written + a.bytes_written)

    return op


# data parallelism's MoE and its operand that is the all-gather's result (every rank's tokens: `_fold_rows`)
DP_MOE = "moe_router_experts_dp"
GATHERED = "xg"
ROWS_FOLDED = "ag_" + DP_MOE + "_rs"


def _fold_rows(moe: OpDef) -> OpDef:
    name, rest = moe.sig.strip().split("(", 1)
    sig = "ag_" + name + "_rs(" + rest.replace(GATHERED + ", ", "", 1)
    attrs = {**{k: (a.type if a.required else (a.type, a.default)) for k, a in moe.attrs.items()
                if k != "variant"}, **AR_ATTRS}
    variants = {k: tuple(v) for k, v in moe.variants.items()} or None
    at, res = moe.operand_index(GATHERED), moe.results.index(PRODUCED)

    def inner(operands, gathered):
        """The DP MoE's operands: `operands` with the gathered tokens in their place."""
        return [*operands[:at], gathered, *operands[at:]]

    def ref(*operands, group, region_bytes, **kw):
        _one_rank(ROWS_FOLDED, group)  # (one rank: its tokens are every rank's, its partial its rows)
        return moe.ref(*inner(list(operands), operands[0]), **kw)

    ref.__doc__ = (f"`{moe.name}` on the one-shot all-gather of its `x` over `group` ranks, its `{PRODUCED}` "
                   "reduce-scattered (one-shot) over them.")
    op = defop(sig, attrs, kernel=moe.kernel, follows=moe.follows or None, variants=variants)(ref)

    @op.infer
    def _(*operands, group, region_bytes, **kw):
        x = operands[0]
        _require_group(op.name, group)
        xg = all_gather_rows._infer(x, group=group)
        types = moe.result_types(inner(list(operands), xg), kw)
        require(x.dtype in ("fp32", "bf16") and types[res].dtype in ("fp32", "bf16"),
                f"{op.name} moves floating-point values", found=(x.dtype, types[res].dtype))
        whole = max(xg.nbytes, types[res].nbytes)
        require(0 < whole <= region_bytes, f"{op.name}: the gathered values must fit the region",
                found=(whole, region_bytes))
        return [reduce_scatter_rows._infer(t, group=group) if i == res else t for i, t in enumerate(types)]

    @op.spmd
    def _(per_rank, attrs):
        kw, g = inner_attrs(attrs), {"group": attrs["group"]}
        xg = all_gather_rows.spmd_ref([[ops[0]] for ops in per_rank], g)
        out = [list(moe.run(inner(list(ops), xg[r][0]), kw)) for r, ops in enumerate(per_rank)]
        mine = reduce_scatter_rows.spmd_ref([[res_[res]] for res_ in out], g)
        return [tuple(mine[r][0] if i == res else v for i, v in enumerate(o)) for r, o in enumerate(out)]

    @op.cost
    def _(operands, results, attrs):
        # the DP MoE's on the gathered tokens, plus the two collectives' ideals (the one-shots' own time is the
        # parallel model's)
        x, g = operands[0], {"group": attrs["group"], "tp": 1}
        xg = all_gather_rows._infer(x, group=attrs["group"])
        whole = all_gather_rows._infer(results[res], group=attrs["group"])
        c = moe.cost_of(inner(list(operands), xg), [whole if i == res else r for i, r in enumerate(results)],
                        inner_attrs(attrs))
        a = all_gather_rows._cost([x], [xg], g)
        b = reduce_scatter_rows._cost([whole], [results[res]], g)
        return Cost(c.flops + a.flops + b.flops, c.bytes_read + a.bytes_read + b.bytes_read,
                    c.bytes_written + a.bytes_written + b.bytes_written)

    return op


PRODUCER_FOLDED = {name: _fold_trailing(get_op(name)) for name in PRODUCERS}
ROWS_FOLDED_OP = _fold_rows(get_op(DP_MOE))
SEAM_ROWS_FOLDED = "mhc_" + ROWS_FOLDED
SEAM_IN = ("y", "streams", "post", "comb", "in_fn", "in_base", "in_scale", "in_norm")  # the seam's operands


def rows_folded(name: str) -> bool:
    """Whether `name` is DP's MoE with its rows collectives folded in (the seam before it too, or not)."""
    return name in (ROWS_FOLDED, SEAM_ROWS_FOLDED)


def _seam_rows_fold(folded: OpDef) -> OpDef:
    from .fused import IN_MHC_ATTRS, _in_attrs, mhc_post_pre

    name, rest = folded.sig.strip().split("(", 1)
    rest = rest.split(", ", 1)[1]  # (its x: the seam's output)
    sig = f"mhc_{name}({', '.join(SEAM_IN)}, {rest.rsplit('->', 1)[0].strip()} -> " \
          f"{rest.rsplit('->', 1)[1].strip()}, streams_out, post_next, comb_next"
    attrs = {**{k: (a.type if a.required else (a.type, a.default)) for k, a in folded.attrs.items()
                if k != "variant"}, **IN_MHC_ATTRS}
    variants = {k: tuple(v) for k, v in folded.variants.items()} or None
    n = len(SEAM_IN)

    def split(operands, attrs):
        """(the seam's operands, its attrs, the folded MoE's operands but x, its attrs)."""
        return (list(operands[:n]), _in_attrs(attrs), list(operands[n:]),
                {k: v for k, v in attrs.items() if k not in IN_MHC_ATTRS})

    def ref(*operands, **attrs):
        s_ops, s_attrs, m_ops, m_attrs = split(operands, attrs)
        s, x, p, c = mhc_post_pre.ref(*s_ops, **s_attrs)
        return (*folded.ref(x, *m_ops, **m_attrs), s, p, c)

    ref.__doc__ = (f"The seam before the MoE (`mhc_post_pre`, `in_*` attributes) and `{folded.name}` on the x it "
                   "returns, in one op; the seam's streams / post / comb are results.")
    op = defop(sig, attrs, kernel=folded.kernel, follows=folded.follows or None, variants=variants)(ref)

    @op.infer
    def _(*operands, **attrs):
        s_ops, s_attrs, m_ops, m_attrs = split(operands, attrs)
        s, x, p, c = mhc_post_pre.result_types(s_ops, s_attrs)
        return [*folded.result_types([x, *m_ops], m_attrs), s, p, c]

    @op.spmd
    def _(per_rank, attrs):
        seams, moes = [], []
        for ops in per_rank:
            s_ops, s_attrs, m_ops, m_attrs = split(ops, attrs)
            s, x, p, c = mhc_post_pre.run(s_ops, s_attrs)
            seams.append((s, p, c))
            moes.append([x, *m_ops])
        out = folded.spmd_ref(moes, split(per_rank[0], attrs)[3])
        return [(*o, *sp) for o, sp in zip(out, seams)]

    @op.cost
    def _(operands, results, attrs):
        # the seam's and the folded MoE's, less the MoE input the seam writes and the MoE reads (scratch of the one
        # launch: counted once each way, as `mhc_moe_ep`'s)
        s_ops, s_attrs, m_ops, m_attrs = split(operands, attrs)
        mid = mhc_post_pre.result_types(s_ops, s_attrs)
        a = mhc_post_pre.cost_of(s_ops, mid, s_attrs)
        b = folded.cost_of([mid[1], *m_ops], list(results[:2]), m_attrs)
        return Cost(a.flops + b.flops, a.bytes_read + b.bytes_read, a.bytes_written + b.bytes_written)

    return op


SEAM_ROWS_FOLDED_OP = _seam_rows_fold(ROWS_FOLDED_OP)
FOLDED = {name: _fold(get_op(name)) for name in CONSUMERS}
