"""Mixture of experts: the router (hash or learned) and the routed experts (`v4-reference.md` section 10).

torch is imported where the ops run (as in `basic`): the MoE kernel family's cost model takes
`expected_active_experts` from here, and the AOT worker, which imports the families, loads no torch."""

from __future__ import annotations

from ..ir.registry import Cost, defop, require
from ..ir.types import TensorType
from .basic import dequant_weight


@defop("router(x, w, bias?, tid2eid?, ids?) -> weights, indices",
       attrs={"k": int, "route_scale": float, "denom_eps": (float, 1e-20), "fp32": (bool, False)}, kernel="router",
       variants={"learned": ("bias",), "hash": ("tid2eid", "ids")})
def router(x, w, bias, tid2eid, ids, *, k, route_scale, denom_eps, fp32):
    """`s = sqrt(softplus(x W^T))`; experts = `tid2eid[ids]` (hash layers) or top-k of `s + bias`
    (the bias only steers selection); weights = `s[sel] / (sum(s[sel]) + denom_eps) * route_scale`
    (`denom_eps`: 1e-20 in transformers, 0 in DeepSeek's code, spec 15 item 14). Computed in x's dtype,
    or with `fp32` from x and W upcast to fp32, the weights then fp32 (DeepSeek's code, spec 10, 15 item 7)."""
    import torch

    scores = _scores(x, w, fp32)
    if tid2eid is not None:
        idx = tid2eid[ids.clamp(min=0)].long()
    else:
        idx = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    wts = scores.gather(-1, idx)
    wts = wts / (wts.sum(dim=-1, keepdim=True) + denom_eps)
    return wts * route_scale, idx


def _scores(x, w, fp32: bool):
    import torch
    import torch.nn.functional as F

    dt = torch.float32 if fp32 else x.dtype
    return F.softplus(F.linear(x.to(dt), w.to(dt))).sqrt()


def selection_scores(x, w, bias, fp32: bool):
    """What a learned router's top-k ranks, `s + bias` as `router` computes it (eager; the golden's choice
    margins read it)."""
    return _scores(x, w, fp32) + bias


@router.infer
def _(x, w, bias, tid2eid, ids, *, k, route_scale, denom_eps, fp32):
    require(denom_eps >= 0.0, "router: denom_eps must be >= 0", found=denom_eps)
    require(w.rank == 2 and w.shape[1] == x.shape[-1], "router weight must be [E, D]", found=list(w.shape))
    require((tid2eid is None) != (bias is None), "router takes either a bias (learned) or tid2eid + ids (hash)")
    require(tid2eid is None or (ids is not None and tid2eid.shape[1] == k), "hash router needs ids and a [V, k] table")
    lead = x.shape[:-1]
    return TensorType((*lead, k), "fp32" if fp32 else x.dtype), TensorType((*lead, k), "i64")


# Where the routing weight enters a routed expert (`v4-reference.md` 10): "after_w2" multiplies w2's
# output, `w2(h) * weight` (transformers); "before_w2" multiplies w2's input, `w2(round(weight * h))`
# (DeepSeek's code: the weight scales the activation in fp32, which is rounded to the activation dtype and,
# with act "fp8", then quantised per 1x128 block). Same maths without activation quantisation; with it,
# not unless the weight is a power of two, so the order is part of the numerics.
ROUTE_WEIGHTS = ("after_w2", "before_w2")
MOE_ATTRS = {"limit": float, "block": (int, 32), "act": (str, "native"), "acc": (str, "fp32"), "out_dtype": (str, ""),
             "route_weight": (str, "after_w2")}


@defop("moe_experts(x, weights, indices, w1, w2, w3, w1_scale?, w2_scale?, w3_scale?) -> y",
       attrs={**MOE_ATTRS, "ep": (int, 1)}, kernel="moe")
