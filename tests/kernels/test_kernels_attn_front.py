"""attn_front family (`pair_norm_linear`: the attention input's `linear_pair` and the `norm_linear` of one of
its outputs) under the interpreter against the launches it replaces: the `linear_pair` kernel, then the
`norm_linear` kernel on the columns of its result that the fused op names.

The one launch (`pair_norm_kernel`) must be bit-identical to the two (the same code and constexprs: nothing
to tolerate), FP8 activation quantisation included (official numerics: every GEMM `act="fp8"`), and match
the op's reference within kernel_check.assert_matches. Cases: the merged-GEMM view (V4: q_a, the first
columns of `wqkv_a`, with both pair GEMMs splitting K and reducing in-launch), a whole result (tiny-pro:
wq_a apart from wkv), and the second result at a column offset. Every result starts as NaN and the
semaphore must end at 0 (run_calls). Deliberately broken variants are caught: the norm GEMM reading the
wrong columns, without its RMSNorm, on the wrong tiles, a phase counter left set. That the norm programs
wait for the half that writes their input is shown on the source (the interpreter runs programs in ticket
order, so a missing wait cannot fail there).
"""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import attn_front
from v4compile.formats import fp8_block_quant

RESULTS = ("y0", "y1", "y")


def _fp8(n, k, g):
    return fp8_block_quant(torch.randn(n, k, generator=g) * 0.05, 128)


def case(dtype, act, src, col, KN, K=512, N0=96, N1=48, NB=192, M=(2, 1), seed=0):
    """x [M, K]; y0 = x w0^T (FP8 weight), y1 = x w1^T (float weight; N1 = 0: none, one `linear`); y =
    norm_linear of y<src> columns [col, col + KN) by an FP8 [NB, KN] weight. K = 512: each GEMM of x splits K
    (decode-sized M)."""
    g = torch.Generator().manual_seed(seed)
    w0, s0 = _fp8(N0, K, g)
    w, s = _fp8(NB, KN, g)
    args = {"x": torch.randn(*M, K, generator=g).to(dtype), "w0": w0, "scale0": s0,
            "w1": (torch.randn(N1, K, generator=g) * 0.05).to(dtype) if N1 else None, "scale1": None,
            "norm": (1.0 + 0.1 * torch.randn(KN, generator=g)).to(dtype), "w": w, "scale": s}
    attrs = {"act0": act, "act1": "native", "act": act, "eps": 1e-6, "src": src, "col": col}
    return args, attrs


def names(args):
    return RESULTS if args["w1"] is not None else ("y0", "y")


def fused(args, attrs):
    ref = kc.reference("pair_norm_linear", args, attrs)
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(names(args), ref)}
    calls = kernels.launch("pair_norm_linear", args, attrs, outs)
    return outs, ref, calls


def apart(args, attrs, ref):
    """The `linear_pair` (without w1: `linear`) kernel, then the `norm_linear` kernel on columns [col, col + K)
    of y<src>."""
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(names(args), ref)}
    if args["w1"] is None:
        calls = kernels.launch("linear", {"x": args["x"], "w": args["w0"], "scale": args["scale0"]}, {"act": attrs["act0"]},
                       {"y": outs["y0"]})
    else:
        calls = kernels.launch("linear_pair", {n: args[n] for n in ("x", "w0", "w1", "scale0", "scale1")},
                       {n: attrs[n] for n in ("act0", "act1")}, {"y0": outs["y0"], "y1": outs["y1"]})
    col, k = attrs["col"], args["norm"].shape[0]
    x = outs[f"y{attrs['src']}"][..., col:col + k]
    calls += kernels.launch("norm_linear", {"x": x, "norm": args["norm"], "w": args["w"], "scale": args["scale"]},
                            {"act": attrs["act"], "eps": attrs["eps"]}, {"y": outs["y"]})
    return outs, calls


