"""Triton kernel families: one file per family, one shared launch description (`KernelCall`).

Each family module `v4compile.codegen.kernels.<family>` (the family an op names with `defop(kernel=...)`)
exposes

    specialise(op_name, operands: dict[str, TensorArg | None], results: dict[str, TensorArg], attrs) -> [KernelCall]

Every shape, stride and attribute is a compile-time constant of the call (`constexprs`), so a launch passes
only base pointers; that is what lets the AOT stage compile each call once and the runtime replay it.
An optional operand that is absent is passed as a `None` constexpr (Triton specialises it away).

`launch(op_name, args, attrs, outs)` runs an op through its family on real tensors (CPU under
TRITON_INTERPRET=1, or GPU). Under the interpreter it first applies `interpreter_fixes()` (see there).

The shared pieces are modules of their own (`SUPPORT`), re-exported here so a family writes
`from . import KernelCall, ptr, ...`: `flags` (the target-bound PDL / CALLS flags), `dtypes` (element type
tables), `call` (`KernelCall` with its cost model, `TensorArg`, the helpers that build calls), `execute`
(running calls on torch tensors: `launch`), `interpreter` (Triton interpreter fixes and the host device's
memory guard).
"""

from __future__ import annotations

from ...errors import CodegenError  # what a family's checks raise, as `kernels.CodegenError` before the split
from .call import (KINDS, KernelCall, TensorArg, any_row, call_name, dims4, in_kernel_order, pad4, ptr, row_offsets,
                   rows_of, unaligned)
from .dtypes import BYTES_OF, IR_TRITON, ir_dtype, torch_dtype, typed_from
from .flags import CALLS_PARAM, PDL_PARAM, declares_calls, declares_pdl, uses_calls, uses_pdl

# The names of the modules that import torch, loaded on first use: the AOT worker imports the families to
# compile them and nothing here that runs them (torch would cost it ~1.6 CPU s; tests/kernels/test_aot_schedule.py).
_ON_USE = {**dict.fromkeys(("family", "full_attrs", "launch", "run_calls", "specialise_tensors"), "execute"),
           **dict.fromkeys(("UNFIXED", "IllegalAddress", "interpreter_fixes", "memory_guard"), "interpreter")}


def __getattr__(name: str):
    if name in _ON_USE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_ON_USE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The modules of this package that are no kernel family and define no @triton.jit function: importing them
# leaves Triton's compile-or-interpret choice open (runtime/kernels.py checks for the others).
SUPPORT = ("call", "dtypes", "execute", "flags", "interpreter", "peers")

__all__ = ["BYTES_OF", "CALLS_PARAM", "CodegenError", "IR_TRITON", "KINDS", "PDL_PARAM", "SUPPORT",
           "UNFIXED", "IllegalAddress", "KernelCall", "TensorArg", "any_row", "call_name", "declares_calls",
           "declares_pdl", "dims4", "family", "full_attrs", "in_kernel_order", "interpreter_fixes", "ir_dtype",
           "launch", "memory_guard", "pad4", "ptr", "row_offsets", "rows_of", "run_calls", "specialise_tensors",
           "torch_dtype", "typed_from", "unaligned", "uses_calls", "uses_pdl"]
