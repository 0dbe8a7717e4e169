"""last_token family under the interpreter vs the op reference: ragged valid lanes, a sequence with none
(lane 0), strided x; exact (a copy)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_token(dtype):
    g = torch.Generator().manual_seed(0)
    xb = torch.randn(4, 5, 90, generator=g).to(dtype)
    x = xb[..., 3:80]
    pos = torch.tensor([[7, 8, 9, -1, -1], [0, 1, 2, 3, 4], [-1] * 5, [4, -1, -1, -1, -1]], dtype=torch.int64)
    y, _ = kc.poisoned((4, 77), dtype)
    kernels.launch("last_token", {"x": x, "pos": pos}, {}, {"y": y})
    ref = kc.reference("last_token", {"x": x, "pos": pos}, {})[0]
    assert torch.equal(y, ref)


def test_wrong_lane_is_caught():
    x = torch.randn(1, 3, 8)
    pos = torch.tensor([[0, 1, -1]])
    y, _ = kc.poisoned((1, 8), torch.float32)
    kernels.launch("last_token", {"x": x, "pos": torch.tensor([[0, 1, 2]])}, {}, {"y": y})
    assert not torch.equal(y, kc.reference("last_token", {"x": x, "pos": pos}, {})[0])
