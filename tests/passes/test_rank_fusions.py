"""Every MoE fusion on every rank: the gpu pipeline on a partitioned module (tiny-pro, tp 2 ep 2) fuses the
FFN as the single-rank pipeline does, with the all-reduces beside the fused launches, and stays exact
against its layout's reference (`ReferenceModel.partitioned`). Each check is shown to catch a fusion that
skips partitioned modules."""

from __future__ import annotations

import functools

import pytest

from test_partition import check_for, partitioned
from v4compile.cli.report import launch_counts
from v4compile.config import preset
from v4compile.passes import GPU_PIPELINE, PassManager, PipelineOptions
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
    """Launches per layer of the decode function, the collectives left out (they are no kernel calls)."""
    fn = module.functions["decode"]
    counts = launch_counts(preset(NAME), fn)["per_layer"]
    reduces: dict[int, int] = {}
    for op in fn.ops:
        if op.name == "all_reduce":
            reduces[op.attrs["layer"]] = reduces.get(op.attrs["layer"], 0) + 1
    return {layer: n - reduces.get(layer, 0) for layer, n in counts.items()}


def check_rank_fusions(result) -> None:
    cfg = preset(NAME)
    ops = [op.name for op in result.module.functions["decode"].ops]
    hits = result.hits()
    assert hits["fuse_moe_router"]["decode.fused"] == cfg.n_layers  # every layer's FFN, one op
    assert hits["fuse_mhc_moe"]["decode.fused"] == cfg.n_layers - 1  # layer 0's seam is an hc_pre_norm
    assert hits["fuse_moe_mhc"]["decode.fused"] == cfg.n_layers - 1  # the last seam is mhc_post_head
    assert ops.count("all_reduce") == 2 * cfg.n_layers  # wo_b's and the routed experts', each its own launch
    assert not {"router", "local_experts", "moe_experts", "swiglu"} & set(ops)
    one, part = kernel_calls_per_layer(single_rank().module), kernel_calls_per_layer(result.module)
    for layer in range(1, cfg.n_layers - 1):
        # the single-rank seam after the MoE is inside its launch; here it follows the all-reduce (one call)
        assert part[layer] == one[layer] + 1, (layer, part[layer], one[layer])


def test_every_moe_fusion_fires_on_a_partitioned_module():
    check_rank_fusions(partitioned_result())


def test_the_fused_partitioned_module_is_exact():
    """The gpu pipeline's module against the layout's reference: bit for bit (the fused ops' references are
    the compositions, the all-reduce adds the ranks' partial sums before the shared expert as before)."""
    assert check_for(NAME, NUMERICS).error(partitioned_result().module) == 0


@pytest.mark.parametrize("fusion", ["fuse_moe_router", "fuse_mhc_moe"])
def test_a_fusion_skipping_partitioned_modules_is_caught(monkeypatch, fusion):
    import importlib
    mod = importlib.import_module(f"v4compile.passes.{fusion}")
    monkeypatch.setattr(mod, "_fuse_ep", lambda *a: None)
    with pytest.raises(AssertionError):
        check_rank_fusions(run_partitioned())
