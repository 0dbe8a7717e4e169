"""The modeled decode step (codegen/roofline.py) and the registry's cost rules it rests on (issue 9): V4-Pro's
kernels move at most 1.05 x the ideal HBM bytes of a decode step (weights read once, only active experts,
only the pool rows a launch touches), and the check fails when a kernel reads something twice."""

from __future__ import annotations

import dataclasses

import pytest

from routing_sample import sampled_routing
from v4compile.codegen.program_kernels import program_kernels
from v4compile.codegen.roofline import BYTES_BOUND, BYTES_GOAL, ideal_bytes, step_model
from v4compile.config import preset
from v4compile.ir.registry import get_op
from v4compile.ir.types import TensorType
from v4compile.ops import moe as ops_moe
from v4compile.passes import GPU_PIPELINE, PassManager
from v4compile.program.build import build_program
from v4compile.trace import TraceOptions, trace


@pytest.fixture(scope="module")
def v4_pro():
    m = trace(preset("v4-pro"), TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=256, dtype="bf16",
                                             numerics="official", weights="released"))
    prog = build_program(PassManager(GPU_PIPELINE).run(m).module)
    return prog, program_kernels(prog)


def test_v4_pro_decode_bytes_within_the_goal_and_the_check_can_fail(v4_pro):
    prog, pk = v4_pro
    weights = sum(b.nbytes for b in prog.functions["decode"].buffers if b.kind == "weight")
    for t in ("gfx950", "sm_90a"):
        m = step_model(prog, pk, "decode", t)
        assert m["bytes_ratio"] <= BYTES_BOUND, m
        # the goal holds at this shape too; the cache only takes re-reads off (codegen/roofline.py)
        assert m["bytes_ratio"] <= BYTES_GOAL and m["ideal_bytes"] < m["kernel_bytes"] < m["traffic_bytes"], m
        assert m["modeled_us"] > m["roofline_us"] > 0 and m["kernel_calls"] >= m["launches"]
        # 2 tokens x 6 of 384 routed experts per layer: a step reads ~6% of the 851 GB (dense layers and
        # the active experts), so the ideal is far below "every weight once"
        assert weights / 50 < m["ideal_bytes"] < weights / 5, (m["ideal_bytes"], weights)
    # A MoE kernel that read its experts twice breaks the goal.
    doubled = dataclasses.replace(pk, calls={f: [[dataclasses.replace(c, bytes_moved=2 * c.bytes_moved)
                                                  if c.name.startswith("moe_") else c for c in per] for per in calls]
                                             for f, calls in pk.calls.items()})
    assert step_model(prog, doubled, "decode", "gfx950")["bytes_ratio"] > BYTES_BOUND
    # With no cache every re-read is an HBM read again: the kernel bytes are the traffic.
    from v4compile.codegen import roofline

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(roofline, "CACHE_SHARE", 0.0)
        m = step_model(prog, pk, "decode", "sm_90a")
    assert m["kernel_bytes"] == m["traffic_bytes"] > step_model(prog, pk, "decode", "sm_90a")["kernel_bytes"]


def _cost(op, operands, results, attrs):
    return get_op(op).cost_of(operands, results, attrs)


def check_moe_cost_counts_the_active_experts():
    """The weight bytes of `moe_experts`' cost, in experts, against the distinct experts counted over
    sampled uniform routings (within 5 standard errors of the sample mean, plus the byte rounding)."""
    D, I, E, k = 64, 32, 16, 2
    w1, w3, w2 = TensorType((E, I, D), "bf16"), TensorType((E, I, D), "bf16"), TensorType((E, D, I), "bf16")
    per_expert = (w1.nbytes + w2.nbytes + w3.nbytes) // E
    for tokens in (1, 3, 64):  # about 2, 5.3 and 16 distinct experts
        xt, it, wt = TensorType((tokens, D), "bf16"), TensorType((tokens, k), "i32"), TensorType((tokens, k), "fp32")
        c = _cost("moe_experts", [xt, wt, it, w1, w2, w3, None, None, None], [xt], {"limit": 1.0})
        modeled = (c.bytes_read - xt.nbytes - wt.nbytes - it.nbytes) / per_expert
        (mean, se), _ = sampled_routing(E, k, tokens)
        assert abs(modeled - mean) <= 5 * se + 1 / per_expert, (tokens, modeled, mean, se)


def test_moe_cost_counts_only_the_active_experts():
    check_moe_cost_counts_the_active_experts()


@pytest.mark.parametrize("wrong", [lambda E, k, t, ep=1: float(min(E, t * k)),
                                   lambda E, k, t, ep=1: float(E)],
                         ids=["one-read-per-pair", "every-expert"])
