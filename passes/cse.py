"""Common-subexpression elimination.

Requires: a verified module (ops are pure).
Guarantees: of several ops with the same name, the same operands (by identity) and the same attributes
(the semantic tags `layer` / `role` aside, like `loc`: they say where an op came from, not what it computes),
only the first remains; uses of the others' results are redirected to it. Outputs are unchanged.
Hits: `<func>.ops_merged`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.semantics import without_tags

from .base import function_pass
from .rewrite import substitute


def cse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    seen: dict[tuple, object] = {}
    mapping: dict[int, object] = {}
    kept = []
    for op in fn.ops:
        operands = tuple(mapping.get(id(v), v) if v is not None else None for v in op.operands)
        key = (op.name, tuple(id(v) if v is not None else None for v in operands),
               tuple(sorted(without_tags(op.attrs).items())))
        if key in seen:
            for old, new in zip(op.results, seen[key].results):
                mapping[id(old)] = new
            continue
        op = op.replace(operands=operands) if operands != op.operands else op
        seen[key] = op
        kept.append(op)
    new = substitute(Function(fn.name, list(fn.inputs), kept, list(fn.outputs), dict(fn.attrs)), mapping)
    return new, {"ops_merged": len(fn.ops) - len(kept)}


CommonSubexpressionElimination = function_pass("cse", cse_function)
