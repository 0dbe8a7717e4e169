"""`mhc_moe_mhc` (the seam before the MoE, the MoE, the seam after it: one op) under the interpreter against
the launches it replaces: the mhc_post_pre kernel on the attention's output, then `moe_mhc_post_pre`'s
launches apart (the router, moe_experts_shared and mhc_post_pre kernels, `test_kernels_moe_router`).

Decode-sized P: one launch (`moe_fused_kernel` with NA seam programs first), bit-identical to the kernels
run one after the other (the same phase bodies in the same order: nothing to tolerate) and within 2 bf16
ulps of the op's reference (kernel_check.assert_matches, as test_kernels_moe_router). Prefill-sized P keeps
the seam's own launch in front of the grouped launches. Every scratch starts as NaN and every counter must
end at 0; deliberately broken variants are caught: seam programs on the wrong tokens, the seam reading its
streams from its own output, a finished count that leaves out the seam programs (the counters are reset one
program early). That the router and shared programs wait for the seam is shown on the source (the
interpreter runs programs in ticket order, so a missing wait cannot fail there).
"""

from __future__ import annotations

import inspect

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import moe_router
from test_kernels_moe_router import SEAM_ATTRS, SEAM_RESULTS, seam_apart, seam_case, seam_fused, seam_weights

FRONT = ("y", "streams", "post", "comb")  # the seam before's activations (its weights: in_fn, ...)
IN_ATTRS = {"in_" + n: v for n, v in SEAM_ATTRS.items()}


def front_case(dtype, hashed, *fmts, B=2, T=5, **kw):
    """`seam_case` with its x as the attention's output y, the seam before's streams / post / comb and its
    own fn / base / scale / norm (`in_*`)."""
    args, attrs = seam_case(dtype, hashed, *fmts, B=B, T=T, **kw)
    g = torch.Generator().manual_seed(11)
    N, D = 4, args["x"].shape[-1]
    args["y"] = args.pop("x")
    args.update(seam_weights(g, N, D, "in_"))
    return args, {**attrs, **IN_ATTRS}


def fused(args, attrs):
    return seam_fused(args, attrs, "mhc_moe_mhc")


def apart(args, attrs, ref):
    """The mhc_post_pre kernel on the attention's output, then `moe_mhc_post_pre`'s kernels apart."""
    mid = kc.reference("mhc_post_pre", {**{n: args[n] for n in FRONT}, "fn": args["in_fn"], "base": args["in_base"],
                                        "scale": args["in_scale"], "norm": args["in_norm"]}, SEAM_ATTRS)
    s, x, p, c = (kc.poisoned(t.shape, t.dtype)[0] for t in mid)
    kernels.launch("mhc_post_pre", {**{n: args[n] for n in FRONT}, **{n: args["in_" + n] for n in
                                    ("fn", "base", "scale", "norm")}}, SEAM_ATTRS,
                   {"streams_out": s, "y_next": x, "post_next": p, "comb_next": c})
    inner = {n: v for n, v in args.items() if n not in FRONT and not n.startswith("in_")}
    inner.update(x=x, streams=s, post=p, comb=c)
    return seam_apart(inner, {n: v for n, v in attrs.items() if n not in IN_ATTRS}, ref)


@pytest.mark.parametrize("dtype,hashed,fmts", [
    (torch.float32, False, ("float", "float")),
    (torch.bfloat16, True, ("fp4", "fp8")),
], ids=["fp32-learned-float", "bf16-hash-fp4"])
def test_fused_decode_equals_the_launches_apart(dtype, hashed, fmts):
    args, attrs = front_case(dtype, hashed, *fmts)
    outs, ref, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["moe_fused_kernel"]
    # NA seam-before blocks + NR router blocks + ST shared tiles + E x RT up + E x ND down + NH seam-after blocks
    assert calls[0].grid[0] == 1 + 1 + 1 + 5 * 1 + 5 * 1 + 1 and calls[0].constexprs["NA"] == 1
    want = apart(args, attrs, ref)
    for n, r in zip(SEAM_RESULTS, ref):
        assert torch.equal(outs[n], want[n]), f"{n}: the fused launch differs from the launches apart"
        kc.assert_matches(outs[n], r, f"mhc_moe_mhc {n}", ulps=2)


def test_grouped_prefill_keeps_the_seam_launches():
    args, attrs = front_case(torch.float32, False, "float", "float", B=1, T=33)  # P = 66 > SCAN_MAX_PAIRS
    outs, ref, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["mhc_kernel", "router_kernel", "moe_group_kernel", "moe_up_kernel",
                                              "moe_down_kernel", "mhc_kernel"]
    for n, r in zip(SEAM_RESULTS, ref):
        kc.assert_matches(outs[n], r, f"grouped {n}", ulps=2)


BROKEN = {
    # every seam-before program runs the first token block (T = 20 tokens: 2 blocks of BT = 16): the MoE's x
    # for the last tokens stays poison
    "seam block": ("mhc_rows(s,", "mhc_rows(s * 0,", AssertionError),
    # the seam before reads the streams from its own output (scratch, NaN) instead of the layer's streams
    "streams from scratch": ("mhc_rows(s, a_y, None, a_s,", "mhc_rows(s, a_y, None, m_s_ptr,",
                             AssertionError),
    # the finished count leaves out the seam programs: the counters are reset one program early and the last
    # program's arrival is left in them (the next call would start wrong)
    "finished early": ("NO + NA + NR + NG + ST + E * RT + E * ND + 2 * NP + SD + NH)",
                       "NO + NR + NG + ST + E * RT + E * ND + 2 * NP + SD + NH)",
                       kernels.CodegenError),
}


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_broken_fused_kernel_is_caught(fault, monkeypatch, tmp_path):
    old, new, error = BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, moe_router, "moe_fused_kernel", old, new)
    T = 20 if fault == "seam block" else 5  # 2 token blocks where the fault needs them
    args, attrs = front_case(torch.float32, True, "float", "float", B=1, T=T)
    with pytest.raises(error):
        outs, ref, _ = fused(args, attrs)
        for n, r in zip(SEAM_RESULTS, ref):
            kc.assert_matches(outs[n], r, f"{fault} {n}")


def test_the_moe_waits_for_the_seam_before():
    """The router and shared programs (the first readers of x) wait for every seam program's publish: the shared
    gate / up where they run early and where they run after the folded all-reduce's publishers
    (`allreduce.fold_trailing`); the routed and combining programs wait for them in turn (test_kernels_moe_router)."""
    src = inspect.getsource(moe_router.moe_fused_kernel.fn)
    at = src.index
    seam, router, shared = at("mhc_rows(s,"), at("_route_phase(v,"), at("_up(v * 0, v - NR,")
    late = at("_up(v * 0, v - NR - E * RT - E * ND - NP,")
    assert seam < at("publish(phase_ptr + SEAM_IN)") < router < shared < late
    waits = [i for i in range(len(src)) if src.startswith("wait_for(phase_ptr + SEAM_IN, NA)", i)]
    # (the first: DP's all-gather of the seam's x, `test_every_wait_follows_its_producers_publish`)
    assert len(waits) == 4 and waits[0] < seam
    waits = waits[1:]
    assert at("elif v < NR:") < waits[0] < router
    assert at("elif v < NR + ST0:") < waits[1] < shared and at("elif v < NR + E * RT + E * ND + NP + ST:") < waits[2] < late
