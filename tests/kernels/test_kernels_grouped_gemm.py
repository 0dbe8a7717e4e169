"""grouped_gemm family (grouped_out_proj, rope_out_proj) under the interpreter vs the op reference: float / FP8 weights,
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


# ---- rope_out_proj: the inverse RoPE (and FP8 quantisation) in wo_a's loader ----------------------------

def run_rope(dtype, wfmt, act, B=2, T=3, H=4, d=64, G=2, R=80, dim=32):
    """The fused launch against the op reference and, bit for bit, against the two launches it replaces
    (inv_rope_group_quant, then grouped_out_proj on its output: pre-quantised when act is fp8)."""
    g = torch.Generator().manual_seed(1)
    o = (2 * torch.randn(B, T, H, d, generator=g)).to(dtype)
    pos = torch.randint(0, 300, (B, T), generator=g)
    pos[1, 2] = -1  # a padding lane
    w = torch.randn(G * R, H * d // G, generator=g) * 0.05
    scale = None
    if wfmt == "fp8":
        w, scale = fp8_block_quant(w, 128)
    else:
        w = w.to(dtype)
    rot = {"dim": dim, "theta": 10000.0, "yarn": (16.0, 256, 32.0, 1.0)}
    out_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype] if act == "fp8" else ""
    attrs = {**rot, "groups": G, "block": 128, "act": act, "out_dtype": out_dtype}
    args = {"o": o, "pos": pos, "w": w, "scale": scale}
    ref = kc.reference("rope_out_proj", args, attrs)[0]
    z, buf = kc.poisoned((B, T, G * R), dtype, pad=3)
    kernels.launch("rope_out_proj", args, attrs, {"z": z})
    assert buf[..., G * R:].float().isnan().all()
    kc.assert_matches(z, ref, f"rope_out_proj {wfmt} {dtype} {act}")
    # the unfused pair, as the program ran it before the fusion
    fmt = "fp8" if act == "fp8" else "none"
    y, _ = kc.poisoned((B, T, H, d), dtype if fmt == "none" else torch.float8_e4m3fn)
    outs = {"y": y}
    if fmt == "fp8":
        outs["scale"], _ = kc.poisoned((B, T, H * d // 128), torch.float32)
    kernels.launch("inv_rope_group_quant", {"x": o, "pos": pos}, {**rot, "fmt": fmt, "group": 128}, outs)
    z2, _ = kc.poisoned((B, T, G * R), dtype)
    kernels.launch("grouped_out_proj", {"o": y, "w": w, "scale": scale, "o_scale": outs.get("scale")},
                   {"groups": G, "block": 128, "act": act, "out_dtype": out_dtype}, {"z": z2})
    assert torch.equal(z, z2), f"rope_out_proj {wfmt} {dtype} {act}: not the unfused launches' bits"


# fp32 (the debug numerics), V4's wo_a (FP8 weight, native bf16 activations), and the FP8-activation fold
@pytest.mark.parametrize("dtype,wfmt,act", [(torch.float32, "float", "native"), (torch.bfloat16, "fp8", "native"),
                                            (torch.bfloat16, "fp8", "fp8")])
def test_rope_out_proj(dtype, wfmt, act):
    run_rope(dtype, wfmt, act)


@pytest.mark.parametrize("old,new", [
    ("(kk ^ 1)[:, None]", "kk[:, None]"),  # the pair partner taken from the channel itself
    ("((gid * G_K + kk) % D)", "(kk % D)"),  # the second group's channels placed as if in the first
    ("tb * P_BS + ", ""),  # every sequence rotated by the first one's positions
])
def test_rope_out_proj_broken_loader_is_caught(monkeypatch, tmp_path, old, new):
    from v4compile.codegen.kernels import gemm
    kc.install_broken_kernel(monkeypatch, tmp_path, gemm, "gemm_program", old, new)
    with pytest.raises(AssertionError):
        run_rope(torch.bfloat16, "fp8", "native", H=3, d=48, dim=16)  # group 1 starts mid-head
