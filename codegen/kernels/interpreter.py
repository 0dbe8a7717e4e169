"""Triton's CPU interpreter made to compute what the GPU computes (`interpreter_fixes`), and the memory guard
its patched loads and stores check (`memory_guard`: the host device's illegal-address check). One module:
the guard lives in the patched accesses. No @triton.jit here (`kernels.SUPPORT`); Triton is imported only
when the fixes are applied."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# ---- memory guard (the host device's illegal-address check) --------------------------------------------

class IllegalAddress(RuntimeError):
    """A kernel under the interpreter touched memory outside every live allocation (on a GPU: a fault,
    CUDA_ERROR_ILLEGAL_ADDRESS / hipErrorIllegalAddress)."""


_GUARD: list[Any] = []  # the active allocations: (sorted starts, ends) as numpy arrays, or empty


@contextlib.contextmanager
def memory_guard(allocations: list[tuple[int, int]]):
    """Within the block, every load, store and atomic of an interpreted kernel must lie, whole, inside one of
    `allocations` ([start, end) byte ranges); otherwise `IllegalAddress`. The interpreter itself reads and
    writes raw addresses unchecked, so a wrong pointer or index would read other memory or crash.
    Entering it applies `interpreter_fixes()`: the check lives in their patched loads and stores, and a
    kernel run under the guard (the host device's) must also round as the GPU does."""
    import numpy as np

    interpreter_fixes()
    spans = sorted(allocations)
    _GUARD.append((np.array([a for a, _ in spans], dtype=np.uint64), np.array([b for _, b in spans], dtype=np.uint64)))
    try:
        yield
    finally:
        _GUARD.pop()


def _check_access(what: str, ptrs, mask, nbytes: int) -> None:
    import numpy as np

    starts, ends = _GUARD[-1]
    p = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
    if mask is not None:
        p = p[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)]
    if p.size == 0:
        return
    i = np.searchsorted(starts, p, side="right").astype(np.int64) - 1
    ok = (i >= 0) & (p + np.uint64(nbytes) <= ends[np.maximum(i, 0)])
    if not ok.all():
        bad = int(p[~ok][0])
        raise IllegalAddress(f"illegal address: a {what} of {nbytes} bytes at {bad:#x} lies outside every live "
                             f"allocation ({int((~ok).sum())} of {p.size} lanes)")


# ---- interpreter fixes ---------------------------------------------------------------------------------

_FIXED = False
# (owner, attribute, Triton's own value) of each patched attribute: a test restores them to see what an
# unfixed interpreter computes (`interpreter_fixes` run again then patches them anew)
UNFIXED: list[tuple[Any, str, Any]] = []


def interpreter_fixes() -> None:
    """Make Triton 3.9's CPU interpreter compute what the GPU computes, in this one place.

    1. bf16 `tl.dot`: the interpreter multiplies the raw uint16 storage of bf16 operands (results ~1e10;
       triton-lang/triton#11584). Fix: widen bf16 (and fp16) operands to fp32 before the matmul, which is
       what the MMA units do (exact products, fp32 accumulation).
    2. fp32 -> bf16 / fp8 casts: the interpreter truncates (and its fp8 "rtne" carries a mantissa overflow
       into the wrong bit). The GPU rounds to nearest even. Fix: do float downcasts with torch, which rounds
       to nearest even; fp8 e4m3 values are saturated to +-448 first, like the GPU's satfinite conversion.
    With both, interpreter results match a correctly rounded reference, so tests need no extra slack.
    3. Inside `memory_guard`, loads, stores and atomics are bounds-checked against live allocations.
    Idempotent; only call it under TRITON_INTERPRET=1."""
    global _FIXED
    if _FIXED:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    orig_convert = it._convert_float
    torch_of = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float8e4nv: torch.float8_e4m3fn,
                tl.float8e5: torch.float8_e5m2, tl.float32: torch.float32}
    uint_of = {16: torch.int16, 8: torch.uint8, 32: torch.int32}

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if (input_dtype.primitive_bitwidth > output_dtype.primitive_bitwidth and input_dtype in torch_of
                and output_dtype in torch_of):
            src = torch.from_numpy(np.ascontiguousarray(data)).view(torch_of[input_dtype]).float()
            if output_dtype == tl.float8e4nv:
                src = torch.where(src.isnan(), src, src.clamp(-448.0, 448.0))
            out = src.to(torch_of[output_dtype]).view(uint_of[output_dtype.primitive_bitwidth])
            return out.numpy().view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(data.shape)
        return orig_convert(data, input_dtype, output_dtype, rounding_mode)

    orig_dot = it.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in (tl.bfloat16, tl.float16) and b.dtype.scalar in (tl.bfloat16, tl.float16):
            a = it.TensorHandle(convert_float_up(a), tl.float32)
            b = it.TensorHandle(convert_float_up(b), tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def convert_float_up(h):
        if h.dtype.scalar == tl.float16:
            return h.data.astype(np.float32)
        return orig_convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32)

    builder = it.InterpreterBuilder
    orig_load, orig_store = builder.create_masked_load, builder.create_masked_store
    orig_rmw, orig_cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def width(ptrs) -> int:
        return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)

    def load(self, ptrs, mask, other, *a):
        if _GUARD:
            _check_access("load", ptrs.data, mask.data, width(ptrs))
        return orig_load(self, ptrs, mask, other, *a)

    def store(self, ptrs, value, mask, *a):
        if _GUARD:
            _check_access("store", ptrs.data, mask.data, width(ptrs))
        return orig_store(self, ptrs, value, mask, *a)

    def rmw(self, op, ptr, val, mask, *a):
        if _GUARD:
            _check_access("atomic", ptr.data, mask.data, width(ptr))
        return orig_rmw(self, op, ptr, val, mask, *a)

    def cas(self, ptr, cmp, val, *a):
        if _GUARD:
            _check_access("atomic", ptr.data, None, width(ptr))
        return orig_cas(self, ptr, cmp, val, *a)

    fixed = ((it, "_convert_float", convert_float), (builder, "create_dot", create_dot),
             (builder, "create_masked_load", load), (builder, "create_masked_store", store),
             (builder, "create_atomic_rmw", rmw), (builder, "create_atomic_cas", cas))
    UNFIXED[:] = UNFIXED or [(owner, name, getattr(owner, name)) for owner, name, _ in fixed]
    for owner, name, fn in fixed:
        setattr(owner, name, fn)
    _FIXED = True
    log.debug("applied Triton interpreter fixes (bf16 dot, rounding downcasts)")
