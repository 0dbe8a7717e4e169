"""Where each value of a function lives: its storage root and its layout (byte offset, element strides).

A value shares its storage with another when the op registry says so: a `view` result (reshape, split)
with its operand, a `tied` result (an in-place update) with the operand it updates. Following those
links to the end gives the value's storage root: an op result that owns memory, a function input, or a
weight. The memory plan gives arena roots their offsets; every other value's layout follows from its
root's by the registry's view rules, through any depth of views.
"""

from __future__ import annotations

from ..errors import IRError
from ..ir.core import Function, Op, Value
from ..ir.registry import Layout, get_op


def view_source(op: Op) -> Value:
    """The operand a view op views (the first one given)."""
    return next(v for v in op.operands if v is not None)


def storage_roots(fn: Function) -> dict[int, Value]:
    """id(value) -> the value that owns its storage (itself for owners)."""
    root: dict[int, Value] = {}
    for v in fn.inputs:
        root[id(v)] = v
    for op in fn.ops:
        opdef = get_op(op.name)
        for name, r in op.named_results():
            if opdef.view is not None:
                src = view_source(op)
            elif name in opdef.tied:
                src = op.operand(opdef.tied[name])
            else:
                root[id(r)] = r
                continue
            root[id(r)] = root.get(id(src), src)
    return root


def layouts(fn: Function, root_offset: dict[int, int]) -> dict[int, Layout]:
    """id(value) -> its layout within its root's buffer. Roots are contiguous, at `root_offset` (arena
    roots) or 0 (inputs, weights, outputs); views follow the registry's view rules; tied results take
    their operand's layout."""
    out: dict[int, Layout] = {}

    def of(v: Value) -> Layout:
        if id(v) not in out:  # a weight, or an input seen first here
            out[id(v)] = Layout.contiguous(v.type.shape, root_offset.get(id(v), 0))
        return out[id(v)]

    for v in fn.inputs:
        of(v)
    for op in fn.ops:
        opdef = get_op(op.name)
        named = op.named_results()
        if opdef.view is not None:
            src = view_source(op)
            try:
                views = opdef.view(of(src), src.type, [r.type for r in op.results], op.attrs)
            except IRError as e:
                raise IRError(e.what, where=f"@{fn.name} %{op.results[0].name} = {op.name}", expected=e.expected,
                              found=e.found) from None
            for r, lay in zip(op.results, views):
                out[id(r)] = lay
            continue
        for name, r in named:
            if name in opdef.tied:
                out[id(r)] = of(op.operand(opdef.tied[name]))
            else:
                out[id(r)] = Layout.contiguous(r.type.shape, root_offset.get(id(r), 0))
    return out
