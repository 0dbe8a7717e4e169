"""The IR's dataflow graph (`v4compile/ir/graph.py`): the verifier's order check and the fusion-legality query.

Each check is shown to fail on a planted fault of its kind: an op moved before its producer, a pool reader
moved after the in-place write of the pool, a fusion placed where it would read the pool after that write.
The faults are picked with a seeded generator among the graph's edges, not hard-coded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from v4compile.config import preset
from v4compile.errors import IRError, PassError
from v4compile.ir.core import Function
from v4compile.ir.graph import dataflow, fusion_blockers, order_violations
from v4compile.ir.verify import verify
from v4compile.passes import PassManager, PipelineOptions
from v4compile.passes.base import Pass, PassResult, register
from v4compile.passes.pipeline import DEFAULT_PIPELINE
from v4compile.passes.rewrite import Rewrite, new_module
from v4compile.trace import TraceOptions, trace

OPTS = TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160)
# Up to the lowering that makes the decode attention and its window write: the pool's reader and its
# in-place writer are then separate ops, adjacent, with wo_a / wo_b after them.
LOWERED = DEFAULT_PIPELINE[:DEFAULT_PIPELINE.index("lower_sparse_attention") + 1]


@pytest.fixture(scope="module")
def lowered():
    return PassManager(LOWERED, PipelineOptions()).run(trace(preset("tiny"), OPTS)).module


def _moved(fn: Function, src: int, dst: int) -> Function:
    """The function with op `src` moved to index `dst` (the other ops keep their order)."""
    ops = list(fn.ops)
    ops.insert(dst, ops.pop(src))
    return Function(fn.name, list(fn.inputs), ops, list(fn.outputs), dict(fn.attrs))


def _edges(fn: Function, kind: str) -> list[tuple[int, int]]:
    return sorted((u, v) for u, v, k in dataflow(fn).edges(data="kind") if k == kind)


def test_the_pipeline_keeps_a_topological_order(lowered):
    """Fault caught: none of its own; it shows the graph is not vacuous (in-place edges exist) and that the
    unbroken module passes, so the faults below fail on what they plant."""
    for fn in lowered.functions.values():
        assert _edges(fn, "war") and order_violations(fn) == []
    verify(lowered)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_op_moved_before_its_producer_is_caught(lowered, seed):
    """Fault: a fusion that moves an op before its producer (a random data edge's user moved to just before
    the producer). Fails `order_violations(...)` naming the user, and the verifier."""
    fn = lowered.functions["decode"]
    u, v = random.Random(seed).choice(_edges(fn, "data"))
    bad = _moved(fn, v, u)
    found = order_violations(bad)
    assert found and f"({fn.ops[v].name}" in found[0], found
    with pytest.raises(IRError):
        verify(new_module(lowered, {**lowered.functions, "decode": bad}))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_read_moved_after_the_in_place_write_is_caught(lowered, seed):
    """Fault: a reader of the pool moved to just after the op that updates the pool in place (SSA-valid: it
    still comes after its operands' producers, so only the graph's `war` edges see it). Fails the
    verifier's topological-order check, which names the in-place update."""
    fn = lowered.functions["decode"]
    reader, writer = random.Random(seed).choice(_edges(fn, "war"))
    bad = new_module(lowered, {**lowered.functions, "decode": _moved(fn, reader, writer)})
    with pytest.raises(IRError, match="not a topological order") as e:
        verify(bad)
    assert fn.ops[writer].name in str(e.value)


@register
@dataclass(frozen=True)
class _ReadAfterWrite(Pass):
    """Test-only: moves each function's first pool reader after the in-place write it must precede."""

    name = "testing-read-after-write"

    def run(self, module):
        fns = {}
        for n, f in module.functions.items():
            war = _edges(f, "war")
            fns[n] = _moved(f, *war[0]) if war else f
        return PassResult(new_module(module, fns))


def test_verify_each_names_a_pass_that_breaks_the_order(lowered):
    """Fault: a pass that moves a read after the in-place write (`testing-read-after-write`). Fails
    `--verify-each`, which names the pass."""
    with pytest.raises(PassError, match="after pass 'testing-read-after-write'.*not a topological order"):
        PassManager(["testing-read-after-write"], PipelineOptions(verify_each=True)).run(lowered)


def _out_proj_chains(fn: Function) -> list[tuple[int, int, int]]:
    """(attention, wo_a, wo_b) index triples, each a sole-use chain (what fuse_out_proj fuses at decode)."""
    rw, at = Rewrite(fn), {id(o): i for i, o in enumerate(fn.ops)}
    out = []
    for op in fn.ops:
        wo_a = rw.producer(op.operand("x"), "rope_out_proj", only_use=True) if op.name == "linear" else None
        attn = rw.producer(wo_a.operand("o"), "sparse_attention", only_use=True) if wo_a is not None else None
        if attn is not None:
            out.append((at[id(attn)], at[id(wo_a)], at[id(op)]))
    return out


def test_a_fusion_placed_after_the_in_place_write_is_refused(lowered):
    """Fault: fusing the decode attention with wo_a / wo_b in wo_b's place, where it would read the pool
    after the window write. `fusion_blockers` names the write, `Rewrite.can_fuse` refuses; in the
    attention's place (what fuse_out_proj does) both allow it."""
    fn = lowered.functions["decode"]
    g, rw = dataflow(fn), Rewrite(fn)
    chains = _out_proj_chains(fn)
    assert chains
    for attn, wo_a, wo_b in chains:
        assert fusion_blockers(g, [attn, wo_a, wo_b], attn) == []
        assert rw.can_fuse(fn.ops[attn], [fn.ops[wo_a], fn.ops[wo_b]])
        blockers = fusion_blockers(g, [attn, wo_a, wo_b], wo_b)
        assert [fn.ops[b].name for b in blockers] == ["pool_write_window"], blockers
        assert not rw.can_fuse(fn.ops[wo_b], [fn.ops[attn], fn.ops[wo_a]])


def test_a_path_through_an_outside_op_is_refused(lowered):
    """Fault: fusing two ops of a data chain p -> x -> c while leaving x outside (picked at random): the
    fused op would be its own ancestor. `fusion_blockers` names x wherever the fused op stands."""
    fn = lowered.functions["decode"]
    g = dataflow(fn)
    chains = [(p, x, c) for p, x in g.edges for c in g.successors(x) if g.edges[p, x]["kind"] == "data"]
    p, x, c = random.Random(0).choice(chains)
    for at in (p, c):
        assert x in fusion_blockers(g, [p, c], at)


@pytest.mark.parametrize("pass_name, hits", [("fuse_out_proj", "decode.attention"), ("fuse_norm_linear", "decode.fused")])
def test_fusion_passes_ask_can_fuse(lowered, monkeypatch, pass_name, hits):
    """Fault: `Rewrite.can_fuse` refusing everything. The pass then fuses nothing, so it does consult the
    shared query (fuse_out_proj and fuse_norm_linear)."""
    def run():
        return PassManager([*DEFAULT_PIPELINE[len(LOWERED):DEFAULT_PIPELINE.index(pass_name)], pass_name],
                           PipelineOptions()).run(lowered).records[-1].hits[hits]
    assert run() > 0
    monkeypatch.setattr(Rewrite, "can_fuse", lambda self, op, absorbed=(): False)
    assert run() == 0
