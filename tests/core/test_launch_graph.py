"""The program's launch dependency graph (`v4compile/program/graph.py`): read-before-write and PDL overlap.

Each check is shown to fail on a planted fault: a launch that writes an arena value dropped (its reader
then reads bytes nothing wrote), and a launch that depends on the one before it overlapping it under PDL
without waiting. The faults are picked with a seeded generator, not hard-coded.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import triton
import triton.language as tl

from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.program.build import program_of
from v4compile.codegen.kernels.pdl import pdl_enter
from v4compile.program.graph import consecutive_graph, launch_graph, overlap_violations, unwritten_reads
from v4compile.program.verify import verify_function
from v4compile.trace import TraceOptions, trace


@pytest.fixture(scope="module")
def program():
    m = trace(preset("tiny"), TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160))
    return program_of(PassManager(DEFAULT_PIPELINE, PipelineOptions()).run(m).module)


def _raw_into_arena(f, g) -> list[tuple[int, int]]:
    """(writer, reader) edges through the arena whose reader has no other writer of those bytes."""
    return [(j, i) for j, i, kinds in g.edges(data="kinds") if "raw" in kinds and g.in_degree(i) == 1
            and any(a.buffer == "arena" for _, a in f.launches[j].results)]


def test_the_compiled_program_has_its_dependencies(program):
    """Fault caught: none of its own; it shows the unbroken program passes and that the graph is not
    vacuous (consecutive launches depend on each other), so the faults below fail on what they plant."""
    for f in program.functions.values():
        g = launch_graph(f)
        assert unwritten_reads(f, g) == []
        assert any(g.has_edge(i - 1, i) and "raw" in g.edges[i - 1, i]["kinds"] for i in range(1, len(f.launches)))
        assert overlap_violations(f, g, overlapped=lambda i: True, waits=lambda i: True) == []


@pytest.mark.parametrize("seed", [0, 1])
def test_a_read_of_unwritten_arena_bytes_is_caught(program, seed):
    """Fault: the launch that writes an arena value dropped (picked at random among writers whose reader
    reads nothing else of the arena). `unwritten_reads` names the reader, as the verifier does."""
    f = program.functions["decode"]
    g = launch_graph(f)
    writer, reader = random.Random(seed).choice(sorted(_raw_into_arena(f, g)))
    bad = dataclasses.replace(f, launches=f.launches[:writer] + f.launches[writer + 1:])
    found = unwritten_reads(bad, launch_graph(bad))
    assert (reader - 1) in [i for i, _ in found], found
    with pytest.raises(IRError, match="read before any launch writes it"):
        verify_function(bad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_overlapped_launch_that_does_not_wait_is_caught(program, seed):
    """Fault: under PDL every launch overlaps the one before it, and one launch (picked at random among
    those reading a range the previous launch writes) does not wait. `overlap_violations` names it and
    the read-after-write; a launch with no dependency on its predecessor may skip the wait."""
    f = program.functions["decode"]
    g = launch_graph(f)
    dependent = [i for i in range(1, len(f.launches)) if g.has_edge(i - 1, i) and "raw" in g.edges[i - 1, i]["kinds"]]
    lax = random.Random(seed).choice(dependent)
    found = overlap_violations(f, g, overlapped=lambda i: True, waits=lambda i: i != lax)
    assert len(found) == 1 and f"launch #{lax} " in found[0] and "raw" in found[0], found
    free = [i for i in range(1, len(f.launches)) if not g.has_edge(i - 1, i)]
    assert free and overlap_violations(f, g, overlapped=lambda i: True, waits=lambda i: i not in free) == []
    # not overlapped (no PDL attribute): it follows the previous launch's end, no wait needed
    assert overlap_violations(f, g, overlapped=lambda i: i != lax, waits=lambda i: i != lax) == []


def test_consecutive_graph_is_the_graph_between_neighbours(program):
    """Fault caught: a neighbour edge (or kind) the one-pass walk misses or invents against the whole graph."""
    for f in program.functions.values():
        whole, near = launch_graph(f), consecutive_graph(f)
        expect = {(i - 1, i): whole.edges[i - 1, i]["kinds"] for i in range(1, len(f.launches)) if whole.has_edge(i - 1, i)}
        assert {(j, i): k for j, i, k in near.edges(data="kinds")} == expect


@triton.jit
def _reads_before_waiting(x_ptr, PDL: tl.constexpr):
    v = tl.load(x_ptr)  # touches memory the previous kernel may still be writing
    pdl_enter(PDL)
    tl.store(x_ptr, v + 1)


def test_pdl_kernels_wait_first_and_a_late_wait_is_caught(program, monkeypatch):
    """Every kernel of the program that launches with PDL on sm_90a waits before it touches memory, so the
    check passes; a kernel that reads first is seen as not waiting (`waits_first`), and where such a kernel
    sits after a launch it depends on, the program is refused naming that launch (picked at random), while
    the same kernel after a launch it does not depend on passes."""
    from v4compile.codegen import pdl_check
    from v4compile.codegen.program_kernels import program_kernels

    pk = program_kernels(program)
    assert pk.complete
    assert pdl_check.pdl_violations(program, pk, "sm_90a") == []
    assert pdl_check.pdl_violations(program, pk, "gfx950") == []  # no PDL there: nothing overlaps
    assert not pdl_check.waits_first(_reads_before_waiting)
    f = program.functions["decode"]
    g = consecutive_graph(f)
    calls = pk.calls["decode"]
    pdl = [i for i in range(1, len(f.launches)) if calls[i] and pdl_check.uses_pdl(calls[i][0].fn, "sm_90a")]
    dependent = [i for i in pdl if g.has_edge(i - 1, i)]
    lax = random.Random(3).choice(dependent)
    late = calls[lax][0].fn
    monkeypatch.setattr(pdl_check, "waits_first", lambda fn: fn is not late)
    found = pdl_check.pdl_violations(program, pk, "sm_90a")
    assert any(f"launch #{lax} " in v and v.startswith("@decode:") for v in found), found
    # the same late-waiting kernel is harmless wherever it follows a launch it does not depend on
    independent = [i for i in range(1, len(f.launches)) if calls[i] and not g.has_edge(i - 1, i)
                   and pdl_check.uses_pdl(calls[i][0].fn, "sm_90a")]
    if independent:
        free = calls[independent[0]][0].fn
        monkeypatch.setattr(pdl_check, "waits_first", lambda fn: fn is not free)
        found = pdl_check.pdl_violations(program, pk, "sm_90a")
        assert not any(f"launch #{independent[0]} " in v and "@decode" in v for v in found)


def test_dot_views_draw_the_graphs(program):
    """`ir dump --format dot` draws the IR dataflow graph (in-place-update orderings dashed) and
    `--stage program --format dot` the launch dependency graph: every edge of each graph, and no other."""
    import re

    from v4compile.ir.export import to_dot as ir_dot
    from v4compile.ir.graph import dataflow
    from v4compile.program.graph import to_dot

    f = program.functions["decode"]
    g = launch_graph(f)
    drawn = {(int(j), int(i)): set(k.split(",")) for j, i, k in re.findall(r"l(\d+) -> l(\d+) \[label=\"([a-z,]+)\"", to_dot(f, g))}
    assert drawn == {(j, i): k for j, i, k in g.edges(data="kinds")} and drawn
    m = trace(preset("tiny"), TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160))
    fn = m.functions["decode"]
    text = ir_dot(fn)
    between = {(int(j), int(i)) for j, i in re.findall(r"op(\d+) -> op(\d+)", text)}
    dg = dataflow(fn)
    assert between == set(dg.edges())
    assert text.count('style=dashed, label="war"') == sum(1 for *_, k in dg.edges(data="kind") if k == "war") > 0
