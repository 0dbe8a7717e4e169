"""The MTP block (spec section 11): drafts token t + 2 from the backbone streams at t and token t + 1."""

from __future__ import annotations

import pytest
import torch

from conftest import dense_weights, make_model, prompt


@pytest.fixture(scope="module")
def setup():
    model = make_model("tiny")
    ids = prompt(80, 512, seed=5)
    logits, draft = model.forward_with_mtp(ids)
    return model, ids, logits, draft


def test_shapes_and_scale(setup):
    model, ids, logits, draft = setup
    assert logits.shape == (80, 512) and draft.shape == (79, 512)
    assert draft.std() > 0.3 and torch.isfinite(draft).all()


def test_incremental_mtp_matches_full(setup):
    model, ids, logits, draft = setup
    cache = model.new_cache(1, 80)
    pos = torch.arange(80).view(1, -1)
    _, streams = model.step(ids.view(1, -1), pos, cache)
    mcache = model.new_cache(1, 80)
    for t in range(79):
        d, _ = model.mtp_step(streams[:, t:t + 1], ids.view(1, -1)[:, t + 1:t + 2], pos[:, t:t + 1], mcache)
        torch.testing.assert_close(d[0, 0], draft[t], atol=1e-4, rtol=0)


def test_draft_depends_on_both_inputs(setup):
    model, ids, logits, draft = setup
    pos = torch.arange(79).view(1, -1)
    cache = model.new_cache(1, 80)
    _, streams = model.step(ids.view(1, -1), torch.arange(80).view(1, -1), cache)
    other_ids = (ids[1:] + 1) % 512
    d1, _ = model.mtp_step(streams[:, :-1], other_ids.view(1, -1), pos, model.new_cache(1, 80))
    noisy = streams[:, :-1] + 0.5 * torch.randn(streams[:, :-1].shape, generator=torch.Generator().manual_seed(0))
    d2, _ = model.mtp_step(noisy, ids[1:].view(1, -1), pos, model.new_cache(1, 80))
    assert (d1[0] - draft).abs().max() > 1e-2
    assert (d2[0] - draft).abs().max() > 1e-2


# ---- an independent oracle: spec section 11's MTP equations, in fp64, in this file --------------------

def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def mtp_oracle(model, streams, next_ids, pos):
    """Draft logits [T, V] of spec 11 for one sequence. The MTP-specific equations (embedding of the next
    ids, enorm / hnorm, e_proj / h_proj, hc_head' with the block's own parameters, its norm, the main head)
    are written here in fp64 from the test's dense weights. Block(X0) is "exactly sections 3-10": the
    backbone's decoder layer (checked against HF's layers elsewhere), run on this X0 with the block's
    weights and its own cache."""
    from v4compile.model.blocks import decoder_layer

    cfg, W = model.cfg, {k: v.double() for k, v in dense_weights("tiny").items() if v.is_floating_point()}
    eps = cfg.rms_eps
    assert cfg.kind(cfg.n_layers) == "swa" and not cfg.is_hash(cfg.n_layers)  # spec 11: SWA, never hashed
    e = _rms(W["embed.weight"][next_ids], W["mtp.0.enorm.weight"], eps) @ W["mtp.0.e_proj.weight"].T  # [T, D]
    xn = _rms(streams.double(), W["mtp.0.hnorm.weight"], eps)  # per stream, over D
    x0 = e[:, None, :] + xn @ W["mtp.0.h_proj.weight"].T  # [T, n, D]
    x1 = decoder_layer(model.params, cfg, cfg.n_layers, "mtp.0.", x0.float().unsqueeze(0), next_ids.view(1, -1),
                       pos.view(1, -1), model.new_cache(1, len(pos)).mtp[0], model._opts())[0].double()
    f = x1.flatten(1)  # [T, n * D], stream 0 first (spec 3.4)
    m = (f @ W["mtp.0.hc_head_fn"].T) / torch.sqrt((f * f).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(m * W["mtp.0.hc_head_scale"][0] + W["mtp.0.hc_head_base"]) + cfg.hc_eps
    h = (pre.unsqueeze(-1) * x1).sum(1)
    return _rms(h, W["mtp.0.norm.weight"], eps) @ W["head.weight"].T


@pytest.fixture(scope="module")
def oracle():
    """A 10-token sequence and the oracle's draft logits for it (from the backbone's streams)."""
    model, ids = make_model("tiny"), prompt(10, 512, seed=5)
    _, streams = model.step(ids.view(1, -1), torch.arange(10).view(1, -1), model.new_cache(1, 10))
    return ids, mtp_oracle(model, streams[0, :-1], ids[1:], torch.arange(9))


def check_draft_matches_the_oracle(model, ids, want):
    """`forward_with_mtp`'s draft logits against the oracle: |d| <= 1e-4 x max|logits| (the block runs in
    fp32 on both sides; the model's fp32 projections and norms differ from fp64 by ~1e-6 relative)."""
    _, draft = model.forward_with_mtp(ids)
    err = float((draft.double() - want).abs().max()) / float(want.abs().max())
    assert err <= 1e-4, err


def test_draft_matches_an_independent_mtp_step(oracle):
    check_draft_matches_the_oracle(make_model("tiny"), *oracle)


@pytest.mark.parametrize("fault", ["enorm-hnorm-swapped", "e-h-proj-swapped", "main-hc-head"])
def test_a_wrong_mtp_wiring_is_caught(oracle, fault, monkeypatch):
    """Faults both of the model's own paths share (so the incremental test cannot see them) fail the oracle."""
    from v4compile.model import blocks

    model = make_model("tiny")
    if fault == "main-hc-head":  # the block's head reads the backbone's hc_head / norm parameters
        real = blocks.head
        monkeypatch.setattr(blocks, "head", lambda P, cfg, pre, *a: real(P, cfg, "", *a))
    else:
        a, b = {"enorm-hnorm-swapped": ("enorm", "hnorm"), "e-h-proj-swapped": ("e_proj", "h_proj")}[fault]
        store = model.params.store  # a fresh model's own dict
        na, nb = f"mtp.0.{a}.weight", f"mtp.0.{b}.weight"
        store[na], store[nb] = store[nb], store[na]
    with pytest.raises(AssertionError):
        check_draft_matches_the_oracle(model, *oracle)