CASES = {
    # official numerics: FP8 activations into wqkv_a and wq_b; q_a = the first 64 of y0's 96 columns
    "official-view": (torch.bfloat16, "fp8", 0, 0, 64),
    # hf numerics, fp32: the norm GEMM reads all of y0 (wq_a apart from wkv)
    "fp32-whole": (torch.float32, "native", 0, 0, 96),
    # the second result, 16 columns in
    "bf16-second-offset": (torch.bfloat16, "native", 1, 16, 32),
    # one `linear` (dense weights: every GEMM of x stacked), its columns 32.. (tiny: q_a after the kv columns)
    "fp32-one-linear": (torch.float32, "native", 0, 32, 64, 512, 96, 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_equals_the_launches_apart(name):
    args, attrs = case(*CASES[name])
    outs, ref, calls = fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["pair_norm_kernel"]
    ce = calls[0].constexprs
    if name == "official-view":
        assert ce["SPLIT0"] > 1 and ce["SPLIT1"] > 1  # the pair's in-launch reductions run before the norm phase
    want, two = apart(args, attrs, ref)
    for n, r in zip(names(args), ref):
        assert torch.equal(outs[n], want[n]), f"{name} {n}: the fused launch differs from the launches apart"
        kc.assert_matches(outs[n], r, f"{name} {n}")
    # the cost model: the two launches' FLOPs and bytes in one launch; the norm GEMM's input, written by this
    # launch, is one more re-read (a last-level cache hit when the launch fits: roofline.hbm_bytes)
    (call,), src = calls, outs[f"y{attrs['src']}"][..., :args["norm"].shape[0]]
    assert call.flops == sum(c.flops for c in two) and call.bytes_moved == sum(c.bytes_moved for c in two)
    assert call.reread_bytes == sum(c.reread_bytes for c in two) + src.numel() * src.element_size()


BROKEN = {  # the function its fault is in: the program body both fused front kernels share, or the kernel
    # the norm GEMM reads y1 from its first column instead of column COL
    "wrong columns": ("_pair_norm_program", "bx_ptr = y1_ptr + COL * Y_CS1", "bx_ptr = y1_ptr", AssertionError),
    # the norm GEMM without its RMSNorm prologue
    "no norm": ("_pair_norm_program", "B_BLOCK, B_ACT, True, B_EPS", "B_BLOCK, B_ACT, False, B_EPS", AssertionError),
    # every norm program computes the first N tile: the others stay poison
    "wrong tile": ("_pair_norm_program", "gemm_program(b % TN,", "gemm_program(b % TN * 0,", AssertionError),
    # the phase counters are never reset: the next call would start at the wrong ticket
    "counter kept": ("pair_norm_kernel", "tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)", "pass",
                     kernels.CodegenError),
}


@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_broken_fused_kernel_is_caught(fault, monkeypatch, tmp_path):
    where, old, new, error = BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, attn_front, where, old, new)
    args, attrs = case(*CASES["bf16-second-offset"], K=128)
    with pytest.raises(error):
        outs, ref, _ = fused(args, attrs)
        for n, r in zip(names(args), ref):
            kc.assert_matches(outs[n], r, f"{fault} {n}")


def test_the_norm_programs_wait_for_the_half_they_read():
    """Each pair half publishes after its GEMM when it writes the norm GEMM's input, and the norm programs wait
    for that half's program count before their GEMM (checked on the source: see the module docstring)."""
    import inspect
    src = inspect.getsource(attn_front._pair_norm_program.fn)
    at = src.index
    assert at("_pair_half(v, ") < at("if SRC == 0:\n            publish(phase_ptr + WRITTEN)") \
        < at("_pair_half(v - P0,") < at("if SRC == 1:\n            publish(phase_ptr + WRITTEN)") \
        < at("wait_for(phase_ptr + WRITTEN, P0)") < at("wait_for(phase_ptr + WRITTEN, P1)") < at("gemm_program(b % TN")


def test_declared_rereads_are_made_by_the_kernel(monkeypatch):
    """The cost model's re-reads (`KernelCall.reread_bytes`, test_cache_model): x read by every K split of both
    pair GEMMs, their partials read back, and the norm GEMM's reads of y0, which this launch wrote, are all
    made, and the bytes the launch touches fit its declared footprint. A model that also called the first read
    of the weights a re-read is caught."""
    import dataclasses

    from test_cache_model import check_declared, measured
    from v4compile.codegen.kernels import gemm
    monkeypatch.setattr(gemm, "TARGET_PROGRAMS", 4)
    args, attrs = case(*CASES["official-view"])
    ref = kc.reference("pair_norm_linear", args, attrs)
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(RESULTS, ref)}
    regions = ("x", "w0", "w1", "norm", "w", "y0", "y1", "y", "scratch")
    (call,), got = measured("pair_norm_linear", args, attrs, outs, regions)
    assert call.constexprs["SPLIT0"] > 1 and got["y0"]["touched"] > got["y0"]["distinct"]
    check_declared(call, got)
    with pytest.raises(AssertionError, match="declares"):
        (b0, r0), (b1, r1) = call.phases
        extra = got["w"]["distinct"]
        check_declared(dataclasses.replace(call, reread_bytes=call.reread_bytes + extra,
                                           phases=((b0, r0), (b1, r1 + extra))), got)


