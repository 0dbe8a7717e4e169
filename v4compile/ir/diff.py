"""Op-level difference of two modules (not a line diff).

Ops are matched by their first result's name (passes keep result names of the values they preserve);
a matched op whose name, operands, attributes or types changed is reported as changed. Weights, function
inputs and outputs are compared by name, and a per-op-kind count summary closes the report. The output
is deterministic: weights, inputs, outputs, functions and module attributes in sorted order (ops in
program order), one line per changed module attribute.
"""

from __future__ import annotations

from collections import Counter

from .core import Function, Module, Op
from .text import fmt_attr, fmt_op


def _op_key(op: Op) -> tuple:
    return (op.name, tuple(v.ref if v is not None else None for v in op.operands),
            tuple(r.type for r in op.results), tuple(sorted(op.attrs.items())), op.loc)


def diff_functions(a: Function, b: Function) -> list[str]:
    out: list[str] = diff_attrs(a.attrs, b.attrs, "func attribute")
    ai = {v.name: v.type for v in a.inputs}
    bi = {v.name: v.type for v in b.inputs}
    for n in sorted(ai.keys() - bi.keys()):
        out.append(f"- input %{n} : {ai[n]}")
    for n in sorted(bi.keys() - ai.keys()):
        out.append(f"+ input %{n} : {bi[n]}")
    for n in sorted(ai.keys() & bi.keys()):
        if ai[n] != bi[n]:
            out.append(f"~ input %{n} : {ai[n]} -> {bi[n]}")
    amap = {op.results[0].name: op for op in a.ops}
    bmap = {op.results[0].name: op for op in b.ops}
    for op in a.ops:
        if op.results[0].name not in bmap:
            out.append(f"- {fmt_op(op)}")
    for op in b.ops:
        old = amap.get(op.results[0].name)
        if old is None:
            out.append(f"+ {fmt_op(op)}")
        elif _op_key(old) != _op_key(op):
            out.append(f"~ {fmt_op(old)}\n    -> {fmt_op(op)}")
    ao, bo = dict((n, v.ref) for n, v in a.outputs), dict((n, v.ref) for n, v in b.outputs)
    for n in sorted(ao.keys() | bo.keys()):
        if ao.get(n) != bo.get(n):
            out.append(f"~ return {n} = {ao.get(n, '(none)')} -> {bo.get(n, '(none)')}")
    ca, cb = Counter(op.name for op in a.ops), Counter(op.name for op in b.ops)
    counts = [f"{k} {ca[k]} -> {cb[k]}" for k in sorted(ca.keys() | cb.keys()) if ca[k] != cb[k]]
    if counts:
        out.append(f"  ops: {len(a.ops)} -> {len(b.ops)} ({', '.join(counts)})")
    return out


def diff_attrs(a: dict, b: dict, what: str = "module attribute") -> list[str]:
    """One line per added, removed or changed key, sorted by key."""
    out = []
    for k in sorted(a.keys() | b.keys()):
        if k not in b:
            out.append(f"- {what} {k} = {fmt_attr(a[k])}")
        elif k not in a:
            out.append(f"+ {what} {k} = {fmt_attr(b[k])}")
        elif a[k] != b[k]:
            out.append(f"~ {what} {k} = {fmt_attr(a[k])} -> {fmt_attr(b[k])}")
    return out


def diff_modules(a: Module, b: Module) -> str:
    lines: list[str] = []
    if a.name != b.name:
        lines.append(f"~ module @{a.name} -> @{b.name}")
    lines += diff_attrs(a.attrs, b.attrs)
    for n in sorted(a.weights.keys() - b.weights.keys()):
        lines.append(f"- weight @{n} : {a.weights[n].type}")
    for n in sorted(b.weights.keys() - a.weights.keys()):
        w = b.weights[n]
        lines.append(f"+ weight @{n} : {w.type} from {', '.join(w.sources)}")
    for n in sorted(a.weights.keys() & b.weights.keys()):
        wa, wb = a.weights[n], b.weights[n]
        if (wa.type, wa.sources) != (wb.type, wb.sources):
            lines.append(f"~ weight @{n} : {wa.type} -> {wb.type}")
    for name in sorted(a.functions.keys() | b.functions.keys()):
        if name not in b.functions:
            lines.append(f"- func @{name}")
        elif name not in a.functions:
            lines.append(f"+ func @{name}")
        else:
            body = diff_functions(a.functions[name], b.functions[name])
            if body:
                lines.append(f"func @{name}:")
                lines += ["  " + ln for ln in body]
    return "\n".join(lines) + ("\n" if lines else "")
