"""grouped_gemm family (grouped_out_proj) under the interpreter vs the op reference: float / FP8 weights,
fp32 / bf16, and the pre-quantised FP8 input with per-128 scales (o_scale). Tolerance:
kernel_check.assert_matches (fp32 summation order only)."""

from __future__ import annotations

import kernel_check as kc
import pytest
import torch

from v4compile.codegen import kernels
from v4compile.formats import FP8_MAX, fp8_block_quant, pow2_scale


def run(dtype, wfmt, quant_in=False, G=2, H=4, d=64, R=96, B=2, T=3, seed=0, wrong=False):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(B, T, H, d, generator=g)
    K = H * d // G
    w = torch.randn(G * R, K, generator=g) * 0.05
    scale = None
    if wfmt == "fp8":
        w, scale = fp8_block_quant(w, 128)
    else:
        w = w.to(dtype)
    o_scale = None
    out_dtype = ""
    if quant_in:
        gq = o.reshape(B, T, -1, 128)
        s = pow2_scale(gq.abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
        o = (gq / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(B, T, H, d)
        o_scale = s.squeeze(-1)
        out_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    else:
        o = o.to(dtype)
    args = {"o": o, "w": w, "scale": scale, "o_scale": o_scale}
    attrs = {"groups": G, "block": 128, "out_dtype": out_dtype}
    ref = kc.reference("grouped_out_proj", args, attrs)[0]
    z, buf = kc.poisoned((B, T, G * R), dtype, pad=3)
    kernels.launch("grouped_out_proj", args, {**attrs, "groups": G if not wrong else 1}, {"z": z})
    assert buf[..., G * R:].float().isnan().all()
    kc.assert_matches(z, ref, f"grouped_out_proj {wfmt} {dtype} quant_in={quant_in}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wfmt", ["float", "fp8"])
def test_grouped(dtype, wfmt):
    run(dtype, wfmt)


@pytest.mark.parametrize("wfmt", ["float", "fp8"])
def test_grouped_prequantised_input(wfmt):
    run(torch.bfloat16, wfmt, quant_in=True, G=2, H=4, d=64, R=80)


def test_wrong_groups_is_caught():
    with pytest.raises((AssertionError, ValueError)):
        run(torch.float32, "float", wrong=True)
