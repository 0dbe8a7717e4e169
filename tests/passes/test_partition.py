"""Tensor / expert parallelism in one process: the collectives' references across ranks, the expert
ownership mask, the partition pass's constraints, and the partitioned module against the reference model
with every rank simulated (`interpret_ranks`), each check shown to catch the fault it names."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from conftest import dense_weights, make_model
from v4compile.config import preset
from v4compile.errors import InputError, IRError
from v4compile.harness import Scenario
from v4compile.ir.interpret import interpret_ranks
from v4compile.ir.registry import get_op
from v4compile.ops.collective import owner_table
from v4compile.passes import CPU_PIPELINE, PassManager, PipelineOptions
from v4compile.passes.base import get_pass
from v4compile.passes.numerics import NumericsCheck
from v4compile.targets import TARGETS
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource

pytestmark = pytest.mark.isa  # exact on torch's CPU kernels: CI runs it again under a second instruction set

OPTS = dict(batch=2, chunk=16, decode_batch=2, capacity=64)
TOL = 1e-5  # of the logit scale: the ranks' partial sums round otherwise than the whole sum (fp32: ~1e-7)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- the ops -------------------------------------------------------------------------------------

def test_all_reduce_and_all_gather_across_ranks():
    g = _gen(0)
    xs = [torch.randn(2, 3, generator=g) for _ in range(4)]
    red = get_op("all_reduce").spmd_ref([[x] for x in xs], {"group": 2})
    gat = get_op("all_gather").spmd_ref([[x] for x in xs], {"group": 2})
    for r in range(4):
        pair = xs[r // 2 * 2: r // 2 * 2 + 2]  # the rank's group: ranks 0, 1 and ranks 2, 3
        torch.testing.assert_close(red[r][0], (pair[0].double() + pair[1].double()).float(), rtol=0, atol=1e-6)
        assert torch.equal(gat[r][0], torch.cat(pair, dim=-1))
    assert red[0][0] is not red[1][0]  # every rank gets its own tensor
    with pytest.raises(IRError, match="groups of 3 ranks in a run of 4"):
        get_op("all_reduce").spmd_ref([[x] for x in xs], {"group": 3})
    with pytest.raises(IRError, match="needs every rank"):  # eagerly, one rank cannot sum over two
        get_op("all_reduce")(xs[0], group=2)


@pytest.mark.parametrize("ep", [2, 4])
def test_local_experts_parts_sum_to_the_whole_moe(ep):
    """Each rank's experts, masked by its owner table, add up over the ranks to the unpartitioned MoE."""
    g = _gen(ep)
    E, D, I, k = 8, 16, 8, 2
    x = torch.randn(3, 5, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(15)]).view(3, 5, k)
    wts = torch.rand(3, 5, k, generator=g)
    w1, w3 = torch.randn(E, I, D, generator=g), torch.randn(E, I, D, generator=g)
    w2 = torch.randn(E, D, I, generator=g)
    moe, mask = get_op("moe_experts"), get_op("local_experts")
    attrs = {"limit": 10.0}
    whole = moe(x, wts, idx, w1, w2, w3, **attrs)
    parts = []
    for p in range(ep):
        sl = slice(p * E // ep, (p + 1) * E // ep)
        lw, li = mask(wts, idx, owner_table(E, ep, p))
        parts.append(moe(x, lw, li, w1[sl], w2[sl], w3[sl], **attrs))
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parts[0], whole, atol=1e-3)  # no single rank has it all
    table = owner_table(E, ep, 1)
    assert table.tolist() == [i - E // ep if E // ep <= i < 2 * E // ep else -1 for i in range(E)]


# ---- the pass's constraints ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def traced():
    return trace(preset("tiny"), TraceOptions(**OPTS))


@pytest.mark.parametrize("tp, ep, needle", [
    (3, 2, "the smaller must divide the larger"),
    (3, 1, "--tp must divide the attention heads"),
    (4, 1, "--tp must divide the output projection groups"),
    (1, 16, "--ep must divide the routed experts"),
])
def test_bad_layout_is_one_input_error(traced, tp, ep, needle):
    with pytest.raises(InputError, match=needle):
        get_pass("partition", {"tp": tp, "ep": ep}).run(traced)


def test_quantised_weights_split_only_into_whole_blocks():
    """Shape-only (released FP8 / FP4) tiny: wo_b's 32 input columns are one 128 block; cutting them in two
    would change the rounding, so TP is refused while EP (whole experts) is fine."""
    m = trace(preset("tiny"), TraceOptions(weights="released", **OPTS))
    with pytest.raises(InputError, match="whole blocks"):
        get_pass("partition", {"tp": 2}).run(m)
    out = get_pass("partition", {"ep": 2}).run(m).module
    assert out.weights["layers.0.ffn.experts.w1.scale"].type.shape[0] == 4


def test_partition_twice_and_the_cli_pipelines(traced):
    once = get_pass("partition", {"tp": 2}).run(traced).module
    with pytest.raises(InputError, match="already partitioned"):
        get_pass("partition", {"tp": 2}).run(once)
    from types import SimpleNamespace

    from v4compile.cli.pipeline import pipeline_of
    args = SimpleNamespace(passes=None, target=None, tp=2, ep=1)
    gpu = pipeline_of(args)  # down to the program: collective launches among the kernels
    assert gpu[0] == "partition{tp=2,ep=1}" and gpu[-1] == "lower_to_program" and "oneshot_allreduce" in gpu
    args.allreduce = "nccl"  # the all-reduces left on NCCL / RCCL: the lowering left out
    assert pipeline_of(args) == [p for p in gpu if p != "oneshot_allreduce"]
    args.target = "cpu"  # ONNX segments meet at the communicator's collectives
    assert pipeline_of(args)[0] == "partition{tp=2,ep=1}" and "oneshot_allreduce" not in pipeline_of(args)
    args.passes = "partition{tp=2},dce"
    with pytest.raises(InputError, match="--passes names it too"):
        pipeline_of(args)


# ---- numerics: every rank in one process ---------------------------------------------------------

_CHECKS: dict = {}


def check_for(name: str, numerics: str) -> NumericsCheck:
    """A scenario long enough to close CSA windows past the indexer's top-k (24 tokens: 6 rows > 4)."""
    if (name, numerics) not in _CHECKS:
        sc = Scenario.make(preset(name).vocab_size, 2, 24, 2, seed=5)
        _CHECKS[name, numerics] = NumericsCheck(make_model(name, numerics=numerics), DenseSource(dense_weights(name)),
                                                sc, 16, TOL, capacity=OPTS["capacity"])
    return _CHECKS[name, numerics]


@functools.cache
def partitioned(name, numerics, tp, ep):  # modules are never changed in place
    m = trace(preset(name), TraceOptions(numerics=numerics, **OPTS))
    return get_pass("partition", {"tp": tp, "ep": ep}).run(m).module


@functools.cache
def cpu_partitioned():
    """tiny (hf) partitioned over tp 2, ep 2, then the cpu pipeline (modules are never changed in place)."""
    return PassManager(CPU_PIPELINE, PipelineOptions()).run(partitioned("tiny", "hf", 2, 2)).module


@pytest.mark.parametrize("name, numerics, tp, ep", [("tiny", "hf", 2, 2), ("tiny-pro", "official", 2, 4)])
def test_partitioned_module_matches_the_reference(name, numerics, tp, ep):
    """Against the reference of its layout (`ReferenceModel.partitioned`: the model code slicing wo_b and the
    expert stacks per rank and adding the ranks' parts in rank order, independently of the pass's weight
    sharding) the partitioned module is exact: the same op references summing in the same order. That
    reference lies within TOL of the plain one here (not 0: the ranks really computed partial sums). With
    official numerics it need not: a ~1e-7 rounding-order difference can flip one FP8 rounding whose input
    sits at an e4m3 midpoint (tiny, tp 2 ep 2, `--check-numerics`' 100 + 32 tokens: one KV value of layer 4
    at decode step 7, 5.74998 vs 5.75003 times its scale, rounds to 5.5 vs 6: 7.0e-5 of the logit scale);
    the partition is then checked against its layout's reference, as DeepSeek's own per-rank sums define it."""
    check = check_for(name, numerics)
    m = partitioned(name, numerics, tp, ep)
    assert check.error(m) == 0
    assert 0 < check.layout_error(m) <= TOL


def test_a_reference_summing_as_the_whole_model_is_caught():
    """The comparison is exact: held to the plain reference (sums over all heads' columns and all experts
    at once) instead of its layout's, the same module is off (by rounding only, within TOL)."""
    check = check_for("tiny", "hf")
    m = partitioned("tiny", "hf", 2, 2)
    check.expected_for(m)  # the layout's reference (computed once per layout)
    saved = dict(check._by_layout)
    try:
        check._by_layout = {k: check.expected for k in saved}
        assert 0 < check.error(m) <= TOL
    finally:
        check._by_layout = saved


def test_a_dropped_all_reduce_is_caught(monkeypatch):
    """Without wo_b's all-reduce each rank continues with its own partial attention output: the ranks'
    caches and logits part, which the simulation refuses."""
    from v4compile.passes.partition import _Partitioner

    keep = _Partitioner._reduce_group
    monkeypatch.setattr(_Partitioner, "_reduce_group",
                        lambda self, op: 0 if op.attrs.get("role") == "attn.wo_b" else keep(self, op))
    m = partitioned.__wrapped__("tiny", "hf", 2, 2)  # not the cached module: this one is built broken
    assert sum(op.name == "all_reduce" for op in m.functions["decode"].ops) == 5  # the MoE's only
    with pytest.raises(IRError, match="differs between rank 0 and rank 1"):
        check_for("tiny", "hf").error(m)


def test_a_wrong_expert_owner_is_caught(traced, monkeypatch):
    """Every rank claiming every expert (as its local expert e mod E/ep): the all-reduce then counts each
    routed expert twice, on every rank alike; the same comparison that passes above fails by far."""
    import v4compile.ops.collective as coll

    assert decode_error(traced, 1, 2) <= TOL
    monkeypatch.setattr(coll, "owner_table", lambda E, parts, part: torch.arange(E) % (E // parts))
    assert decode_error(traced, 1, 2) > 100 * TOL


def test_cpu_pipeline_after_the_partition():
    """The later passes (merges, fusions, the native pool) keep the partitioned module's numbers."""
    out = cpu_partitioned()
    assert sum(op.name == "all_reduce" for op in out.functions["decode"].ops) == 10
    assert check_for("tiny", "hf").error(out) <= TOL


def decode_error(traced, tp, ep) -> float:
    """One decode step of the partitioned module, its ranks in lockstep on the same seeded inputs, against
    the unpartitioned module (relative to its largest logit); the ranks' logits must agree bit for bit."""
    from v4compile.ir.interpret import interpret
    from v4compile.weights_convert import load_ir_weights

    m = get_pass("partition", {"tp": tp, "ep": ep}).run(traced).module
    source = DenseSource(dense_weights("tiny"))
    fn = m.functions["decode"]
    g = _gen(3)
    inputs = {v.name: (torch.randint(0, 512, v.type.shape, generator=g) if v.name == "ids" else
                       torch.full(v.type.shape, 5) if v.name == "pos" else torch.randn(v.type.shape, generator=g))
              for v in fn.inputs}
    world = max(tp, ep)
    outs = interpret_ranks(fn, [load_ir_weights(m, source, rank=r) for r in range(world)], [inputs] * world)
    assert all(torch.equal(o["logits"], outs[0]["logits"]) for o in outs)
    whole = interpret(traced.functions["decode"], load_ir_weights(traced, source), inputs)["logits"]
    return float((outs[0]["logits"] - whole).abs().max()) / float(whole.abs().max())


def test_interpret_ranks_runs_ranks_in_lockstep(traced):
    """A collective sees every rank's operands: four ranks (TP groups of 2) give the unpartitioned logits."""
    assert 0 < decode_error(traced, 2, 4) <= TOL


def test_report_parallel_section(capsys):
    """`--json` under "parallel": per-rank bytes against an independent count from the traced weights (the
    split ones divided by their group, the owner tables added), the all-reduces of a decode step."""
    import json

    from v4compile.cli import main

    assert main(["-q", "compile", "--preset", "tiny", "--dtype", "fp32", "--tp", "2", "--ep", "4", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["parallel"]
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=256))
    split = {"attn.wq_b.weight": 2, "attn.wo_a.weight": 2, "attn.wo_b.weight": 2, "attn.attn_sink": 2,
             "ffn.experts.w1": 4, "ffn.experts.w2": 4, "ffn.experts.w3": 4}
    want = sum(w.type.nbytes // next((n for k, n in split.items() if w.name.endswith(k)), 1)
               for w in m.weights.values()) + cfg.n_layers * cfg.n_experts * 8
    assert (p["tp"], p["ep"], p["world"]) == (2, 4, 4)
    assert p["per_rank_weight_bytes"] == want
    assert p["unpartitioned_weight_bytes"] == sum(w.type.nbytes for w in m.weights.values())
    c = p["collectives_per_decode_step"]
    assert c["count"] == 2 * cfg.n_layers and {o["bytes"] for o in c["ops"]} == {2 * cfg.dim * 4}
    assert sorted({o["group"] for o in c["ops"]}) == [2, 4]
    assert p["per_rank_kv_bytes"] > 0 and set(p["decode_step"]) == {"gfx950", "sm_90a"}
    # the partitioned program's kernel calls (each launch but a collective makes at least one), its collectives
    # launches of it but the MoE's one-shot all-reduces (the ep 4 group's) folded into the MoE's launch, every
    # layer's (`fuse_oneshot_producer`; the attention's, group 2, stay on the communicator: nothing to lead)
    assert c["program_folded"] == 0 and c["program_folded_after"] == cfg.n_layers
    assert c["program_collective_launches"] == c["count"] - c["program_folded_after"]
    after = [o for o in c["ops"] if "folded_after" in o]
    assert len(after) == cfg.n_layers and all(o["group"] == 4 and o["hidden_bytes"] > 0 for o in after)
    for t, s in p["decode_step"].items():  # exposed: max(0, the one-shot's time - the shared expert's bytes / HBM)
        link, hbm = TARGETS[t].link, TARGETS[t].hbm_bytes_s
        own = [link.oneshot_s(4, o["bytes"]) if link.oneshot_latency_s is not None else
               link.allreduce_latency_s + 1.5 * o["bytes"] / link.bytes_s for o in after]
        hidden = sum(x - max(0.0, x - o["hidden_bytes"] / hbm) for x, o in zip(own, after))
        assert s["folded_after"] == cfg.n_layers and s["hidden_us"] == round(hidden * 1e6, 1) and hidden > 0
    for t, s in p["decode_step"].items():
        assert s["launches_counted"] == "kernel calls" and s["launches"] >= c["program_launches"] - c["count"]
        # the roofline term is what the program's kernel calls move (the MoE: this rank's slots only)
        assert s["roofline_us"] == round(s["program_kernel_bytes"] / TARGETS[t].hbm_bytes_s * 1e6, 1) > 0


# ---- per-rank weights of an artifact -------------------------------------------------------------

def _checkpoint_whole(source, base: str, dtype: str, layout) -> torch.Tensor:
    """A source's whole tensor as the checkpoint (or the layout's ownership table) gives it, in the IR dtype."""
    from v4compile.parallel import synthesized
    from v4compile.weights_convert import expand_sources, ir_tensor

    whole = synthesized(base, layout)
    if whole is not None:
        return whole
    fetched = [ir_tensor(source, n, dtype) for n in expand_sources((base,))]
    return torch.stack(fetched) if "{0.." in base else fetched[0]


def _rebuilt_from_ranks(m, source, ranks: list) -> dict[str, int]:
    """Rebuilds every source tensor of every weight from the ranks' written tensors and compares it with the
    checkpoint's, bit for bit: each weight's rows are cut into its sources' pieces (a merge concatenates them
    along axis 0), a rank-local piece is the contiguous chunk `layout.part(group, r)` of its axis (the ranks'
    chunks concatenated in part order give the whole tensor back), a replicated piece is the whole tensor on
    every rank. Independent of `rank_part` / `load_ir_weights`, which the writer calls. Returns the number of
    sharded and replicated pieces checked."""
    from v4compile.parallel import ParallelLayout, split_shard

    layout = ParallelLayout.of(m)
    counts = {"sharded": 0, "replicated": 0}
    for w in m.weights.values():
        row = 0
        for s in w.sources:
            base, group, axis = split_shard(s)
            whole = _checkpoint_whole(source, base, w.type.dtype, layout)
            n = layout.size(group) if group is not None else 1
            rows = whole.shape[0] // n if axis == 0 else whole.shape[0]
            pieces = [ranks[r][w.name][row:row + rows] for r in range(layout.world)]
            if group is None:
                assert all(torch.equal(p, whole) for p in pieces), f"{w.name}: replicated {base} differs on a rank"
                counts["replicated"] += 1
            else:
                by_part = {layout.part(group, r): p for r, p in enumerate(pieces)}
                assert sorted(by_part) == list(range(n)), f"{w.name}: a part of {base} is on no rank"
                for r, p in enumerate(pieces):  # ranks holding the same part (world > n) hold the same bytes
                    assert torch.equal(p, by_part[layout.part(group, r)]), f"{w.name}: rank {r}'s part differs"
                rebuilt = torch.cat([by_part[k] for k in range(n)], dim=axis)
                assert torch.equal(rebuilt, whole), f"{w.name}: the ranks' parts of {base} do not rebuild it"
                counts["sharded"] += 1
            row += rows
        assert all(row == ranks[r][w.name].shape[0] for r in range(layout.world)), f"{w.name}: rows left over"
    return counts


def _write_and_map(m, source, tmp_path):
    from v4compile.cli.driver import write_rank_weights
    from v4compile.errors import ArtifactError
    from v4compile.weights_map import MappedWeights

    weights, hashed, par = write_rank_weights(m, source, tmp_path)
    mapped = [MappedWeights(tmp_path, par["rank_weights"][r]["tensors"], ArtifactError) for r in range(par["world"])]
    return weights, hashed, par, mapped


def test_rank_weights_written_per_rank(tmp_path):
    """Each rank's directory holds exactly that rank's tensors (merged weights included: the cpu pipeline's
    merges concatenate a rank's part of wq_b with the whole indexer wq_b): the dense checkpoint tensors are
    rebuilt from the ranks' written parts (`_rebuilt_from_ranks`), bit for bit; the manifest's `parallel`
    entry passes the schema, and each of its rules refuses a broken entry. The planted fault is
    `test_rank_weights_with_swapped_parts_fail_the_rebuild`."""
    import copy

    from v4compile.errors import ArtifactError
    from v4compile.manifest import _check_parallel

    m = cpu_partitioned()
    source = DenseSource(dense_weights("tiny"))
    weights, hashed, par, got = _write_and_map(m, source, tmp_path)
    assert weights is par["rank_weights"][0] and (par["tp"], par["ep"], par["world"]) == (2, 2, 2)
    for r in range(2):
        assert set(got[r]) == set(m.weights)
        assert all(s.startswith(f"weights/rank-{r}/") and s in hashed for s in par["rank_weights"][r]["shards"])
    counts = _rebuilt_from_ranks(m, source, got)
    assert counts["sharded"] > 0 and counts["replicated"] > 0, counts
    merged = next(n for n in m.weights if n.endswith("wq_b_merged.weight"))
    assert not torch.equal(got[0][merged], got[1][merged])  # each rank its own heads
    kv = "layers.0.attn.wqkv_a.weight"  # wq_a and the KV head merged: whole on every rank
    assert torch.equal(got[0][kv], got[1][kv])

    cfg, listed = preset("tiny"), (lambda rel, key: rel)
    _check_parallel(par, weights, cfg, listed)
    for breaks, needle in ((lambda p: p.update(world=3), "must be max"), (lambda p: p.update(ep=16, world=16), "do not divide the routed experts"),
                           (lambda p: p["rank_weights"].pop(), "one entry per rank"),
                           (lambda p: p["rank_weights"][1]["shards"].__setitem__(0, "weights/rank-0/x.safetensors"),
                            "shard` is not one of|lie outside"),
                           (lambda p: next(iter(p["rank_weights"][1]["tensors"].values()))["shape"].append(1),
                            "other tensors")):
        bad = copy.deepcopy(par)
        breaks(bad)
        with pytest.raises(ArtifactError, match=needle):
            _check_parallel(bad, bad["rank_weights"][0], cfg, listed)


def test_rank_weights_with_swapped_parts_fail_the_rebuild(tmp_path, monkeypatch):
    """The planted fault: `parallel.rank_part` hands rank r the chunk of rank world-1-r. The old round trip
    (the written tensors against `load_ir_weights`, which calls the same `rank_part`) still held; the rebuild
    from the parts does not give the checkpoint tensors back."""
    from v4compile import parallel
    from v4compile.weights_convert import load_ir_weights

    m = cpu_partitioned()
    source = DenseSource(dense_weights("tiny"))
    real = parallel.rank_part
    monkeypatch.setattr(parallel, "rank_part", lambda t, group, axis, layout, rank, what:
                        real(t, group, axis, layout, layout.world - 1 - rank, what))
    _, _, _, got = _write_and_map(m, source, tmp_path)
    want = load_ir_weights(m, source, rank=1)
    assert all(torch.equal(got[1][n], want[n]) for n in want)  # what the old test checked: it passes
    with pytest.raises(AssertionError, match="do not rebuild it"):
        _rebuilt_from_ranks(m, source, got)


def test_local_experts_onnx_lowering_matches_its_reference():
    """The cpu target's lowering of the ownership mask, run by ONNX Runtime, against the op's reference."""
    import onnxruntime as ort

    from v4compile.codegen.onnx_export import export_function
    from v4compile.ir.text import parse_module

    m = parse_module('''module @t
weight @owner : i64[8] from "owner"
func @f(%w : fp32[2,3,2], %i : i64[2,3,2]) {
  %0, %1 = local_experts(%w, %i, @owner) : fp32[2,3,2], i64[2,3,2]
  return w_out = %0, i_out = %1
}''')
    g = _gen(7)
    w, i = torch.rand(2, 3, 2, generator=g), torch.randint(0, 8, (2, 3, 2), generator=g)
    for part in range(2):
        owner = owner_table(8, 2, part)
        sess = ort.InferenceSession(export_function(m, "f").SerializeToString(), providers=["CPUExecutionProvider"])
        got = sess.run(["w_out", "i_out"], {"w": w.numpy(), "i": i.numpy(), "owner": owner.numpy()})
        want = get_op("local_experts")(w, i, owner)
        assert torch.equal(torch.from_numpy(got[0]), want[0]) and torch.equal(torch.from_numpy(got[1]), want[1])
        assert (want[0] == 0).any() and (want[0] != 0).any()  # both owned and foreign slots occur


# ---- the cpu target: ONNX segments cut at the collectives ----------------------------------------

def run_segments(segments, rank_weights, inputs, states):
    """Every rank's segments in one process, in lockstep (`runtime.distributed.run_segment` each), each
    collective combining the ranks' values with its reference across ranks."""
    import onnxruntime as ort

    from v4compile.runtime.distributed import run_segment

    world = len(rank_weights)
    env = [dict(inputs) for _ in range(world)]
    weights = [{n: t.numpy() for n, t in w.items()} for w in rank_weights]
    for model, coll in segments:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for r in range(world):
            run_segment(sess, env[r], states[r], weights[r])
        if coll is not None:
            got = get_op(coll.name).spmd_ref([[torch.from_numpy(env[r][coll.operands[0].name])] for r in range(world)],
                                             {"group": coll.attrs["group"]})
            for r in range(world):
                env[r][coll.results[0].name] = got[r][0].numpy()
    return [e["logits"] for e in env]


def test_onnx_segments_run_the_partitioned_function(fault=None):
    """The cpu pipeline's partitioned prefill, cut at its 10 all-reduces into 11 ONNX segments, run for two
    ranks with the sums between them: the interpreter's logits and states (every rank in lockstep).
    `fault` (`test_segments_check_fails_without_the_sums`): breaks the segment runner after the expectation."""
    from v4compile.codegen.onnx_segments import export_segments
    from v4compile.harness import PagedAllocator
    from v4compile.ir.types import DTYPES
    from v4compile.pool import PoolGeometry
    from v4compile.weights_convert import load_ir_weights

    m = cpu_partitioned()
    fn = m.functions["prefill"]
    segments = export_segments(m, "prefill")
    assert len(segments) == 11 and [c is None for _, c in segments] == [False] * 10 + [True]
    source = DenseSource(dense_weights("tiny"))
    weights = [load_ir_weights(m, source, rank=r) for r in range(2)]
    g = _gen(11)
    pos = torch.arange(16).repeat(2, 1)
    inputs = {"ids": torch.randint(0, 512, (2, 16), generator=g), "pos": pos,
              **PagedAllocator(PoolGeometry.from_attrs(m.attrs)).step_inputs(pos)}
    for v in fn.inputs:
        inputs.setdefault(v.name, torch.zeros(v.type.shape, dtype=DTYPES[v.type.dtype]))
    want = interpret_ranks(fn, weights, [inputs, inputs])
    states = [{n: t.numpy().copy() for n, t in inputs.items() if n.startswith(("pool.", "state."))} for _ in range(2)]
    if fault is not None:
        fault()
    logits = run_segments(segments, weights, {n: t.numpy() for n, t in inputs.items()}, states)
    scale = float(want[0]["logits"].abs().max())
    for r in range(2):
        assert np.abs(logits[r] - want[r]["logits"].numpy()).max() <= 1e-5 * scale
        for n, s in states[r].items():
            assert np.abs(s - want[r][n].numpy()).max() <= 1e-5 * max(float(want[r][n].abs().max()), 1.0), n
    assert any(np.abs(s).max() > 0 for s in states[0].values())  # the prefill really wrote the pool


def test_segments_check_fails_without_the_sums(monkeypatch):
    """The same comparison with a segment runner whose collective adds nothing (each rank keeps its part)."""
    op = get_op("all_reduce")
    with pytest.raises(AssertionError):
        test_onnx_segments_run_the_partitioned_function(
            lambda: monkeypatch.setattr(op, "spmd_ref", lambda per_rank, attrs: [[x[0].clone()] for x in per_rank]))


# ---- two processes with gloo ---------------------------------------------------------------------

def _launch(d, world: int, ranks, timeout_s: float = 120):
    """`dist_worker.py DIR` as ranks `ranks` of a `world`-rank group: (returncode, stderr) per rank."""
    import sys
    from pathlib import Path

    from dist_launch import launch

    worker = Path(__file__).resolve().parents[1] / "dist_worker.py"
    return [(code, err) for code, _, err in launch([sys.executable, str(worker), str(d)], world, ranks, timeout_s)]


@pytest.fixture(scope="module")
def gloo_plan(tmp_path_factory):
    """A partitioned prefill (tiny, tp 2, ep 2) as files for `dist_worker.py`, and its expected logits."""
    import json

    from v4compile.codegen.onnx_segments import export_segments
    from v4compile.harness import PagedAllocator
    from v4compile.ir.types import DTYPES
    from v4compile.pool import PoolGeometry
    from v4compile.weights_convert import load_ir_weights

    d = tmp_path_factory.mktemp("gloo")
    m = cpu_partitioned()
    fn = m.functions["prefill"]
    source = DenseSource(dense_weights("tiny"))
    weights = [load_ir_weights(m, source, rank=r) for r in range(2)]
    pos = torch.arange(16).repeat(2, 1)
    inputs = {"ids": torch.randint(0, 512, (2, 16), generator=_gen(12)), "pos": pos,
              **PagedAllocator(PoolGeometry.from_attrs(m.attrs)).step_inputs(pos)}
    for v in fn.inputs:
        inputs.setdefault(v.name, torch.zeros(v.type.shape, dtype=DTYPES[v.type.dtype]))
    want = interpret_ranks(fn, weights, [inputs, inputs])[0]["logits"].numpy()
    segs = []
    for k, (model, c) in enumerate(export_segments(m, "prefill")):
        (d / f"seg-{k}.onnx").write_bytes(model.SerializeToString())
        segs.append({"file": f"seg-{k}.onnx", "collective": None if c is None else
                     {"operand": c.operands[0].name, "result": c.results[0].name, "group": c.attrs["group"]}})
    (d / "plan.json").write_text(json.dumps({"tp": 2, "ep": 2, "timeout_s": 60, "segments": segs}))
    for r in range(2):
        np.savez(d / f"rank-{r}.npz", **{n: t.numpy() for n, t in weights[r].items()})
    states = {n for n in inputs if n.startswith(("pool.", "state."))}
    np.savez(d / "inputs.npz", **{n: t.numpy() for n, t in inputs.items() if n not in states})
    np.savez(d / "states.npz", **{n: inputs[n].numpy() for n in states})
    return d, want


def test_two_ranks_with_gloo_give_the_simulated_logits(gloo_plan):
    d, want = gloo_plan
    for code, err in _launch(d, 2, [0, 1]):
        assert code == 0, err
    got = [np.load(d / f"out-{r}.npz")["logits"] for r in range(2)]
    assert np.array_equal(got[0], got[1])  # the all-reduce gives every rank the same sum
    assert np.abs(got[0] - want).max() <= 1e-5 * np.abs(want).max()


MISSING_RANK_BOUND_S = 12  # from the ready line: the group's 3 s timeout, a slow start of gloo, the error (~6 s at load 25 on 2 cores)


def _missing_rank(d, timeout_s: float) -> tuple[int, str, float]:
    """Rank 0 of 2 alone, its group's timeout `timeout_s`: (returncode, stderr without the ready line,
    seconds from its ready line to its end)."""
    import json
    import time

    from dist_launch import since_ready, without_ready

    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "timeout_s": timeout_s}))
    try:
        (code, err), = _launch(d, 2, [0], timeout_s=120)  # rank 1 never arrives
        return code, without_ready(err), since_ready([err], time.time())
    finally:
        (d / "plan.json").write_text(json.dumps(plan))


def test_wrong_world_size_and_a_missing_rank_end_with_one_error(gloo_plan):
    """A missing rank ends rank 0 with one error within MISSING_RANK_BOUND_S of its ready line (after its
    imports: `dist_launch.since_ready`); the broken variant is the test below."""
    d, _ = gloo_plan
    (code, err), = _launch(d, 3, [0], timeout_s=60)
    assert code == 2 and err.count("error:") == 1 and "world size differs" in err and "WORLD_SIZE 3" in err
    code, err, took = _missing_rank(d, 3)
    assert code == 2 and err.strip().startswith("error:"), err
    assert took < MISSING_RANK_BOUND_S, took


def test_a_missing_rank_that_ends_late_fails_the_bound(gloo_plan):
    """The planted fault: the group's timeout past the bound (as a rank that ignored its timeout and waited
    longer would). The same error comes, late: the bound's assertion fails."""
    d, _ = gloo_plan
    code, err, took = _missing_rank(d, MISSING_RANK_BOUND_S + 2)
    assert code == 2 and err.strip().startswith("error:"), err
    with pytest.raises(AssertionError):
        assert took < MISSING_RANK_BOUND_S, took
