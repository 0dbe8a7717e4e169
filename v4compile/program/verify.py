"""The program verifier.

* buffers: unique names, a known kind, a size that matches their type, a power-of-two alignment;
* every launch names a registered op whose operand / result names it gives in order, and a kernel
  family (for a target: one that codegen provides for it);
* every argument lies inside its buffer, aligned to its element size, with non-negative strides, and
  has the type its value has everywhere else in the function;
* an arena value is read only after a launch has written it (the arena holds nothing between calls);
* a tied result is in its operand's place (in-place update), and the updated value is not read after;
* no two arena values whose lifetimes overlap share a byte unless they share a storage root (a view or
  an in-place update of one another);
* outputs: every state / pool output is its input buffer (updated in place, never copied).
"""

from __future__ import annotations

from ..errors import IRError
from ..ir.registry import get_op
from ..ir.types import BYTES
from .core import BUFFER_KINDS, Arg, FunctionProgram, Program


def _check_arg(f: FunctionProgram, where: str, a: Arg, buffers: dict, types: dict) -> None:
    b = buffers.get(a.buffer)
    if b is None:
        raise IRError(f"argument uses undeclared buffer %{a.buffer}", where=where)
    if len(a.strides) != a.type.rank or any(s < 0 for s in a.strides):
        raise IRError(f"%{a.value}: strides must be {a.type.rank} non-negative integers", where=where,
                      found=a.strides)
    size = BYTES[a.type.dtype]
    if a.offset % size:
        raise IRError(f"%{a.value}: offset is not aligned to its element size", where=where,
                      expected=f"a multiple of {size}", found=a.offset)
    lo, hi = a.extent
    if lo < 0 or hi > b.nbytes:
        raise IRError(f"%{a.value} lies outside buffer %{b.name}", where=where,
                      expected=f"bytes within [0, {b.nbytes})", found=f"[{lo}, {hi})")
    prev = types.setdefault(a.value, (a.type, a.buffer, a.offset, a.strides))
    if prev != (a.type, a.buffer, a.offset, a.strides):
        raise IRError(f"%{a.value} is placed or typed differently in two launches", where=where,
                      expected=prev, found=(a.type, a.buffer, a.offset, a.strides))


def verify_function(f: FunctionProgram, target: str | None = None, families: set[str] | None = None) -> None:
    fw = f"program @{f.name}"
    buffers = {}
    for b in f.buffers:
        if b.name in buffers:
            raise IRError(f"buffer %{b.name} declared twice", where=fw)
        if b.kind not in BUFFER_KINDS:
            raise IRError(f"buffer %{b.name} has unknown kind {b.kind!r}", where=fw)
        if b.type is not None and b.type.nbytes != b.nbytes:
            raise IRError(f"buffer %{b.name}: size does not match its type", where=fw)
        if b.align <= 0 or b.align & (b.align - 1):
            raise IRError(f"buffer %{b.name}: alignment must be a power of two", where=fw, found=b.align)
        buffers[b.name] = b
    types: dict = {}
    first: dict[str, int] = {}  # storage root -> first launch writing it
    last: dict[str, int] = {}  # storage root -> last launch touching it
    arena_args: dict[str, list[Arg]] = {}
    dead: dict[str, int] = {}  # value overwritten in place -> the launch that did it
    for i, l in enumerate(f.launches):
        where = f"{fw} launch #{i} ({l.op}{', ' + l.loc if l.loc else ''})"
        opdef = get_op(l.op, where=where)
        if tuple(n for n, _ in l.operands) != opdef.operand_names:
            raise IRError("operands must be named as in the op's signature", where=where,
                          expected=opdef.operand_names, found=tuple(n for n, _ in l.operands))
        for n, _ in l.results:
            opdef.result_index(n)
        if not opdef.launch:
            raise IRError(f"op '{l.op}' is a view and launches nothing", where=where)
        if l.kernel is None or l.kernel != opdef.kernel:
            raise IRError("launch has no kernel family" if l.kernel is None else "kernel family differs from the op's",
                          where=where, expected=opdef.kernel, found=l.kernel)
        if families is not None and l.kernel not in families:
            raise IRError(f"no kernel family '{l.kernel}' for target {target}", where=where)
        operands = dict(l.operands)
        for n, a in l.operands:
            if a is None:
                if not opdef.operands[opdef.operand_index(n)].optional:
                    raise IRError(f"missing operand '{n}'", where=where)
                continue
            if a.value in dead:
                raise IRError(f"%{a.value} is read after launch #{dead[a.value]} updated it in place", where=where)
            _check_arg(f, where, a, buffers, types)
            if a.buffer == "arena" and a.root not in first:  # the arena holds nothing between calls
                raise IRError(f"%{a.value} is read before any launch writes it", where=where)
            last[a.root] = i
            if a.buffer == "arena":
                arena_args.setdefault(a.root, []).append(a)
        for n, a in l.results:
            _check_arg(f, where, a, buffers, types)
            if n in opdef.tied:
                src = operands.get(opdef.tied[n])
                if src is None or (src.buffer, src.offset, src.strides, src.type) != (a.buffer, a.offset, a.strides, a.type):
                    raise IRError(f"tied result '{n}' is not in place of operand '{opdef.tied[n]}'", where=where)
                dead[src.value] = i
            first.setdefault(a.root, i)
            last[a.root] = i
            if a.buffer == "arena":
                arena_args.setdefault(a.root, []).append(a)
    end = len(f.launches)
    for n, a in f.outputs:
        _check_arg(f, f"{fw} output '{n}'", a, buffers, types)
        last[a.root] = end
        b = buffers[a.buffer]
        if n in buffers and buffers[n].kind in ("pool", "state") and a.buffer != n:
            raise IRError(f"output '{n}' is not its input buffer updated in place", where=fw, found=f"%{a.buffer}")
        if b.kind == "arena":
            raise IRError(f"output '{n}' lives in the arena, which the next call reuses", where=fw)
    # Arena overlap: pairwise over storage roots whose lifetimes overlap.
    spans = []
    for root, args in arena_args.items():
        lo = min(a.extent[0] for a in args)
        hi = max(a.extent[1] for a in args)
        spans.append((first.get(root, 0), last.get(root, end), lo, hi, root))
    spans.sort(key=lambda s: s[2])
    for j, (b0, d0, lo0, hi0, r0) in enumerate(spans):
        for b1, d1, lo1, hi1, r1 in spans[j + 1:]:
            if lo1 >= hi0:
                break
            if not (d0 < b1 or d1 < b0):
                raise IRError(f"arena values %{r0} and %{r1} overlap while both are live", where=fw,
                              found=f"bytes [{lo0}, {hi0}) and [{lo1}, {hi1}), launches {b0}-{d0} and {b1}-{d1}")


def verify_program(p: Program, target: str | None = None, families: set[str] | None = None) -> Program:
    shared: dict[str, tuple] = {}
    for f in p.functions.values():
        verify_function(f, target, families)
        for b in f.buffers:
            if b.kind not in ("pool", "state", "weight"):  # step inputs / outputs are per function
                continue
            prev = shared.setdefault(b.name, (b.kind, b.nbytes, b.type))
            if prev != (b.kind, b.nbytes, b.type):
                raise IRError(f"buffer %{b.name} differs between functions", expected=prev,
                              found=(b.kind, b.nbytes, b.type))
    return p