def test_the_pair_rereads_come_within_its_declared_reuse(monkeypatch, tmp_path):
    """The pair phase's declared reuse distance (`KernelCall.reuse_bytes`: what lets its re-reads hit a cache far
    smaller than the phase, codegen/roofline.py) bounds the measured one: a split's partials read back, and x
    read again by the next tile, programs in ticket order (4 tiles of the first GEMM, K in 2 splits). The pair in
    the old order (N tiles fastest: a tile's splits 4 programs apart) re-reads from farther than declared."""
    from test_cache_model import reuse_distance
    from v4compile.codegen.kernels import gemm
    monkeypatch.setattr(gemm, "TARGET_PROGRAMS", 8)

    def worst():
        args, attrs = case(torch.bfloat16, "fp8", 0, 0, 64, N0=512, N1=16, NB=64)
        outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(RESULTS, kc.reference("pair_norm_linear", args,
                                                                                          attrs))}
        (call,), far = reuse_distance("pair_norm_linear", args, attrs, outs, range(10))
        ce = call.constexprs
        assert (ce["P0"], ce["SPLIT0"], ce["P1"]) == (8, 2, 2), "the pair phase: programs 0..9"
        return call, far

    call, far = worst()
    assert 0 < far <= call.reuse_bytes[0] < call.phases[0][0] - call.phases[0][1], (far, call.reuse_bytes, call.phases)
    kc.install_broken_kernel(monkeypatch, tmp_path, gemm, "_pair_half",
                             "gemm_program((pid // SPLIT) % TN, pid // (SPLIT * TN), pid % SPLIT,",
                             "gemm_program(pid % TN, 0, pid // TN,")
    monkeypatch.setattr(attn_front, "_pair_half", gemm._pair_half)
    call, far = worst()
    assert far > call.reuse_bytes[0], (far, call.reuse_bytes)


# ---- mhc_add_pair_norm_linear: the seam after a partitioned MoE as the launch's first phase ------------------

SEAM_ATTRS = {"in_eps": 1e-6, "in_hc_eps": 1e-6, "in_iters": 3, "in_norm_eps": 1e-6}  # few Sinkhorn steps
SEAM_RESULTS = ("streams_out", "post_next", "comb_next")


def seam_case(name, N=4):
    """`case` with x as the seam's output: the reduced routed sum y and the shared expert's y2, 4 streams of
    x's width, post / comb and the seam's fn / base / scale / norm (`in_*`)."""
    from test_kernels_moe_router import seam_weights
    sizes = {**dict(zip(("K", "N0", "N1"), CASES[name][5:])), "K": 128}  # the seam's interpreted passes: a small D
    args, attrs = case(*CASES[name][:5], **sizes)
    x = args.pop("x")
    g = torch.Generator().manual_seed(13)
    B, T, D = x.shape
    args.update(y=x, y2=torch.randn(B, T, D, generator=g).to(x.dtype),
                streams=(torch.randn(B, T, N, D, generator=g) * 2).to(x.dtype),
                post=2 * torch.rand(B, T, N, generator=g), comb=torch.softmax(torch.randn(B, T, N, N, generator=g), -1))
    args.update(seam_weights(g, N, D, "in_"))
    return args, {**attrs, **SEAM_ATTRS}


