"""The kernels of a program: each launch's Triton kernel calls, specialised from its arguments' exact
types and strides (`v4compile.program`), deduplicated by specialisation, and compiled ahead of time.

A launch's calls come from its op's kernel family (`v4compile.codegen.kernels.<family>.specialise`); the
base alignment of each argument follows from its byte offset in a 256-byte aligned buffer.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from dataclasses import dataclass, field

from ..program.core import Arg, Program
from .kernels import KernelCall, TensorArg, full_attrs

log = logging.getLogger(__name__)


def tensor_arg(a: Arg) -> TensorArg:
    off = a.offset
    align = 16 if off % 16 == 0 else (off & -off)
    return TensorArg(a.type, tuple(a.strides), align)


def available_family(name: str | None) -> bool:
    if name is None:
        return False
    try:
        importlib.import_module(f"{__package__}.kernels.{name}")
    except ModuleNotFoundError:
        return False
    return True


@dataclass
class ProgramKernels:
    """Per function, per launch index: its kernel calls; `unique` holds each specialisation once;
    `missing` counts launches whose family has no kernels yet (by family)."""
    calls: dict[str, list[list[KernelCall]]] = field(default_factory=dict)
    unique: dict[str, KernelCall] = field(default_factory=dict)
    missing: Counter = field(default_factory=Counter)

    @property
    def complete(self) -> bool:
        return not self.missing


def program_kernels(prog: Program) -> ProgramKernels:
    from .kernels import family

    out = ProgramKernels()
    have: dict[str, bool] = {}
    for fname, f in prog.functions.items():
        per = []
        for l in f.launches:
            if not have.setdefault(l.kernel, available_family(l.kernel)):
                out.missing[l.kernel] += 1
                per.append([])
                continue
            operands = {n: (tensor_arg(a) if a is not None else None) for n, a in l.operands}
            results = {n: tensor_arg(a) for n, a in l.results}
            calls = family(l.op).specialise(l.op, operands, results, full_attrs(l.op, l.attrs))
            per.append(calls)
            for c in calls:
                out.unique.setdefault(c.name, c)
        out.calls[fname] = per
    if out.missing:
        log.warning("no kernels yet for %s", ", ".join(f"{k} ({v} launches)" for k, v in sorted(out.missing.items())))
    return out
