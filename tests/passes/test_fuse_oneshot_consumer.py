"""`fuse_oneshot_consumer`, `fuse_oneshot_producer` and `fuse_oneshot_rows`: the one-shot all-reduces folded into their
consumers' and producers' launches (tiny-pro, tp 2 ep 2, the gpu pipeline down to the program stage). Every layer's
MoE all-reduce folds into its MoE's launch (`<moe>_ar`), every layer's but layer 0's wo_b all-reduce (read by
`hc_post`) into the next MoE's (`ar_mhc_moe_ep_ar`), one launch fewer each; a decode step of every rank (the IR
interpreter, each rank simulated: the folded ops' references across ranks) gives the unfolded module's logits to the
bit, and a fold that loses the sum is caught. Under `--allreduce nccl` neither finds anything; a grouped MoE (a
prefill chunk's) takes the one-shots as calls of their own, before and after its calls. Data parallel (dp 2 ep 2):
every layer's MoE takes its all-gather and reduce-scatter (`ag_moe_router_experts_dp_rs`), two launches fewer each,
and but in layer 0 the seam before it (`mhc_ag_moe_router_experts_dp_rs`), one more; the logits to the bit, a fold
whose gather reverses the ranks caught; the seam's pointers reach its kernel through the call's table (the schedule's
tables checked, one in another order caught).
The kernels' side (the leading phase run by the C runtime across two processes):
tests/runtime/test_parallel_artifact.py::test_oneshot_allreduce_on_the_host_device, test_dp_artifact.py (the DP
fold)."""


from __future__ import annotations

import pytest
import torch

from test_partition import OPTS, partitioned
from test_rank_fusions import NAME, NUMERICS, PROGRAM_STAGE, folded_logits, logits_of, through_the_pipeline
from v4compile.cli.report import launch_counts
from v4compile.config import preset
from v4compile.passes import GPU_PIPELINE, PassManager, PipelineOptions


def run(stage=PROGRAM_STAGE):
    return PassManager(stage, PipelineOptions()).run(partitioned(NAME, NUMERICS, 2, 2))


def test_the_fold_fires_where_it_may_and_is_exact(monkeypatch):
    from v4compile.ops import fused_allreduce
    from v4compile.passes import fuse_oneshot_consumer, fuse_oneshot_producer

    cfg = preset(NAME)
    folded = run()
    hits, after = folded.hits()["fuse_oneshot_consumer"], folded.hits()["fuse_oneshot_producer"]
    assert hits["decode.folded"] == hits["prefill.folded"] == cfg.n_layers - 1, hits
    assert after["decode.folded"] == after["prefill.folded"] == cfg.n_layers, after
    fn = folded.module.functions["decode"]
    ops = [op.name for op in fn.ops]
    # the MoE's all-reduce goes to its producer (the attention front keeps none to lead), the attention's leads the MoE
    assert ops.count("ar_mhc_moe_ep_ar") == cfg.n_layers - 1 and ops.count("moe_router_experts_ep_ar") == 1
    assert not {"ar_mhc_add_pair_norm_linear", "ar_mhc_moe_ep", "mhc_moe_ep", "moe_router_experts_ep"} & set(ops)
    users = {id(v): op.name for op in fn.ops for v in op.operands}
    kept = [op for op in fn.ops if op.name == "all_reduce_oneshot"]  # the unfoldable one keeps its launch
    assert [(op.attrs["layer"], users[id(op.results[0])]) for op in kept] == [(0, "hc_post")]
    with monkeypatch.context() as mp:
        mp.setattr(fuse_oneshot_consumer, "CONSUMERS", ())
        mp.setattr(fuse_oneshot_producer, "PRODUCERS", ())
        apart = run().module
    calls, calls_apart = (launch_counts(cfg, m.functions["decode"])["per_layer"] for m in (folded.module, apart))
    assert sum(calls_apart.values()) - sum(calls.values()) == 2 * cfg.n_layers - 1, (calls, calls_apart)
    want = logits_of("tp2ep2", apart)
    assert torch.equal(logits_of("tp2ep2", folded.module), want)
    # a fold whose reference loses the sum (each rank's own partial): caught
    monkeypatch.setattr(fused_allreduce, "_rank_sum", lambda per_rank, ranks: per_rank[ranks[0]][0].clone())
    assert not torch.equal(logits_of("tp2ep2", folded.module), want)


