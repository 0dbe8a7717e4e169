"""embed family under the interpreter vs the op reference: padding ids (-1 read row 0), a non-power-of-two
width, bf16 and fp32 tables; exact (a copy)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import embed


def check_embed(dtype, idtype):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 1100, generator=g).to(dtype)
    ids = torch.randint(0, 50, (3, 4), generator=g).to(idtype)
    ids[1, 3] = -1
    y, _ = kc.poisoned((3, 4, 1100), dtype)
    kernels.launch("embed", {"ids": ids, "table": table}, {}, {"x": y})
    ref = kc.reference("embed", {"ids": ids, "table": table}, {})[0]
    assert torch.equal(y, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
def test_embed(dtype, idtype):
    check_embed(dtype, idtype)


# Kernel faults: the id off by one, and ids clamped to row 1 instead of 0 (padding ids read the wrong row).
@pytest.mark.parametrize("old,new", [("ids[:, None] * T_RS", "(ids[:, None] + 1) * T_RS"),
                                     (".to(tl.int64), 0)", ".to(tl.int64), 1)")],
                         ids=["id+1", "clamp-to-1"])
def test_wrong_row_is_caught(monkeypatch, tmp_path, old, new):
    kc.install_broken_kernel(monkeypatch, tmp_path, embed, "embed_kernel", old, new)
    with pytest.raises(AssertionError):
        check_embed(torch.float32, torch.int64)