def moe_experts(x, weights, indices, w1, w2, w3, w1_scale, w2_scale, w3_scale, *, limit, block, act, acc, out_dtype,
                route_weight, ep=1):
    """`y = sum_k weights_k * w2_e(swiglu(w1_e x, w3_e x))` over each token's selected experts e, the weight
    applied where `route_weight` says (ROUTE_WEIGHTS); the stacked expert weights are `[E, out, in]` (FP4
    packed with 1 x block scales when scaled). The three GEMMs of an expert have `linear`'s numerics for
    `act` (each GEMM's result in the activation dtype). A slot whose index lies outside [0, E) adds
    nothing (expert parallelism: `local_experts` marks other ranks' slots -1). `ep`: the stack is one of
    `ep` equal parts of the routed experts (a rank's, `partition`); only the cost model uses it (a slot
    lands here with probability 1 / ep)."""
    import torch
    import torch.nn.functional as F

    from .basic import gemm

    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    idx = indices.reshape(flat.shape[0], -1)
    wts = weights.reshape(flat.shape[0], -1)
    out = torch.zeros_like(flat)
    for e in torch.unique(idx).tolist():
        if not 0 <= e < w1.shape[0]:
            continue
        tok, slot = torch.where(idx == e)
        xe = flat[tok]
        sc = (lambda s: None if s is None else s[e])
        if act == "native":
            g = F.linear(xe, dequant_weight(w1[e], sc(w1_scale), block, x.dtype))
            u = F.linear(xe, dequant_weight(w3[e], sc(w3_scale), block, x.dtype))
        else:
            g = gemm(xe, w1[e], sc(w1_scale), block, act)
            u = gemm(xe, w3[e], sc(w3_scale), block, act)
        h = F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)
        wt = wts[tok, slot, None]
        if route_weight == "before_w2":
            h = (h.float() * wt.float()).to(x.dtype)
        if act == "native":
            ye = F.linear(h, dequant_weight(w2[e], sc(w2_scale), block, x.dtype))
        else:
            ye = gemm(h, w2[e], sc(w2_scale), block, act)
        if route_weight == "after_w2":
            ye = ye * wt
        out.index_add_(0, tok, ye.to(out.dtype))
    return out.reshape(shape)


@moe_experts.infer
def _(x, weights, indices, w1, w2, w3, w1_scale, w2_scale, w3_scale, *, limit, block, act, acc, out_dtype,
      route_weight, ep=1):
    from .basic import check_gemm_attrs, check_weight, weight_in_features
    require(ep >= 1, "moe_experts: ep (the expert-parallel parts) must be >= 1", found=ep)
    require(weights.shape == indices.shape, "moe weights / indices shapes differ")
    require(weight_in_features(w1) == x.shape[-1] and w1.shape == w3.shape and w2.shape[1] == x.shape[-1]
            and weight_in_features(w2) == w1.shape[1],
            "moe expert weights must be w1, w3 [E, I, D] and w2 [E, D, I]",
            found=(list(w1.shape), list(w2.shape), list(w3.shape)))
    for w, s, n in ((w1, w1_scale, "w1"), (w2, w2_scale, "w2"), (w3, w3_scale, "w3")):
        check_weight(w, s, block, f"moe_experts {n}")
    check_gemm_attrs("moe_experts", act, acc, out_dtype)
    require(out_dtype == "", "moe_experts returns the activation dtype (out_dtype \"\")", found=out_dtype)
    require(route_weight in ROUTE_WEIGHTS, f"moe_experts: route_weight must be one of {ROUTE_WEIGHTS}",
            found=route_weight)
    return x


@router.cost
def _(operands, results, attrs):
    """A hash layer looks up one `tid2eid` row per token, not the table."""
    x, w, bias, tid2eid, ids = operands
    tokens = x.numel // x.shape[-1]
    table = ids.numel * tid2eid.nbytes // tid2eid.shape[0] + ids.nbytes if tid2eid is not None else 0
    return Cost(2 * tokens * w.numel, x.nbytes + w.nbytes + (bias.nbytes if bias is not None else 0) + table,
                sum(r.nbytes for r in results))


def expected_active_experts(E: int, k: int, tokens: int, ep: int = 1) -> float:
    """Distinct experts of a stack of E that `tokens` tokens route to, each picking k distinct of the E * ep
    routed experts (`ep` > 1: the stack is one expert-parallel rank's part). Routing is data, so this is the
    expectation under uniform routing: E (1 - (1 - k / (E ep))^tokens) <= min(E, tokens k / ep)."""
    return min(float(E), tokens * k / ep, E * (1.0 - (1.0 - k / (E * ep)) ** tokens))


def expert_cost(x, weights, indices, stacks, y, ep: int = 1) -> Cost:
    """A step reads the stacked `[E, ...]` expert weights of its distinct active experts, each once (what
    grouping by expert achieves), plus the activations; with `ep` parts, only the 1 / ep of the slots
    routed to this stack (the others are skipped) cost FLOPs and expert reads."""
    tokens, k = x.numel // x.shape[-1], indices.shape[-1]
    E = stacks[0].shape[0]
    active = expected_active_experts(E, k, tokens, ep)
    w = round(sum(t.nbytes // E for t in stacks) * active)
    inter = stacks[0].shape[1]
    return Cost(6 * tokens * k * inter * x.shape[-1] // ep, x.nbytes + weights.nbytes + indices.nbytes + w, y.nbytes)


@moe_experts.cost
def _(operands, results, attrs):
    x, weights, indices = operands[:3]
    return expert_cost(x, weights, indices, [t for t in operands[3:] if t is not None], results[0], attrs.get("ep", 1))