def seam_names(args):
    return SEAM_RESULTS + tuple("y_front" if n == "y" else n for n in names(args))


def seam_fused(args, attrs):
    ref = kc.reference("mhc_add_pair_norm_linear", args, attrs)
    outs = {n: kc.poisoned(r.shape, r.dtype)[0] for n, r in zip(seam_names(args), ref)}
    calls = kernels.launch("mhc_add_pair_norm_linear", args, attrs, outs)
    return outs, ref, calls


def seam_apart(args, attrs):
    """The mhc_post_pre_add launch, then pair_norm_linear's launches apart on the x it wrote."""
    s_args = {n: args[n] for n in ("y", "y2", "streams", "post", "comb")}
    s_args.update({n: args["in_" + n] for n in ("fn", "base", "scale", "norm")})
    s_attrs = {n[len("in_"):]: v for n, v in SEAM_ATTRS.items()}
    mid = kc.reference("mhc_post_pre_add", s_args, s_attrs)
    s, x, p, c = (kc.poisoned(t.shape, t.dtype)[0] for t in mid)
    kernels.launch("mhc_post_pre_add", s_args, s_attrs, {"streams_out": s, "y_next": x, "post_next": p, "comb_next": c})
    f_args = {n: v for n, v in args.items() if n not in ("y", "y2", "streams", "post", "comb") and not n.startswith("in_")}
    f_attrs = {n: v for n, v in attrs.items() if not n.startswith("in_")}
    f_args["x"] = x
    front, _ = apart(f_args, f_attrs, kc.reference("pair_norm_linear", f_args, f_attrs))
    return {"streams_out": s, "post_next": p, "comb_next": c, **{("y_front" if n == "y" else n): v for n, v in front.items()}}


@pytest.mark.parametrize("name", ["official-view"])  # V4's numerics; the broken variants run the one-linear case
def test_seam_then_front_equals_the_launches_apart(name):
    """One launch (the seam's token blocks, then the pair and the norm GEMM), each result bit-identical to the
    seam's launch and the front's two apart; fp32 also within kernel_check.assert_matches of the reference."""
    args, attrs = seam_case(name)
    outs, ref, calls = seam_fused(args, attrs)
    assert [c.kernel_name for c in calls] == ["seam_pair_norm_kernel"]
    ce = calls[0].constexprs
    assert ce["PH"] == 1 and calls[0].grid[0] == ce["PH"] + ce["P0"] + ce["P1"] + ce["PB"]
    want = seam_apart(args, attrs)
    for n, r in zip(seam_names(args), ref):
        assert torch.equal(outs[n], want[n]), f"{name} {n}: the fused launch differs from the launches apart"
        if args["y"].dtype == torch.float32:
            kc.assert_matches(outs[n], r, f"{name} {n}")


SEAM_BROKEN = {
    # the seam without the shared expert's output (y2): the add the fold took in is lost
    "no y2": ("_seam_phase(v, h_y_ptr, h_y2_ptr,", "_seam_phase(v, h_y_ptr, None,", AssertionError),
    # the pair reads the seam's input y instead of the x it wrote
    "pair input": ("_pair_norm_program(v - PH, x_ptr,", "_pair_norm_program(v - PH, h_y_ptr,", AssertionError),
    # the seam's counter is never reset: the next call would not wait for its seam
    "counter kept": ("tl.store(phase_ptr + tl.arange(0, COUNTERS), 0)",
                     "tl.store(phase_ptr + tl.arange(0, COUNTERS), 0, mask=tl.arange(0, COUNTERS) != SEAM_DONE)",
                     kernels.CodegenError),
}


