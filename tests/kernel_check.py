"""Shared helpers of the kernel tests: poisoned outputs, the reference, and the closeness check.

Tolerance rule (`assert_matches`): the interpreter runs with `interpreter_fixes()` (correct bf16 dot,
round-to-nearest-even casts), so a kernel and its torch reference differ only by fp32 summation order.
fp32 results: |d| <= 1e-5 * max|ref| + 1e-6 * |ref| (a few fp32 ulps of the accumulated magnitude).
bf16 results: |d| <= 1 bf16 ulp of |ref| + 1e-5 * max|ref| (a sum that lands near a rounding boundary
may round the other way; the fp32 part covers cancellation near zero).
The reference must be finite: a NaN or inf in it would make the tolerance NaN / inf and every compare pass.

`install_broken_kernel` swaps a kernel for a copy with one source edit: the deliberately faulty variant a
test uses to show that its check catches a kernel fault.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from v4compile.ir.registry import get_op  # noqa: E402


def poisoned(shape, dtype, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled (or -7-filled for ints) result buffer with `pad` extra columns; returns (view, buffer).
    The view has the row stride of the buffer, so kernels must honour strides and masks."""
    shape = tuple(shape)
    buf_shape = (*shape[:-1], shape[-1] + pad)
    if dtype.is_floating_point:
        buf = torch.full(buf_shape, float("nan"), dtype=torch.float32).to(dtype)
    else:
        buf = torch.full(buf_shape, -7, dtype=dtype)
    return buf[..., : shape[-1]], buf


def reference(op_name: str, args: dict, attrs: dict) -> list[torch.Tensor]:
    op = get_op(op_name)
    operands = [args.get(o.name) for o in op.operands]
    a = {k: v for k, v in attrs.items() if k in op.attrs}
    if hasattr(op, "with_variant"):  # ops whose optional operands select a variant name it
        a = op.with_variant(operands, a)
    return op.run(operands, op.normalize_attrs(a))


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(v.float().abs().clamp(min=2.0 ** -126)))
    return torch.exp2(e - 7)


def assert_matches(y: torch.Tensor, ref: torch.Tensor, what: str, ulps: float = 1.0) -> None:
    assert y.shape == ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(ref.shape)}"
    assert y.dtype == ref.dtype, f"{what}: dtype {y.dtype} != {ref.dtype}"
    yf, rf = y.float(), ref.float()
    if not rf.isfinite().all():
        raise AssertionError(f"{what}: the reference is not finite at {tuple((~rf.isfinite()).nonzero()[0].tolist())}")
    assert not yf.isnan().any(), f"{what}: NaN in the result (unwritten lanes?)"
    scale = rf.abs().max().clamp(min=1e-30)
    if y.dtype == torch.bfloat16:
        tol = ulps * bf16_ulp(rf) + 1e-5 * scale
    else:
        tol = 1e-5 * scale + 1e-6 * rf.abs()
    d = (yf - rf).abs()
    bad = d > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{d.numel()} elements off, max |d| {d.max().item():.3g} "
                           f"(max |ref| {scale.item():.3g}) first at {tuple(bad.nonzero()[0].tolist())}")


def install_broken_kernel(monkeypatch, tmp_path: Path, module, name: str, old: str, new: str) -> None:
    """Replace the @triton.jit kernel `module.name` (for this test) by its source with `old` -> `new`.
    The variant runs in the module's namespace; its source is written under tmp_path so the interpreter
    can read it back. `old` must occur exactly once, so a stale fault is an error, not a silent no-op."""
    src = inspect.getsource(getattr(module, name).fn)
    assert src.count(old) == 1, f"{module.__name__}.{name}: {old!r} occurs {src.count(old)} times"
    path = tmp_path / f"broken_{name}.py"
    path.write_text(src.replace(old, new))
    namespace = dict(vars(module))
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    monkeypatch.setattr(module, name, namespace[name])


@contextlib.contextmanager
def counted_loads(monkeypatch, tensors: dict[str, torch.Tensor]):
    """Within the block, count for every element of `tensors` how many times an interpreted kernel loads it
    (masked-off lanes not counted). Yields name -> flat int64 counts, filled as kernels run."""
    from triton.runtime import interpreter as it

    counts = {n: np.zeros(t.numel(), dtype=np.int64) for n, t in tensors.items()}
    spans = {n: (t.data_ptr(), t.element_size(), t.numel()) for n, t in tensors.items()}
    orig = it.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, other, cache_policy, is_volatile):
        addr = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)
        for n, (base, size, numel) in spans.items():
            hit = addr[(addr >= base) & (addr < base + size * numel)]
            np.add.at(counts[n], (hit - base) // size, 1)
        return orig(self, ptrs, mask, other, cache_policy, is_volatile)

    with monkeypatch.context() as m:
        m.setattr(it.InterpreterBuilder, "create_masked_load", counting_load)
        yield counts


def small_gemm_calls():
    """One small FP8 GEMM specialisation (the AOT and cache tests compile it for real: seconds, not minutes)."""
    from v4compile.codegen.kernels import TensorArg, gemm
    from v4compile.formats import fp8_block_quant

    x = TensorArg.of(torch.zeros(1, 8, 256, dtype=torch.bfloat16))
    y = TensorArg.of(torch.zeros(1, 8, 128, dtype=torch.bfloat16))
    w, s = fp8_block_quant(torch.randn(128, 256), 128)
    return gemm.specialise("linear", {"x": x, "w": TensorArg.of(w), "scale": TensorArg.of(s)}, {"y": y},
                           {"block": 128, "act": "fp8"})
