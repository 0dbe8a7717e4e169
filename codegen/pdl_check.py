"""Programmatic dependent launch checked against the launch dependency graph (`program/graph.py`).

On a target with PDL (`targets.TargetSpec.pdl`) the runtime launches every kernel that declares the flag
with programmatic stream serialization, so its blocks may start while the previous kernel still runs
(`kernels/pdl.py`). That is safe where the kernel waits (`pdl_enter`) before touching memory, or where it
does not depend on the previous kernel at all. The PTX check in `aot.py` proves a wait exists; this one
proves it comes first, per kernel call:

* a call overlaps the call before it when its kernel uses PDL on the target; the first call of a launch
  follows the previous launch's last call, a later call the call before it in the same launch;
* it waits for it when the kernel's first statement (after the docstring) is `pdl_enter(...)`;
* an overlapping call that does not wait must not depend on what it overlaps: for a launch's first call,
  no edge from the previous launch in the dependency graph; a later call of the same launch touches the
  same arguments as its predecessor, so it is taken to depend on it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ..program.core import Program
from ..program.graph import consecutive_graph, overlap_violations
from .kernels.flags import uses_pdl
from .program_kernels import ProgramKernels


@functools.cache
def waits_first(fn: Any) -> bool:
    """Whether the @triton.jit function's first statement is its `pdl_enter` call."""
    py = fn
    while hasattr(py, "fn"):  # a JITFunction (or the interpreter's wrapper) around the Python function
        py = py.fn
    body = ast.parse(textwrap.dedent(inspect.getsource(py))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0] if body else None
    return (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and isinstance(first.value.func, ast.Name) and first.value.func.id == "pdl_enter")


def pdl_violations(prog: Program, pk: ProgramKernels, target: str) -> list[str]:
    """What would race on `target`: each overlapping call that does not wait and depends on what it
    overlaps, named by function, launch and kernel."""
    out = []
    for fname, f in prog.functions.items():
        calls = pk.calls[fname]

        def overlapped(i: int) -> bool:
            return bool(calls[i]) and uses_pdl(calls[i][0].fn, target)

        def waits(i: int) -> bool:
            return waits_first(calls[i][0].fn)

        out += [f"@{fname}: {v}" for v in overlap_violations(f, consecutive_graph(f), overlapped, waits)]
        for i, cs in enumerate(calls):
            for k, c in enumerate(cs[1:], start=1):
                if uses_pdl(c.fn, target) and not waits_first(c.fn):
                    out.append(f"@{fname}: call {k} of launch #{i} ({f.launches[i].op}, {c.name}) overlaps call "
                               f"{k - 1} of the same launch without waiting for it")
    return out
