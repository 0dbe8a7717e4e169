"""The MTP block (spec section 11): drafts token t + 2 from the backbone streams at t and token t + 1."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, prompt


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