def test_a_cost_rule_that_miscounts_experts_is_caught(monkeypatch, wrong):
    monkeypatch.setattr(ops_moe, "expected_active_experts", wrong)
    with pytest.raises(AssertionError):
        check_moe_cost_counts_the_active_experts()


def test_pool_ops_cost_their_rows_not_the_pool(v4_pro):
    """Doubling the pool leaves every launch's cost unchanged (the ideal does not grow with capacity)."""
    prog, _ = v4_pro
    f = prog.functions["decode"]
    for l in f.launches:
        if l.kernel not in ("sparse_attention", "compress", "pool_write", "qkv_norm_rope", "indexer"):
            continue
        ops = [a.type if a is not None else None for _, a in l.operands]
        big = [TensorType((2 * t.shape[0], *t.shape[1:]), t.dtype)
               if t is not None and f.buffer(a.buffer).kind == "pool" else t
               for t, (_, a) in zip(ops, l.operands)]
        res = [a.type for _, a in l.results]
        assert get_op(l.op).cost_of(ops, res, l.attrs) == get_op(l.op).cost_of(big, res, l.attrs), l.op
    assert ideal_bytes(prog, "decode") > 0


def test_a_launch_signature_is_one_set_of_binaries(v4_pro):
    """Launches with equal `specialisation` (the registry's `offset_attrs` left out) get the same kernels, so
    the declared offsets really are launch-time pointer offsets, not constexprs; and every layer of a kind
    shares them (V4-Pro decode: 61 layers, a few dozen signatures)."""
    prog, pk = v4_pro
    f = prog.functions["decode"]
    names: dict[str, set] = {}
    for l, calls in zip(f.launches, pk.calls["decode"]):
        names.setdefault(l.specialisation, set()).add(tuple(c.name for c in calls))
    assert all(len(v) == 1 for v in names.values()), [k for k, v in names.items() if len(v) > 1][:3]
    assert len(names) < 40 < len(f.launches)


def _one_moe_binary(prog, calls) -> None:
    """The decode step's one-launch MoE: the first MoE layer's (`moe_mhc_post_pre`, no seam before it) and the
    middle layers' (`mhc_moe_mhc`, both seams) calls one AOT binary per target. `calls`: launch index -> its
    calls."""
    from v4compile.codegen import aot
    f = prog.functions["decode"]
    for target in ("gfx950", "sm_90a"):
        keys = {}
        for i, l in enumerate(f.launches):
            if l.op in ("moe_mhc_post_pre", "mhc_moe_mhc"):
                (c,) = calls(i)
                keys.setdefault(l.op, set()).add(aot.job_of(c, target)["key"])
        assert set(keys) == {"moe_mhc_post_pre", "mhc_moe_mhc"}, keys
        assert len(keys["moe_mhc_post_pre"] | keys["mhc_moe_mhc"]) == 1, f"two binaries on {target}"


def test_the_first_moe_layer_shares_the_middle_layers_binary(v4_pro, monkeypatch):
    """Issue 40: V4-Pro's first MoE layer launches the middle layers' one-launch MoE binary (its seam before's
    programs copy its inputs: `moe_router._as_both_seams`), on both targets; a first-layer call with a
    constexpr of its own is caught. (The last layer's, with no seam on either side, keeps its own binary: its
    op carries no mHC attributes for the seams to stand in with.)"""
    from v4compile.codegen.kernels import moe_router
    from v4compile.codegen.program_kernels import calls_of
    prog, pk = v4_pro
    _one_moe_binary(prog, lambda i: pk.calls["decode"][i])
    real = moe_router._as_both_seams

    def own(*args):  # the seam before's eps of its own: a second binary
        calls = real(*args)
        calls[0].constexprs = {**calls[0].constexprs, "A_EPS": calls[0].constexprs["A_EPS"] * 2}
        return calls
    monkeypatch.setattr(moe_router, "_as_both_seams", own)
    with pytest.raises(AssertionError, match="two binaries"):
        _one_moe_binary(prog, lambda i: calls_of(prog.functions["decode"].launches[i]))