def test_dp_rows_collectives_fold_into_their_moe_exactly(monkeypatch):
    from types import SimpleNamespace

    from v4compile.ops import fused_allreduce
    from v4compile.passes import fuse_oneshot_rows

    cfg = preset(NAME)
    folded = through_the_pipeline("dp2ep2")
    ops = [op.name for op in folded.functions["decode"].ops]
    # every layer's; the seam before it too but in layer 0 (an `hc_pre_norm`, which nothing folds)
    assert [ops.count(fused_allreduce.ROWS_FOLDED), ops.count(fused_allreduce.SEAM_ROWS_FOLDED)] \
        == [1, cfg.n_layers - 1] and not [o for o in ops if o.endswith("_oneshot")]
    with monkeypatch.context() as mp:
        mp.setattr(fuse_oneshot_rows, "_seam_before", lambda *a: None)
        no_seam = through_the_pipeline("dp2ep2")
        mp.setattr(fuse_oneshot_rows, "DP_MOE", "none")
        apart = through_the_pipeline("dp2ep2")
    calls, calls_no_seam, calls_apart = (launch_counts(cfg, m.functions["decode"])["per_layer"]
                                         for m in (folded, no_seam, apart))
    assert sum(calls_apart.values()) - sum(calls_no_seam.values()) == 2 * cfg.n_layers, (calls_no_seam, calls_apart)
    assert sum(calls_no_seam.values()) - sum(calls.values()) == cfg.n_layers - 1, (calls, calls_no_seam)
    want = logits_of("dp2ep2", apart)
    assert torch.equal(folded_logits("dp2ep2"), want) and torch.equal(logits_of("dp2ep2", no_seam), want)
    # a fold whose reference gathers the ranks' tokens in reverse order: caught, with the seam and without
    gather = fused_allreduce.all_gather_rows
    monkeypatch.setattr(fused_allreduce, "all_gather_rows", SimpleNamespace(
        _infer=gather._infer, _cost=gather._cost, spmd_ref=lambda per_rank, a: gather.spmd_ref(per_rank[::-1], a)))
    assert not torch.equal(logits_of("dp2ep2", folded), want)
    assert not torch.equal(logits_of("dp2ep2", no_seam), want)


def table_errors(sched) -> list[str]:
    """Where a call's pointer table (`KernelCall.tabled`) in the schedule is not the slots of the values its launch
    binds to the tabled pointers, in table order (null: an unbound one), or a tabled pointer is an argument too."""
    from v4compile.runtime.schedule import TABLES

    at = {off: entries for off, entries in sched.tables}
    errs = []
    for f in sched.functions:
        launches = f.program.launches
        for c, li in zip(f.calls, f.launch_of):
            kc = c.kernel
            if kc is None or not kc.tabled:
                continue
            vals = {**dict(launches[li].operands), **dict(launches[li].results)}
            want = tuple((-1, 0) if vals.get(n) is None else (sched.buffer_index(f.name, vals[n].buffer),
                                                              vals[n].offset) for _, _, n, _ in kc.tabled)
            tab = [p for p in c.params if p.role.startswith("table:")]
            if len(tab) != 1 or tab[0].buffer != sched.index[TABLES] or at.get(tab[0].offset) != want \
                    or {p[0] for p in kc.tabled} & {p[0] for p in kc.pointers}:
                errs.append(f"{f.name}#{li} {kc.name}")
    return errs


