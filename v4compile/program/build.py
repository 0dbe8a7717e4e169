"""Build the program of a memory-planned module (see `passes/lower_to_program.py`).

Every value gets an `Arg`: arena values at the offsets and strides the memory plan annotated
(`_arena`, `_strides`), inputs / weights / outputs in their own buffers, tied results in their operand's
place. The annotations are taken as given: `verify_program` then checks that they agree with the op
registry's view and tie rules and that no two live values overlap.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import IRError
from ..ir.core import WEIGHT, Function, Module, Value
from ..ir.registry import Layout, get_op, semantic
from .core import Arg, Buffer, FunctionProgram, Launch, Program
from .layout import layouts, storage_roots



def buffer_kind(input_name: str) -> str:
    """The kind of a function input's buffer, from the lowering's input naming (`pool.*`, `state.*`)."""
    if input_name.startswith("pool."):
        return "pool"
    if input_name.startswith("state."):
        return "state"
    return "input"


def build_function(fn: Function, m: Module) -> FunctionProgram:
    if "arena_bytes" not in fn.attrs:
        raise IRError("the program needs a memory-planned function (run plan_memory first)", where=f"@{fn.name}")
    align = int(m.attrs.get("arena_align", 256))
    root = storage_roots(fn)
    out_name = {}
    for n, v in fn.outputs:
        out_name.setdefault(id(root.get(id(v), v)), n)
    buffers: dict[str, Buffer] = {"arena": Buffer("arena", "arena", int(fn.attrs["arena_bytes"]), align)}
    for v in fn.inputs:
        buffers[v.name] = Buffer(v.name, buffer_kind(v.name), v.type.nbytes, align, v.type)
    planned = {}
    for op in fn.ops:
        for r, off in zip(op.results, op.attrs.get("_arena", ())):
            if root.get(id(r)) is r and off >= 0:
                planned[id(r)] = int(off)
    lay = layouts(fn, planned)
    place: dict[int, Arg] = {}

    def root_buffer(r: Value) -> str:
        if r.kind == WEIGHT:
            buffers.setdefault(r.name, Buffer(r.name, "weight", r.type.nbytes, align, r.type))
            return r.name
        if any(r is v for v in fn.inputs):
            return r.name
        if id(r) in out_name:
            name = out_name[id(r)]
            if name in buffers and buffers[name].kind != "output":
                raise IRError(f"output '{name}' is computed into a new value but is also an input: it must be "
                              "updated in place (a tied result)", where=f"@{fn.name}")
            buffers.setdefault(name, Buffer(name, "output", r.type.nbytes, align, r.type))
            return name
        return "arena"

    def arg(v: Value | None) -> Arg | None:
        if v is None:
            return None
        if id(v) not in place:  # a weight or an input
            r = root.get(id(v), v)
            place[id(v)] = Arg(root_buffer(r), 0, v.type, Layout.contiguous(v.type.shape).strides, v.name, r.name)
        return place[id(v)]

    for v in fn.inputs:
        arg(v)
    launches = []
    for op in fn.ops:
        opdef = get_op(op.name)
        offs, flat = op.attrs.get("_arena"), op.attrs.get("_strides")
        if offs is None or flat is None or len(offs) != len(op.results):
            raise IRError("op has no memory-plan annotation (_arena, _strides)", where=f"@{fn.name} {op.name} ({op.loc})")
        operands = tuple((n, arg(v)) for n, v in zip(opdef.operand_names, op.operands))
        k = 0
        results = []
        for (name, r), off in zip(op.named_results(), offs):
            strides = tuple(flat[k:k + r.type.rank])
            k += r.type.rank
            buf = root_buffer(root[id(r)])
            if buf == "arena":
                if off < 0:
                    raise IRError("arena value without an offset", where=f"@{fn.name} %{r.name}")
                want = lay[id(r)]
                if (int(off), strides) != (want.offset, want.strides):
                    raise IRError(f"the memory plan's place for %{r.name} disagrees with the {op.name} rule applied to "
                                  f"its storage root %{root[id(r)].name}", where=f"@{fn.name} ({op.loc})",
                                  expected=f"offset {want.offset} strides {want.strides}",
                                  found=f"offset {off} strides {strides}")
                a = Arg("arena", int(off), r.type, strides, r.name, root[id(r)].name)
            else:
                a = Arg(buf, lay[id(r)].offset, r.type, lay[id(r)].strides, r.name, root[id(r)].name)
            place[id(r)] = a
            results.append((name, a))
        if opdef.launch:
            launches.append(Launch(op.name, opdef.kernel, operands, tuple(results), semantic(op.attrs), op.loc))
    outputs = [(n, place[id(v)] if id(v) in place else arg(v)) for n, v in fn.outputs]
    attrs = {k: v for k, v in fn.attrs.items() if k in ("batch", "tokens", "arena_bytes")}
    return FunctionProgram(fn.name, list(buffers.values()), launches, outputs, attrs)


def program_of(m: Module) -> Program:
    """The module's verified program, built once per module object: `lower_to_program` builds it and the
    report, the GPU targets' codegen and `ir dump --stage program` take it from there. Passes never change
    a module they are given, so a module's program stays its own."""
    prog = m.__dict__.get("_program")
    if prog is None:
        from .verify import verify_program

        prog = m.__dict__["_program"] = verify_program(build_program(m))
    return prog


def carry_program(old: Module, new: Module) -> None:
    """Where `new` is `old` with other module attrs only (the same functions and weights: the pass manager's
    record of the passes run), `new`'s program is `old`'s, if built, with `new`'s attrs: not a second build and
    verification of the same functions (~0.4 s for V4-Pro's GPU targets)."""
    prog = old.__dict__.get("_program")
    if prog is not None and new.functions is old.functions and new.weights is old.weights:
        new.__dict__["_program"] = replace(prog, attrs=_program_attrs(new))


def _program_attrs(m: Module) -> dict:
    return {k: v for k, v in m.attrs.items() if not k.startswith("_")}


def build_program(m: Module) -> Program:
    from .. import ops

    ops.load_all()
    return Program(m.name, {name: build_function(fn, m) for name, fn in m.functions.items()}, _program_attrs(m))
