"""The program's launch dependency graph (`v4compile/program/graph.py`): read-before-write and PDL overlap.

Each check is shown to fail on a planted fault: a launch that writes an arena value dropped (its reader
then reads bytes nothing wrote), and a launch that depends on the one before it overlapping it under PDL
without waiting. The faults are picked with a seeded generator, not hard-coded.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.program.build import program_of
from v4compile.program.graph import launch_graph, overlap_violations, unwritten_reads
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
