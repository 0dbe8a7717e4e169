"""GEMM numerics made explicit (`v4-reference.md` 12, 13.1): the `act` / `acc` / `out_dtype` attributes of
every GEMM op, what official numerics sets them to, fp32 logits and fp32 compressor state.

Tolerance of the 13.1 comparisons: the direct implementation accumulates per 128-wide K block in float64
and applies `s_act * s_weight` per block; the op dequantises both sides exactly (an e4m3 / e2m1 value times
a power of two is exact in fp32) and runs one fp32 GEMM, so the two differ by fp32 summation order only
(~K * 2^-24 relative, < 1e-5 for K <= 320). A wrong scale rule or no activation quantisation at all moves
results by > 1e-3 relative (shown below).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_model
from v4compile.config import preset
from v4compile.formats import act_quant, fp4_dequant, fp4_quant, fp8_block_quant
from v4compile.ops.attention import grouped_out_proj
from v4compile.ops.basic import linear
from v4compile.trace import TraceOptions, trace

RTOL = 1e-5


def hand_made_activations(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows whose 128-blocks span very different magnitudes, one block below the 1e-4 amax floor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    mags = torch.tensor([1.0, 300.0, 3e-3, 1e-6, 20.0])
    for b in range(0, k, 128):
        x[:, b:b + 128] *= mags[(b // 128) % len(mags)]
    x[0, :128] *= 1e-5  # one token's first block under the floor
    return x


def direct_13_1(x: torch.Tensor, wdeq_blocks) -> torch.Tensor:
    """Spec 13.1 written out: per token and 128-block of K, s = 2^ceil(log2(max(amax, 1e-4) / 448)),
    q = e4m3(clamp(x / s, -448, 448)); the block's partial product (q . w_q) * s_weight is formed in
    float64 and scaled by s_act. `wdeq_blocks(kb)` gives the weight columns of K block kb as float64
    values *with* their own scales applied (per weight scale block)."""
    n, k = x.shape
    out = None
    for kb, start in enumerate(range(0, k, 128)):
        blk = x[:, start:start + 128].double()
        amax = blk.abs().amax(dim=1).clamp(min=1e-4)
        s = torch.tensor([2.0 ** math.ceil(math.log2(float(a) / 448.0)) for a in amax], dtype=torch.float64)
        q = (blk / s[:, None]).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
        part = (q @ wdeq_blocks(kb).T) * s[:, None]
        out = part if out is None else out + part
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_act_quant_scales_are_the_13_1_rule():
    x = hand_made_activations(3, 320)
    q, s = act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two (UE8M0)
    floor = 2.0 ** math.ceil(math.log2(1e-4 / 448))
    assert float(s[0, 0]) == floor  # a block below the floor gets the floor's scale
    assert float(q.float().abs().max()) <= 448


def test_fp8_weight_gemm_matches_13_1():
    x = hand_made_activations(4, 320)  # 2.5 K blocks: a partial last block of activations and weights
    w = torch.randn(200, 320, generator=torch.Generator().manual_seed(1)) * 0.05
    wq, ws = fp8_block_quant(w)
    sw = torch.exp2(ws.double() - 127)

    def cols(kb):
        c = wq[:, kb * 128:(kb + 1) * 128].float().double()
        return c * sw[:, kb].repeat_interleave(128)[: c.shape[0], None]

    want = direct_13_1(x, cols)
    got = linear(x, wq, ws, block=128, act="fp8")
    assert got.dtype == torch.float32 and rel(got, want) < RTOL
    # the check can fail: no activation quantisation (today's native GEMM) is far off
    assert rel(linear(x, wq, ws, block=128), want) > 1e-3


def test_fp4_weight_gemm_matches_13_1():
    x = hand_made_activations(3, 256, seed=2)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3))
    wq, ws = fp4_quant(w, 32)
    wdeq = fp4_dequant(wq, ws, 32).double()  # e2m1 value x its own 1x32 scale: exact

    want = direct_13_1(x, lambda kb: wdeq[:, kb * 128:(kb + 1) * 128])
    got = linear(x, wq, ws, block=32, act="fp8")
    assert rel(got, want) < RTOL


def test_a_wrong_scale_rule_is_caught(monkeypatch):
    """Rounding the scale exponent instead of taking its ceiling lets blocks overflow 448 and clamp."""
    import v4compile.formats as formats

    x = hand_made_activations(4, 256, seed=4)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    wq, ws = fp8_block_quant(w)
    sw = torch.exp2(ws.double() - 127)
    want = direct_13_1(x, lambda kb: wq[:, kb * 128:(kb + 1) * 128].float().double()
                       * sw[:, kb].repeat_interleave(128)[:64, None])
    monkeypatch.setattr(formats, "pow2_scale",
                        lambda amax, qmax, floor: torch.exp2(torch.floor(torch.log2(amax.float().clamp(min=floor) / qmax))))
    assert rel(linear(x, wq, ws, block=128, act="fp8"), want) > 1e-3


def test_grouped_out_proj_fp8_and_the_fold_agree_bit_for_bit():
    """wo_a with act=fp8 quantises each group's K in 128-blocks; inv_rope_group_quant's e4m3 + scales fed to
    it (what fold_inverse_rope_wo_a_quant makes) give the same bits; both match 13.1 per group."""
    from v4compile.ops.fused import inv_rope_group_quant

    g = torch.Generator().manual_seed(6)
    o = (torch.randn(2, 3, 4, 64, generator=g) * torch.tensor([1.0, 50.0, 1e-3, 5.0]).view(1, 1, 4, 1)).bfloat16()
    pos = torch.arange(6).view(2, 3)
    w = torch.randn(2 * 8, 128, generator=g).bfloat16()  # 2 groups of K = 128, R = 8
    rot = {"dim": 16, "theta": 10000.0, "yarn": ()}
    y = inv_rope_group_quant(o, pos, fmt="none", **rot)
    self_quant = grouped_out_proj(y, w, None, None, groups=2, act="fp8")
    q, s = inv_rope_group_quant(o, pos, fmt="fp8", group=128, **rot)
    folded = grouped_out_proj(q, w, None, s, groups=2, act="fp8", out_dtype="bf16")
    assert self_quant.dtype == torch.bfloat16 and torch.equal(self_quant, folded)
    for gi in range(2):
        xg = y.reshape(6, 2, 128)[:, gi].float()
        want = direct_13_1(xg, lambda kb: w[gi * 8:(gi + 1) * 8].double())
        assert rel(self_quant.reshape(6, 16)[:, gi * 8:(gi + 1) * 8].float(), want) < 1e-2  # bf16 output
    assert rel(self_quant.float(), grouped_out_proj(y, w, None, None, groups=2).float()) > 1e-3


def test_native_numerics_is_unchanged_default():
    x = torch.randn(2, 5, 64)
    w = torch.randn(8, 64)
    assert torch.equal(linear(x, w, None), torch.nn.functional.linear(x, w))
    out = linear(x.bfloat16(), w.bfloat16(), None, out_dtype="fp32")
    assert out.dtype == torch.float32 and torch.equal(out, torch.nn.functional.linear(x.bfloat16().float(),
                                                                                      w.bfloat16().float()))


# ---- what numerics="official" sets -----------------------------------------------------------------

GEMMS = ("linear", "norm_linear", "grouped_out_proj", "moe_experts", "moe_experts_shared")


def gemm_weights(op):
    return op.operand("w1") if op.name.startswith("moe_experts") else op.operand("w")


def test_official_quantised_tiny_runs_fp8_activations_on_exactly_the_quantised_gemms(tmp_path):
    from v4compile import frontend
    from v4compile.init_random import init_random

    ck = init_random(tmp_path / "q", preset("tiny"), seed=1, quantized=True)
    opts = dict(batch=2, chunk=16, decode_batch=2, capacity=64)
    for numerics in ("official", "hf"):
        m = frontend.load(str(ck), None, None, TraceOptions(numerics=numerics, **opts)).module
        seen = set()
        for fn in m.functions.values():
            for op in fn.ops:
                if op.name not in GEMMS:
                    continue
                quantised = gemm_weights(op).type.dtype in ("fp8e4m3", "fp4x2")
                # spec 12: DeepSeek dequantises wo_a at conversion and runs it as a bf16 einsum
                want = "fp8" if numerics == "official" and quantised and op.attrs["role"] != "attn.wo_a" else "native"
                assert op.attrs["act"] == want, (numerics, op.attrs["role"], op.attrs["act"])
                assert op.attrs["acc"] == "fp32"
                seen.add((quantised, op.attrs["act"]))
        if numerics == "official":
            assert seen == {(True, "fp8"), (True, "native"), (False, "native")}  # all three kinds occur
        else:
            assert {a for _, a in seen} == {"native"}


@pytest.mark.parametrize("numerics", ["official", "hf"])
def test_official_logits_and_compressor_state_are_fp32_in_bf16(numerics):
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(numerics=numerics, dtype="bf16", batch=1, chunk=8, decode_batch=1, capacity=64))
    fn = m.functions["decode"]
    want = "fp32" if numerics == "official" else "bf16"
    assert fn.output("logits").type.dtype == want
    head = [op for op in fn.ops if op.attrs.get("role") == "head" and op.name == "linear"]
    assert len(head) == 1 and head[0].attrs["out_dtype"] == ("fp32" if numerics == "official" else "")
    states = {v.name: v.type.dtype for v in fn.inputs if v.name.endswith("state_kv")}
    assert states and set(states.values()) == {want}
    model = make_model("tiny", numerics=numerics, dtype=torch.bfloat16)
    cache = model.new_cache(1, 8)
    logits, _ = model.step(torch.arange(8).view(1, 8), torch.arange(8).view(1, 8), cache)
    assert logits.dtype == (torch.float32 if numerics == "official" else torch.bfloat16)
    assert cache.layers[1]["state_kv"].dtype == logits.dtype