@pytest.mark.parametrize("fault", sorted(SEAM_BROKEN))
def test_broken_seam_front_is_caught(fault, monkeypatch, tmp_path):
    old, new, error = SEAM_BROKEN[fault]
    kc.install_broken_kernel(monkeypatch, tmp_path, attn_front, "seam_pair_norm_kernel", old, new)
    args, attrs = seam_case("fp32-one-linear")
    with pytest.raises(error):
        outs, ref, _ = seam_fused(args, attrs)
        for n, r in zip(seam_names(args), ref):
            kc.assert_matches(outs[n], r, f"{fault} {n}")


def test_the_front_waits_for_the_seam():
    """On the source: a folded all-reduce's NO programs (`allreduce.fold`) publish after reducing into h_y, every
    seam program waits for all of them before it reads h_y; the seam's programs publish after writing x, every
    front program waits for all PH of them before anything else; the counters are reset by the last program only.
    (The Triton interpreter runs programs in ticket order, so a missing wait shows only here and on a GPU.)"""
    import inspect
    src = inspect.getsource(attn_front.seam_pair_norm_kernel.fn)
    at = src.index
    assert at("oneshot_tiles(v + NO, ar_x_ptr, h_y_ptr") < at("publish(phase_ptr + REDUCED)") \
        < at("wait_for(phase_ptr + REDUCED, NO)") < at("_seam_phase(v, h_y_ptr")
    assert at("_seam_phase(v, h_y_ptr") < at("_seam_phase_inlined(v, h_y_ptr") < at("publish(phase_ptr + SEAM_DONE)") \
        < at("wait_for(phase_ptr + SEAM_DONE, PH)") < at("_pair_norm_program(v - PH, x_ptr")
    assert at("_pair_norm_program(v - PH, x_ptr") < at("last_to_arrive(phase_ptr + FINISHED, NO + PH + P0 + P1 + PB)")


# ---- AOT: the V4-Pro specialisations compile for both targets, matrix instructions, no gfx950 spills ------

def v4pro_call(M, csa=True):
    """pair_norm_linear as `v4compile ir dump --preset v4-pro --weights none --stage final --numerics official
    --dtype bf16 --decode-batch 8` has it (M = 8 at decode): wqkv_a (FP8, FP8 activations) + the BF16 x_gemm
    (the CSA layer's compressor and indexer columns, 2624; HCA's compressor, 1024), then q_norm + wq_b (FP8)
    on q_a, the first 1536 columns of wqkv_a's 2048 (CSA: the merged wq_b with the indexer's, 73728 rows)."""
    from test_kernels_moe import _ta
    N1, NB = (2624, 73728) if csa else (1024, 65536)
    ops = dict(x=_ta((M, 1, 7168), "bf16"), w0=_ta((2048, 7168), "fp8e4m3"), scale0=_ta((16, 56), "e8m0"),
               w1=_ta((N1, 7168), "bf16"), scale1=None, norm=_ta((1536,), "bf16"), w=_ta((NB, 1536), "fp8e4m3"),
               scale=_ta((NB // 128, 12), "e8m0"))
    res = dict(y0=_ta((M, 1, 2048), "bf16"), y1=_ta((M, 1, N1), "bf16"), y=_ta((M, 1, NB), "bf16"))
    attrs = {**kernels.full_attrs("pair_norm_linear", {"act0": "fp8", "act": "fp8", "eps": 1e-6, "src": 0})}
    return attn_front.specialise("pair_norm_linear", ops, res, attrs)


@pytest.mark.slow
def test_aot_v4pro_decode(tmp_path, monkeypatch):
    """The CSA layer's decode launch (the HCA one, `v4pro_call(8, csa=False)`, differs in sizes and K splits
    only: measured gfx950 222 VGPRs / 0 spills / 28 MFMA, sm_90a 96 registers / 0 spills / 32 MMA)."""
    from v4compile.codegen import aot
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path / "cache"))
    rows = aot.compile_calls(v4pro_call(8), ["gfx950", "sm_90a"], tmp_path / "out", jobs=2)
    assert len(rows) == 2
    for r in rows:
        if r["target"] == "gfx950":
            assert r["spills"] == 0, f"{r['name']}: gfx950 goal is 0 spills"
        assert r["mma_instructions"] > 0, f"{r['name']} {r['target']}: no matrix instructions"
