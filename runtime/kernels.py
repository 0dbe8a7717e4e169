"""Where a launch's kernel calls come from: the hook between the program and the Triton kernel families.

A family `v4compile.codegen.kernels.<family>` that exposes `specialise(op, operands, results, attrs) ->
[KernelCall]` (`v4compile.codegen.kernels`) gives the real kernels of each launch of that family: the
schedule then launches its calls (pointer parameters only) and the host driver's callback runs each
Triton kernel on the host buffers (under TRITON_INTERPRET=1). A family without `specialise` keeps the
placeholder call (the op's reference in the callback).

`kernels` knob (recorded by the caller): "reference" (always the placeholder), "auto" (a family's kernels
where `specialise` exists).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from v4compile.codegen.program_kernels import calls_of, family_specialise

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "reference")


def make_kernel_calls(resolve: Callable[[str], Callable | None] = family_specialise) -> Callable:
    """launch -> [KernelCall] from its family's `specialise`, or None (placeholder): `calls_of`, the path the
    AOT stage took to name the artifact's kernels."""
    return lambda l: calls_of(l, resolve)


def kernel_calls_for(mode: str, device: str) -> Callable | None:
    if mode not in KERNEL_MODES:
        from v4compile.errors import InputError
        raise InputError(f"unknown kernels mode '{mode}'", expected=", ".join(KERNEL_MODES))
    if mode == "reference":
        return None
    if device == "host":  # Triton kernels run on the host buffers through the interpreter
        # @triton.jit reads the switch when a kernel module is imported: modules imported for compiling
        # (an AOT compile earlier in this process) would fail at the first launch with Triton's
        # "0 active drivers". Say so once instead. The package's support modules define no kernel.
        from v4compile.codegen.kernels import SUPPORT

        loaded = sorted(m for m in sys.modules if m.startswith("v4compile.codegen.kernels.")
                        and m.rpartition(".")[2] not in SUPPORT)
        if loaded and os.environ.get("TRITON_INTERPRET") != "1":
            from v4compile.errors import DeviceError
            raise DeviceError("the host device runs the kernels under Triton's interpreter, but this process "
                              "imported them for compiling", found=loaded[0],
                              expected="the host device loaded in a fresh process (or TRITON_INTERPRET=1 set "
                                       "before v4compile is imported)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return make_kernel_calls()


