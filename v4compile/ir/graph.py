"""A function's dataflow graph: the ops as a networkx `DiGraph`, the one place order questions are answered.

Nodes are op indices in `fn.ops`. Edges run from an op to one that must come after it:

* `data`: the producer of an operand -> its user (views are ops too, so a view's reader hangs off the view);
* `war`: every reader of a value an op updates in place (a `tied` result), or of a view of that value,
  -> the updating op. The SSA form says the reader sees the old contents; the buffer holds the new ones
  once the update has run, so the reader must run first (the decode window write and the attention that
  reads the pool before it, say).

`order_violations` is what the verifier checks (the op order is a topological order of the graph, hence
acyclic); `fusion_blockers` is the fusion passes' one legality query (`passes/rewrite.Rewrite.can_fuse`).
"""

from __future__ import annotations

import networkx as nx

from .core import Function
from .registry import get_op


def dataflow(fn: Function) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(len(fn.ops)))
    at: dict[int, int] = {}  # id(value) -> index of the op that defines it
    storage: dict[int, int] = {}  # id(value) -> id of the value it is a view of (itself when it is none)
    for i, op in enumerate(fn.ops):
        base = next((v for v in op.operands if v is not None), None)
        view = get_op(op.name).view is not None and base is not None
        for r in op.results:
            at[id(r)] = i
            storage[id(r)] = storage.get(id(base), id(base)) if view else id(r)
    readers: dict[int, list[int]] = {}  # storage id -> the ops reading it
    for i, op in enumerate(fn.ops):
        for v in op.operands:
            if v is not None:
                if id(v) in at:
                    g.add_edge(at[id(v)], i, kind="data")
                readers.setdefault(storage.get(id(v), id(v)), []).append(i)
    for i, op in enumerate(fn.ops):
        opdef = get_op(op.name)
        for name, _ in op.named_results():
            if name in opdef.tied:
                old = op.operand(opdef.tied[name])
                for j in readers.get(storage.get(id(old), id(old)), ()):
                    if j != i and not g.has_edge(j, i):
                        g.add_edge(j, i, kind="war")
    return g


def order_violations(fn: Function, g: nx.DiGraph | None = None) -> list[str]:
    """Why the op order is not a topological order of the dataflow graph: a cycle, or an edge backwards."""
    g = dataflow(fn) if g is None else g
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        return ["the ops form a cycle: " + " -> ".join(_name(fn, u) for u, _ in cycle) + f" -> {_name(fn, cycle[0][0])}"]
    return [f"{_name(fn, v)} runs before {_name(fn, u)}, which it must follow ("
            + ("it reads its result" if k == "data" else "it updates in place a value that one reads") + ")"
            for u, v, k in g.edges(data="kind") if u >= v]


def fusion_blockers(g: nx.DiGraph, members: list[int], at: int) -> list[int]:
    """The ops outside `members` that forbid fusing them into one op standing at index `at`.

    An outside op must follow a member but stands before `at`, or must precede a member but stands after
    it; in particular any op on a path from one member to another (the fused op would be its own
    ancestor). Only ops between the first and last of members and `at` can be on such a path (the op order
    is topological), so the search stays inside that window."""
    inside = set(members)
    lo, hi = min(inside | {at}), max(inside | {at})
    window = g.subgraph(range(lo, hi + 1))
    after = set().union(*(nx.descendants(window, m) for m in inside)) - inside
    before = set().union(*(nx.ancestors(window, m) for m in inside)) - inside
    return sorted({y for y in after if y < at} | {y for y in before if y > at} | (after & before))


def _name(fn: Function, i: int) -> str:
    op = fn.ops[i]
    return f"op #{i} ({op.name}{', ' + op.loc if op.loc else ''})"
