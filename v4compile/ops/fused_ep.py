"""Fused ops of an expert-parallel module (`passes/fuse_moe_router.py`, `fuse_mhc_moe.py`, `fuse_moe_mhc.py`
on a partitioned module): the one-launch MoE of the single-rank pipeline, with the all-reduce beside it.

Under `--ep` the FFN is `add(all_reduce(moe_experts(x, local_experts(router(x), owner))), shared(x))`: the
ranks' routed partial sums are added first (in rank order), the replicated shared expert after. The fused
MoE op therefore returns two values, the rank's routed partial sum and the shared expert's output, and
never their sum (adding the shared expert into one rank's partial would change the order of the adds, so
the result would no longer be the layout reference's bit for bit). The `all_reduce` of the partial is a
launch of its own (a collective in the captured graph), and the seam after reads `add(reduced, shared)`
(`mhc_post_pre_add`: the add folded into the seam's launch). Each reference is the composition of the
references it replaces, so a fusion never changes a value.
Data parallel (`--dp N --ep N`): `moe_router_experts_dp` reads the gathered tokens for the routed part and the
rank's own for the shared expert; its partial goes through `reduce_scatter_rows` instead of the all-reduce.
"""

from __future__ import annotations

from ..ir.registry import Cost, defop
from .collective import local_experts
from .fused import IN_MHC_ATTRS, MHC_ATTRS, MOE_ROUTER_ATTRS, ROUTER_ATTRS, moe_experts_shared
from .fused import _in_attrs, mhc_post_pre  # noqa: F401  (the seam's reference)
from .moe import MOE_ATTRS, moe_experts, router
from .basic import linear, swiglu

EP_ATTRS = {**MOE_ROUTER_ATTRS, "ep": (int, 1)}
MOE_OPERANDS = ("w1", "w2", "w3", "s1", "s2", "s3", "w1_scale", "w2_scale", "w3_scale", "s1_scale", "s2_scale",
                "s3_scale")


def _moe_attrs(attrs: dict) -> dict:
    return {n: attrs[n] for n in MOE_ATTRS}


def _routed_and_shared(x, wts, idx, owner, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale, s2_scale,
                       s3_scale, attrs, xs=None):
    """(this rank's routed partial sum over the tokens `x`, the shared expert's output on `xs`, default `x`)."""
    lw, li = local_experts.ref(wts, idx, owner)
    m = _moe_attrs(attrs)
    partial = moe_experts.ref(x, lw, li, w1, w2, w3, w1_scale, w2_scale, w3_scale, ep=attrs.get("ep", 1), **m)
    xs = x if xs is None else xs
    lin = {"block": attrs["shared_block"], "act": attrs["shared_act"], "acc": m["acc"], "out_dtype": m["out_dtype"]}
    g = linear.ref(xs, s1, s1_scale, **lin)
    u = linear.ref(xs, s3, s3_scale, **lin)
    return partial, linear.ref(swiglu.ref(g, u, limit=m["limit"]), s2, s2_scale, **lin)


