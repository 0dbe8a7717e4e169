"""Calls to noinline functions: a target-bound flag, like PDL (pdl.py).

A kernel that calls a `@triton.jit(noinline=True)` function where it pays (sm_90a: the callee's registers are
allocated apart, so its arrays do not make the caller's MMA tiles spill) takes a `CALLS: tl.constexpr` and
branches on it to an inlined copy of the same function. KernelCall binds it to True (the interpreter runs
the call); the AOT stage sets it from the target (`uses_calls`).

On gfx950 a real call is refused: LLVM's AMDGPU backend cannot prove the callee needs no implicit kernel
arguments, so the kernel grows the hidden-argument block (hidden_block_count_x ... hidden_dynamic_lds_size:
the kernarg segment 376 B for the 15 explicit pointers' 120) behind the parameters the KernelCall describes,
and the call itself goes through the full calling convention. The launch's parameter array holds the
explicit pointers only, so the binary's parameters and the call's no longer agree (the fake HIP driver,
sizing the parameters from the kernarg segment as the binary declares it, reads past the array and refuses
the launch: hipErrorIllegalAddress); `aot.compile_job` checks every hsaco for hidden arguments.
"""

from __future__ import annotations

from typing import Any

from ...targets import TARGETS

PARAM = "CALLS"


def declares_calls(fn: Any) -> bool:
    """Whether a kernel (a @triton.jit function) takes the CALLS flag."""
    return PARAM in getattr(fn, "arg_names", ())


def uses_calls(target: str) -> bool:
    """Whether kernels on `target` call their noinline functions (else they run the inlined copies)."""
    return TARGETS[target].backend == "cuda"
