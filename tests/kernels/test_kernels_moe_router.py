"""moe_router family (`moe_router_experts_shared`: router + shared expert + routed experts; `moe_mhc_post_pre`:
the same and the mHC seam after it) under the interpreter against the launches it replaces: the router, the
moe_experts_shared and the mhc_post_pre kernels run apart.

Decode-sized P (scan mode): the whole op is one launch (`moe_fused_kernel`: router, shared and routed gate /
up, routed down, the combine, and the seam), and its results must be bit-identical to the kernels run one
after the other (same arithmetic in the same order, nothing to tolerate) and match the op's reference
within kernel_check.assert_matches (2 bf16 ulps as in test_kernels_moe). Prefill-sized P (grouped mode):
the router and the seam keep their own launches (the same kernels as apart), checked against the
reference in test_kernels_mhc_moe (with the seam before the MoE in front). Learned and hash routing, fp32
and bf16 (a bf16 router: the bias sum in bf16), FP4 / FP8 and float weights. Every scratch starts as NaN and every counter must end at 0 (run_calls), and deliberately
broken variants of the fused kernel are caught: router programs that route the wrong row block, a counter
left set (the ticket, a D tile's arrivals), up or down programs that run another expert's pairs, a
combine without the shared expert, seam programs on the wrong tokens. That
every consumer waits for its producers is shown on the source (the interpreter runs programs in ticket
order, so a missing wait cannot fail there). The gfx950 binary of the fused kernel takes only the
parameters its call describes (the router phase is inlined there: a noinline call would add AMDGPU's
hidden kernel arguments), and the AOT stage refuses a binary that takes hidden arguments.
"""

from __future__ import annotations

import json

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import moe_router
from test_kernels_moe import expert_args


def case(dtype, hashed, efmt="fp4", sfmt="fp8", E=5, D=64, I=64, IS=64, k=2, B=2, T=5, seed=0, fp32=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    args = {"x": x, "gate": (torch.randn(E, D, generator=g) * 0.2).to(dtype), "bias": None, "tid2eid": None,
            "ids": None}
    if hashed:
        args["tid2eid"] = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(9)])  # E - 1 idle
        args["ids"] = torch.randint(0, 9, (B, T), generator=g)
        args["ids"][-1, -1] = -1  # padding
    else:
        args["bias"] = torch.randn(E, generator=g) * 0.5
    args.update(expert_args(efmt, sfmt, E, D, I, IS, g, dtype))
    attrs = {"limit": 1.5, "block": 32 if efmt == "fp4" else 128, "shared_block": 128, "route_weight": "before_w2",
             "k": k, "route_scale": 2.5, "fp32": fp32}
    return args, attrs


def apart(args, attrs):
    """y from the router kernel, then the moe_experts_shared kernels on its results."""
    x, k = args["x"], attrs["k"]
    r_attrs = {n: attrs[n] for n in ("k", "route_scale", "fp32")}
    wts, _ = kc.poisoned((*x.shape[:-1], k), torch.float32 if attrs["fp32"] else x.dtype)
    idx, _ = kc.poisoned((*x.shape[:-1], k), torch.int64)
    kernels.launch("router", {"x": x, "w": args["gate"], **{n: args[n] for n in ("bias", "tid2eid", "ids")}},
                   r_attrs, {"weights": wts, "indices": idx})
    m_args = {n: v for n, v in args.items() if n not in ("gate", "bias", "tid2eid", "ids")}
    y, _ = kc.poisoned(x.shape, x.dtype)
    kernels.launch("moe_experts_shared", {**m_args, "weights": wts, "indices": idx},
                   {n: v for n, v in attrs.items() if n not in r_attrs}, {"y": y})
    return y


def fused(args, attrs):
    y, _ = kc.poisoned(args["x"].shape, args["x"].dtype)
    calls = kernels.launch("moe_router_experts_shared", args, attrs, {"y": y})
    return y, calls


SEAM_ATTRS = {"eps": 1e-6, "hc_eps": 1e-6, "iters": 3, "norm_eps": 1e-6}  # few Sinkhorn steps: interpreter time
SEAM_RESULTS = ("streams_out", "y_next", "post_next", "comb_next")


