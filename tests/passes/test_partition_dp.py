"""Data-parallel attention with expert-parallel MoE (`partition{dp}`) in one process: the layout's rules,
the two collectives' references across ranks, and the partitioned module against the reference model with
every rank simulated (`harness.DPRunner`: each replica its own sequences and state, the ranks in lockstep),
each check shown to catch the fault it names."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import dense_weights, make_model
from v4compile.config import preset
from v4compile.errors import InputError, IRError
from v4compile.harness import Scenario
from v4compile.ir.registry import get_op
from v4compile.parallel import ParallelLayout
from v4compile.passes.base import get_pass
from v4compile.passes.numerics import NumericsCheck
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource

OPTS = dict(batch=1, chunk=16, decode_batch=1, capacity=64)  # per replica: 2 replicas, 2 sequences
# Of the logit scale. The experts' GEMMs see every rank's tokens, the rest the replica's: other batches than
# the reference's one batch of every sequence, whose rows round otherwise (hf: measured ~1e-6); official
# numerics: such a difference can flip one FP8 / FP4 rounding of the simulations (spec 13.2 / 13.3).
TOL = {"hf": 1e-5, "official": 2e-3}


# ---- the layout and the ops ----------------------------------------------------------------------

@pytest.mark.parametrize("dp, tp, ep, needle", [
    (2, 1, 3, "--ep must be 1 or dp x tp = 2"), (2, 2, 2, "--ep must be 1 or dp x tp = 4"),
    (0, 1, 1, ">= 1")])
def test_bad_dp_layouts_are_one_input_error(dp, tp, ep, needle):
    """Every bad combination is one InputError naming the constraint (the pass and the manifest share the
    rule, `ParallelLayout.problem`); the good ones give the world dp x tp."""
    m = tiny_pro("hf")
    with pytest.raises(InputError, match=needle.replace("+", r"\+")):
        get_pass("partition", {"tp": tp, "ep": ep, "dp": dp}).run(m)
    assert ParallelLayout(1, 2, 2).world == 2 and ParallelLayout(2, 1, 2).world == 4
    assert ParallelLayout(1, 4, 4).problem() is None and ParallelLayout(2, 1, 3).problem() is None
    assert ParallelLayout(2, 4, 2).problem() is None and ParallelLayout(2, 4, 2).world == 4


def test_gather_and_reduce_scatter_rows_across_ranks():
    """all_gather_rows: every rank's rows in rank order on every rank; reduce_scatter_rows: the sum in rank
    order, rank k keeping the k-th part of the rows; both as their shape rules say."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 3, 4, generator=g) for _ in range(4)]
    gat = get_op("all_gather_rows").spmd_ref([[x] for x in xs], {"group": 2})
    assert torch.equal(gat[0][0], torch.cat(xs[:2])) and torch.equal(gat[3][0], torch.cat(xs[2:]))
    ys = [torch.randn(4, 3, generator=g) for _ in range(2)]
    red = get_op("reduce_scatter_rows").spmd_ref([[y] for y in ys], {"group": 2})
    total = ys[0] + ys[1]
    assert torch.equal(red[0][0], total[:2]) and torch.equal(red[1][0], total[2:])
    from v4compile.ir.types import TensorType

    rule = get_op("reduce_scatter_rows").result_types
    assert rule([TensorType((4, 3), "fp32")], {"group": 2})[0].shape == (2, 3)
    with pytest.raises(IRError, match="one equal part per rank"):
        rule([TensorType((3, 3), "fp32")], {"group": 2})
    assert get_op("all_gather_rows").result_types([TensorType((2, 5), "i64")], {"group": 4})[0].shape == (8, 5)


# ---- numerics: every rank in one process ---------------------------------------------------------

@functools.cache
def tiny_pro(numerics):
    return trace(preset("tiny-pro"), TraceOptions(numerics=numerics, **OPTS))


@functools.cache
def dp_module(numerics, tp=1):
    return get_pass("partition", {"tp": tp, "ep": 2 * tp, "dp": 2}).run(tiny_pro(numerics)).module


_CHECKS: dict = {}


def check_for(numerics: str) -> NumericsCheck:
    """Two sequences (one per replica; 20 and 15 tokens: CSA windows closed past the indexer's top-k, two
    prefill chunks), one teacher-forced decode step."""
    if numerics not in _CHECKS:
        sc = Scenario.make(preset("tiny-pro").vocab_size, 2, 20, 1, seed=5)
        _CHECKS[numerics] = NumericsCheck(make_model("tiny-pro", numerics=numerics),
                                          DenseSource(dense_weights("tiny-pro")), sc, 16, TOL[numerics],
                                          capacity=OPTS["capacity"], replicas=2)
    return _CHECKS[numerics]


