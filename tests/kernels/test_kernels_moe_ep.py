"""The expert-parallel MoE ops (`ops/fused_ep.py`) under the interpreter, on one rank's part of the experts.

`moe_router_experts_ep` / `mhc_moe_ep`: the single-rank one-launch MoE (decode) with the rank's owner table
masking the routing in the router phase and the combine writing the routed partial sum and the shared
expert's output apart; prefill keeps the grouped launches (the router launch masks, the down launch writes
the two apart). Checked against the op's reference (the composition router -> local_experts -> moe_experts
and the shared expert's linears) within kernel_check.assert_matches, on both ranks of ep 2 (so every slot is
some rank's and the partial sums add up). `mhc_post_pre_add` (the seam after the all-reduce, with the add
folded in) against its reference. Broken variants are caught: the owner mask left out of the router phase,
the shared output added into the partial (the single-rank combine), the add's y2 ignored.
"""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.ops.collective import owner_table
from test_kernels_moe_router import SEAM_ATTRS, case, seam_weights

E_ALL, EP = 6, 2
STACKS = ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")


def ep_case(dtype, hashed, fmts, part, B=2, T=3):
    """`case` with E_ALL routed experts, cut to rank `part`'s E_ALL / EP of them (its owner table)."""
    args, attrs = case(dtype, hashed, *fmts, E=E_ALL, B=B, T=T)
    per = E_ALL // EP
    for n in STACKS:
        if args.get(n) is not None:
            args[n] = args[n][part * per:(part + 1) * per].contiguous()
    args["owner"] = owner_table(E_ALL, EP, part)
    return args, {**attrs, "ep": EP}


def run(op_name, args, attrs, names):
    ref = kc.reference(op_name, args, attrs)
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(names, ref)}
    calls = kernels.launch(op_name, args, attrs, outs)
    return outs, ref, calls


@pytest.mark.parametrize("dtype,hashed,fmts,T", [
    (torch.bfloat16, True, ("float", "float"), 3),
    (torch.float32, False, ("float", "float"), 33),  # prefill-sized: the grouped launches
], ids=["bf16-hash-decode", "fp32-learned-prefill"])
def test_moe_router_experts_ep_matches_its_reference(dtype, hashed, fmts, T):
    check_ep(dtype, hashed, fmts, T, range(EP))


def check_ep(dtype, hashed, fmts, T, parts):
    total = None
    for part in parts:
        args, attrs = ep_case(dtype, hashed, fmts, part, B=1 if T > 3 else 2, T=T)
        outs, ref, calls = run("moe_router_experts_ep", args, attrs, ("partial", "shared"))
        if T == 3:
            assert [c.kernel_name for c in calls] == ["moe_fused_kernel"]
        for n, r in zip(("partial", "shared"), ref):
            kc.assert_matches(outs[n], r, f"moe_router_experts_ep {n} (rank {part})", ulps=2)
        total = outs["partial"].float() if total is None else total + outs["partial"].float()
    if len(parts) < EP:
        return
    # the ranks' partial sums add up to the whole routed sum (every slot is exactly one rank's)
    whole, _ = case(dtype, hashed, *fmts, E=E_ALL, B=1 if T > 3 else 2, T=T)
    from v4compile.ops.moe import moe_experts, router
    wts, idx = router.ref(whole["x"], whole["gate"], whole["bias"], whole["tid2eid"], whole["ids"], k=attrs["k"],
                          route_scale=attrs["route_scale"], denom_eps=1e-20, fp32=attrs["fp32"])
    routed = moe_experts.ref(whole["x"], wts, idx, *(whole.get(n) for n in STACKS), limit=attrs["limit"],
                             block=attrs["block"], act="native", acc="fp32", out_dtype="", route_weight="before_w2")
    kc.assert_matches(total.to(dtype), routed, "the ranks' partial sums", ulps=4)


def test_mhc_moe_ep_matches_its_reference():
    args, attrs = ep_case(torch.float32, False, ("float", "float"), 1)
    g = torch.Generator().manual_seed(5)
    N, D = 4, args["x"].shape[-1]
    B, T = args["x"].shape[:2]
    args["y"] = args.pop("x")
    args.update(streams=torch.randn(B, T, N, D, generator=g), post=2 * torch.rand(B, T, N, generator=g),
                comb=torch.softmax(torch.randn(B, T, N, N, generator=g), -1), **seam_weights(g, N, D, "in_"))
    attrs.update({"in_" + n: v for n, v in SEAM_ATTRS.items()})
    outs, ref, calls = run("mhc_moe_ep", args, attrs, ("partial", "shared", "streams_out", "post_next", "comb_next"))
    assert [c.kernel_name for c in calls] == ["moe_fused_kernel"] and calls[0].constexprs["NA"] == 1
    for n, r in zip(("partial", "shared", "streams_out", "post_next", "comb_next"), ref):
        kc.assert_matches(outs[n], r, f"mhc_moe_ep {n}")


def seam_add_case():
    g = torch.Generator().manual_seed(3)
    B, T, N, D = 2, 3, 4, 64
    args = dict(y=torch.randn(B, T, D, generator=g), y2=torch.randn(B, T, D, generator=g),
                streams=torch.randn(B, T, N, D, generator=g), post=2 * torch.rand(B, T, N, generator=g),
                comb=torch.softmax(torch.randn(B, T, N, N, generator=g), -1), **seam_weights(g, N, D))
    return args