def test_step_time_splits_into_bandwidth_compute_and_launch_kinds(v4_pro, monkeypatch):
    """The modeled step is its parts: bandwidth + compute + launch latency; every sm_90a call is a graph node
    with PDL (every kernel waits in pdl_enter), every gfx950 call a plain graph node; per layer the calls and
    times add up to the step's, and the layer kinds are V4-Pro's (31 HCA, 30 CSA, the head and embedding
    outside the layers). A kernel that did not wait would launch as a plain node: the model charges it so."""
    from v4compile.codegen import roofline
    from v4compile.codegen.roofline import by_layer_kind
    from v4compile.targets import TARGETS

    prog, pk = v4_pro
    cfg = preset("v4-pro")
    for t, kind in (("gfx950", "graph"), ("sm_90a", "graph_pdl")):
        for fn in ("decode", "prefill"):
            m = step_model(prog, pk, fn, t)
            assert abs(m["bandwidth_us"] + m["compute_us"] + m["launch_latency_us"] - m["modeled_us"]) < 0.05
            # V4-Pro's steps here are bandwidth-bound through and through (no call's FLOPs outlast its bytes)
            assert m["bandwidth_us"] > m["compute_us"] >= 0
            assert m["calls_by_launch_kind"][kind] == m["kernel_calls"] and sum(m["calls_by_launch_kind"].values()) \
                == m["kernel_calls"]
            lat = TARGETS[t].launch_latency(kind)
            assert abs(m["launch_latency_us"] - m["kernel_calls"] * lat * 1e6) < 0.05
            assert sum(v["calls"] for v in m["by_layer"].values()) == m["kernel_calls"]
            assert abs(sum(v["modeled_us"] for v in m["by_layer"].values()) - m["modeled_us"]) < 1
            kinds = by_layer_kind(m, cfg.kind)
            assert {k: v["layers"] for k, v in kinds.items()} == {"other": 1, "hca": 31, "csa": 30}
            # the bytes above ideal, by kernel family, add up to the step's (no weight is shared between launches)
            fam = m["by_family"].values()
            assert sum(v["kernel_bytes"] for v in fam) == m["kernel_bytes"]
            assert sum(v["ideal_bytes"] for v in fam) == m["ideal_bytes"]
            assert sum(v["ideal_bytes"] for v in m["by_layer"].values()) == m["ideal_bytes"]
            assert sum(v["calls"] for v in fam) == m["kernel_calls"]
            excess = [v["kernel_bytes"] - v["ideal_bytes"] for v in fam]
            assert excess == sorted(excess, reverse=True)
    monkeypatch.setattr(roofline, "uses_pdl", lambda fn, target: False)
    m = step_model(prog, pk, "decode", "sm_90a")
    assert m["calls_by_launch_kind"] == {"graph": m["kernel_calls"], "graph_pdl": 0}
    assert abs(m["launch_latency_us"] - m["kernel_calls"] * 1.3) < 0.05


def test_a_toy_step_does_not_report_the_goal_as_missed(v4_pro):
    """V4-Pro's step streams from HBM: the bytes goal is judged ("ok"). tiny's step fits in the last-level
    cache many times over (its time is ~650x the roofline, all launch latency): the ratios are stated as
    not a goal at that size, never "MISSED". The broken variant (every step judged as if at scale) loses
    the statement through the same render."""
    from v4compile.codegen import roofline

    prog, pk = v4_pro
    big = roofline.step_model(prog, pk, "decode", "gfx950")
    assert roofline.at_scale(big) and "goal <= 1.01: ok" in roofline.render_step(big)
    m = trace(preset("tiny"), TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=64))
    small_prog = build_program(PassManager(GPU_PIPELINE).run(m).module)
    small = roofline.step_model(small_prog, program_kernels(small_prog), "decode", "gfx950")
    text = roofline.render_step(small)
    assert not roofline.at_scale(small) and "MISSED" not in text and "not a goal at this size" in text, text
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(roofline, "at_scale", lambda m: True)
        assert "not a goal at this size" not in roofline.render_step(small)


# V4-Pro's decode step by layer class: layer 0 (no seam before its attention), the hash-routed HCA and CSA
# layers 1 and 2, then HCA and CSA alternate (29 and 28 layers like 3 and 4) up to the last layer, 60, a CSA whose
# seam after its MoE is the head's. Seven traced layers hold every class: the whole step is their sum.
V4_PRO_LAYERS = {"other": 1, "0": 1, "1": 1, "2": 1, "3": 29, "4": 28, "6": 1}


def whole_v4_pro(m: dict, field: str) -> int:
    """A step figure of the 61-layer V4-Pro from a step model of its first 7 layers (`V4_PRO_LAYERS`)."""
    return sum(n * m["by_layer"][layer][field] for layer, n in V4_PRO_LAYERS.items())


@pytest.fixture(scope="module", params=["partition{tp=8,ep=8}", "partition{tp=1,ep=8,dp=8}"], ids=["tp8ep8", "dp8ep8"])
def v4_pro_8(request):
    """V4-Pro's first 7 layers, shape-only, as `compile --tp 8 --ep 8` (or `--dp 8 --ep 8`) `--decode-batch 8
    --max-context 4096` builds them (no MTP block: the decode step has none)."""
    full = preset("v4-pro")
    cfg = dataclasses.replace(full, n_layers=7, layer_kinds=full.layer_kinds[:7], n_mtp_layers=0).validate()
    m = trace(cfg, TraceOptions(batch=2, chunk=16, decode_batch=8, capacity=4096, dtype="bf16", numerics="official",
                                weights="released"))
    prog = build_program(PassManager([request.param, *GPU_PIPELINE]).run(m).module)
    return request.param, prog, program_kernels(prog)