@defop("moe_router_experts_ep(x, gate, bias?, tid2eid?, ids?, owner, w1, w2, w3, s1, s2, s3, w1_scale?, w2_scale?, "
       "w3_scale?, s1_scale?, s2_scale?, s3_scale?) -> partial, shared",
       attrs=EP_ATTRS, kernel="moe_router", variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def moe_router_experts_ep(x, gate, bias, tid2eid, ids, owner, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale,
                          s1_scale, s2_scale, s3_scale, **attrs):
    """The router, this rank's routed experts (`local_experts` with the rank's `owner` table folded into the
    routing) and the shared expert, in one op: `partial` is the routed sum over this rank's experts (the
    all-reduce after it adds the ranks'), `shared` the shared expert's output (added after the all-reduce)."""
    wts, idx = router.ref(x, gate, bias, tid2eid, ids, **{n: attrs[n] for n in ROUTER_ATTRS})
    return _routed_and_shared(x, wts, idx, owner, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale,
                              s2_scale, s3_scale, attrs)


def _split(operands, attrs):
    """(router operands, router attrs, moe_experts_shared operands without weights / indices, its attrs)."""
    r_ops, owner, m_ops = list(operands[:5]), operands[5], list(operands[6:])
    m_attrs = {n: attrs[n] for n in (*MOE_ATTRS, "shared_block", "shared_act")}
    return r_ops, {n: attrs[n] for n in ROUTER_ATTRS}, owner, m_ops, m_attrs


@moe_router_experts_ep.infer
def _(*operands, **attrs):
    r_ops, r_attrs, owner, m_ops, m_attrs = _split(operands, {**attrs})
    wts, idx = router.result_types(r_ops, r_attrs)
    local_experts.result_types([wts, idx, owner], {})
    y = moe_experts_shared.result_types([r_ops[0], wts, idx, *m_ops], m_attrs)[0]
    return y, y


@moe_router_experts_ep.cost
def _(operands, results, attrs):
    """The router's, the mask's and the experts' costs (1 / ep of the slots land here), less what the fusion
    keeps off memory (the routing, the second read of x); two results written instead of one."""
    from .moe import expert_cost
    r_ops, r_attrs, owner, m_ops, m_attrs = _split(operands, attrs)
    x = operands[0]
    wts, idx = router.result_types(r_ops, r_attrs)
    rc = router.cost_of(r_ops, [wts, idx], r_attrs)
    w1, w2, w3, s1, s2, s3 = m_ops[:6]
    dense = sum(t.nbytes for t in m_ops[9:] if t is not None) + s1.nbytes + s2.nbytes + s3.nbytes
    c = expert_cost(x, wts, idx, [t for t in (w1, w2, w3, *m_ops[6:9]) if t is not None], results[0],
                    attrs.get("ep", 1))
    tokens = x.numel // x.shape[-1]
    return Cost(rc.flops + c.flops + 6 * tokens * s1.shape[0] * s1.shape[1],
                rc.bytes_read + c.bytes_read + dense + owner.nbytes - wts.nbytes - idx.nbytes,
                c.bytes_written + results[1].nbytes)


@defop("mhc_moe_ep(y, streams, post, comb, in_fn, in_base, in_scale, in_norm, gate, bias?, tid2eid?, ids?, owner, "
       "w1, w2, w3, s1, s2, s3, w1_scale?, w2_scale?, w3_scale?, s1_scale?, s2_scale?, s3_scale?) "
       "-> partial, shared, streams_out, post_next, comb_next",
       attrs={**EP_ATTRS, **IN_MHC_ATTRS}, kernel="moe_router",
       variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def mhc_moe_ep(y, streams, post, comb, in_fn, in_base, in_scale, in_norm, *rest, **attrs):
    """The seam before the MoE (`mhc_post_pre`: the attention's `hc_post` on its (all-reduced) output `y`, the
    FFN's `hc_pre` and ffn_norm, `in_*` attributes) and `moe_router_experts_ep` on the MoE input it returns,
    in one op: the MoE's input never leaves it; the seam's streams / post / comb are results (the seam after
    the all-reduce reads them)."""
    s, x, p, c = mhc_post_pre.ref(y, streams, post, comb, in_fn, in_base, in_scale, in_norm, **_in_attrs(attrs))
    partial, shared = moe_router_experts_ep.ref(x, *rest, **_ep_attrs(attrs))
    return partial, shared, s, p, c


def _ep_attrs(attrs):
    return {n: v for n, v in attrs.items() if n not in IN_MHC_ATTRS and n != "variant"}


@mhc_moe_ep.infer
def _(*operands, **attrs):
    s, x, p, c = mhc_post_pre.result_types(list(operands[:8]), _in_attrs(attrs))
    partial, shared = moe_router_experts_ep.result_types([x, *operands[8:]], _ep_attrs(attrs))
    return partial, shared, s, p, c


@mhc_moe_ep.cost
def _(operands, results, attrs):
    """The seam's and the MoE's costs, summed, less the MoE input the seam writes and the MoE reads (scratch of
    the one launch: counted once each way, as the single-rank `mhc_moe_mhc` does)."""
    a_ops, a_attrs = list(operands[:8]), _in_attrs(attrs)
    mid = mhc_post_pre.result_types(a_ops, a_attrs)
    ac = mhc_post_pre.cost_of(a_ops, mid, a_attrs)
    mc = moe_router_experts_ep.cost_of([mid[1], *operands[8:]], list(results[:2]), _ep_attrs(attrs))
    return Cost(ac.flops + mc.flops, ac.bytes_read + mc.bytes_read, ac.bytes_written + mc.bytes_written)


@defop("mhc_post_pre_add(y, y2, streams, post, comb, fn, base, scale, norm?) -> streams_out, y_next, post_next, "
       "comb_next", attrs=MHC_ATTRS, kernel="mhc", variants={"norm": ("norm",), "plain": ()})
def mhc_post_pre_add(y, y2, streams, post, comb, fn, base, scale, norm, *, eps, hc_eps, iters, norm_eps):
    """`mhc_post_pre(add(y, y2), ...)`: the seam after an expert-parallel MoE reads the all-reduced routed
    sum `y` plus the shared expert's `y2` (added in their dtype first, as `add` does), in one launch."""
    return mhc_post_pre.ref(y + y2, streams, post, comb, fn, base, scale, norm, eps=eps, hc_eps=hc_eps, iters=iters,
                            norm_eps=norm_eps)


@mhc_post_pre_add.infer
def _(y, y2, streams, post, comb, fn, base, scale, norm, **attrs):
    from ..ir.registry import require
    require(y == y2, "mhc_post_pre_add: y and y2 must have one type", found=(str(y), str(y2)))
    return mhc_post_pre.result_types([y, streams, post, comb, fn, base, scale, norm],
                                     {n: attrs[n] for n in MHC_ATTRS})


@mhc_post_pre_add.cost
def _(operands, results, attrs):
    y2 = operands[1]
    c = mhc_post_pre.cost_of([operands[0], *operands[2:]], results, {n: attrs[n] for n in MHC_ATTRS})
    return Cost(c.flops + y2.numel, c.bytes_read + y2.nbytes, c.bytes_written)



# ---- data parallel with the experts over the world (`partition{dp, ep}`) --------------------------------------
# The FFN of a dp module is `add(reduce_scatter_rows(moe_experts(xg, local_experts(router(xg), owner))), shared(x))`
# with `xg = all_gather_rows(x)`: the routed experts see every rank's tokens, the shared expert the rank's own.
# The fused op reads both; the gather is a launch of its own before it and the reduce-scatter one after it (the
# seam after reads `add(reduced, shared)`: `mhc_post_pre_add`, as under `--ep` alone), or, run one-shot on a GPU,
# both are folded into its launch, with the seam before it (`passes/fuse_oneshot_rows.py`, `ops/fused_allreduce.py`).

@defop("moe_router_experts_dp(x, xg, gate, bias?, tid2eid?, ids?, owner, w1, w2, w3, s1, s2, s3, w1_scale?, "
       "w2_scale?, w3_scale?, s1_scale?, s2_scale?, s3_scale?) -> partial, shared",
       attrs=EP_ATTRS, kernel="moe_router", variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def moe_router_experts_dp(x, xg, gate, bias, tid2eid, ids, owner, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale,
                          w3_scale, s1_scale, s2_scale, s3_scale, **attrs):
    """`moe_router_experts_ep` with the router and the routed experts on the gathered tokens `xg` (every rank's,
    in rank order: `partial` has a row for each; the reduce-scatter after it adds the ranks' and hands each rank
    its own rows) and the shared expert on this rank's own tokens `x` (`shared`: a row for each of them)."""
    wts, idx = router.ref(xg, gate, bias, tid2eid, ids, **{n: attrs[n] for n in ROUTER_ATTRS})
    return _routed_and_shared(xg, wts, idx, owner, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale,
                              s2_scale, s3_scale, attrs, xs=x)


@moe_router_experts_dp.infer
def _(*operands, **attrs):
    from ..ir.registry import require
    x, xg, rest = operands[0], operands[1], operands[2:]
    require(x.shape[1:] == xg.shape[1:] and x.dtype == xg.dtype and xg.shape[0] % x.shape[0] == 0,
            "moe_router_experts_dp: xg must be whole copies of x's rows (every rank's, gathered)",
            found=(str(x), str(xg)))
    partial, _ = moe_router_experts_ep.result_types([xg, *rest], {**attrs})
    return partial, x


@moe_router_experts_dp.cost
def _(operands, results, attrs):
    """`moe_router_experts_ep`'s cost on the gathered tokens, less the shared expert's FLOPs and reads on the
    rows that are not this rank's (it runs on x alone), plus x's read."""
    x, xg, rest = operands[0], operands[1], operands[2:]
    c = moe_router_experts_ep.cost_of([xg, *rest], [results[0], results[0]], attrs)
    s1 = rest[8]
    others = (xg.numel - x.numel) // x.shape[-1]
    return Cost(c.flops - 6 * others * s1.shape[0] * s1.shape[1], c.bytes_read + x.nbytes,
                c.bytes_written - results[0].nbytes + results[1].nbytes)


# ---- the seam after a partitioned MoE as the first phase of the next attention's front --------------------
# `mhc_post_pre_add`'s MoE input (the next attention's x) has one user, that attention's `pair_norm_linear`: the
# two become one op whose x never leaves it (`passes/fuse_attn_front.py`); the seam's streams / post / comb stay
# results (the seam after the attention reads them).

SEAM_IN = ("y", "y2", "streams", "post", "comb", "in_fn", "in_base", "in_scale", "in_norm")


def _seam_front_split(operands, attrs):
    """(mhc_post_pre_add operands, its attrs, pair_norm_linear operands without x, its attrs)."""
    from .front import pair_norm_linear
    n = len(SEAM_IN)
    return (list(operands[:n]), _in_attrs(attrs), list(operands[n:]),
            {k: v for k, v in attrs.items() if k in pair_norm_linear.attrs and k != "variant"})


def _front_attrs():
    from .front import NORM_ATTRS, PAIR_ATTRS
    return {**PAIR_ATTRS, **NORM_ATTRS}


@defop("mhc_add_pair_norm_linear(y, y2, streams, post, comb, in_fn, in_base, in_scale, in_norm, w0, w1?, scale0?, "
       "scale1?, norm, w, scale?) -> streams_out, post_next, comb_next, y0, y1?, y_front",
       attrs={**IN_MHC_ATTRS, **_front_attrs()}, kernel="attn_front", follows={"y1": "w1"})
def mhc_add_pair_norm_linear(y, y2, streams, post, comb, in_fn, in_base, in_scale, in_norm, *front, **attrs):
    """`mhc_post_pre_add` (the seam after an expert-parallel MoE: hc_post on the reduced routed sum plus the
    shared expert's output, the next attention's hc_pre and attn_norm: its operands and attributes `in_*`) and
    that attention's `pair_norm_linear` on the x it returns (its `y` as `y_front`), in one op: x never leaves it."""
    from .front import pair_norm_linear
    s_ops, s_attrs, f_ops, f_attrs = _seam_front_split((y, y2, streams, post, comb, in_fn, in_base, in_scale, in_norm,
                                                        *front), attrs)
    s, x, p, c = mhc_post_pre_add.ref(*s_ops, **s_attrs)
    return (s, p, c, *pair_norm_linear.ref(x, *f_ops, **f_attrs))


@mhc_add_pair_norm_linear.infer
def _(*operands, **attrs):
    from .front import pair_norm_linear
    s_ops, s_attrs, f_ops, f_attrs = _seam_front_split(operands, attrs)
    s, x, p, c = mhc_post_pre_add.result_types(s_ops, s_attrs)
    return (s, p, c, *pair_norm_linear.result_types([x, *f_ops], f_attrs))


@mhc_add_pair_norm_linear.cost
def _(operands, results, attrs):
    """The seam's and the front's costs, summed: x still goes to scratch and back, as between the launches."""
    from .front import pair_norm_linear
    s_ops, s_attrs, f_ops, f_attrs = _seam_front_split(operands, attrs)
    mid = mhc_post_pre_add.result_types(s_ops, s_attrs)
    a = mhc_post_pre_add.cost_of(s_ops, mid, s_attrs)
    b = pair_norm_linear.cost_of([mid[1], *f_ops], list(results[3:]), f_attrs)
    return Cost(a.flops + b.flops, a.bytes_read + b.bytes_read, a.bytes_written + b.bytes_written)