def test_mhc_post_pre_add_matches_its_reference():
    outs, ref, _ = run("mhc_post_pre_add", seam_add_case(), SEAM_ATTRS,
                       ("streams_out", "y_next", "post_next", "comb_next"))
    for n, r in zip(("streams_out", "y_next", "post_next", "comb_next"), ref):
        kc.assert_matches(outs[n], r, f"mhc_post_pre_add {n}")


def test_broken_kernels_are_caught(monkeypatch, tmp_path):
    """Each fault, patched into the kernel source, makes the check above fail."""
    from v4compile.codegen.kernels import mhc, moe, moe_router, router
    one_rank = (torch.float32, False, ("float", "float"), 3, (1,))
    faults = [(router, "route_rows", "    if o_ptr is not None:\n        known", "    if False:\n        known",
               check_ep, one_rank),
              (moe, "_combine", "        if sy_ptr is not None:", "        if False:", check_ep, one_rank),
              (mhc, "_post_chunk", "    if y2_ptr is not None:", "    if False:",
               test_mhc_post_pre_add_matches_its_reference, ())]
    for module, name, old, new, check, params in faults:
        with monkeypatch.context() as m:
            kc.install_broken_kernel(m, tmp_path, module, name, old, new)
            if name == "route_rows":  # the fused kernel's router phase calls moe_router's import of it
                m.setattr(moe_router, name, getattr(router, name))
            with pytest.raises(AssertionError):
                check(*params)


def check_dp(dtype, hashed, T, kernel="moe_fused_kernel"):
    """`moe_router_experts_dp` on rank 1 of a dp 2 / ep 2 group: the router and this rank's routed experts on
    the gathered rows (both ranks' tokens), the shared expert on rank 1's own (the second half of them)."""
    args, attrs = ep_case(dtype, hashed, ("float", "float"), 1, B=2, T=T)
    args["xg"] = args["x"]
    args["x"] = args["xg"][1:].clone()
    outs, ref, calls = run("moe_router_experts_dp", args, attrs, ("partial", "shared"))
    assert kernel in [c.kernel_name for c in calls]
    assert outs["partial"].shape[0] == 2 and outs["shared"].shape[0] == 1
    for n, r in zip(("partial", "shared"), ref):
        kc.assert_matches(outs[n], r, f"moe_router_experts_dp {n}", ulps=2)
    return calls


# (dtype, hash router, tokens a rank, the launches' form): 12 pairs scan their ids in one launch; 68 pairs are
# grouped by a phase of that launch; with FUSED_MAX_PAIRS below them, by launches of their own (prefill's form)
DP_CASES = {"bf16-hash-scan": (torch.bfloat16, True, 3, "scan"), "fp32-learned-grouped": (torch.float32, False, 17, "grouped"),
            "fp32-learned-apart": (torch.float32, False, 17, "apart")}


@pytest.mark.parametrize("case_id", sorted(DP_CASES))
def test_moe_router_experts_dp_matches_its_reference(monkeypatch, case_id):
    from v4compile.codegen.kernels import moe_router
    dtype, hashed, T, form = DP_CASES[case_id]
    if form == "apart":
        monkeypatch.setattr(moe_router, "FUSED_MAX_PAIRS", 16)
    calls = check_dp(dtype, hashed, T, "moe_up_kernel" if form == "apart" else "moe_fused_kernel")
    if form != "apart":
        assert len(calls) == 1 and (calls[0].constexprs["NG"] > 0) == (form == "grouped")


DP_FAULTS = {
    # the shared expert's gate / up reading x (the gathered rows: rank 0's first) instead of the rank's own
    # (the shared gate / up in its place before the routed experts: the dp op folds no all-reduce in)
    "fused reads x": ("moe_router", "moe_fused_kernel", "v - NR, _or(xs_ptr, x_ptr)", "v - NR, x_ptr", 3,
                      "moe_fused_kernel"),
    "grouped reads x": ("moe", "moe_up_kernel", "_or(xs_ptr, x_ptr)", "x_ptr", 17, "moe_up_kernel"),
    # the one launch's grouping programs all doing block 0: the rest of the pairs' list and the offsets unwritten
    "fused grouping block": ("moe_router", "moe_fused_kernel", "_group_block(t - NR,", "_group_block((t - NR) * 0,", 17,
                             "moe_fused_kernel"),
}


@pytest.mark.parametrize("fault", sorted(DP_FAULTS))
def test_a_broken_dp_kernel_is_caught(monkeypatch, tmp_path, fault):
    import importlib
    from v4compile.codegen.kernels import moe_router
    module, name, old, new, T, kernel = DP_FAULTS[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, importlib.import_module(f"v4compile.codegen.kernels.{module}"),
                             name, old, new)
    if kernel == "moe_up_kernel":
        monkeypatch.setattr(moe_router, "FUSED_MAX_PAIRS", 16)
    with pytest.raises(AssertionError):
        check_dp(torch.float32, False, T, kernel)
