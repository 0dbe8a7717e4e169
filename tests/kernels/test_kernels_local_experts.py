"""local_experts family under the interpreter vs the op reference: seeded routing of every rank's owner
table (experts split over 4 ranks), strided routing weights, fp32 and bf16; exact (a select and a gather).
Each fault (another rank's slot keeps its weight; the local index not gathered) is caught."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.codegen.kernels import local_experts
from v4compile.ops.collective import owner_table

E, PARTS, K = 16, 4, 6


def check_local_experts(dtype):
    g = torch.Generator().manual_seed(0)
    wide = torch.rand(3, 5, K + 2, generator=g).to(dtype)
    w = wide[..., 1:K + 1]  # strided rows
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(15)]).reshape(3, 5, K)
    for part in range(PARTS):
        owner = owner_table(E, PARTS, part)
        wo, _ = kc.poisoned((3, 5, K), dtype)
        io = torch.full((3, 5, K), -7, dtype=torch.int64)
        kernels.launch("local_experts", {"weights": w, "indices": idx, "owner": owner}, {},
                       {"weights_out": wo, "indices_out": io})
        rw, ri = kc.reference("local_experts", {"weights": w, "indices": idx, "owner": owner}, {})
        assert torch.equal(wo, rw) and torch.equal(io, ri), part
        assert 0 < int((rw != 0).sum()) < rw.numel()  # the case has both kinds of slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_experts(dtype):
    check_local_experts(dtype)


@pytest.mark.parametrize("old,new", [("tl.where(mine, w, tl.zeros_like(w))", "w"),
                                     ("tl.maximum(local, 0)", "tl.maximum(e, 0)")], ids=["weight", "index"])
def test_a_wrong_mask_is_caught(monkeypatch, tmp_path, old, new):
    kc.install_broken_kernel(monkeypatch, tmp_path, local_experts, "local_experts_kernel", old, new)
    with pytest.raises(AssertionError):
        check_local_experts(torch.float32)
