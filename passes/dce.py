"""Dead-code elimination.

Requires: a verified module. Every op is pure (caches are explicit inputs and outputs), so an op none of
whose results is used by a later op or a function output can go.
Guarantees: the same outputs, computed by a subset of the ops; weights no function uses are dropped.
Hits: `<func>.ops_removed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.ir.core import Function

from .base import Pass, PassResult, register
from .rewrite import map_functions, prune_weights


def dce_function(fn: Function) -> tuple[Function, dict[str, int]]:
    live = {id(v) for _, v in fn.outputs}
    kept = []
    for op in reversed(fn.ops):
        if any(id(r) in live for r in op.results):
            kept.append(op)
            live.update(id(v) for v in op.operands if v is not None)
    kept.reverse()
    return Function(fn.name, list(fn.inputs), kept, list(fn.outputs), dict(fn.attrs)), \
        {"ops_removed": len(fn.ops) - len(kept)}


@register
@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    name = "dce"

    def run(self, module):
        m, hits = map_functions(module, dce_function)
        return PassResult(prune_weights(m), hits)