def test_v4_pro_8_gpus_decode_bytes_meet_the_bar(v4_pro_8):
    """Issue 34's bar: V4-Pro TP8/EP8 and DP8/EP8 at decode batch 8 a rank, context 4096, move <= 1.02x the ideal
    bytes on both targets (the whole step, as the compile report gives it: TP8/EP8 gfx950 1.0178, sm_90a 1.0192;
    DP8/EP8 1.0046, 1.0071). On sm_90a TP8/EP8's rests on the attention front's pair phase (34-59 MB, more than
    its share of the 50 MB L2) re-reading only within a tile's K splits (`KernelCall.reuse_bytes`): the old
    order, splits a whole GEMM apart, misses the bar there."""
    layout, prog, pk = v4_pro_8
    models = {t: step_model(prog, pk, "decode", t) for t in ("gfx950", "sm_90a")}
    for t, m in models.items():
        # the classes' premise: layers of one class are alike (HCA 3 and 5)
        assert m["by_layer"]["3"] == m["by_layer"]["5"], t
        assert whole_v4_pro(m, "kernel_bytes") <= 1.02 * whole_v4_pro(m, "ideal_bytes"), (t, m["by_family"])
    if "dp" in layout:
        return
    no_reuse = dataclasses.replace(pk, calls={f: [[dataclasses.replace(c, reuse_bytes=()) for c in per]
                                                   for per in calls] for f, calls in pk.calls.items()})
    m = step_model(prog, no_reuse, "decode", "sm_90a")
    assert whole_v4_pro(m, "kernel_bytes") > 1.02 * whole_v4_pro(m, "ideal_bytes")
    assert step_model(prog, no_reuse, "decode", "gfx950") == models["gfx950"]  # its cache holds every phase


def test_v4_pro_tp8_folds_its_all_reduces_into_their_consumers(v4_pro_8):
    """Issue 34: TP8/EP8's one-shot all-reduces run inside the MoE's launch: every MoE's own as a trailing part
    (`fuse_oneshot_producer`, 7 of 7: `<moe>_ar`), every wo_b's but layer 0's (read by hc_post) as the leading
    phase of the MoE's that reads it (`fuse_oneshot_consumer`, 6: `ar_mhc_moe_ep_ar`); the decode step is 43
    kernel calls (each layer's qkv_norm_rope and compressor one launch too, `pair_rope_compress`), 56 unfolded.
    The whole V4-Pro (`compile --preset v4-pro --weights none --tp 8 --ep 8 --report --decode-batch 8
    --max-context 4096`): 286 kernel calls, 287 with the consumer fold alone, 407 unfolded. DP8/EP8 has no
    all-reduce: its MoE input's one-shot all-gather and output's reduce-scatter are the leading phase and the trailing
    part of the MoE's launch (`fuse_oneshot_rows`, 7 of 7), and the seam before the MoE its first phase (6 of 7:
    `mhc_ag_moe_router_experts_dp_rs`; layer 0's, `hc_pre_norm`, is no seam; the hash router's token ids' gather
    stays on the communicator): 43 launches, 42 kernel calls (49 and 48 with the seam apart, 63 and 62 with the
    one-shots launches of their own, 48 with them on the communicator: `--allreduce nccl`). The whole V4-Pro
    DP8/EP8: 286 launches, 285 kernel calls (346 and 345 with the seam apart, 468 and 467 unfolded)."""
    layout, prog, pk = v4_pro_8
    ops = [l.op for l in prog.functions["decode"].launches]
    calls = sum(len(c) for c in pk.calls["decode"])
    if "dp" in layout:
        assert not [o for o in ops if o.startswith("ar_")] and "all_reduce_oneshot" not in ops
        assert [ops.count(o) for o in ("all_gather_rows_oneshot", "reduce_scatter_rows_oneshot", "all_gather_rows",
                                       "reduce_scatter_rows", "ag_moe_router_experts_dp_rs",
                                       "mhc_ag_moe_router_experts_dp_rs")] == [0, 0, 1, 0, 1, 6]
        assert (len(ops), calls) == (43, 42)
        return
    assert (ops.count("all_reduce_oneshot"), sum(o.startswith("ar_") for o in ops)) == (1, 6)
    assert sum(o.endswith("_ar") for o in ops) == 7 and "ar_mhc_add_pair_norm_linear" not in ops
    assert calls == len(ops) == 43
