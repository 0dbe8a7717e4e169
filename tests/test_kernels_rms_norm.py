"""rms_norm family under the interpreter vs the op reference (weighted and unweighted, strided rows).
Tolerance: kernel_check.assert_matches (fp32 sum order of mean(x^2) only)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(dtype, weighted):
    g = torch.Generator().manual_seed(0)
    xb = (2 * torch.randn(2, 3, 4, 100, generator=g)).to(dtype)
    x = xb[..., :72]  # [B, T, H, d] with a row stride larger than d
    w = (1 + 0.1 * torch.randn(72, generator=g)).to(dtype) if weighted else None
    y, buf = kc.poisoned((2, 3, 4, 72), dtype, pad=3)
    kernels.launch("rms_norm", {"x": x, "weight": w}, {"eps": 1e-6}, {"y": y})
    assert buf[..., 72:].float().isnan().all()
    kc.assert_matches(y, kc.reference("rms_norm", {"x": x, "weight": w}, {"eps": 1e-6})[0], "rms_norm")


def test_wrong_eps_is_caught():
    g = torch.Generator().manual_seed(1)
    x = 0.01 * torch.randn(5, 64, generator=g)
    y, _ = kc.poisoned((5, 64), torch.float32)
    kernels.launch("rms_norm", {"x": x, "weight": None}, {"eps": 1e-3}, {"y": y})
    with pytest.raises(AssertionError):
        kc.assert_matches(y, kc.reference("rms_norm", {"x": x, "weight": None}, {"eps": 1e-6})[0], "rms_norm")