def seam_case(dtype, hashed, *fmts, B=2, T=5, **kw):
    """`case` plus the operands of the mhc_post_pre after the MoE (4 streams of x's width)."""
    args, attrs = case(dtype, hashed, *fmts, B=B, T=T, **kw)
    g = torch.Generator().manual_seed(7)
    N, D = 4, args["x"].shape[-1]
    args.update(streams=(torch.randn(B, T, N, D, generator=g) * 2).to(dtype), post=2 * torch.rand(B, T, N, generator=g),
                comb=torch.softmax(torch.randn(B, T, N, N, generator=g), -1))
    args.update(seam_weights(g, N, D))
    return args, {**attrs, **SEAM_ATTRS}


def seam_weights(g, N, D, prefix=""):
    """An mhc_post_pre's fn / base / scale / norm for N streams of width D (named with `prefix`)."""
    w = dict(fn=torch.randn(6 * N, N * D, generator=g) * (2.0 / (N * D) ** 0.5),
             base=torch.randn(6 * N, generator=g) * 0.5, scale=torch.rand(3, generator=g) + 0.5,
             norm=torch.rand(D, generator=g) + 0.5)
    return {prefix + n: v for n, v in w.items()}


def seam_fused(args, attrs, op_name="moe_mhc_post_pre"):
    """The op's reference, and the op's launches on poisoned results (also `mhc_moe_mhc`'s: the same results)."""
    ref = kc.reference(op_name, args, attrs)
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(SEAM_RESULTS, ref)}
    calls = kernels.launch(op_name, args, attrs, outs)
    return outs, ref, calls


def seam_apart(args, attrs, ref):
    """The router and moe kernels (`apart`), then the mhc_post_pre kernel on their output."""
    m_args = {n: v for n, v in args.items() if n not in moe_router.SEAM_OPERANDS}
    y = apart(m_args, {n: v for n, v in attrs.items() if n not in SEAM_ATTRS})
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(SEAM_RESULTS, ref)}
    kernels.launch("mhc_post_pre", {"y": y, **{n: args[n] for n in moe_router.SEAM_OPERANDS}}, SEAM_ATTRS, outs)
    return outs


@pytest.mark.parametrize("dtype,hashed,fmts,fp32", [  # (fp32, learned, float weights: test_kernels_mhc_moe)
    (torch.bfloat16, True, ("fp4", "fp8"), False),
    (torch.bfloat16, False, ("float", "float"), True),  # official numerics: an fp32 router on bf16 activations
], ids=["bf16-hash-fp4", "bf16-learned-float-fp32router"])
def test_fused_decode_equals_the_launches_apart(dtype, hashed, fmts, fp32):
    """`moe_mhc_post_pre` at decode: one launch, bit-identical to the router, moe and mhc kernels run one
    after the other, and within 2 bf16 ulps of the reference (the MoE's sums, carried through the seam)."""
    args, attrs = seam_case(dtype, hashed, *fmts, fp32=fp32)
    outs, ref, calls = seam_fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["moe_fused_kernel"]
    # `mhc_moe_mhc`'s launch (its seam before's weights null): NA copying blocks + NR router blocks + ST shared
    # tiles + E x RT routed up tiles + E x ND routed down tiles + NH seam blocks
    assert calls[0].grid[0] == 1 + 1 + 1 + 5 * 1 + 5 * 1 + 1 and calls[0].constexprs["NA"] == 1
    assert {n for _, k, n, _ in calls[0].pointers if n.startswith("absent_")} == {
        "absent_in_fn", "absent_in_base", "absent_in_scale", "absent_in_norm"}
    want = seam_apart(args, attrs, ref)
    for n, r in zip(SEAM_RESULTS, ref):
        assert torch.equal(outs[n], want[n]), f"{n}: the fused launch differs from the launches apart"
        kc.assert_matches(outs[n], r, f"moe_mhc_post_pre {n}", ulps=2)


