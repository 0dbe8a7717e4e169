"""`fuse_oneshot_consumer`: the one-shot all-reduces folded into their consumers' launches (tiny-pro, tp 2 ep 2,
the gpu pipeline down to the program stage). Every layer's but layer 0's wo_b all-reduce (read by `hc_post`) and
the last layer's MoE all-reduce (read by the `add` before the head) fold, one launch fewer each; a decode step of
every rank (the IR interpreter, each rank simulated: the folded op's reference across ranks) gives the unfolded
module's logits to the bit, and a fold that loses the sum is caught. Under `--allreduce nccl` it finds nothing; a
grouped consumer (a prefill chunk's MoE) takes the one-shot as a call of its own.
The kernels' side (the leading phase run by the C runtime across two processes): tests/runtime/
test_parallel_artifact.py::test_oneshot_allreduce_on_the_host_device."""

from __future__ import annotations

import pytest
import torch

from test_partition import OPTS, partitioned
from test_rank_fusions import NAME, NUMERICS, PROGRAM_STAGE, logits_of
from v4compile.cli.report import launch_counts
from v4compile.config import preset
from v4compile.passes import GPU_PIPELINE, PassManager, PipelineOptions


def run(stage=PROGRAM_STAGE):
    return PassManager(stage, PipelineOptions()).run(partitioned(NAME, NUMERICS, 2, 2))


def test_the_fold_fires_where_it_may_and_is_exact(monkeypatch):
    from v4compile.ops import fused_allreduce
    from v4compile.passes import fuse_oneshot_consumer

    cfg = preset(NAME)
    folded = run()
    hits = folded.hits()["fuse_oneshot_consumer"]
    assert hits["decode.folded"] == hits["prefill.folded"] == 2 * (cfg.n_layers - 1), hits
    fn = folded.module.functions["decode"]
    ops = [op.name for op in fn.ops]
    assert ops.count("ar_mhc_moe_ep") == ops.count("ar_mhc_add_pair_norm_linear") == cfg.n_layers - 1
    users = {id(v): op.name for op in fn.ops for v in op.operands}
    kept = [op for op in fn.ops if op.name == "all_reduce_oneshot"]  # the unfoldable ones keep their launch
    assert [(op.attrs["layer"], users[id(op.results[0])]) for op in kept] == [(0, "hc_post"), (cfg.n_layers - 1, "add")]
    with monkeypatch.context() as mp:
        mp.setattr(fuse_oneshot_consumer, "CONSUMERS", ())
        apart = run().module
    calls, calls_apart = (launch_counts(cfg, m.functions["decode"])["per_layer"] for m in (folded.module, apart))
    assert sum(calls_apart.values()) - sum(calls.values()) == 2 * (cfg.n_layers - 1), (calls, calls_apart)
    want = logits_of("tp2ep2", apart)
    assert torch.equal(logits_of("tp2ep2", folded.module), want)
    # a fold whose reference loses the sum (each rank's own partial): caught
    monkeypatch.setattr(fused_allreduce, "_rank_sum", lambda per_rank, ranks: per_rank[ranks[0]][0].clone())
    assert not torch.equal(logits_of("tp2ep2", folded.module), want)


def test_nothing_to_fold_on_the_communicator():
    """`--allreduce nccl` (the pipeline without `oneshot_allreduce`): the all-reduces stay launches of their own."""
    stage = [p for p in PROGRAM_STAGE if p != "oneshot_allreduce"]
    assert "fuse_oneshot_consumer" in stage
    result = run(stage)
    ops = [op.name for op in result.module.functions["decode"].ops]
    assert not any(result.hits()["fuse_oneshot_consumer"].values()) and not [o for o in ops if o.startswith("ar_")]
    assert ops.count("all_reduce") == 2 * preset(NAME).n_layers


@pytest.mark.parametrize("wrong", ["hc_post"])
def test_only_its_consumers_take_the_fold(wrong):
    """The folded op exists for the phased consumers only: another consumer is no `ar_` op."""
    from v4compile.ops.fused_allreduce import consumer_of

    assert consumer_of("ar_" + wrong) is None and consumer_of("ar_mhc_moe_ep") == "mhc_moe_ep"


def test_a_grouped_consumer_takes_the_one_shot_as_a_call_of_its_own():
    """A prefill chunk whose MoE is grouped (several calls: no phase to lead): the folded launch's first call is
    the one-shot kernel, reading the op's partial `y` and writing the scratch every later call reads instead."""
    from v4compile.codegen.kernels import allreduce
    from v4compile.codegen.program_kernels import program_kernels
    from v4compile.program.build import build_program
    from v4compile.trace import TraceOptions, trace

    m = trace(preset(NAME), TraceOptions(numerics=NUMERICS, **{**OPTS, "chunk": 64}))
    prog = build_program(PassManager(["partition{tp=2,ep=2}", *GPU_PIPELINE], PipelineOptions()).run(m).module)
    pk = program_kernels(prog)
    grouped = [(l, c) for l, c in zip(prog.functions["prefill"].launches, pk.calls["prefill"])
               if l.op == "ar_mhc_moe_ep"]
    assert grouped and all(len(c) > 1 for _, c in grouped)
    for l, (first, *rest) in grouped:
        assert first.fn is allreduce.oneshot_kernel
        assert [q[:3] for q in first.pointers] == [("x_ptr", "operand", "y"), ("y_ptr", "scratch", "ar_y"),
                                                   ("peers_ptr", "peers", "peers")]
        assert any(q[1:3] == ("scratch", "ar_y") for c in rest for q in c.pointers)
        assert not any(q[1:3] == ("operand", "y") for c in rest for q in c.pointers)
