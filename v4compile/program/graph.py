"""A function program's launch dependency graph: which launch must wait for which, from the bytes they touch.

Nodes are launch indices. An edge j -> i (j < i) says launch i touches bytes of a buffer that launch j
touched and one of them writes: `raw` (i reads what j writes), `war` (i writes what j reads), `waw` (both
write). The edge's `kinds` holds every kind that applies. The ranges are each argument's byte extent
(`Arg.extent`), so views and in-place updates need no special case.

Two questions are asked of it:
* `unwritten_reads`: an arena read no earlier launch writes (the arena holds nothing between calls);
* `overlap_violations` (on the whole graph or on `consecutive_graph`): a launch that may start while the one before it still runs (programmatic dependent
  launch, `codegen/kernels/pdl.py`) must wait for it (`pdl_enter`) if it depends on it at all. It need not
  look further back: the launch before it completed only after its own wait, that is after every earlier
  launch completed.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from .core import Arg, FunctionProgram


def _touches(launch) -> list[tuple[Arg, bool]]:
    return [(a, False) for _, a in launch.operands if a is not None] + [(a, True) for _, a in launch.results]


def launch_graph(f: FunctionProgram) -> nx.DiGraph:
    """Every edge, through a per-buffer index of earlier touches (the edge kinds: `_kind`)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(f.launches)))
    writes: dict[str, list[tuple[int, int, int]]] = {}  # buffer -> (first byte, end, launch) of each write
    reads: dict[str, list[tuple[int, int, int]]] = {}
    for i, launch in enumerate(f.launches):
        touched = _touches(launch)
        for a, writing in touched:
            lo, hi = a.extent
            earlier = [(w, _kind(True, writing)) for w in writes.get(a.buffer, ())]
            if writing:
                earlier += [(r, _kind(False, True)) for r in reads.get(a.buffer, ())]
            for (plo, phi, j), kind in earlier:
                if j != i and plo < hi and lo < phi:
                    if not g.has_edge(j, i):
                        g.add_edge(j, i, kinds=set())
                    g.edges[j, i]["kinds"].add(kind)
        for a, writing in touched:
            (writes if writing else reads).setdefault(a.buffer, []).append((*a.extent, i))
    return g


def _kinds_between(before, after) -> set[str]:
    """launch_graph's edge kinds from a launch's touches (`before`) to a later one's (`after`)."""
    kinds = set()
    for a, a_writes in before:
        for b, b_writes in after:
            if a.buffer == b.buffer and a.extent[0] < b.extent[1] and b.extent[0] < a.extent[1] and (a_writes or b_writes):
                kinds.add(_kind(a_writes, b_writes))
    return kinds


def _kind(earlier_writes: bool, later_writes: bool) -> str:
    """The edge kind between two touches of overlapping bytes, at least one a write."""
    return "waw" if earlier_writes and later_writes else "raw" if earlier_writes else "war"


def consecutive_graph(f: FunctionProgram) -> nx.DiGraph:
    """launch_graph's edges between consecutive launches only (i - 1 -> i): all that `overlap_violations`
    asks, in one pass over neighbouring pairs instead of the whole graph's walk (a V4-Pro function's graph
    has ~80k edges and takes a second; this is what the AOT stage checks each program against)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(f.launches)))
    touched = [_touches(launch) for launch in f.launches]
    for i in range(1, len(touched)):
        kinds = _kinds_between(touched[i - 1], touched[i])
        if kinds:
            g.add_edge(i - 1, i, kinds=kinds)
    return g


def unwritten_reads(f: FunctionProgram, g: nx.DiGraph) -> list[tuple[int, str]]:
    """(launch, value) of each arena operand whose bytes no earlier launch writes."""
    out = []
    for i, launch in enumerate(f.launches):
        for _, a in launch.operands:
            if a is None or a.buffer != "arena":
                continue
            lo, hi = a.extent
            if not any("raw" in g.edges[j, i]["kinds"] and _writes_into(f.launches[j], lo, hi)
                       for j in g.predecessors(i)):
                out.append((i, a.value))
    return out


def _writes_into(launch, lo: int, hi: int) -> bool:
    return any(a.buffer == "arena" and a.extent[0] < hi and lo < a.extent[1] for _, a in launch.results)


def overlap_violations(f: FunctionProgram, g: nx.DiGraph, overlapped: Callable[[int], bool],
                       waits: Callable[[int], bool]) -> list[str]:
    """Each launch that may overlap the one before it (`overlapped`), does not wait for it (`waits`), and
    depends on it: what it would race on."""
    out = []
    for i in range(1, len(f.launches)):
        if overlapped(i) and not waits(i) and g.has_edge(i - 1, i):
            kinds = ", ".join(sorted(g.edges[i - 1, i]["kinds"]))
            out.append(f"launch #{i} ({f.launches[i].op}) overlaps launch #{i - 1} ({f.launches[i - 1].op}) "
                       f"without waiting for it, but depends on it ({kinds})")
    return out


def to_dot(f: FunctionProgram, g: nx.DiGraph | None = None) -> str:
    """The launch dependency graph in Graphviz dot: launches as boxes (index, op, kernel family, provenance),
    edges labelled with their kinds (raw solid; war / waw only, dashed). Transitive edges are kept: the
    graph is what the checks ask, not a minimal drawing (`tred` from Graphviz thins it)."""
    g = launch_graph(f) if g is None else g
    lines = [f'digraph "{f.name}" {{', "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];']
    for i, l in enumerate(f.launches):
        kernel, loc = l.kernel or "", l.loc or ""
        lines.append(f'  l{i} [label="#{i} {l.op}\\n{kernel}\\n{loc}"];')
    for j, i, kinds in sorted(g.edges(data="kinds")):
        style = "" if "raw" in kinds else ", style=dashed"
        lines.append(f'  l{j} -> l{i} [label="{",".join(sorted(kinds))}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"
