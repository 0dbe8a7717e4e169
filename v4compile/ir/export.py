"""Other views of the IR: Graphviz dot (one function) and JSON (a whole module)."""

from __future__ import annotations

import json

from .core import WEIGHT, Function, Module
from .text import fmt_attr


def to_dot(fn: Function) -> str:
    """Ops are boxes (name, provenance, result types); inputs and outputs are ovals. The edges between ops
    are the dataflow graph's (`ir/graph.py`): a value from its producer to its user (solid), and a read of
    storage an op later updates in place, from the reader to the update (dashed, "war"). Weights are left
    out to keep the graph readable."""
    from .graph import dataflow

    lines = [f'digraph "{fn.name}" {{', "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    node_of: dict[int, str] = {}
    for v in fn.inputs:
        node_of[id(v)] = f"in_{len(node_of)}"
        lines.append(f'  {node_of[id(v)]} [shape=oval, label="%{v.name}\\n{v.type}"];')
    for i, op in enumerate(fn.ops):
        types = ", ".join(str(r.type) for r in op.results)
        lines.append(f'  op{i} [shape=box, label="{op.name}\\n{op.loc}\\n{types}"];')
        for v in op.operands:  # from the function's inputs; edges between ops come from the graph below
            if v is not None and v.kind != WEIGHT and node_of.get(id(v), "").startswith("in_"):
                lines.append(f"  {node_of[id(v)]} -> op{i};")
        for r in op.results:
            node_of[id(r)] = f"op{i}"
    for j, i, kind in sorted(dataflow(fn).edges(data="kind")):
        lines.append(f"  op{j} -> op{i};" if kind == "data" else f'  op{j} -> op{i} [style=dashed, label="{kind}"];')
    for k, (name, v) in enumerate(fn.outputs):
        lines.append(f'  out_{k} [shape=oval, label="{name}"];')
        if id(v) in node_of:
            lines.append(f"  {node_of[id(v)]} -> out_{k};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_json(m: Module, functions: list[str] | None = None) -> str:
    def fn_json(fn: Function) -> dict:
        return {
            "name": fn.name, "attrs": fn.attrs,
            "inputs": [{"name": v.name, "type": str(v.type)} for v in fn.inputs],
            "ops": [{"op": op.name, "results": [{"name": r.name, "type": str(r.type)} for r in op.results],
                     "operands": [v.ref if v is not None else None for v in op.operands],
                     "attrs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in op.attrs.items()},
                     "loc": op.loc} for op in fn.ops],
            "outputs": {n: v.ref for n, v in fn.outputs},
        }

    return json.dumps({
        "module": m.name, "attrs": m.attrs,
        "weights": [{"name": w.name, "type": str(w.type), "sources": list(w.sources)} for w in m.weights.values()],
        "functions": [fn_json(f) for n, f in m.functions.items() if functions is None or n in functions],
    }, indent=1, default=fmt_attr) + "\n"