def test_dp_seam_pointers_reach_the_kernel_through_its_table():
    """The DP MoE launch with the seam before it takes the seam's inputs and weights through its pointer table
    (`moe_router.TABLED`: as arguments their scalar registers made gfx950 spill): the schedule gives each such call
    its table of the slots its launch binds (what the runtime writes at load; the run itself:
    tests/runtime/test_dp_artifact.py), and a table in another order is caught."""
    from v4compile.ops.fused_allreduce import SEAM_ROWS_FOLDED
    from v4compile.program.build import build_program
    from v4compile.runtime.kernels import make_kernel_calls
    from v4compile.runtime.schedule import build_schedule

    planned = PassManager(GPU_PIPELINE[len(PROGRAM_STAGE):], PipelineOptions()).run(through_the_pipeline("dp2ep2"))
    sched = build_schedule(build_program(planned.module), make_kernel_calls(), functions=["decode"])
    f = sched.functions[0]
    tabled = {f.program.launches[li].op for c, li in zip(f.calls, f.launch_of) if c.kernel and c.kernel.tabled}
    assert tabled == {SEAM_ROWS_FOLDED} and len(sched.tables) == preset(NAME).n_layers - 1
    assert table_errors(sched) == []
    sched.tables = [(off, entries[::-1]) for off, entries in sched.tables]
    assert len(table_errors(sched)) == len(sched.tables)


def test_nothing_to_fold_on_the_communicator():
    """`--allreduce nccl` (the pipeline without `oneshot_allreduce`): the all-reduces stay launches of their own."""
    stage = [p for p in PROGRAM_STAGE if p != "oneshot_allreduce"]
    assert "fuse_oneshot_consumer" in stage and "fuse_oneshot_producer" in stage
    result = run(stage)
    ops = [op.name for op in result.module.functions["decode"].ops]
    assert not any(result.hits()["fuse_oneshot_consumer"].values()) and not [o for o in ops if o.startswith("ar_")]
    assert not any(result.hits()["fuse_oneshot_producer"].values()) and not [o for o in ops if o.endswith("_ar")]
    assert ops.count("all_reduce") == 2 * preset(NAME).n_layers


@pytest.mark.parametrize("wrong", ["hc_post"])
def test_only_its_consumers_take_the_fold(wrong):
    """The folded op exists for the phased consumers only: another consumer is no `ar_` op; the producer fold for
    the one-launch EP MoE only (the attention front's launch, with no work independent of its all-reduce's value,
    keeps the consumer fold)."""
    from v4compile.ops.fused_allreduce import consumer_of, producer_of

    assert consumer_of("ar_" + wrong) is None and consumer_of("ar_mhc_moe_ep") == "mhc_moe_ep"
    assert consumer_of("ar_mhc_moe_ep_ar") == "mhc_moe_ep_ar" and producer_of("mhc_moe_ep_ar") == "mhc_moe_ep"
    assert producer_of("ar_mhc_moe_ep_ar") is None and producer_of("mhc_add_pair_norm_linear_ar") is None


def test_a_grouped_consumer_takes_the_one_shot_as_a_call_of_its_own():
    """A prefill chunk whose MoE is grouped (several calls: no phase to lead): the folded launch's first call is
    the one-shot kernel, reading the op's partial `y` and writing the scratch every later call reads instead; its
    last the MoE's own all-reduce (the producer fold: no phases to put it between), in place on `partial`."""
    from v4compile.codegen.kernels import allreduce
    from v4compile.codegen.program_kernels import program_kernels
    from v4compile.program.build import build_program
    from v4compile.trace import TraceOptions, trace

    m = trace(preset(NAME), TraceOptions(numerics=NUMERICS, **{**OPTS, "chunk": 64}))
    prog = build_program(PassManager(["partition{tp=2,ep=2}", *GPU_PIPELINE], PipelineOptions()).run(m).module)
    pk = program_kernels(prog)
    grouped = [(l, c) for l, c in zip(prog.functions["prefill"].launches, pk.calls["prefill"])
               if l.op == "ar_mhc_moe_ep_ar"]
    assert grouped and all(len(c) > 2 for _, c in grouped)
    for l, (first, *rest, last) in grouped:
        assert last.fn is allreduce.oneshot_kernel
        assert [q[:3] for q in last.pointers] == [("x_ptr", "result", "partial"), ("y_ptr", "result", "partial"),
                                                  ("peers_ptr", "peers", "peers")]
        assert first.fn is allreduce.oneshot_kernel
        assert [q[:3] for q in first.pointers] == [("x_ptr", "operand", "y"), ("y_ptr", "scratch", "ar_y"),
                                                   ("peers_ptr", "peers", "peers")]
        assert any(q[1:3] == ("scratch", "ar_y") for c in rest for q in c.pointers)
        assert not any(q[1:3] == ("operand", "y") for c in rest for q in c.pointers)
