"""Every MoE fusion on every rank: the gpu pipeline on a partitioned module (tiny-pro, tp 2 ep 2) fuses the
FFN as the single-rank pipeline does, with the all-reduces beside the fused launches, and stays exact
against its layout's reference (`ReferenceModel.partitioned`). Each check is shown to catch a fusion that
skips partitioned modules."""

from __future__ import annotations

import functools

import pytest
import torch

from test_partition import check_for, partitioned
from v4compile.cli.report import launch_counts
from v4compile.config import preset
from v4compile.passes import GPU_PIPELINE, PassManager, PipelineOptions
from v4compile.passes.base import get_pass
from v4compile.trace import TraceOptions, trace
from test_partition import OPTS

NAME, NUMERICS = "tiny-pro", "official"
MOE_FUSIONS = ("fuse_moe_router", "fuse_moe_mhc", "fuse_mhc_moe")


@functools.cache
def single_rank():
    m = trace(preset(NAME), TraceOptions(numerics=NUMERICS, **OPTS))
    return PassManager(GPU_PIPELINE, PipelineOptions()).run(m)


def run_partitioned():
    return PassManager(GPU_PIPELINE, PipelineOptions()).run(partitioned(NAME, NUMERICS, 2, 2))


@functools.cache
def partitioned_result():
    return run_partitioned()


def kernel_calls_per_layer(module) -> dict[int, int]:
    """Launches per layer of the decode function, the all-reduces left out (the fusions compared: NCCL's are
    no kernel calls; the one-shot ones the GPU pipeline lowers them to are one each)."""
    fn = module.functions["decode"]
    counts = launch_counts(preset(NAME), fn)["per_layer"]
    reduces: dict[int, int] = {}
    for op in fn.ops:
        if op.name in ("all_reduce", "all_reduce_oneshot"):
            reduces[op.attrs["layer"]] = reduces.get(op.attrs["layer"], 0) + 1
    return {layer: n - reduces.get(layer, 0) for layer, n in counts.items()}


def check_rank_fusions(result) -> None:
    cfg = preset(NAME)
    ops = [op.name for op in result.module.functions["decode"].ops]
    hits = result.hits()
    assert hits["fuse_moe_router"]["decode.fused"] == cfg.n_layers  # every layer's FFN, one op
    assert hits["fuse_mhc_moe"]["decode.fused"] == cfg.n_layers - 1  # layer 0's seam is an hc_pre_norm
    assert hits["fuse_moe_mhc"]["decode.fused"] == cfg.n_layers - 1  # the last seam is mhc_post_head
    # wo_b's and the routed experts' (one-shot: the GPU pipeline's oneshot_allreduce): the routed experts' folded
    # into the MoE's launch (fuse_oneshot_producer), wo_b's into the next MoE's that reads it (fuse_oneshot_consumer)
    # but layer 0's (read by hc_post)
    folded, after = [o for o in ops if o.startswith("ar_")], [o for o in ops if o.endswith("_ar")]
    assert ops.count("all_reduce_oneshot") == 1 and "all_reduce" not in ops
    assert len(folded) == cfg.n_layers - 1 and len(after) == cfg.n_layers
    assert not {"router", "local_experts", "moe_experts", "swiglu"} & set(ops)
    one, part = kernel_calls_per_layer(single_rank().module), kernel_calls_per_layer(result.module)
    for layer in range(1, cfg.n_layers - 1):
        # the single-rank seam after the MoE is inside its launch; here it follows the all-reduce, as the first
        # phase of the next attention's front launch (`mhc_add_pair_norm_linear`, tagged with that layer)
        assert part[layer] == one[layer], (layer, part[layer], one[layer])


def test_every_moe_fusion_fires_on_a_partitioned_module():
    check_rank_fusions(partitioned_result())


FUSED_STAGE = GPU_PIPELINE[:GPU_PIPELINE.index("fuse_mhc_moe") + 1]  # the MoE fusions, before the pool lowering


def dp_partitioned():
    """tiny-pro (official numerics) over dp 2, ep 2: each rank its own sequences, the experts split."""
    m = trace(preset(NAME), TraceOptions(numerics=NUMERICS, **OPTS))
    return get_pass("partition", {"tp": 1, "ep": 2, "dp": 2}).run(m).module


LAYOUTS = {"tp2ep2": lambda: partitioned(NAME, NUMERICS, 2, 2), "dp2ep2": dp_partitioned}
FUSED_OP = {"tp2ep2": "mhc_moe_ep", "dp2ep2": "moe_router_experts_dp"}


