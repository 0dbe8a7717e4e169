"""embed family under the interpreter vs the op reference: padding ids (-1 read row 0), a non-power-of-two
width, bf16 and fp32 tables; exact (a copy)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
def test_embed(dtype, idtype):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 1100, generator=g).to(dtype)
    ids = torch.randint(0, 50, (3, 4), generator=g).to(idtype)
    ids[1, 3] = -1
    y, _ = kc.poisoned((3, 4, 1100), dtype)
    kernels.launch("embed", {"ids": ids, "table": table}, {}, {"x": y})
    ref = kc.reference("embed", {"ids": ids, "table": table}, {})[0]
    assert torch.equal(y, ref)


def test_wrong_row_is_caught():
    g = torch.Generator().manual_seed(1)
    table = torch.randn(20, 16, generator=g)
    ids = torch.tensor([[3, 4]])
    y, _ = kc.poisoned((1, 2, 16), torch.float32)
    kernels.launch("embed", {"ids": ids + 1, "table": table}, {}, {"x": y})
    assert not torch.equal(y, kc.reference("embed", {"ids": ids, "table": table}, {})[0])
