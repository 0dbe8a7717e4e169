"""Fused ops produced by passes. Each reference is the composition of the references it replaces, so a
fusion never changes a value."""

from __future__ import annotations

from ..ir.registry import Cost, defop, require
from ..ir.types import TensorType
from .basic import GEMM_ATTRS, linear, rms_norm, swiglu
from .mhc import hc_head, hc_post, hc_pre
from .moe import MOE_ATTRS, moe_experts, router
from .numerics import fp8_round_ref
from .rope import rotate

# ---- mHC seams ---------------------------------------------------------------------------------


def _pre(streams, fn, base, scale, norm, eps, hc_eps, iters, norm_eps):
    y, post, comb = hc_pre.ref(streams, fn, base, scale, eps=eps, hc_eps=hc_eps, iters=iters)
    if norm is not None:
        y = rms_norm.ref(y, norm, eps=norm_eps)
    return y, post, comb


@defop("hc_pre_norm(streams, fn, base, scale, norm?) -> y, post, comb",
       attrs={"eps": float, "hc_eps": float, "iters": int, "norm_eps": float}, kernel="mhc",
       variants={"norm": ("norm",), "plain": ()})
def hc_pre_norm(streams, fn, base, scale, norm, *, eps, hc_eps, iters, norm_eps):
    """`hc_pre` with the sub-layer's RMSNorm (attn_norm / ffn_norm) folded in: y is returned normalised."""
    return _pre(streams, fn, base, scale, norm, eps, hc_eps, iters, norm_eps)


@hc_pre_norm.infer
def _(streams, fn, base, scale, norm, **attrs):
    a = {k: attrs[k] for k in ("eps", "hc_eps", "iters")}
    return hc_pre.result_types([streams, fn, base, scale], a)


@defop("mhc_post_pre(y, streams, post, comb, fn, base, scale, norm?) -> streams_out, y_next, post_next, comb_next",
       attrs={"eps": float, "hc_eps": float, "iters": int, "norm_eps": float}, kernel="mhc",
       variants={"norm": ("norm",), "plain": ()})
def mhc_post_pre(y, streams, post, comb, fn, base, scale, norm, *, eps, hc_eps, iters, norm_eps):
    """One seam between sub-layers: the previous sub-layer's `hc_post` and the next one's `hc_pre` (and
    its RMSNorm), in one launch."""
    out = hc_post.ref(y, streams, post, comb)
    return (out, *_pre(out, fn, base, scale, norm, eps, hc_eps, iters, norm_eps))


@mhc_post_pre.infer
def _(y, streams, post, comb, fn, base, scale, norm, **attrs):
    out = hc_post.result_types([y, streams, post, comb], {})[0]
    a = {k: attrs[k] for k in ("eps", "hc_eps", "iters")}
    return (out, *hc_pre.result_types([out, fn, base, scale], a))


@defop("mhc_post_head(y, streams, post, comb, fn, base, scale) -> h", attrs={"eps": float, "hc_eps": float}, kernel="mhc")
def mhc_post_head(y, streams, post, comb, fn, base, scale, *, eps, hc_eps):
    """The last sub-layer's `hc_post` folded into the final `hc_head` collapse."""
    return hc_head.ref(hc_post.ref(y, streams, post, comb), fn, base, scale, eps=eps, hc_eps=hc_eps)


@mhc_post_head.infer
def _(y, streams, post, comb, fn, base, scale, *, eps, hc_eps):
    out = hc_post.result_types([y, streams, post, comb], {})[0]
    return hc_head.result_types([out, fn, base, scale], {"eps": eps, "hc_eps": hc_eps})


# ---- attention output ----------------------------------------------------------------------------


@defop("inv_rope_group_quant(x, pos) -> y, scale?",
       attrs={"dim": int, "theta": float, "yarn": tuple, "fmt": (str, "none"), "group": (int, 128)}, kernel="inv_rope_quant")
