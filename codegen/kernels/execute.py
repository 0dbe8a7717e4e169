"""Running an op's kernels on torch tensors: the family's calls specialised for the tensors, launched (on a
GPU, or on the CPU under TRITON_INTERPRET=1 with `interpreter.interpreter_fixes()` applied first)."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from ...errors import CodegenError
from ...ir.registry import get_op
from . import interpreter
from .call import KernelCall, TensorArg
from .dtypes import torch_dtype, typed_from

def run_calls(calls: list[KernelCall], args: dict[str, torch.Tensor | None], outs: dict[str, torch.Tensor]) -> None:
    """Launch prepared calls on tensors (scratch buffers allocated per name, shared by the calls, poisoned;
    semaphores zeroed, and checked to be left zero, as the runtime's shared `semaphores` buffer needs)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter.interpreter_fixes()
    device = next(t.device for t in list(args.values()) + list(outs.values()) if t is not None)
    scratch: dict[str, torch.Tensor] = {}
    for call in calls:
        values = []
        for param, kind, name, ty in call.pointers:
            if kind in ("scratch", "semaphore"):
                if name not in scratch:
                    # scratch starts as NaN bytes, so a read of what no program wrote shows in the result
                    scratch[name] = torch.full((max(call.scratch_bytes[name], 16),), 0 if kind == "semaphore" else 0xFF,
                                               dtype=torch.uint8, device=device)
                t = scratch[name]
            elif kind == "table":  # the call's pointer table: its entries' addresses (null: an unbound one)
                t = torch.tensor([0 if v is None else v.data_ptr() for v in ((outs if k == "result" else args).get(n)
                                                                           for _, k, n, _ in call.tabled)],
                                 dtype=torch.int64, device=device)
            else:
                t = (outs if kind == "result" else args).get(name)  # "peers": the caller's peer table
                if t is None:  # an optional operand the launch lacks: a null pointer (None: Triton's compile-time one)
                    values.append(None)
                    continue
            want = torch_dtype(ty[1:])
            off = call.offsets.get(param, 0)
            if off:
                values.append(typed_from(t.view(torch.uint8).reshape(-1)[off:], ty))
            else:
                values.append(t if t.dtype == want else t.view(want))
        call.fn[call.grid](*call.bind(values), num_warps=call.num_warps, num_stages=call.num_stages)
        for param, kind, name, _ in call.pointers:
            if kind == "semaphore" and bool(scratch[name].any()):
                raise CodegenError(f"semaphore '{name}' left non-zero by {call.kernel_name}", where=call.name)


def family(op_name: str):
    """The kernel family module of an op."""
    op = get_op(op_name)
    if op.kernel is None:
        raise KeyError(f"op '{op_name}' names no kernel family")
    return importlib.import_module(f"{__package__}.{op.kernel}")


def full_attrs(op_name: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """The op's attributes with declared defaults filled in (private `_` attributes dropped)."""
    op = get_op(op_name)
    out = {k: s.default for k, s in op.attrs.items() if not s.required}
    out.update({k: v for k, v in attrs.items() if not k.startswith("_")})
    return out


def specialise_tensors(op_name: str, args: dict[str, torch.Tensor | None], attrs: dict[str, Any],
               outs: dict[str, torch.Tensor]) -> list[KernelCall]:
    """The family's `specialise` on the TensorArgs of real tensors (types, strides, base alignment)."""
    operands = {k: (None if v is None else TensorArg.of(v)) for k, v in args.items()}
    results = {k: TensorArg.of(v) for k, v in outs.items()}
    return family(op_name).specialise(op_name, operands, results, full_attrs(op_name, attrs))


def launch(op_name: str, args: dict[str, torch.Tensor | None], attrs: dict[str, Any],
           outs: dict[str, torch.Tensor]) -> list[KernelCall]:
    """Run an op's kernels on real tensors. `outs` are preallocated (possibly strided) results; a tied result
    must be the operand tensor itself. Returns the calls it ran."""
    op = get_op(op_name)
    for r, o in op.tied.items():
        if r in outs and args.get(o) is not None and outs[r].data_ptr() != args[o].data_ptr():
            raise ValueError(f"{op_name}: tied result '{r}' must be operand '{o}' itself")
    calls = specialise_tensors(op_name, args, attrs, outs)
    run_calls(calls, args, outs)
    return calls
