"""elementwise family (add with broadcasting, swiglu) under the interpreter vs the op references.
Tolerance: kernel_check.assert_matches (one fp32 op per element: results are bit-identical in practice;
bf16 swiglu rounds silu then the product, exactly as torch does)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_broadcast_and_strided(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 37, generator=g).to(dtype)
    bb = torch.randn(3, 50, generator=g).to(dtype)
    b = bb[:, 5:42]  # broadcast over the first axis, strided rows
    y, buf = kc.poisoned((2, 3, 37), dtype, pad=4)
    kernels.launch("add", {"a": a, "b": b}, {}, {"y": y})
    assert buf[..., 37:].float().isnan().all()
    kc.assert_matches(y, kc.reference("add", {"a": a, "b": b}, {})[0], "add")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_split_halves(dtype):
    g = torch.Generator().manual_seed(1)
    gu = (3 * torch.randn(2, 5, 2 * 45, generator=g)).to(dtype)  # merged GEMM output, split in halves
    gate, up = gu[..., :45], gu[..., 45:]
    y, _ = kc.poisoned((2, 5, 45), dtype)
    kernels.launch("swiglu", {"gate": gate, "up": up}, {"limit": 2.0}, {"y": y})
    kc.assert_matches(y, kc.reference("swiglu", {"gate": gate, "up": up}, {"limit": 2.0})[0], "swiglu")


def test_wrong_limit_is_caught():
    g = torch.Generator().manual_seed(2)
    gate, up = (3 * torch.randn(4, 33, generator=g)), (3 * torch.randn(4, 33, generator=g))
    y, _ = kc.poisoned((4, 33), torch.float32)
    kernels.launch("swiglu", {"gate": gate, "up": up}, {"limit": 7.0}, {"y": y})
    with pytest.raises(AssertionError):
        kc.assert_matches(y, kc.reference("swiglu", {"gate": gate, "up": up}, {"limit": 1.0})[0], "swiglu")
