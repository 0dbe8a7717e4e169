"""The kernels of a program: each launch's Triton kernel calls, specialised from its arguments' exact
types and strides (`v4compile.program`), deduplicated by specialisation, and compiled ahead of time.

A launch's calls come from its op's kernel family (`v4compile.codegen.kernels.<family>.specialise`)
through `calls_of`, the one path from a launch to its kernel calls: the AOT stage, the report and the
runtime (`runtime/kernels.py`) all take it, so compile time and load time agree on every kernel name. The
base alignment of each argument follows from its byte offset in a 256-byte aligned buffer.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ir.registry import get_op
from ..program.core import Arg, Launch, Program
from . import family_module
from .kernels.call import KernelCall, TensorArg
from .kernels.execute import full_attrs

log = logging.getLogger(__name__)


def tensor_arg(a: Arg) -> TensorArg:
    off = a.offset
    align = 16 if off % 16 == 0 else (off & -off)
    return TensorArg(a.type, tuple(a.strides), align)


@functools.cache
def family_specialise(name: str) -> Callable | None:
    """The family's `specialise`, or None when the family has no Triton kernels."""
    module = family_module("kernels", name)
    return getattr(module, "specialise", None) if module is not None else None


def calls_of(l: Launch, resolve: Callable[[str], Callable | None] = family_specialise) -> list[KernelCall] | None:
    """The launch's kernel calls (None: its family has no kernels). `resolve`: family -> specialise."""
    spec = resolve(l.kernel) if l.kernel else None
    if spec is None:
        return None
    operands = {n: (tensor_arg(a) if a is not None else None) for n, a in l.operands}
    results = {n: tensor_arg(a) for n, a in l.results}
    return spec(l.op, operands, results, full_attrs(l.op, l.attrs))


@dataclass
class ProgramKernels:
    """Per function, per launch index: its kernel calls; `unique` holds each specialisation once;
    `missing` counts launches whose family has no kernels yet (by family). A communicator launch (a
    partitioned program's `all_reduce`, `all_gather_rows`, ...) has no kernel calls: the runtime's communicator
    runs it (NCCL / RCCL on the stream, gloo on the host device), so it is neither a call nor missing; the
    one-shot all-reduce (`all_reduce_oneshot`; the rows ones, `*_rows_oneshot`, alike) is a collective with kernel
    calls of its own, counted as calls (folded
    into its consumer, `ar_*`, or its producer, `*_ar`: that launch's calls; the rows ones into the MoE between
    them, `ag_moe_router_experts_dp_rs` or with the seam before it `mhc_ag_...`: the MoE's)."""
    calls: dict[str, list[list[KernelCall]]] = field(default_factory=dict)
    unique: dict[str, KernelCall] = field(default_factory=dict)
    missing: Counter = field(default_factory=Counter)

    @property
    def complete(self) -> bool:
        return not self.missing


def program_kernels(prog: Program) -> ProgramKernels:
    out = ProgramKernels()
    for fname, f in prog.functions.items():
        per = []
        for l in f.launches:
            if get_op(l.op).communicator:
                per.append([])
                continue
            calls = calls_of(l)
            if calls is None:
                out.missing[l.kernel] += 1
                per.append([])
                continue
            per.append(calls)
            for c in calls:
                out.unique.setdefault(c.name, c)
        out.calls[fname] = per
    if out.missing:
        log.warning("no kernels yet for %s", ", ".join(f"{k} ({v} launches)" for k, v in sorted(out.missing.items())))
    return out
