"""The verifier: a module is well formed.

* every operand is defined before use (a function input, a module weight, or an earlier result);
* SSA names are unique; output names are unique and refer to defined values;
* every op is registered, its required operands are present, its attributes are valid, and its
  result types are exactly what its shape rule infers from the operand types (which also checks the
  operands against the op's signature: their ranks, dims and dtypes);
* every type is bounded (rank <= MAX_RANK, elements <= MAX_NUMEL), every attribute is in range: floats
  finite, integers non-negative and bounded, sizes and divisors (`SIZE_ATTRS`) at least 1; a shape rule
  that fails in any way on what it is given is reported as an `IRError` naming the op;
* the op order is a topological order of the function's dataflow graph (`ir/graph.py`): also every reader
  of a value an op updates in place runs before that op.

Cheap enough to run after every pass. A module parsed from text carries the line:column of its
functions and ops (`source_positions`); errors then start with it.
"""

from __future__ import annotations

import math

from ..errors import IRError
from .core import INPUT, WEIGHT, Function, Module, Value
from .graph import order_violations
from .registry import get_op, semantic

MAX_RANK = 8
MAX_NUMEL = 1 << 48
MAX_ATTR_INT = 1 << 53
# Attribute names that are sizes or divisors wherever they occur: a block, group, ratio, top-k count,
# element count or iteration count of 0 is never meaningful.
SIZE_ATTRS = frozenset({"block", "shared_block", "kv_round_block", "group", "groups", "ratio", "k", "n", "iters",
                        "block_tokens"})


def check_type(v: Value, where: str) -> None:
    t = v.type
    if t.rank > MAX_RANK or math.prod(t.shape) > MAX_NUMEL:
        raise IRError(f"type of {'@' if v.kind == WEIGHT else '%'}{v.name} is too large", where=where,
                      expected=f"rank <= {MAX_RANK}, <= {MAX_NUMEL} elements", found=str(t))


def check_attrs(attrs: dict, where: str) -> None:
    for k, v in semantic(attrs).items():
        items = v if isinstance(v, tuple) else (v,)
        for x in items:
            if isinstance(x, bool) or isinstance(x, str):
                continue
            if isinstance(x, float) and not math.isfinite(x):
                raise IRError(f"attribute '{k}' must be finite", where=where, found=repr(v))
            if isinstance(x, int) and not -MAX_ATTR_INT <= x <= MAX_ATTR_INT:
                raise IRError(f"attribute '{k}' is out of range", where=where, expected=f"|value| <= 2^53", found=x)
        if isinstance(v, int) and not isinstance(v, bool):
            lo = 1 if k in SIZE_ATTRS else 0
            if v < lo:
                raise IRError(f"attribute '{k}' must be >= {lo}", where=where, found=v)


def _line(m: Module, obj: object) -> str:
    pos = getattr(m, "source_positions", {}).get(id(obj))
    return f"line {pos[0]}:{pos[1]}: " if pos else ""


def verify_function(fn: Function, m: Module) -> None:
    where = f"{_line(m, fn)}@{fn.name}"
    defined: dict[str, object] = {}
    for v in fn.inputs:
        check_type(v, where)
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
        check_attrs(op.attrs, at)
        for r in op.results:
            check_type(r, at)
        types = [v.type if v is not None else None for v in op.operands]
        try:
            want = opdef.result_types(types, op.attrs)
        except IRError as e:
            raise IRError(e.what, where=at, expected=e.expected, found=e.found) from None
        except Exception as e:  # noqa: BLE001 - a shape rule given ranks or sizes it does not handle
            raise IRError("operand types or attributes are outside what the op accepts", where=at,
                          expected=opdef.sig, found=", ".join("none" if t is None else str(t) for t in types)
                          + f" ({type(e).__name__}: {e})") from None
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
    bad = order_violations(fn)
    if bad:
        raise IRError(f"the op order is not a topological order of the dataflow graph: {bad[0]}", where=where,
                      found=f"{len(bad)} backward edge(s)" if len(bad) > 1 else None)


def verify(m: Module) -> Module:
    for w in m.weights.values():
        if w.kind != WEIGHT:
            raise IRError(f"weight @{w.name} is not marked as a weight")
        check_type(w, f"weight @{w.name}")
    for fn in m.functions.values():
        verify_function(fn, m)
    return m
