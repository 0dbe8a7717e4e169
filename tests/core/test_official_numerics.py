"""`numerics="official"`: the HF maths plus the QAT roundings of spec section 13 (FP8 KV rows, Hadamard +
FP4 indexer), and nothing else."""

from __future__ import annotations

import torch

from conftest import make_model, prompt
from v4compile.ops import op
from v4compile.formats import FP4_VALUES, hadamard


def test_official_differs_from_hf_only_by_the_roundings(monkeypatch):
    ids = prompt(100, 512)
    hf = make_model("tiny").forward(ids)
    off = make_model("tiny", numerics="official").forward(ids)
    assert (off - hf).abs().max() > 1e-2  # the roundings matter (they flip indexer / router choices)
    # With the two rounding steps made identities and HF's routing-weight order (the same maths on these
    # fp32 weights, which quantise no activation; spec 10), official is bit-identical to hf.
    monkeypatch.setattr(op.fp8_round, "ref", lambda x, *, dims, block: x)
    experts = op.moe_experts.ref
    monkeypatch.setattr(op.moe_experts, "ref", lambda *a, route_weight, **k: experts(*a, route_weight="after_w2", **k))
    monkeypatch.setattr(op.hadamard_fp4_round, "ref", lambda x, *, block: x)
    import v4compile.ops.compressor as comp
    monkeypatch.setattr(comp, "fp8_round_ref", lambda x, dims, block: x)
    monkeypatch.setattr(comp, "hadamard_fp4_round_ref", lambda x, block: x)
    assert torch.equal(make_model("tiny", numerics="official").forward(ids), hf)


def test_fp8_round_keeps_rope_dims_and_lands_on_the_e4m3_grid():
    x = torch.randn(3, 7, 512) * 3
    y = op.fp8_round(x, dims=448, block=64)
    assert torch.equal(y[..., 448:], x[..., 448:])
    g = y[..., :448].reshape(3, 7, 7, 64)
    amax = x[..., :448].reshape(3, 7, 7, 64).abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = g / s
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q)  # exactly representable
    # Round to nearest: within half an ulp (3 mantissa bits: 2^-4 relative; subnormals: s * 2^-10).
    err = (g - x[..., :448].reshape(3, 7, 7, 64)).abs()
    assert (err <= torch.maximum(x[..., :448].reshape(3, 7, 7, 64).abs() * 2 ** -4, s * 2 ** -10)).all()
    assert not torch.equal(y, x)
    assert torch.equal(op.fp8_round(y, dims=448, block=64), y)  # idempotent


def test_hadamard_fp4_round_lands_on_the_fp4_grid():
    x = torch.randn(5, 128)
    y = op.hadamard_fp4_round(x, block=32)
    g = y.reshape(5, 4, 32)
    rot = (x @ hadamard(128)).reshape(5, 4, 32)
    s = torch.exp2(torch.ceil(torch.log2(rot.abs().amax(-1, keepdim=True) / 6)))
    grid = torch.tensor(FP4_VALUES)
    q = (g / s).abs().unsqueeze(-1)
    assert ((q - grid).abs().min(-1).values == 0).all()
    assert (y - rot.reshape(5, 128)).abs().max() <= s.max() * 1.0  # at most half the widest fp4 step


def test_hadamard_alone_does_not_change_indexer_scores():
    q, keys = torch.randn(1, 6, 8, 128), torch.randn(1, 9, 128)
    w, pos = torch.randn(1, 6, 8), torch.arange(30, 36).view(1, 6)
    h = hadamard(128)
    a = op.indexer_scores(q, w, keys, pos, ratio=4, q_scale=0.1, w_scale=0.3)
    b = op.indexer_scores(q @ h, w, keys @ h, pos, ratio=4, q_scale=0.1, w_scale=0.3)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_official_cached_decode_matches_official_full_forward():
    model = make_model("tiny", numerics="official")
    ids = prompt(120, 512, seed=7)
    full = model.forward(ids)
    cache, last = model.prefill([ids[:80].tolist()], chunk=11, capacity=120)
    torch.testing.assert_close(last[0], full[79], atol=1e-4, rtol=0)
    for t in range(80, 119):
        torch.testing.assert_close(model.decode([int(ids[t])], cache)[0], full[t], atol=1e-4, rtol=0)
