"""Memory plan: give every intermediate value an offset in one arena, by liveness.

Requires: a verified module (typically the last pass).
Guarantees: every op carries an `_arena` annotation, one byte offset per result: an offset into the
function's arena, or -1 for values that live elsewhere: function outputs and the pool / state buffers
their updates write in place (`pool_write_window`, `compress_paged`, `qkv_norm_rope`'s planes, and the
unlowered cache ops). Views (`reshape`, `split`) alias their operand (`split` parts at their column offset
within it, so strided) and extend its lifetime. Offsets are found greedily, largest value first, at the
lowest aligned address free during its lifetime; two values whose lifetimes overlap never overlap in
memory. Function attributes `arena_bytes` / `arena_naive_bytes` (the sum of all intermediates) and module
attribute `arena_bytes` (the largest function's: functions run one at a time) record the result.
Option: `align` (bytes, default 256). Hits: `<func>.values`, `<func>.arena_bytes`, `<func>.naive_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.errors import PassError
from v4compile.ir.core import Function

from .base import Pass, PassResult, register
from .rewrite import new_module

VIEWS = {"reshape", "split"}
# result index -> operand index it updates in place
IN_PLACE = {"pool_write_window": {0: 3, 1: 4, 2: 5}, "compress_paged": {0: 4, 1: 5, 2: 9, 3: 10, 4: 11},
            "window_write": {0: 0}, "compress": {0: 6, 1: 4, 2: 5}}


def in_place_results(op) -> dict[int, int]:
    if op.name == "qkv_norm_rope":
        first = 3 if op.operands[4] is not None else 2
        return {first + k: 6 + k for k in range(len(op.results) - first)}
    return IN_PLACE.get(op.name, {})


def plan_function(fn: Function, align: int) -> tuple[Function, dict[str, int]]:
    root: dict[int, int] = {}  # view value -> the value whose buffer it uses
    persistent = {id(v) for _, v in fn.outputs}
    for op in fn.ops:
        for r_i, o_i in in_place_results(op).items():
            if r_i < len(op.results):
                persistent.add(id(op.results[r_i]))
        if op.name in VIEWS:
            base = op.operands[0]
            for r in op.results:
                root[id(r)] = root.get(id(base), id(base))
    # A view of a persistent value is persistent; a value viewed by an output must persist too.
    for v_id, base in list(root.items()):
        if v_id in persistent:
            persistent.add(base)
    size: dict[int, int] = {}
    born: dict[int, int] = {}
    dies: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        for r in op.results:
            if op.name not in VIEWS:
                size[id(r)] = r.type.nbytes
                born[id(r)] = i
                dies[id(r)] = i
        for v in op.operands:
            if v is not None:
                b = root.get(id(v), id(v))
                if b in dies:
                    dies[b] = max(dies[b], i)
    arena = [v for v in size if v not in persistent]
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
    ops = []
    for op in fn.ops:
        offs = []
        for k, r in enumerate(op.results):
            base = root.get(id(r), id(r))
            o = offset.get(base, -1)
            if o >= 0 and op.name == "split" and k == 1:
                o += op.results[0].type.shape[-1] * (r.type.nbytes // max(r.type.numel, 1))
            offs.append(o)
        ops.append(op.replace(attrs={**op.attrs, "_arena": tuple(offs)}))
    attrs = {**fn.attrs, "arena_bytes": total, "arena_naive_bytes": naive}
    return Function(fn.name, list(fn.inputs), ops, list(fn.outputs), attrs), \
        {"values": len(arena), "arena_bytes": total, "naive_bytes": naive}


@register
@dataclass(frozen=True)
class PlanMemory(Pass):
    name = "plan_memory"
    align: int = 256

    def run(self, module):
        if not (isinstance(self.align, int) and 0 < self.align <= 1 << 16 and self.align & (self.align - 1) == 0):
            raise PassError("plan_memory: align must be a power of two in [1, 65536] bytes", found=self.align)
        funcs, hits = {}, {}
        for name, fn in module.functions.items():
            funcs[name], h = plan_function(fn, self.align)
            hits.update({f"{name}.{k}": v for k, v in h.items()})
        arena = max((f.attrs["arena_bytes"] for f in funcs.values()), default=0)
        naive = max((f.attrs["arena_naive_bytes"] for f in funcs.values()), default=0)
        return PassResult(new_module(module, funcs, attrs={**module.attrs, "arena_bytes": arena,
                                                           "arena_naive_bytes": naive}), hits)
