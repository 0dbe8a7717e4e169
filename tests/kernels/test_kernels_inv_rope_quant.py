"""inv_rope_quant family (inv_rope_group_quant) under the interpreter vs the op reference: plain and YaRN
frequencies, padding positions (-1), fp32 / bf16, fmt none / fp8. Tolerances: kernel_check.assert_matches
for the rotated values (cos / sin may differ from torch's by an fp32 ulp before rounding to x's dtype);
for fp8, scales exactly and e4m3 codes within one code step (an input one ulp away can round across)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels


def run(dtype, fmt, yarn, B=2, T=3, H=4, d=96, dim=32, wrong=False):
    g = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(B, T, H, d, generator=g)).to(dtype)
    pos = torch.randint(0, 300, (B, T), generator=g)
    pos[1, 2] = -1
    attrs = {"dim": dim, "theta": 10000.0, "yarn": yarn, "fmt": fmt, "group": 128}
    refs = kc.reference("inv_rope_group_quant", {"x": x, "pos": pos}, attrs)
    y, _ = kc.poisoned((B, T, H, d), dtype if fmt == "none" else torch.float8_e4m3fn)
    outs = {"y": y}
    if fmt == "fp8":
        outs["scale"], _ = kc.poisoned((B, T, H * d // 128), torch.float32)
    kernels.launch("inv_rope_group_quant", {"x": x, "pos": pos if not wrong else pos + 1}, attrs, outs)
    if fmt == "none":
        kc.assert_matches(y, refs[0], f"inv_rope {dtype}")
    else:
        assert torch.equal(outs["scale"], refs[1]), "fp8 group scales differ"
        codes = y.view(torch.uint8).to(torch.int32)
        rcodes = refs[0].view(torch.uint8).to(torch.int32)
        diff = (y.float() - refs[0].float()).abs()
        step = (refs[0].float().abs() * 2 ** -3).clamp(min=2 ** -9)
        assert (diff <= step).all() and (codes != rcodes).float().mean() < 0.02, "fp8 codes differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("yarn", [(), (16.0, 256, 32.0, 1.0)])
def test_inv_rope(dtype, yarn):
    run(dtype, "none", yarn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inv_rope_fp8(dtype):
    run(dtype, "fp8", (16.0, 256, 32.0, 1.0), H=6, d=64)


def test_wrong_positions_are_caught():
    run(torch.float32, "none", ())
    with pytest.raises(AssertionError):
        run(torch.float32, "none", (), wrong=True)