def _fused_at_run_time(hashed, ids=True):
    """`moe_router_experts_shared` as its AOT binary runs: the routing table one pointer (tid2eid, or the bias
    where the layer has none) and the token ids a null pointer where absent (an empty tensor: address 0, not
    Triton's compile-time None), so the kernel picks the routing at run time. `ids=False`: a hash layer
    launched without its ids (a wrong choice, to be caught)."""
    args, attrs = case(torch.bfloat16, hashed, "fp4", "fp8", fp32=True)  # (an fp32 router: the bias's dtype)
    y, _ = kc.poisoned(args["x"].shape, args["x"].dtype)
    calls = kernels.specialise_tensors("moe_router_experts_shared", args, attrs, {"y": y})
    bound = {n: torch.empty(0, dtype=torch.int64) if v is None or (n == "ids" and not ids) else v
             for n, v in args.items()}
    assert all(bound[n].data_ptr() == 0 for n, v in args.items() if v is None)
    kernels.run_calls(calls, bound, {"y": y})
    return y, calls[0], apart(args, attrs)


def test_one_binary_routes_both_ways_at_run_time():
    """The hash-routed and the learned layers' one-launch MoE are one binary (the same constexprs and
    signature; two names, as each binds its own routing table), routing each right when the choice is made at
    run time: bit-identical to the router and moe kernels apart; a hash layer launched without its token ids
    (routing by its table read as a bias) is caught."""
    (yl, cl, wl), (yh, ch, wh) = (_fused_at_run_time(h) for h in (False, True))
    assert cl.constexprs == ch.constexprs and cl.signature() == ch.signature() and cl.name != ch.name
    assert torch.equal(yl, wl) and torch.equal(yh, wh), "the run-time routing differs from the launches apart"
    assert not torch.equal(_fused_at_run_time(True, ids=False)[0], wh), "a wrong routing choice went unseen"


def test_without_a_seam_the_same_launch_ends_at_the_combine():
    """`moe_router_experts_shared` (the last layer's MoE): the same kernel with no seam programs, its y
    bit-identical to the router and moe kernels run apart."""
    args, attrs = case(torch.bfloat16, True, "fp4", "fp8")
    y, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["moe_fused_kernel"] and calls[0].grid[0] == 1 + 1 + 5 + 5
    assert torch.equal(y, apart(args, attrs)), "the fused launch differs from the router + moe kernels"
    kc.assert_matches(y, kc.reference("moe_router_experts_shared", args, attrs)[0], "moe_router_experts_shared",
                      ulps=2)


# (prefill-sized P, the grouped launches and the seams': test_kernels_mhc_moe, the same calls with the seam before)


def _first_and_middle_calls(dtype=torch.bfloat16, fmts=("fp4", "fp8")):
    """The one-launch calls of a first MoE layer (`moe_mhc_post_pre`) and of a middle one (`mhc_moe_mhc`) of
    one model (tensors of the same shapes and layouts; hash-routed both)."""
    from test_kernels_mhc_moe import front_case
    calls = []
    for op_name, (args, attrs) in (("moe_mhc_post_pre", seam_case(dtype, True, *fmts)),
                                   ("mhc_moe_mhc", front_case(dtype, True, *fmts))):
        s = args["streams"]
        outs = {"streams_out": torch.empty_like(s), "y_next": torch.empty((*s.shape[:-2], s.shape[-1]), dtype=s.dtype),
                "post_next": torch.empty_like(args["post"]), "comb_next": torch.empty_like(args["comb"])}
        (c,) = kernels.specialise_tensors(op_name, args, attrs, outs)
        calls.append(c)
    return calls


def _check_one_binary(first, middle):
    from v4compile.codegen import aot
    assert first.name != middle.name  # (one sidecar each: they bind different operands)
    for target in ("gfx950", "sm_90a"):
        assert aot.job_of(first, target)["key"] == aot.job_of(middle, target)["key"], f"two binaries on {target}"
    assert middle.grid == first.grid  # the seam before's programs: copying in the first layer's launch


def test_first_moe_layer_is_the_middle_layers_binary():
    """The first MoE layer's launch (no seam before it) and the others' (both seams) are one AOT binary: the
    same constexprs, signature and alignment; its numerics: test_fused_decode_equals_the_launches_apart. A
    call of the first layer with a constexpr of its own is caught."""
    first, middle = _first_and_middle_calls()
    _check_one_binary(first, middle)
    first.constexprs = {**first.constexprs, "A_EPS": first.constexprs["A_EPS"] * 2}  # e.g. its own seam's eps
    with pytest.raises(AssertionError, match="two binaries"):
        _check_one_binary(first, middle)


