"""The verifier: a module is well formed.

* every operand is defined before use (a function input, a module weight, or an earlier result);
* SSA names are unique; output names are unique and refer to defined values;
* every op is registered, its required operands are present, its attributes are valid, and its
  result types are exactly what its shape rule infers from the operand types (which also checks the
  operands against the op's signature).

Cheap enough to run after every pass. A module parsed from text carries the line:column of its
functions and ops (`source_positions`); errors then start with it.
"""

from __future__ import annotations

from ..errors import IRError
from .core import INPUT, WEIGHT, Function, Module
from .registry import get_op


def _line(m: Module, obj: object) -> str:
    pos = getattr(m, "source_positions", {}).get(id(obj))
    return f"line {pos[0]}:{pos[1]}: " if pos else ""


def verify_function(fn: Function, m: Module) -> None:
    where = f"{_line(m, fn)}@{fn.name}"
    defined: dict[str, object] = {}
    for v in fn.inputs:
        if v.kind != INPUT:
            raise IRError(f"input %{v.name} is not marked as an input", where=where)
        if v.name in defined:
            raise IRError(f"input %{v.name} defined twice", where=where)
        defined[v.name] = v
    for i, op in enumerate(fn.ops):
        at = f"{_line(m, op) or _line(m, fn)}@{fn.name} op #{i} ({op.name}{', ' + op.loc if op.loc else ''})"
        opdef = get_op(op.name, where=at)
        if len(op.operands) != len(opdef.operands):
            raise IRError(f"op takes {len(opdef.operands)} operands", where=at, found=len(op.operands))
        for spec, v in zip(opdef.operands, op.operands):
            if v is None:
                if not spec.optional:
                    raise IRError(f"missing operand '{spec.name}'", where=at)
                continue
            if v.kind == WEIGHT:
                if m.weights.get(v.name) is not v:
                    raise IRError(f"operand '{spec.name}' uses undeclared weight @{v.name}", where=at)
            elif defined.get(v.name) is not v:
                raise IRError(f"operand '{spec.name}' uses %{v.name} before its definition", where=at)
        attrs = opdef.normalize_attrs(dict(op.attrs), where=at)
        if attrs != op.attrs:
            raise IRError("attributes are not normalised (missing defaults)", where=at)
        try:
            want = opdef.result_types([v.type if v is not None else None for v in op.operands], op.attrs)
        except IRError as e:
            raise IRError(e.what, where=at, expected=e.expected, found=e.found) from None
        got = [r.type for r in op.results]
        if want != got:
            raise IRError("result types do not match the op's shape rule", where=at,
                          expected=", ".join(map(str, want)), found=", ".join(map(str, got)))
        for name, r in op.named_results():
            if name in opdef.tied and op.operand(opdef.tied[name]).type != r.type:
                raise IRError(f"result '{name}' updates operand '{opdef.tied[name]}' in place, so it must have its type",
                              where=at, expected=str(op.operand(opdef.tied[name]).type), found=str(r.type))
        if opdef.variants:
            try:
                opdef.check_variant(op.operands, op.attrs)
            except IRError as e:
                raise IRError(e.what, where=at, expected=e.expected, found=e.found) from None
        for r in op.results:
            if r.name in defined:
                raise IRError(f"%{r.name} defined twice", where=at)
            defined[r.name] = r
    names = set()
    for n, v in fn.outputs:
        if n in names:
            raise IRError(f"output '{n}' returned twice", where=where)
        names.add(n)
        if v.kind == WEIGHT:
            if m.weights.get(v.name) is not v:
                raise IRError(f"output '{n}' is an undeclared weight", where=where)
        elif defined.get(v.name) is not v:
            raise IRError(f"output '{n}' uses undefined %{v.name}", where=where)


def verify(m: Module) -> Module:
    for w in m.weights.values():
        if w.kind != WEIGHT:
            raise IRError(f"weight @{w.name} is not marked as a weight")
    for fn in m.functions.values():
        verify_function(fn, m)
    return m
