"""elementwise family (add with broadcasting, swiglu) under the interpreter vs the op references.
Tolerance: kernel_check.assert_matches (one fp32 op per element: results are bit-identical in practice;
bf16 swiglu rounds silu then the product, exactly as torch does). Sizes span three 1024-element blocks, so
the `program_id * BLOCK` offsets and the last block's mask both run."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import elementwise


def check_add(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 437, generator=g).to(dtype)  # 2622 elements: 3 programs, the last one partial
    bb = torch.randn(3, 450, generator=g).to(dtype)
    b = bb[:, 5:442]  # broadcast over the first axis, strided rows
    y, buf = kc.poisoned((2, 3, 437), dtype, pad=4)
    calls = kernels.launch("add", {"a": a, "b": b}, {}, {"y": y})
    assert calls[0].grid[0] == 3
    assert buf[..., 437:].float().isnan().all()
    kc.assert_matches(y, kc.reference("add", {"a": a, "b": b}, {})[0], "add")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_broadcast_and_strided(dtype):
    check_add(dtype)


def test_a_kernel_that_ignores_its_block_is_caught(monkeypatch, tmp_path):
    kc.install_broken_kernel(monkeypatch, tmp_path, elementwise, "binary_kernel",
                             "idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)", "idx = tl.arange(0, BLOCK)")
    with pytest.raises(AssertionError, match="NaN in the result"):
        check_add(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_split_halves(dtype):
    g = torch.Generator().manual_seed(1)
    gu = (3 * torch.randn(2, 5, 2 * 245, generator=g)).to(dtype)  # merged GEMM output, split in halves
    gate, up = gu[..., :245], gu[..., 245:]
    y, _ = kc.poisoned((2, 5, 245), dtype)  # 2450 elements: 3 programs
    kernels.launch("swiglu", {"gate": gate, "up": up}, {"limit": 2.0}, {"y": y})
    kc.assert_matches(y, kc.reference("swiglu", {"gate": gate, "up": up}, {"limit": 2.0})[0], "swiglu")


def test_wrong_limit_is_caught():
    g = torch.Generator().manual_seed(2)
    gate, up = (3 * torch.randn(4, 33, generator=g)), (3 * torch.randn(4, 33, generator=g))
    y, _ = kc.poisoned((4, 33), torch.float32)
    kernels.launch("swiglu", {"gate": gate, "up": up}, {"limit": 7.0}, {"y": y})
    with pytest.raises(AssertionError):
        kc.assert_matches(y, kc.reference("swiglu", {"gate": gate, "up": up}, {"limit": 1.0})[0], "swiglu")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_reference_fails(dtype, bad):
    """kernel_check's tolerance scales with the reference: one NaN / inf in it must fail, not pass all."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 33, generator=g).to(dtype), torch.randn(4, 33, generator=g).to(dtype)
    y, _ = kc.poisoned((4, 33), dtype)
    kernels.launch("add", {"a": a, "b": b}, {}, {"y": y})
    ref = kc.reference("add", {"a": a, "b": b}, {})[0]
    kc.assert_matches(y, ref, "add")
    ref[2, 7] = bad
    with pytest.raises(AssertionError, match="reference is not finite"):
        kc.assert_matches(y, ref, "add")
