"""last_token family under the interpreter vs the op reference: ragged valid lanes, a sequence with none
(lane 0), strided x; exact (a copy)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import last_token


def check_last_token(dtype):
    g = torch.Generator().manual_seed(0)
    xb = torch.randn(4, 5, 90, generator=g).to(dtype)
    x = xb[..., 3:80]
    pos = torch.tensor([[7, 8, 9, -1, -1], [0, 1, 2, 3, 4], [-1] * 5, [4, -1, -1, -1, -1]], dtype=torch.int64)
    y, _ = kc.poisoned((4, 77), dtype)
    kernels.launch("last_token", {"x": x, "pos": pos}, {}, {"y": y})
    ref = kc.reference("last_token", {"x": x, "pos": pos}, {})[0]
    assert torch.equal(y, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_token(dtype):
    check_last_token(dtype)


# Kernel faults: the lane count off by one (reads the first padding lane), and a kernel that reads lane 0.
@pytest.mark.parametrize("old,new", [("idx = tl.maximum(n - 1, 0)", "idx = tl.minimum(n, T - 1)"),
                                     ("idx = tl.maximum(n - 1, 0)", "idx = 0")], ids=["n", "lane0"])
def test_wrong_lane_is_caught(monkeypatch, tmp_path, old, new):
    kc.install_broken_kernel(monkeypatch, tmp_path, last_token, "last_token_kernel", old, new)
    with pytest.raises(AssertionError):
        check_last_token(torch.float32)
