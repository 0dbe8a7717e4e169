"""The reference speculative decoder (`v4compile/model/speculative.py`): the oracle for the compiled paths.

Greedy: the ids equal plain greedy decoding. Rollback: with an oracle draft (always accepted) and an
always-wrong one (always rejected) the ids are still plain, and the state (every backbone layer's window
ring, compressed rows, compressor and indexer rings, and the MTP block's ring) is byte for byte the state
of replaying only the kept lanes (rejected lanes as padding), and within float noise of plain decoding.
Sampling: the first token decided by the acceptance rule is distributed as plain sampling's (chi-square), and so
is the rule's own first token on a seeded synthetic verify (`speculation.sample_accept`; min(1, q/p) caught).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_model, prompt
from spec_sampling import (ALPHA, N, SMALL_VOCAB, always_accept, chisquare_pvalue, first_token_pvalue, inverted_ratio,
                           probs)
from v4compile.config import preset
from v4compile.errors import InputError
from v4compile.model import ReferenceModel
from v4compile.model import speculative
from v4compile.model.speculative import speculative_generate
from v4compile.speculation import Acceptance, clobbered

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"
pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 64


@pytest.fixture(scope="module")
def models():
    return {"tiny": make_model("tiny"), "tiny-pro": make_model("tiny-pro"),
            "tiny-doc": ReferenceModel.from_pretrained(EXAMPLE)}


def ragged(model) -> list[list[int]]:
    return [prompt(n, model.cfg.vocab_size, seed=n).tolist() for n in (5, 11)]


def plain_greedy(model, prompts, new):
    """Plain greedy decoding of a ragged batch (one token per sequence per step)."""
    cache, logits = model.prefill(prompts, capacity=max(map(len, prompts)) + new)
    out = [[] for _ in prompts]
    for i in range(new):
        nxt = logits.argmax(-1).tolist()
        for b, t in enumerate(nxt):
            out[b].append(t)
        if i + 1 < new:
            logits = model.decode(nxt, cache)
    return out


@pytest.fixture(scope="module")
def plain(models):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before the per-test `one_torch_thread`
    yield {name: plain_greedy(m, ragged(m), NEW) for name, m in models.items()}
    torch.set_num_threads(n)


# k = 1, 2, 3 on the trained model (drafts both accepted and rejected); k = 2 on the random presets
# (every draft rejected: the oracle / wrong-draft tests below force the accept path on them).
@pytest.mark.parametrize("name,k", [("tiny-doc", 1), ("tiny-doc", 2), ("tiny-doc", 3), ("tiny", 2), ("tiny-pro", 2)])
def test_greedy_ids_equal_plain_decoding(models, plain, name, k):
    r = speculative_generate(models[name], ragged(models[name]), NEW, k)
    assert r.ids == plain[name]
    if name == "tiny-doc":  # the trained MTP block drafts well: the speculative path is really taken
        assert r.acceptance.rates()[0] > 0.3 and r.acceptance.tokens_per_step() > 1.3


def replay(model, result, capacity):
    """A fresh cache fed only the lanes each step kept: the state speculation must leave."""
    cache = model.new_cache(len(result.ids), capacity)
    streams = None
    for kind, ids, pos in result.chunks:
        if kind == "main":
            _, streams = model.step(ids, pos, cache)
        else:
            model.mtp_step(streams, ids, pos, cache, last_only=True)
    return cache


def states(cache):
    return [(f"layers.{i}.{k}", t) for i, c in enumerate(cache.layers) for k, t in c.items()] + \
           [(f"mtp.{i}.{k}", t) for i, c in enumerate(cache.mtp) for k, t in c.items()]


def forced(model, prompts, ids, kind, k, new):
    """Speculation with an oracle draft (the plain ids) or an always-wrong one."""
    V = model.cfg.vocab_size

    def hook(b, position, d):
        i = position - len(prompts[b])
        want = ids[b][i] if i < len(ids[b]) else d
        return want if kind == "oracle" else (want + 1) % V

    return speculative_generate(model, prompts, new, k, draft=hook)


RealUndo = speculative.UndoLog


class CheckedUndo(RealUndo):
    """The undo log, checking each restore byte for byte: afterwards every state tensor equals its value
    before the step except at the entries the kept positions wrote, which hold what the step wrote."""

    def __init__(self, cfg, layers, caches, spans):
        super().__init__(cfg, layers, caches, spans)
        self.cfg, self.layers, self.caches, self.spans = cfg, list(layers), list(caches), spans
        self.before = [{k: t.clone() for k, t in c.items()} for c in self.caches]

    def restore(self, keep):
        after = [{k: t.clone() for k, t in c.items()} for c in self.caches]
        self.undo(keep)
        self.check(after, keep)

    def undo(self, keep):
        RealUndo.restore(self, keep)

    def check(self, after, keep):
        for layer, c, before, written in zip(self.layers, self.caches, self.before, after):
            ratio = self.cfg.ratio(layer) if layer < self.cfg.n_layers else 0
            for key, t in c.items():
                want = before[key].clone()
                for b, (first, _) in self.spans.items():
                    for q in range(first - 1, keep.get(b, 0)):  # lane 0 (first - 1) and the accepted drafts
                        i = clobbered(key, t.shape[1], ratio, q)
                        if i is not None:
                            want[b, i] = written[key][b, i]
                assert torch.equal(t, want), (layer, key)
        CheckedUndo.checks += 1

    checks = 0


@pytest.mark.parametrize("kind", ["oracle", "wrong"])
def test_forced_drafts_leave_the_state_of_the_kept_tokens(models, kind, monkeypatch):
    model, k, new = models["tiny"], 3, 13  # 13 = 1 + 3 x (1 + k): the oracle run ends on a step boundary
    prompts = ragged(model)
    ids = [model.generate(p, new) for p in prompts]
    monkeypatch.setattr(speculative, "UndoLog", CheckedUndo)
    CheckedUndo.checks = 0
    r = forced(model, prompts, ids, kind, k, new)
    verifies = sum(kind == "main" for kind, _, _ in r.chunks) - 1  # the first chunk is the prefill
    assert verifies >= 3 and CheckedUndo.checks >= 2 * verifies  # every verify's and every drafting's undo
    assert r.ids == ids
    assert r.acceptance.rates() == ([1.0] * k if kind == "oracle" else [0.0] * k)
    # The same chunks with the rejected lanes as padding: the same bytes when nothing is rejected; otherwise the
    # kept lanes' values round differently in the last bits (the MoE groups a chunk's lanes per expert, so a
    # lane's GEMM shapes depend on where the other lanes went), within 1e-5 of the largest value.
    want = dict(states(replay(model, r, r.cache.capacity)))
    for name, t in states(r.cache):
        if kind == "oracle":
            assert torch.equal(t, want[name]), name
        else:
            assert (t - want[name]).abs().max() <= 1e-5 * max(want[name].abs().max(), 1), name
    # and within float noise of plain one-token decoding of the same tokens (a chunk's GEMMs round differently)
    for b, p in enumerate(prompts):
        fed = p + ids[b][:-1]
        cache, _ = model.prefill([p], capacity=r.cache.capacity)
        for t in fed[len(p):]:
            model.decode([t], cache)
        for layer, c in enumerate(cache.layers):
            for key, t in c.items():
                got = r.cache.layers[layer][key][b]
                assert (got - t[0]).abs().max() <= 1e-4 * max(t[0].abs().max(), 1), (layer, key)


@pytest.mark.parametrize("fault", ["no-restore", "restore-one-short"])
def test_a_broken_rollback_is_caught(models, monkeypatch, fault):
    """Deliberately broken variants: no undo, or the last rejected position left in place."""
    model, k, new = models["tiny"], 3, 4
    prompts = ragged(model)[:1]
    ids = [model.generate(p, new) for p in prompts]

    def broken(self, keep):
        if fault == "restore-one-short":
            RealUndo.restore(self, {b: q + 1 for b, q in keep.items()})

    monkeypatch.setattr(CheckedUndo, "undo", broken)
    monkeypatch.setattr(speculative, "UndoLog", CheckedUndo)
    with pytest.raises(AssertionError):
        forced(model, prompts, ids, "wrong", k, new)


# ---- sampling ----------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def small():
    return make_model("tiny", cfg=dataclasses.replace(preset("tiny"), vocab_size=SMALL_VOCAB),
                      weights=_small_weights())


def _small_weights():
    from v4compile.init_random import random_source
    from v4compile.weights import spec_table

    cfg = dataclasses.replace(preset("tiny"), vocab_size=SMALL_VOCAB)
    src = random_source(cfg, 0)
    return {n: src(s) for n, s in spec_table(cfg).items()}


def second_token_pvalue(model) -> float:
    """N copies of one prompt sampled at temperature 1 for two tokens (the first from the prompt's logits,
    the second decided by speculation at k = 1): the p-value of the second token's counts against the exact
    plain-sampling marginal sum_t1 p(t1) p(t2 | t1)."""
    ids = [1, 2, 3]
    r = speculative_generate(model, [ids] * N, 2, 1, temperature=1.0, seed=0)
    p1 = probs(model.forward(torch.tensor(ids))[-1].numpy(), 1.0)
    want = sum(p1[t] * probs(model.forward(torch.tensor(ids + [t]))[-1].numpy(), 1.0) for t in range(SMALL_VOCAB))
    got = np.bincount([o[1] for o in r.ids], minlength=SMALL_VOCAB)
    return chisquare_pvalue(got, want * N)


def test_chisquare_pvalue_is_the_chi_square_survival_function():
    # statistic 4 at 1 degree of freedom: P(chi2_1 > 4) = 0.0455 (tables); counts equal to their expectation: 1
    assert abs(chisquare_pvalue(np.array([60.0, 40.0]), np.array([50.0, 50.0])) - 0.0455) < 1e-4
    assert chisquare_pvalue(np.full(8, 10.0), np.full(8, 10.0)) == 1.0
    # statistic 24.322 at 7 degrees of freedom: the 0.001 critical value (tables)
    d = (24.322 * 100 / 2) ** 0.5
    observed = np.array([100 + d, 100 - d] + [100.0] * 6)
    assert abs(chisquare_pvalue(observed, np.full(8, 100.0)) - 0.001) < 2e-5


def test_sampling_matches_plain_sampling(small):
    assert second_token_pvalue(small) > ALPHA


def test_always_accepting_fails_the_sampling_test(small, monkeypatch):
    monkeypatch.setattr(speculative, "accept", always_accept)
    assert second_token_pvalue(small) < ALPHA


def test_the_sampled_rule_is_distributed_as_the_target():
    """`speculation.sample_accept` alone (the host's sampled acceptance and the `spec_sample` op's reference): the
    first token it emits is distributed as the target's p; accepting with min(1, q/p) is caught."""
    from v4compile.speculation import sample_accept

    assert first_token_pvalue(sample_accept) > ALPHA
    assert first_token_pvalue(inverted_ratio()) < ALPHA


# ---- the rule's bookkeeping and refusals ---------------------------------------------------------------

def test_acceptance_rates_are_conditional():
    a = Acceptance(3)
    for accepted in (3, 1, 0, 2):
        a.add(accepted, accepted + 1)
    assert a.offered == [4, 3, 2] and a.accepted == [3, 2, 1]
    assert a.tokens_per_step() == 10 / 4


def test_refusals(models):
    tiny = models["tiny"]
    with pytest.raises(InputError, match="draft_tokens"):
        speculative_generate(tiny, [[1, 2]], 4, 0)
    with pytest.raises(InputError, match="draft_tokens"):
        speculative_generate(tiny, [[1, 2]], 4, 8)
    no_mtp = ReferenceModel(tiny.cfg, {k: v for k, v in tiny.weights.items() if not k.startswith("mtp.")})
    with pytest.raises(InputError, match="no MTP weights"):
        speculative_generate(no_mtp, [[1, 2]], 4, 1)