BROKEN = {
    # every router program routes the first row block (T = 20 tokens: 2 blocks of BR = 16): the last tokens'
    # routing stays poison
    "unrouted block": ("_route_phase(v,", "_route_phase(v * 0,", AssertionError),
    # the phase counters are never reset: the next call of the program would start at the wrong ticket
    "ticket kept": ("tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)", "pass", kernels.CodegenError),
    # the routed up programs map to the wrong experts: odd experts never run (their h rows stay poison)
    "wrong expert": ("_up(w // RT, w % RT,", "_up(w // RT // 2 * 2, w % RT,", AssertionError),
    # the routed down programs map to the wrong experts: odd experts' yr rows stay poison
    "wrong down expert": ("_down(e, n_tile,", "_down(e // 2 * 2, n_tile,", AssertionError),
    # a D tile's arrival counter is left set: the next call would combine that tile before its experts ran
    "arrival kept": ("tl.store(phase_ptr + COUNTERS + n_tile, 0)", "pass", kernels.CodegenError),
    # the combine sums the routed rows but leaves out the shared expert's down GEMM
    "no shared down": ("idx_ptr, cw2_ptr, cs2_ptr, out_ptr, sy_ptr", "idx_ptr, None, cs2_ptr, out_ptr, sy_ptr",
                       AssertionError),
    # the seam programs all run the first token block (T = 20 tokens: 2 blocks of BT = 16): the rest stays poison
    "seam block": ("mhc_rows(v - NR - ST - E * RT - E * ND - SD - 2 * NP,",
                   "mhc_rows((v - NR - ST - E * RT - E * ND - SD - 2 * NP) * 0,", AssertionError),
    # (no seam before: its programs copy the MoE's x and the seam's streams / post / comb to scratch) all copy
    # the first token block: the rest stays poison
    "seam copy block": ("_copy_rows(s,", "_copy_rows(s * 0,", AssertionError),
    # the streams copied from where they are to go (poison) instead of the layer's streams
    "seam copy streams": ("_copy_rows(s, a_y, a_s,", "_copy_rows(s, a_y, m_s_ptr,",
                          AssertionError),
}


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_broken_fused_kernel_is_caught(fault, monkeypatch, tmp_path):
    old, new, error = BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, moe_router, "moe_fused_kernel", old, new)
    if fault.startswith("seam"):
        args, attrs = seam_case(torch.float32, True, "float", "float", B=1, T=20)
        with pytest.raises(error):
            outs, ref, _ = seam_fused(args, attrs)
            for n, r in zip(SEAM_RESULTS, ref):
                kc.assert_matches(outs[n], r, f"{fault} {n}")
        return
    args, attrs = case(torch.float32, True, "float", "float", B=1, T=20)
    ref = kc.reference("moe_router_experts_shared", args, attrs)[0]
    with pytest.raises(error):
        y, _ = fused(args, attrs)
        kc.assert_matches(y, ref, fault)