@functools.cache
def decode_case(layout: str = "tp2ep2"):
    """tiny-pro's partitioned decode (official numerics) on seeded inputs and weights, every rank simulated
    (data parallel: each rank its own inputs): (the runner, each rank's outputs before any fusion)."""
    from test_partition import _gen
    from conftest import dense_weights
    from v4compile.ir.interpret import interpret_ranks
    from v4compile.weights_convert import DenseSource, load_ir_weights

    before = LAYOUTS[layout]()
    source = DenseSource(dense_weights(NAME))
    g = _gen(4)
    per_rank = []
    for _ in range(2 if layout.startswith("dp") else 1):
        inputs = {}
        for v in before.functions["decode"].inputs:
            if v.name == "ids":
                inputs[v.name] = torch.randint(0, preset(NAME).vocab_size, v.type.shape, generator=g)
            elif v.type.dtype in ("i64", "i32"):
                inputs[v.name] = torch.full(v.type.shape, 3, dtype=torch.int64 if v.type.dtype == "i64" else torch.int32)
            else:
                inputs[v.name] = torch.randn(v.type.shape, generator=g) * 0.1
        per_rank.append(inputs)
    per_rank = per_rank * (2 // len(per_rank))

    def run(m):
        return interpret_ranks(m.functions["decode"], [load_ir_weights(m, source, rank=r) for r in range(2)], per_rank)
    return run, run(before)


@functools.cache
def fused_stage(layout: str):
    """The partitioned module after the MoE fusions (a broken variant changes an op's reference, not this)."""
    return PassManager(FUSED_STAGE, PipelineOptions()).run(LAYOUTS[layout]()).module


def fused_decode_mismatch(layout: str = "tp2ep2") -> int:
    """One decode step: the module after the MoE fusions against the partitioned module before any (whose
    exactness against `ReferenceModel.partitioned` test_partition holds). Returns the number of output
    elements that differ in any bit (the fused ops' references are the compositions, so none may)."""
    run, want = decode_case(layout)
    after = fused_stage(layout)
    assert any(op.name == FUSED_OP[layout] for op in after.functions["decode"].ops)
    got = run(after)
    return sum(int((got[r][n] != ref).sum()) for r in range(2) for n, ref in want[r].items())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_fused_partitioned_module_is_exact(layout):
    assert fused_decode_mismatch(layout) == 0


def test_a_fused_op_adding_in_another_order_is_caught(monkeypatch):
    """The shared expert added into each rank's partial sum (the all-reduce then counts it twice): caught."""
    from v4compile.ops import fused_ep
    keep = fused_ep._routed_and_shared

    def wrong(*a):
        p, s = keep(*a)
        return p + s, s
    monkeypatch.setattr(fused_ep, "_routed_and_shared", wrong)
    assert fused_decode_mismatch() > 0


@pytest.mark.parametrize("fusion", ["fuse_moe_router", "fuse_mhc_moe"])
def test_a_fusion_skipping_partitioned_modules_is_caught(monkeypatch, fusion):
    import importlib
    mod = importlib.import_module(f"v4compile.passes.{fusion}")
    monkeypatch.setattr(mod, "_fuse_ep", lambda *a: None)
    with pytest.raises(AssertionError):
        check_rank_fusions(run_partitioned())


def test_a_dp_fused_op_with_the_shared_expert_on_the_gathered_rows_is_caught(monkeypatch):
    """The data-parallel MoE's shared expert run on the gathered rows' first part (rank 0's tokens on every
    rank) instead of the rank's own: caught on rank 1."""
    from v4compile.ops import fused_ep
    keep = fused_ep._routed_and_shared

    def wrong(x, *a, xs=None):
        p, s = keep(x, *a, xs=None if xs is None else x[:xs.shape[0]])
        return p, s
    monkeypatch.setattr(fused_ep, "_routed_and_shared", wrong)
    assert fused_decode_mismatch("dp2ep2") > 0


def check_dp_fusions(result) -> None:
    """Data parallel: the router, the mask, the routed and the shared expert are one op a layer, between the
    gather and the reduce-scatter (each a launch of its own, or, one-shot on the GPU pipeline, `oneshot_allreduce`,
    folded into the MoE's, with the seam before it: `fuse_oneshot_rows`), the seam after reading the
    reduce-scatter."""
    from v4compile.ops.fused_allreduce import rows_folded

    cfg = preset(NAME)
    ops = [op.name.removesuffix("_oneshot") for op in result.module.functions["decode"].ops]
    folded = sum(map(rows_folded, ops))
    assert ops.count("moe_router_experts_dp") + folded == cfg.n_layers
    assert ops.count("reduce_scatter_rows") + folded == cfg.n_layers and ops.count("all_gather_rows") + folded \
        >= cfg.n_layers
    # the seam after each MoE but the last (mhc_post_head) reads the reduce-scatter, inside the next front's launch
    assert ops.count("mhc_add_pair_norm_linear") == cfg.n_layers - 1 and "mhc_post_pre_add" not in ops
    assert not {"router", "local_experts", "moe_experts", "swiglu"} & set(ops)


def test_every_moe_fusion_fires_on_a_dp_module():
    check_dp_fusions(PassManager(GPU_PIPELINE, PipelineOptions()).run(dp_partitioned()))


@pytest.mark.parametrize("fusion", ["fuse_moe_router", "fuse_moe_mhc"])
def test_a_fusion_skipping_dp_modules_is_caught(monkeypatch, fusion):
    import importlib
    mod = importlib.import_module(f"v4compile.passes.{fusion}")
    monkeypatch.setattr(mod, "_fuse_ep" if fusion == "fuse_moe_router" else "_fold_add", lambda *a: None)
    with pytest.raises(AssertionError):
        check_dp_fusions(PassManager(GPU_PIPELINE, PipelineOptions()).run(dp_partitioned()))


# ---- the seam a collective leaves apart, folded into the next attention's launch --------------------------
# Every partitioned layout: the seam after the MoE's collective as the first phase of the next attention's
# front (`mhc_add_pair_norm_linear`). (The seam before a data-parallel MoE stays its own launch: as the
# attention tail's last phase the V4-Pro kernel spilled 88-104 bytes on sm_90a: tried and left out.)

PROGRAM_STAGE = GPU_PIPELINE[:GPU_PIPELINE.index("plan_memory")]  # every fusion; the IR interpreter runs it
SEAM_OPS = {"tp2ep2": ("mhc_add_pair_norm_linear",),
            "dp2ep2": ("mhc_add_pair_norm_linear",)}


def through_the_pipeline(layout: str):
    from test_partition_dp import dp_module
    m = partitioned(NAME, NUMERICS, 2, 2) if layout == "tp2ep2" else dp_module(NUMERICS)
    return PassManager(PROGRAM_STAGE, PipelineOptions()).run(m).module


@functools.cache
def rank_weights(layout: str) -> list:
    """Each rank's weights of the layout's module (the fusions keep them: every folded module shares these)."""
    from conftest import dense_weights
    from v4compile.weights_convert import DenseSource, load_ir_weights
    m = through_the_pipeline(layout)
    return [load_ir_weights(m, DenseSource(dense_weights(NAME)), rank=r) for r in range(2)]


def logits_of(layout: str, m) -> torch.Tensor:
    """A decode step of two seeded first tokens (the dp layout: one a replica) from empty pools, every rank
    simulated: every fused op of the decode function runs (a prefill would run the same ops' front fold on
    more rows, at 4x the interpreter's time); no reference run: the authority is the unfolded module."""
    from v4compile.harness import DPRunner, IRRunner
    from v4compile.parallel import ParallelLayout, spmd_interpreter
    weights = rank_weights(layout)
    if layout == "dp2ep2":
        runner = DPRunner(m, weights, ParallelLayout.of(m))
        for rep in runner.replicas:
            rep.lengths = [0]
    else:
        runner = IRRunner(m, weights, interpreter=spmd_interpreter)
        runner.lengths = [0, 0]
    return runner.decode(torch.randint(0, preset(NAME).vocab_size, (2,), generator=torch.Generator().manual_seed(5))
                         .tolist())


def unfolded(monkeypatch, layout: str):
    from v4compile.passes import fuse_attn_front
    with monkeypatch.context() as mp:
        mp.setattr(fuse_attn_front, "_fold_seam", lambda fn: (fn, 0))
        return through_the_pipeline(layout)


@functools.cache
def folded_logits(layout: str):
    return logits_of(layout, through_the_pipeline(layout))


@pytest.mark.parametrize("layout", ["dp2ep2"])  # (tp2ep2's fold: check_rank_fusions' counts)
def test_the_seams_fold_into_the_attention_launches_exactly(monkeypatch, layout):
    """The fold fires once a layer but layer 0 (its seam is no `mhc_post_pre_add`), a launch a layer fewer, and a
    decode step of every rank gives the unfolded module's logits to the bit."""
    cfg = preset(NAME)
    after = through_the_pipeline(layout)
    ops = [op.name for op in after.functions["decode"].ops]
    for name in SEAM_OPS[layout]:
        assert ops.count(name) == cfg.n_layers - 1, name
    assert "mhc_post_pre_add" not in ops
    before = unfolded(monkeypatch, layout)
    calls, calls_before = kernel_calls_per_layer(after), kernel_calls_per_layer(before)
    fewer = len(SEAM_OPS[layout])
    assert all(calls[n] == calls_before[n] - fewer for n in range(1, cfg.n_layers)), (calls, calls_before)
    assert torch.equal(logits_of(layout, before), folded_logits(layout))


def _iters_off_by_one(module, name):
    """`module.name` (a fused op's operand / attribute split) with the seam's Sinkhorn iterations one fewer."""
    keep = getattr(module, name)

    def wrong(operands, attrs):
        parts = list(keep(operands, attrs))
        parts[1] = {**parts[1], "iters": parts[1]["iters"] - 1}  # (seam operands, its attrs, front ..., ...)
        return tuple(parts)
    return wrong


@pytest.mark.parametrize("layout, where", [("dp2ep2", "fused_ep._seam_front_split")])
def test_a_seam_folded_with_another_attribute_is_caught(monkeypatch, layout, where):
    """A fused op whose seam runs with one Sinkhorn iteration fewer (an attribute lost in the fold): its
    logits differ from the folded module's."""
    import importlib
    mod_name, fn_name = where.split(".")
    mod = importlib.import_module(f"v4compile.ops.{mod_name}")
    want = folded_logits(layout)
    monkeypatch.setattr(mod, fn_name, _iters_off_by_one(mod, fn_name))
    assert not torch.equal(logits_of(layout, through_the_pipeline(layout)), want)
