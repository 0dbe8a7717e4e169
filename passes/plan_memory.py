"""Memory plan: give every intermediate value an offset in one arena, by liveness.

Requires: a verified module (typically the last pass before `lower_to_program`).
Guarantees: every op carries two annotations: `_arena`, one byte offset per result (the value's first
element in the function's arena, views and tied results included; -1 for values that live elsewhere:
function inputs such as the pool and state planes, weights, and function outputs), and `_strides`, the
element strides of every result, concatenated in result order. Storage sharing comes from the op
registry's traits only (`view` results alias their operand at the offset and strides the view rule
gives, through any depth of views; `tied` results are their operand). Storage roots are placed greedily,
largest first, at the lowest aligned address free during their lifetime (from their definition to the
last use of any value sharing them); two roots whose lifetimes overlap never overlap in memory.
Function attributes `arena_bytes` / `arena_naive_bytes` (the sum of all roots) and module attribute
`arena_bytes` (the largest function's: functions run one at a time) record the result.
Option: `align` (bytes, default 256). Hits: `<func>.values`, `<func>.arena_bytes`, `<func>.naive_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.errors import PassError
from v4compile.ir.core import Function
from v4compile.program.layout import layouts, storage_roots

from .base import Pass, PassResult, register
from .rewrite import new_module


def plan_function(fn: Function, align: int) -> tuple[Function, dict[str, int]]:
    root = storage_roots(fn)
    inputs = {id(v) for v in fn.inputs}
    # A root that backs a function output lives in the output's own buffer.
    elsewhere = {id(root.get(id(v), v)) for _, v in fn.outputs}
    born: dict[int, int] = {}
    dies: dict[int, int] = {}
    size: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        for v in op.operands:
            if v is not None:
                r = root.get(id(v), v)
                if id(r) in dies:
                    dies[id(r)] = max(dies[id(r)], i)
        for r in op.results:
            if root[id(r)] is r and id(r) not in inputs:
                size[id(r)] = r.type.nbytes
                born[id(r)] = dies[id(r)] = i
            else:  # a write through an alias keeps the root alive
                b = id(root[id(r)])
                if b in dies:
                    dies[b] = max(dies[b], i)
    arena = [v for v in size if v not in elsewhere]
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, born, dies)
    offset: dict[int, int] = {}
    for v in sorted(arena, key=lambda v: (-size[v], born[v])):
        n = -(-size[v] // align) * align
        clash = sorted((o, e) for o, e, b, d in placed if not (d < born[v] or dies[v] < b))
        at = 0
        for o, e in clash:
            if at + n <= o:
                break
            at = max(at, -(-e // align) * align)
        offset[v] = at
        placed.append((at, at + n, born[v], dies[v]))
    total = max((e for _, e, _, _ in placed), default=0)
    naive = sum(size[v] for v in arena)
    lay = layouts(fn, offset)
    ops = []
    for op in fn.ops:
        offs, strides = [], []
        for r in op.results:
            offs.append(lay[id(r)].offset if id(root[id(r)]) in offset else -1)
            strides.extend(lay[id(r)].strides)
        ops.append(op.replace(attrs={**op.attrs, "_arena": tuple(offs), "_strides": tuple(strides)}))
    attrs = {**fn.attrs, "arena_bytes": total, "arena_naive_bytes": naive}
    return Function(fn.name, list(fn.inputs), ops, list(fn.outputs), attrs), \
        {"values": len(arena), "arena_bytes": total, "naive_bytes": naive}


@register
@dataclass(frozen=True)
class PlanMemory(Pass):
    name = "plan_memory"
    after = {"spec_steps": "it plans the composed speculative steps too"}
    final = True  # it plans the final op list
    align: int = 256

    def run(self, module):
        if self.align <= 0 or self.align & (self.align - 1):
            raise PassError("plan_memory{align} must be a positive power of two", found=self.align)
        funcs, hits = {}, {}
        for name, fn in module.functions.items():
            funcs[name], h = plan_function(fn, self.align)
            hits.update({f"{name}.{k}": v for k, v in h.items()})
        arena = max((f.attrs["arena_bytes"] for f in funcs.values()), default=0)
        naive = max((f.attrs["arena_naive_bytes"] for f in funcs.values()), default=0)
        return PassResult(new_module(module, funcs, attrs={**module.attrs, "arena_bytes": arena,
                                                           "arena_naive_bytes": naive, "arena_align": self.align}), hits)
