"""Conformance of the reference model with HF transformers 5.23 `DeepseekV4ForCausalLM` (CPU oracle).

Tolerance: 1e-4 absolute on fp32 logits whose std is ~1.0 and max |logit| ~5 (printed by the tests),
i.e. about 1e-4 relative; fp32 accumulation-order noise is ~1e-6 at this scale, so 1e-4 leaves room
for it while catching any real maths difference (which moves logits by >1e-2).
"""

from __future__ import annotations

import pytest
import torch

from conftest import dense_weights, make_model, prompt
from hf_oracle import hf_model
from v4compile.config import CSA, HCA, SWA, preset

pytestmark = pytest.mark.isa  # exact on torch's CPU kernels: CI runs it again under a second instruction set

ATOL = 1e-4
PRESETS = ["tiny", "tiny-pro"]


@pytest.fixture(scope="module", params=PRESETS)
def pair(request):
    name = request.param
    cfg = preset(name)
    return name, make_model(name), hf_model(cfg, dense_weights(name))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def test_configs_exercise_every_feature():
    kinds = set(preset("tiny").layer_kinds)
    assert kinds == {SWA, CSA, HCA}
    pro = preset("tiny-pro")
    assert pro.layer_kinds == (HCA, HCA, CSA, HCA, CSA)  # V4-Pro's pattern: [128, 128, 4, 128, 4, ...]
    for cfg in (preset("tiny"), pro):
        assert 0 < cfg.n_hash_layers < cfg.n_layers  # hash and learned routing
        # A 100-token prompt closes 25 CSA windows, more than index_topk: the indexer drops rows.
        assert 100 // cfg.csa_ratio > cfg.index_topk
        assert 100 // cfg.hca_ratio >= 4 and 100 > cfg.window


def test_full_forward_matches_hf(pair):
    name, ours, hf = pair
    ids = prompt(100, ours.cfg.vocab_size)
    a, b = ours.forward(ids), hf_logits(hf, ids)
    print(f"{name}: logit std {b.std():.3f}, max |logit| {b.abs().max():.3f}, max diff {(a - b).abs().max():.2e}")
    assert b.std() > 0.5
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37])
def test_chunked_prefill_and_decode_match_full_forward(pair, chunk):
    name, ours, hf = pair
    ids = prompt(140, ours.cfg.vocab_size, seed=2)
    full = hf_logits(hf, ids)
    cache, last = ours.prefill([ids[:100].tolist()], chunk=chunk, capacity=140)
    torch.testing.assert_close(last[0], full[99], atol=ATOL, rtol=0)
    for t in range(100, 139):  # 39 decode steps
        logits = ours.decode([int(ids[t])], cache)
        torch.testing.assert_close(logits[0], full[t], atol=ATOL, rtol=0)


def test_batch_of_different_lengths(pair):
    name, ours, hf = pair
    ids = prompt(90, ours.cfg.vocab_size, seed=3)
    prompts = [ids[:33].tolist(), ids[:90].tolist(), ids[:4].tolist(), ids[10:71].tolist()]
    cache, last = ours.prefill(prompts, chunk=24, capacity=130)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(last[b], hf_logits(hf, torch.tensor(p))[-1], atol=ATOL, rtol=0)
    # Decode 32 steps for all four at once; each continues with its own (HF-checked) greedy tokens.
    seqs = [list(p) for p in prompts]
    nxt = [int(last[b].argmax()) for b in range(4)]
    for _ in range(32):
        for b in range(4):
            seqs[b].append(nxt[b])
        logits = ours.decode(nxt, cache)
        nxt = [int(logits[b].argmax()) for b in range(4)]
    for b in range(4):
        torch.testing.assert_close(logits[b], hf_logits(hf, torch.tensor(seqs[b]))[-1], atol=ATOL, rtol=0)


def test_greedy_ids_match_hf_generate(pair):
    name, ours, hf = pair
    ids = prompt(60, ours.cfg.vocab_size, seed=4)
    with torch.no_grad():
        expect = hf.generate(ids[None], max_new_tokens=40, do_sample=False)[0, 60:].tolist()
    assert ours.generate(ids, 40) == expect


def test_bf16_is_bit_exact_with_hf():
    cfg = preset("tiny")
    ours = make_model("tiny", dtype=torch.bfloat16)
    hf = hf_model(cfg, dense_weights("tiny"), torch.bfloat16)
    ids = prompt(100, cfg.vocab_size)
    a = ours.forward(ids)
    b = hf_logits(hf, ids)
    assert torch.equal(a, b), (a - b).abs().max()
    # ... and bf16 is a genuinely different computation from fp32 (the test could fail).
    assert not torch.allclose(a, make_model("tiny").forward(ids), atol=1e-2)


def test_hf_layout_checkpoint_roundtrip(tmp_path):
    """HF's own `save_pretrained` output (its mixed naming) loads through our loader unchanged."""
    cfg = preset("tiny")
    hf = hf_model(cfg, dense_weights("tiny"))
    hf.save_pretrained(tmp_path / "hf")  # with HF's own config.json (HF field names)
    from v4compile.model import ReferenceModel

    ours = ReferenceModel.from_pretrained(tmp_path / "hf")
    # HF's config.json maps back onto the same config (no quantization_config: plain storage formats).
    assert ours.cfg == cfg.replace(weight_format="bf16", expert_format="bf16")
    assert not ours.has_mtp  # HF drops MTP weights
    ids = prompt(50, cfg.vocab_size)
    torch.testing.assert_close(ours.forward(ids), hf_logits(hf, ids), atol=ATOL, rtol=0)
