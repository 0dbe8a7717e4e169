"""Target-bound flags of the kernels: programmatic dependent launch (`PDL`) and calls to noinline functions
(`CALLS`): which kernels declare them and which targets turn them on.

They live outside any @triton.jit module (the kernel half of PDL is pdl.py): importing such a module for
these would fix Triton's compile-or-interpret choice before the host device makes it (runtime/kernels.py
refuses a process that imported kernel modules; this one is in `kernels.SUPPORT`).
"""

from __future__ import annotations

from typing import Any

PDL_PARAM = "PDL"


def declares_pdl(fn: Any) -> bool:
    """Whether a kernel (a @triton.jit function) takes the PDL flag, that is waits in `pdl_enter`."""
    return PDL_PARAM in getattr(fn, "arg_names", ())


def uses_pdl(fn: Any, target: str) -> bool:
    """Whether the kernel's launches on `target` carry the programmatic-serialization attribute."""
    from ...targets import TARGETS
    return TARGETS[target].pdl and declares_pdl(fn)


# Calls to noinline functions, a target-bound flag like PDL. A kernel that calls a
# `@triton.jit(noinline=True)` function where it pays (sm_90a: the callee's registers are allocated apart, so
# its arrays do not make the caller's MMA tiles spill) takes a `CALLS: tl.constexpr` and branches on it to an
# inlined copy of the same function. KernelCall binds it to True (the interpreter runs the call); the AOT
# stage sets it from the target (`uses_calls`). On gfx950 a real call is refused: LLVM's AMDGPU backend cannot
# prove the callee needs no implicit kernel arguments, so the kernel grows the hidden-argument block
# (hidden_block_count_x ... hidden_dynamic_lds_size) behind the parameters the KernelCall describes; the
# launch's parameter array holds the explicit pointers only, so the binary's parameters and the call's no
# longer agree (the fake HIP driver, sizing the parameters from the kernarg segment, refuses the launch);
# `aot` checks every hsaco for hidden arguments.
CALLS_PARAM = "CALLS"


def declares_calls(fn: Any) -> bool:
    """Whether a kernel (a @triton.jit function) takes the CALLS flag."""
    return CALLS_PARAM in getattr(fn, "arg_names", ())


def uses_calls(target: str) -> bool:
    """Whether kernels on `target` call their noinline functions (else they run the inlined copies)."""
    from ...targets import TARGETS
    return TARGETS[target].backend == "cuda"