def inv_rope_group_quant(x, pos, *, dim, theta, yarn, fmt, group):
    """The inverse RoPE of the attention output, and the activation quantisation feeding `wo_a`, in one op.

    `fmt="none"` (the hf / official numerics, whose GEMMs take activations as they are): y is the rotated
    output, no scale. `fmt="fp8"` (FP8 activation GEMMs, spec 13.1): y is e4m3 with one UE8M0 scale per
    `group` values along the flattened heads `[B, T, H*d / group]`.
    """
    y = rotate(x, pos, dim, theta, yarn, inverse=True)
    if fmt == "none":
        return (y,)
    from ..formats import FP8_MAX, pow2_scale
    import torch

    B, T = y.shape[:2]
    g = y.float().reshape(B, T, -1, group)
    s = pow2_scale(g.abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(y.shape), s.squeeze(-1)


@inv_rope_group_quant.infer
def _(x, pos, *, dim, theta, yarn, fmt, group):
    require(fmt in ("none", "fp8"), "inv_rope_group_quant fmt must be none or fp8", found=fmt)
    if fmt == "none":
        return (x,)
    hd = x.numel // (x.shape[0] * x.shape[1])
    require(hd % group == 0, "heads * head_dim must be a multiple of the quantisation group")
    return x.with_dtype("fp8e4m3"), TensorType((x.shape[0], x.shape[1], hd // group), "fp32")


@defop("rope_out_proj(o, pos, w, scale?) -> z",
       attrs={"dim": int, "theta": float, "yarn": tuple, "groups": int, **GEMM_ATTRS}, kernel="grouped_gemm")
def rope_out_proj(o, pos, w, scale, *, dim, theta, yarn, groups, block, act, acc, out_dtype):
    """`wo_a` reading the attention output through its inverse RoPE: `grouped_out_proj(rope(o, pos,
    inverse=true))`, the rotation (and, with `act="fp8"`, the activation quantisation) done as the GEMM
    loads each K tile, so no rotated copy of o is stored."""
    from .attention import grouped_out_proj
    y = rotate(o, pos, dim, theta, yarn, inverse=True)
    return grouped_out_proj.ref(y, w, scale, None, groups=groups, block=block, act=act, acc=acc, out_dtype=out_dtype)


@rope_out_proj.infer
def _(o, pos, w, scale, *, dim, theta, yarn, groups, block, act, acc, out_dtype):
    from .attention import grouped_out_proj
    require(o.rank == 4 and dim % 2 == 0 and dim <= o.shape[-1], "rope_out_proj takes o [B, T, H, d] and an even "
            "rope dim <= d", found=(list(o.shape), dim))
    require(list(pos.shape) == list(o.shape[:2]), "rope_out_proj pos must be [B, T]", found=list(pos.shape))
    return grouped_out_proj.result_types([o, w, scale, None], {"groups": groups, "block": block, "act": act,
                                                                "acc": acc, "out_dtype": out_dtype})


# ---- GEMMs of one input --------------------------------------------------------------------------

PAIR_ATTRS = {"block0": (int, 128), "act0": (str, "native"), "out_dtype0": (str, ""),
              "block1": (int, 128), "act1": (str, "native"), "out_dtype1": (str, ""), "acc": (str, "fp32")}


def _side(attrs: dict, i: int) -> dict:
    """One GEMM's `linear` attributes out of a `linear_pair`'s."""
    return {"block": attrs[f"block{i}"], "act": attrs[f"act{i}"], "acc": attrs["acc"], "out_dtype": attrs[f"out_dtype{i}"]}


@defop("linear_pair(x, w0, w1, scale0?, scale1?) -> y0, y1", attrs=PAIR_ATTRS, kernel="gemm")
def linear_pair(x, w0, w1, scale0, scale1, **attrs):
    """Two `linear`s of one input whose weights cannot be stacked into one (another format or numerics:
    V4's FP8 `wqkv_a` and the BF16 compressor / indexer GEMMs of the attention input), in one launch."""
    return linear.ref(x, w0, scale0, **_side(attrs, 0)), linear.ref(x, w1, scale1, **_side(attrs, 1))


@linear_pair.infer
def _(x, w0, w1, scale0, scale1, **attrs):
    return (linear.result_types([x, w0, scale0], _side(attrs, 0))[0],
            linear.result_types([x, w1, scale1], _side(attrs, 1))[0])


# ---- MoE -----------------------------------------------------------------------------------------

@defop("moe_experts_shared(x, weights, indices, w1, w2, w3, s1, s2, s3, w1_scale?, w2_scale?, w3_scale?, "
       "s1_scale?, s2_scale?, s3_scale?) -> y",
       attrs={**MOE_ATTRS, "shared_block": (int, 128), "shared_act": (str, "native")}, kernel="moe")
def moe_experts_shared(x, weights, indices, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale, s2_scale,
                       s3_scale, *, limit, block, act, acc, out_dtype, route_weight, shared_block, shared_act):
    """Routed experts and the shared expert in one launch: `moe_experts(...) + w2_s(swiglu(w1_s x, w3_s x))`
    (`act`: the routed GEMMs' activation format, `shared_act`: the shared expert's; `route_weight`: see
    `moe.ROUTE_WEIGHTS`)."""
    routed = moe_experts.ref(x, weights, indices, w1, w2, w3, w1_scale, w2_scale, w3_scale, limit=limit, block=block,
                             act=act, acc=acc, out_dtype=out_dtype, route_weight=route_weight)
    lin = {"block": shared_block, "act": shared_act, "acc": acc, "out_dtype": out_dtype}
    g = linear.ref(x, s1, s1_scale, **lin)
    u = linear.ref(x, s3, s3_scale, **lin)
    return routed + linear.ref(swiglu.ref(g, u, limit=limit), s2, s2_scale, **lin)


@moe_experts_shared.infer
def _(x, weights, indices, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale, s2_scale, s3_scale, *, limit,
      block, act, acc, out_dtype, route_weight, shared_block, shared_act):
    moe_experts.result_types([x, weights, indices, w1, w2, w3, w1_scale, w2_scale, w3_scale],
                             {"limit": limit, "block": block, "act": act, "acc": acc, "out_dtype": out_dtype,
                              "route_weight": route_weight})
    lin = {"block": shared_block, "act": shared_act, "acc": acc, "out_dtype": out_dtype}
    h = linear.result_types([x, s1, s1_scale], lin)[0]
    linear.result_types([x, s3, s3_scale], lin)
    linear.result_types([h, s2, s2_scale], lin)
    return x


@moe_experts_shared.cost
def _(operands, results, attrs):
    from .moe import expert_cost
    x, weights, indices, w1, w2, w3, s1, s2, s3 = operands[:9]
    dense = sum(t.nbytes for t in operands[9:] if t is not None and t.rank < 3) + s1.nbytes + s2.nbytes + s3.nbytes
    c = expert_cost(x, weights, indices, [t for t in (w1, w2, w3, *operands[9:12]) if t is not None], results[0])
    tokens = x.numel // x.shape[-1]
    return Cost(c.flops + 6 * tokens * s1.shape[0] * s1.shape[1], c.bytes_read + dense, c.bytes_written)


ROUTER_ATTRS = {"k": int, "route_scale": float, "denom_eps": (float, 1e-20), "fp32": (bool, False)}
MOE_ROUTER_ATTRS = {**MOE_ATTRS, "shared_block": (int, 128), "shared_act": (str, "native"), **ROUTER_ATTRS}


@defop("moe_router_experts_shared(x, gate, bias?, tid2eid?, ids?, w1, w2, w3, s1, s2, s3, w1_scale?, w2_scale?, "
       "w3_scale?, s1_scale?, s2_scale?, s3_scale?) -> y",
       attrs=MOE_ROUTER_ATTRS, kernel="moe_router", variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def moe_router_experts_shared(x, gate, bias, tid2eid, ids, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale,
                              s1_scale, s2_scale, s3_scale, *, limit, block, act, acc, out_dtype, route_weight,
                              shared_block, shared_act, k, route_scale, denom_eps, fp32):
    """The router (`gate`: its [E, D] weight; learned with `bias` or hash with `tid2eid` + `ids`) and
    `moe_experts_shared` on its weights and indices, in one op: the routing never leaves the op."""
    wts, idx = router.ref(x, gate, bias, tid2eid, ids, k=k, route_scale=route_scale, denom_eps=denom_eps, fp32=fp32)
    return moe_experts_shared.ref(x, wts, idx, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale,
                                  s2_scale, s3_scale, limit=limit, block=block, act=act, acc=acc,
                                  out_dtype=out_dtype, route_weight=route_weight, shared_block=shared_block,
                                  shared_act=shared_act)


def _split_router(operands, attrs):
    """(router operands, router attrs, moe_experts_shared operands without weights / indices, its attrs)."""
    r_ops, m_ops = operands[:5], operands[5:]
    r_attrs = {n: attrs[n] for n in ROUTER_ATTRS}
    m_attrs = {n: attrs[n] for n in (*MOE_ATTRS, "shared_block", "shared_act")}
    return r_ops, r_attrs, m_ops, m_attrs


@moe_router_experts_shared.infer
def _(x, gate, bias, tid2eid, ids, *rest, **attrs):
    r_ops, r_attrs, m_ops, m_attrs = _split_router([x, gate, bias, tid2eid, ids, *rest], attrs)
    wts, idx = router.result_types(r_ops, r_attrs)
    return moe_experts_shared.result_types([x, wts, idx, *m_ops], m_attrs)


@moe_router_experts_shared.cost
def _(operands, results, attrs):
    """The router's and the experts' costs, less what the fusion keeps off memory: the routing (written by
    one, read by the other) and the second read of x."""
    r_ops, r_attrs, m_ops, m_attrs = _split_router(operands, attrs)
    x = operands[0]
    wts, idx = router.result_types(r_ops, r_attrs)
    rc = router.cost_of(r_ops, [wts, idx], r_attrs)
    mc = moe_experts_shared.cost_of([x, wts, idx, *m_ops], results, m_attrs)
    return Cost(rc.flops + mc.flops, rc.bytes_read + mc.bytes_read - x.nbytes - wts.nbytes - idx.nbytes,
                mc.bytes_written)


MHC_ATTRS = {"eps": float, "hc_eps": float, "iters": int, "norm_eps": float}


@defop("moe_mhc_post_pre(x, gate, bias?, tid2eid?, ids?, w1, w2, w3, s1, s2, s3, w1_scale?, w2_scale?, w3_scale?, "
       "s1_scale?, s2_scale?, s3_scale?, streams, post, comb, fn, base, scale, norm) "
       "-> streams_out, y_next, post_next, comb_next",
       attrs={**MOE_ROUTER_ATTRS, **MHC_ATTRS}, kernel="moe_router",
       variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def moe_mhc_post_pre(x, gate, bias, tid2eid, ids, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale, w3_scale, s1_scale,
                     s2_scale, s3_scale, streams, post, comb, fn, base, scale, norm, *, eps, hc_eps, iters, norm_eps,
                     **moe_attrs):
    """`moe_router_experts_shared` and the seam after it (`mhc_post_pre`: the FFN's `hc_post` on the MoE's
    output, the next attention's `hc_pre` and its RMSNorm) in one op: the MoE's output never leaves it."""
    y = moe_router_experts_shared.ref(x, gate, bias, tid2eid, ids, w1, w2, w3, s1, s2, s3, w1_scale, w2_scale,
                                      w3_scale, s1_scale, s2_scale, s3_scale, **moe_attrs)
    return mhc_post_pre.ref(y, streams, post, comb, fn, base, scale, norm, eps=eps, hc_eps=hc_eps, iters=iters,
                            norm_eps=norm_eps)


def _split_mhc(operands, attrs):
    """(moe_router_experts_shared operands, its attrs, mhc_post_pre operands without y, its attrs)."""
    m_attrs = {n: v for n, v in attrs.items() if n not in MHC_ATTRS and n != "variant"}
    return list(operands[:17]), m_attrs, list(operands[17:]), {n: attrs[n] for n in MHC_ATTRS}


@moe_mhc_post_pre.infer
def _(*operands, **attrs):
    m_ops, m_attrs, h_ops, h_attrs = _split_mhc(operands, attrs)
    y = moe_router_experts_shared.result_types(m_ops, m_attrs)[0]
    return mhc_post_pre.result_types([y, *h_ops], h_attrs)


@moe_mhc_post_pre.cost
def _(operands, results, attrs):
    """The MoE's and the seam's costs, summed: the fused kernel still writes the MoE's output (scratch) and
    its last phase reads it back, as the two launches did; the fusion saves a launch, not traffic."""
    m_ops, m_attrs, h_ops, h_attrs = _split_mhc(operands, attrs)
    y = moe_router_experts_shared.result_types(m_ops, m_attrs)[0]
    mc = moe_router_experts_shared.cost_of(m_ops, [y], m_attrs)
    hc = mhc_post_pre.cost_of([y, *h_ops], results, h_attrs)
    return Cost(mc.flops + hc.flops, mc.bytes_read + hc.bytes_read, mc.bytes_written + hc.bytes_written)


# the seam before the MoE's attributes in `mhc_moe_mhc` (the seam after it keeps MHC_ATTRS' names)
IN_MHC_ATTRS = {"in_" + n: t for n, t in MHC_ATTRS.items()}


@defop("mhc_moe_mhc(y, streams, post, comb, in_fn, in_base, in_scale, in_norm, gate, bias?, tid2eid?, ids?, w1, w2, "
       "w3, s1, s2, s3, w1_scale?, w2_scale?, w3_scale?, s1_scale?, s2_scale?, s3_scale?, fn, base, scale, norm) "
       "-> streams_out, y_next, post_next, comb_next",
       attrs={**MOE_ROUTER_ATTRS, **MHC_ATTRS, **IN_MHC_ATTRS}, kernel="moe_router",
       variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def mhc_moe_mhc(y, streams, post, comb, in_fn, in_base, in_scale, in_norm, *rest, **attrs):
    """The seam before the MoE (`mhc_post_pre`: the attention's `hc_post` on its output `y`, the FFN's
    `hc_pre` and ffn_norm, `in_*` attributes) and `moe_mhc_post_pre` on what it returns, in one op: the MoE's
    input and the seam's streams, post and comb never leave it."""
    s, x, p, c = mhc_post_pre.ref(y, streams, post, comb, in_fn, in_base, in_scale, in_norm, **_in_attrs(attrs))
    m_ops, h_ops = rest[:16], rest[16:]
    return moe_mhc_post_pre.ref(x, *m_ops, s, p, c, *h_ops, **{n: v for n, v in attrs.items() if n not in IN_MHC_ATTRS})


def _in_attrs(attrs):
    return {n[len("in_"):]: attrs[n] for n in IN_MHC_ATTRS}


def _split_in(operands, attrs):
    """(the seam before's operands, its attrs, moe_mhc_post_pre's operands with x / streams / post / comb left
    out, its attrs)."""
    return (list(operands[:8]), _in_attrs(attrs), list(operands[8:]),
            {n: v for n, v in attrs.items() if n not in IN_MHC_ATTRS and n != "variant"})


def _inner(seam_types, rest):
    """moe_mhc_post_pre's operands given the seam before's results (streams, x, post, comb) and the rest."""
    s, x, p, c = seam_types
    return [x, *rest[:16], s, p, c, *rest[16:]]


@mhc_moe_mhc.infer
def _(*operands, **attrs):
    a_ops, a_attrs, rest, m_attrs = _split_in(operands, attrs)
    return moe_mhc_post_pre.result_types(_inner(mhc_post_pre.result_types(a_ops, a_attrs), rest), m_attrs)


@mhc_moe_mhc.cost
def _(operands, results, attrs):
    """The two seams' and the MoE's costs, summed: the seam before's results go to scratch and are read back
    by the router, experts and the seam after, as between the two launches; the fusion saves a launch."""
    a_ops, a_attrs, rest, m_attrs = _split_in(operands, attrs)
    mid = mhc_post_pre.result_types(a_ops, a_attrs)
    ac = mhc_post_pre.cost_of(a_ops, mid, a_attrs)
    mc = moe_mhc_post_pre.cost_of(_inner(mid, rest), results, m_attrs)
    return Cost(ac.flops + mc.flops, ac.bytes_read + mc.bytes_read, ac.bytes_written + mc.bytes_written)


# ---- indexer -------------------------------------------------------------------------------------

@defop("indexer_topk(q, weights, keys, pos) -> indices", attrs={"ratio": int, "q_scale": float, "w_scale": float,
                                                                "k": int})
def indexer_topk(q, weights, keys, pos, *, ratio, q_scale, w_scale, k):
    """Lightning-indexer scores and their top-k in one launch (the scores never reach memory)."""
    from .indexer import indexer_scores, topk
    return topk.ref(indexer_scores.ref(q, weights, keys, pos, ratio=ratio, q_scale=q_scale, w_scale=w_scale), k=k)


@indexer_topk.infer
def _(q, weights, keys, pos, *, ratio, q_scale, w_scale, k):
    from .indexer import indexer_scores, topk
    s = indexer_scores.result_types([q, weights, keys, pos], {"ratio": ratio, "q_scale": q_scale, "w_scale": w_scale})
    return topk.result_types(s, {"k": k})


@defop("indexer_select(q, weights, pos, block_table, p0, p1?) -> indptr, indices",
       attrs={"ratio": int, "q_scale": float, "w_scale": float, "k": int, "block_tokens": int,
              "index_envelope_rows": int, "index_offset": int, "envelope_rows": int, "max_rows": int, "fmt": str}, kernel="indexer",
       offset_attrs=("index_offset",))
def indexer_select(q, weights, pos, block_table, p0, p1, *, ratio, q_scale, w_scale, k, block_tokens,
                   index_envelope_rows, index_offset, envelope_rows, max_rows, fmt):
    """On the pool: indexer scores over the index plane, top-k, and translation of the picks to physical
    main-pool rows packed as CSR (ATOM's paged MQA logits + top_k_per_row + csa_translate_pack)."""
    from .indexer import topk
    from .paged import csr_selected, indexer_scores_paged
    s = indexer_scores_paged.ref(q, weights, pos, block_table, p0, p1, ratio=ratio, q_scale=q_scale, w_scale=w_scale,
                                 block_tokens=block_tokens, envelope_rows=index_envelope_rows,
                                 layer_offset=index_offset, max_rows=max_rows, fmt=fmt)
    return csr_selected.ref(topk.ref(s, k=k), pos, block_table, ratio=ratio, block_tokens=block_tokens,
                            envelope_rows=envelope_rows)


@indexer_select.infer
def _(q, weights, pos, block_table, p0, p1, *, k, **_):
    B, T = q.shape[:2]
    return TensorType((B * T + 1,), "i32"), TensorType((B * T * k,), "i32")


# ---- q / kv norm + RoPE (+ window write) ---------------------------------------------------------

@indexer_select.cost
def _(operands, results, attrs):
    """Every visible compressed index row of a sequence once (its lanes share them), scores in fp32."""
    from .paged import row_bytes
    q, weights, pos, block_table, p0, p1 = operands
    B, T, HI, DI = q.shape
    return Cost(2 * B * T * HI * DI * attrs["max_rows"],
                q.nbytes + weights.nbytes + pos.nbytes + block_table.nbytes + B * attrs["max_rows"] * row_bytes(p0, p1),
                sum(r.nbytes for r in results))


@defop("qkv_norm_rope(q, kv, norm, pos, qi?, slot?, p0?, p1?, p2?) -> q_out, kv_out, qi_out?, q0?, q1?, q2?",
       attrs={"eps": float, "dim": int, "theta": float, "yarn": tuple, "kv_round_dims": (int, 0),
              "kv_round_block": (int, 64), "qi_round": (str, "none"), "q_mean": (str, "fp32"), "window": (int, 0),
              "slot_rows": (int, 0),
              "n_rows": (int, 0), "layer_row": (int, 0), "fmt": (str, "")}, tied={"q0": "p0", "q1": "p1", "q2": "p2"},
       follows={"qi_out": "qi"}, kernel="qkv_norm_rope", offset_attrs=("layer_row",),
       variants={"plain": (), "indexer": ("qi",), "write": ("slot", "p0"), "indexer_write": ("qi", "slot", "p0")})
def qkv_norm_rope(q, kv, norm, pos, qi, slot, p0, p1, p2, *, eps, dim, theta, yarn, kv_round_dims, kv_round_block,
                  qi_round, q_mean, window, slot_rows, n_rows, layer_row, fmt):
    """One launch for the attention's query / key prologue: the per-head unweighted RMSNorm + RoPE of q,
    the weighted RMSNorm + RoPE of the kv latent (+ its official FP8 rounding), the RoPE of the indexer
    query `qi` (+ Hadamard / FP4 rounding) when given, and, in decode (with `slot` and planes), the
    write of the new kv row into the window ring (`q_mean`: the q norm's `rms_norm` mean). Results: q, kv,
    [qi], [planes]."""
    from .numerics import hadamard_fp4_round_ref
    from .paged import pool_write_window

    qo = rotate(rms_norm.ref(q, None, eps=eps, mean=q_mean), pos, dim, theta, yarn)
    kvo = rotate(rms_norm.ref(kv, norm, eps=eps), pos, dim, theta, yarn)
    if kv_round_dims:
        kvo = fp8_round_ref(kvo, kv_round_dims, kv_round_block)
    out = [qo, kvo]
    if qi is not None:
        qio = rotate(qi, pos, dim, theta, yarn)
        out.append(hadamard_fp4_round_ref(qio, 32) if qi_round == "fp4" else qio)
    if p0 is not None:
        out += list(pool_write_window.ref(kvo, pos, slot, p0, p1, p2, window=window, slot_rows=slot_rows,
                                          n_rows=n_rows, layer_row=layer_row, fmt=fmt))
    return tuple(out)


@qkv_norm_rope.infer
def _(q, kv, norm, pos, qi, slot, p0, p1, p2, *, window, fmt, q_mean, **_):
    from .basic import RMS_MEANS
    require(q_mean in RMS_MEANS, f"qkv_norm_rope: q_mean must be one of {RMS_MEANS}", found=q_mean)
    require(q.rank == 4 and kv.rank == 3 and q.shape[3] == kv.shape[2], "qkv_norm_rope q [B, T, H, d] / kv [B, T, d]",
            found=(list(q.shape), list(kv.shape)))
    require(norm.shape == (kv.shape[2],), "qkv_norm_rope norm must be [d]", found=list(norm.shape))
    out = [q, kv] + ([qi] if qi is not None else [])
    if p0 is not None:
        require(slot is not None and window > 0 and fmt != "", "the window write needs slot, window and fmt")
        out += [p for p in (p0, p1, p2) if p is not None]
    return out


@qkv_norm_rope.cost
def _(operands, results, attrs):
    """Activations in and out; in decode also one window-ring row per token written to the pool."""
    from .paged import row_bytes
    q, kv, norm, pos, qi, slot, p0, p1, p2 = operands
    acts = [r for r in results[:3] if r is not None] if qi is not None else list(results[:2])
    rows = kv.shape[0] * kv.shape[1] if p0 is not None else 0
    return Cost(0, sum(t.nbytes for t in (q, kv, norm, pos, qi, slot) if t is not None),
                sum(t.nbytes for t in acts) + rows * row_bytes(p0, p1, p2))


@defop("norm_linear(x, norm, w, scale?) -> y", attrs={"eps": float, **GEMM_ATTRS}, kernel="gemm")
def norm_linear(x, norm, w, scale, *, eps, block, act, acc, out_dtype):
    """A weighted RMSNorm folded into the GEMM that alone reads it: the kernel's prologue already streams
    every input row in full (it is the reduction axis), so the row's rsqrt(mean(x^2)) and the norm weight
    are applied on the way in."""
    return linear.ref(rms_norm.ref(x, norm, eps=eps), w, scale, block=block, act=act, acc=acc, out_dtype=out_dtype)


@norm_linear.infer
def _(x, norm, w, scale, *, eps, block, act, acc, out_dtype):
    rms_norm.result_types([x, norm], {"eps": eps})
    return linear.result_types([x, w, scale], {"block": block, "act": act, "acc": acc, "out_dtype": out_dtype})