def test_every_wait_follows_its_producers_publish():
    """The waits cannot be shown wrong by running them (the interpreter runs programs in ticket order), so the
    kernel's source is checked: each producer publishes after its work, each consumer waits before its own
    (a folded all-reduce -> the seam before; router -> routed up; routed up -> its expert's down programs; shared
    up -> the combining program; with the MoE's all-reduce folded in: the combined D tiles -> the publishers -> the
    gatherers, the shared gate / up and down between them; DP's folded all-gather -> the router, its reduce-scatter's
    gatherers where the all-reduce's are; the seam before it, first by ticket -> the all-gather); the last program to finish counts every phase's; the
    phases sit in the kernel (the ticket order) as the deadlock-freedom argument needs (`allreduce.fold_trailing`:
    no program waits for a later ticket on its rank)."""
    import inspect
    src = inspect.getsource(moe_router.moe_fused_kernel.fn)
    at = src.index
    assert at("oneshot_tiles(c, ar_x_ptr, a_y_ptr") < at("publish(phase_ptr + REDUCED)") \
        < at("wait_for(phase_ptr + REDUCED, NO)  # every tile") < at("mhc_rows(s, a_y")
    # DP (`allreduce.fold_rows`): every rank's tokens gathered into the router's x, then the router reads them; with
    # the seam before (tickets [0, NA), the gather's NO after them), the gather waits for the seam's x
    assert at("c = v + NO + NA - NA * AR_GATHER") and at("s = v + NA + NO * AR_GATHER")
    assert at("wait_for(phase_ptr + SEAM_IN, NA)  # this rank's tokens") < at("rows_tiles(c, xs_ptr, x_ptr") \
        < at("publish(phase_ptr + REDUCED)") < at("if AR_GATHER:\n            wait_for(phase_ptr + REDUCED, NO)") \
        < at("_route_phase(v,")
    assert at("mhc_rows(s, a_y") < at("publish(phase_ptr + SEAM_IN)")
    assert at("last_to_arrive(phase_ptr + FINISHED, NO + NA + NR + NG + ST + E * RT + E * ND + 2 * NP + SD + NH)")
    assert at("_route_phase(v,") < at("publish(phase_ptr + ROUTED)") < at("wait_for(phase_ptr + ROUTED, NR)") \
        < at("_up(w // RT")
    assert at("_up(w // RT") < at("publish(phase_ptr + COUNTERS + ND + w // RT)") \
        < at("wait_for(phase_ptr + COUNTERS + ND + e, RT)") < at("_down(e, n_tile,")
    assert at("_up(v * 0, v - NR") < at("publish(phase_ptr + SHARED_UP)") < at("wait_for(phase_ptr + SHARED_UP, ST)") \
        < at("_combine_column(n_tile, hs_ptr, yr_ptr, idx_ptr, cw2_ptr")
    # the trailing all-reduce: the routed sum alone -> COMBINED -> publishers -> the shared expert -> gatherers
    assert at("_combine_column(n_tile, hs_ptr, yr_ptr, idx_ptr, None, None") < at("publish(phase_ptr + COMBINED)") \
        < at("wait_for(phase_ptr + COMBINED, ND)\n            publish_tiles(") < at("publish(phase_ptr + PUBLISHED)") \
        < at("_up(v * 0, v - NR - E * RT - E * ND - NP") < src.rindex("publish(phase_ptr + SHARED_UP)") \
        < src.rindex("wait_for(phase_ptr + SHARED_UP, ST)") < at("CDT, BM, D_BN, C_BK, C_BKS, False)") \
        < at("wait_for(phase_ptr + PUBLISHED, NP)") < at("scatter_tiles(") < at("gather_tiles(") \
        < at("mhc_rows(v - NR")
    assert at("_down(e, n_tile,") < at("last_to_arrive(phase_ptr + COUNTERS + n_tile, E)") < at("_combine_column(n_tile,")
    assert at("_combine_column(n_tile,") < at("publish(phase_ptr + COMBINED)") < at("wait_for(phase_ptr + COMBINED, ND)") \
        < at("mhc_rows(v - NR")


@pytest.mark.slow
def test_gfx950_binary_takes_only_the_calls_parameters(tmp_path, monkeypatch):
    """The router phase is a noinline call on sm_90a only (kernels/flags.py: CALLS_PARAM): called on gfx950, the kernel
    grows AMDGPU's hidden kernel arguments behind the pointers the call describes (the launch's parameter
    array would not cover them; the fake HIP driver refuses the launch); the AOT stage records them."""
    from v4compile.codegen import aot

    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path / "cache"))
    args, attrs = case(torch.float32, True, "float", "float")  # (the seam phase is inlined code: no call)
    _, calls = fused(args, attrs)
    rows = aot.compile_calls(calls[:1], ["gfx950"], tmp_path / "ok", jobs=1)
    side = json.loads((tmp_path / "ok" / rows[0]["sidecar"]).read_text())
    assert side["constexprs"]["CALLS"] is False and b"hidden_" not in (tmp_path / "ok" / rows[0]["path"]).read_bytes()
    assert rows[0]["hidden_args"] == 0, rows[0]
    monkeypatch.setattr(aot, "uses_calls", lambda target: True)  # the call kept on gfx950: the fault shows
    rows = aot.compile_calls(calls[:1], ["gfx950"], tmp_path / "called", jobs=1)
    assert rows[0]["hidden_args"] > 0 and b"hidden_" in (tmp_path / "called" / rows[0]["path"]).read_bytes()