@pytest.mark.parametrize("numerics", ["hf", "official"])
def test_dp_module_matches_the_reference(numerics):
    """dp 2, ep 2: one gather of the hash routers' token ids, then per MoE a gather of x and a
    reduce-scatter of the routed outputs; the two replicas' sequences, each run on its own rank with its
    own pool and state, give the reference's logits (all sequences in one batch, the layout's expert sums)
    within TOL."""
    m = dp_module(numerics)
    ops = [op.name for op in m.functions["decode"].ops if get_op(op.name).collective]
    layers = preset("tiny-pro").n_layers
    assert ops.count("all_gather_rows") == layers + 1 and ops.count("reduce_scatter_rows") == layers
    assert m.attrs["parallel.dp"] == 2 and m.functions["decode"].attrs["batch"] == 1
    assert check_for(numerics).error(m) <= TOL[numerics]


def test_a_reduce_scatter_keeping_another_ranks_rows_is_caught(monkeypatch):
    """A reduce-scatter that hands each rank the other rank's rows (the routed outputs of the other
    replica's tokens): the same comparison, on the prefill's logits (the scenario's first step: the fault
    shows there already), fails by far."""
    op = get_op("reduce_scatter_rows")
    right = op.spmd_ref

    def swapped(per_rank, attrs):
        return right(per_rank, attrs)[::-1]

    monkeypatch.setattr(op, "spmd_ref", swapped)
    check = check_for("hf")
    got = check.runner(dp_module("hf")).prefill([list(p) for p in check.scenario.prompts])
    assert float((got - check.expected_for(dp_module("hf"))[0]).abs().max()) / check.scale > 100 * TOL["hf"]


# ---- data parallel with tensor-parallel attention: --dp 2 --tp 2 --ep 4 -----------------------------------

def test_rows_collectives_of_replicas_across_ranks():
    """tp 2 in a group of 4 (two replicas of two ranks): the gather keeps each replica's first rank's rows once,
    the reduce-scatter gives both ranks of a replica its rows of the sum; the shape rules agree."""
    from v4compile.ir.types import TensorType

    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 3, generator=g) for _ in range(4)]
    gat = get_op("all_gather_rows").spmd_ref([[x] for x in xs], {"group": 4, "tp": 2})
    assert all(torch.equal(o[0], torch.cat([xs[0], xs[2]])) for o in gat)
    ys = [torch.randn(4, 3, generator=g) for _ in range(4)]
    red = get_op("reduce_scatter_rows").spmd_ref([[y] for y in ys], {"group": 4, "tp": 2})
    total = ys[0] + ys[1] + ys[2] + ys[3]
    assert [torch.equal(o[0], total[:2] if r < 2 else total[2:]) for r, o in enumerate(red)] == [True] * 4
    assert get_op("all_gather_rows").result_types([TensorType((2, 5), "fp32")], {"group": 4, "tp": 2})[0].shape \
        == (4, 5)
    assert get_op("reduce_scatter_rows").result_types([TensorType((4, 5), "fp32")], {"group": 4, "tp": 2})[0].shape \
        == (2, 5)
    with pytest.raises(IRError, match="tp must divide"):
        get_op("all_gather_rows").result_types([TensorType((2, 5), "fp32")], {"group": 4, "tp": 3})


def test_dp_tp_module_matches_the_reference():
    """dp 2, tp 2, ep 4 (hf): the attention's heads split inside each replica (an all-reduce of 2 after wo_b),
    the MoE's gather and reduce-scatter over the 4 ranks with tp 2; the replicas' sequences give the
    reference's logits within TOL, and a replica's two ranks end every call with the same bits (`DPRunner`
    checks it: an InputError otherwise)."""
    m = dp_module("hf", tp=2)
    ops = [op for op in m.functions["decode"].ops if get_op(op.name).collective]
    layers = preset("tiny-pro").n_layers
    assert [op.attrs["tp"] for op in ops if op.name != "all_reduce"] == [2] * (2 * layers + 1)
    assert sum(op.name == "all_reduce" and op.attrs["group"] == 2 for op in ops) == layers
    assert m.attrs["parallel.dp"] == 2 and m.attrs["parallel.tp"] == 2 and m.attrs["parallel.ep"] == 4
    assert check_for("hf").error(m) <= TOL["hf"]


def test_a_replica_rank_keeping_the_other_replicas_rows_is_caught(monkeypatch):
    """The reduce-scatter handing the second rank of each replica the other replica's rows (the part of its
    position in the group, not of its replica): the replica's ranks disagree, which the run refuses."""
    op = get_op("reduce_scatter_rows")
    right = op.spmd_ref

    def by_position(per_rank, attrs):
        out = right(per_rank, attrs)
        return [out[0], out[2], out[1], out[3]] if attrs.get("tp", 1) == 2 else out

    monkeypatch.setattr(op, "spmd_ref", by_position)
    with pytest.raises(InputError, match="differs between ranks"):  # one token a replica: the fault shows at once
        check_for("hf").runner(dp_module("hf", tp=2)).prefill([[3], [4]])
