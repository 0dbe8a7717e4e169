"""Speculative decoding on the cpu device (`runtime/speculative.py`): the compiled `verify_b<B>` step, greedy
acceptance and the pool's rollback give the ids of plain greedy decoding, whatever the drafts (an oracle
that is always right, one that is always wrong, a mix), for k = 1..3 and a ragged batch (three prompts of
different lengths in the batch-4 bucket). With the rollback broken the wrong drafts leave traces. Sampled
speculatively, a request's ids are the same alone and in a batch (each request its own generator; one
generator shared by the batch fails that). With the prefix cache, a request served from cached blocks under
speculation gives the cold run's logits and ids and writes no shared block, on the cpu and the host device."""

from __future__ import annotations

import numpy as np
import pytest

import v4compile
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.cli.driver import compile_artifact
from v4compile.errors import InputError
from v4compile.runtime import undo
from v4compile.runtime.speculative import mtp_draft, speculative_generate
from v4compile.trace import TraceOptions

from spec_rollback import pool_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [list(range(3, 16)), [5, 9, 200], list(range(40, 60))]  # 13, 3, 20 tokens: positions cross windows
NEW = 64
V = 512


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=96))
    return compile_artifact(fe, tmp_path_factory.mktemp("art") / "tiny", Buckets((1, 2, 4), (16,), draft_tokens=3))


def _run(art, fn):
    sess = v4compile.load(art, device="cpu", threads=1)
    try:
        return fn(sess), pool_bytes(sess.backend)
    finally:
        sess.close()


@pytest.fixture(scope="module")
def plain(art):
    return _run(art, lambda s: s.generate(PROMPTS, NEW))


def drafts(plain_ids, kind: str, seed: int = 0):
    full = [p + o for p, o in zip(PROMPTS, plain_ids)]
    rng = np.random.default_rng(seed)

    def oracle(i, ctx, k):
        return (full[i][len(ctx): len(ctx) + k] + [0] * k)[:k]

    def draft(i, ctx, k):
        right = oracle(i, ctx, k)
        if kind == "oracle":
            return right
        return [t if kind == "mixed" and rng.random() < 0.6 else (t + 1) % V for t in right]
    return draft


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", ["oracle", "wrong"])
def test_speculative_ids_equal_plain_greedy(art, plain, k, kind):
    (ids, stats), state = _run(art, lambda s: speculative_generate(s, PROMPTS, NEW, k, drafts(plain[0], kind)))
    assert ids == plain[0]
    rates = stats.rates()
    assert rates == ([1.0] * k if kind == "oracle" else [0.0] + [0.0] * (k - 1))
    assert stats.tokens == 3 * (NEW - 1)  # the first token comes from prefill
    # every pool / state row ends as plain decoding left it: kept positions rewritten by the verify chunk
    # (other GEMM shapes than decode's: fp32 rounding), rejected ones restored
    assert state.keys() == plain[1].keys()
    for n in state:
        np.testing.assert_allclose(state[n], plain[1][n], rtol=1e-4, atol=1e-5, err_msg=n)


def test_mixed_drafts_ragged_through_generate(art, plain):
    def gen(s):
        return s.generate(PROMPTS, NEW, speculative="mtp", draft_tokens=2, draft=drafts(plain[0], "mixed")), \
            s.last_acceptance
    (ids, stats), _ = _run(art, gen)
    assert ids == plain[0]
    assert 0 < stats.rates()[0] < 1 and 1 < stats.tokens_per_step() < 3


def test_compiled_mtp_drafts(art, plain):
    """The artifact's own MTP block as the draft source (tiny, random weights: its drafts are rarely right, so
    this is the always-rejecting path with the block's real writes and rollbacks), k = 3, the ragged batch."""
    (ids, stats), _ = _run(art, lambda s: (s.generate(PROMPTS, NEW, speculative="mtp", draft_tokens=3),
                                           s.last_acceptance))
    assert ids == plain[0]
    assert stats.steps >= NEW - 1 and stats.offered[0] > 0


def test_broken_rollback_is_caught(art, plain, monkeypatch):
    monkeypatch.setattr(undo.PoolUndo, "restore", lambda self, keep: None)
    (ids, _), state = _run(art, lambda s: speculative_generate(s, PROMPTS, NEW, 3, drafts(plain[0], "wrong")))
    assert ids != plain[0] or any(not np.allclose(state[n], plain[1][n], rtol=1e-4, atol=1e-5) for n in state)


@pytest.fixture(scope="module")
def no_mtp_art(tmp_path_factory):
    """tiny from a checkpoint without the MTP block's weights, compiled with --draft-tokens: verify functions,
    no draft functions."""
    from v4compile.config import preset
    from v4compile.init_random import init_random

    ck = init_random(tmp_path_factory.mktemp("ck") / "tiny-no-mtp", preset("tiny"), include_mtp=False)
    fe = frontend.load(str(ck), None, None, TraceOptions(numerics="hf", dtype="fp32", capacity=32))
    return compile_artifact(fe, tmp_path_factory.mktemp("art") / "no-mtp", Buckets((1,), (16,), draft_tokens=1))


def test_no_mtp_weights_refused(art, no_mtp_art):
    from artifact_tamper import manifest

    assert "mtp_draft" not in manifest(no_mtp_art)["buckets"] and manifest(art)["buckets"]["mtp_draft"] is True
    sess = v4compile.load(no_mtp_art, device="cpu", threads=1)
    assert not any(n.startswith("mtp.") for n in sess.art.manifest["weights"]["tensors"])
    with pytest.raises(InputError, match="no MTP weights"):
        mtp_draft(sess)
    with pytest.raises(InputError, match="no MTP weights"):
        sess.generate(PROMPTS[:1], 4, speculative="mtp")
    sess.close()
    sess = v4compile.load(art, device="cpu", threads=1)
    with pytest.raises(InputError, match="top_p"):
        sess.generate(PROMPTS[:1], 4, speculative="mtp", temperature=0.5, top_p=0.9)
    with pytest.raises(InputError, match="draft_tokens"):
        speculative_generate(sess, PROMPTS[:1], 4, 4, drafts([[]], "oracle"))
    sess.close()


def test_cli_refuses_speculative_without_mtp(no_mtp_art, capsys):
    from v4compile.cli import main

    from bad_input_util import assert_one_error

    capsys.readouterr()
    rc = main(["-q", "run", str(no_mtp_art), "--ids", "1,2,3", "--speculative", "mtp", "--draft-tokens", "1",
               "--json", "--device", "cpu", "--threads", "1"])
    r = capsys.readouterr()
    assert_one_error(rc, r.err, "no MTP weights")
    assert r.out == ""


def _with_bucket(art, dest, key, value):
    """A copy of `art` whose manifest's buckets[key] is `value` (None: the entry removed)."""
    from artifact_tamper import copy, manifest, write_manifest

    t = copy(art, dest)
    m = manifest(t)
    if value is None:
        del m["buckets"][key]
    else:
        m["buckets"][key] = value
    write_manifest(t, m)
    return t


@pytest.mark.parametrize("draft_tokens", [None, 2, 8])
def test_manifest_draft_tokens_must_match_the_verify_functions(art, tmp_path, draft_tokens):
    from v4compile.errors import ArtifactError

    from artifact_tamper import manifest

    assert manifest(art)["buckets"]["draft_tokens"] == 3
    t = _with_bucket(art, tmp_path / "t", "draft_tokens", draft_tokens)
    with pytest.raises(ArtifactError, match="draft_tokens|one function per bucket|disagrees"):
        v4compile.load(t, device="cpu", threads=1)


@pytest.mark.parametrize("verify_drafts", [None, [3], [1, 3], [1, 2], [0, 1, 2, 3], [2, 1, 3], "1,2,3"])
def test_manifest_verify_drafts_must_match_the_lane_functions(art, tmp_path, verify_drafts):
    """The cpu target's verify / draft functions of fewer lanes are there exactly for `verify_drafts`, which
    ends at `draft_tokens` (absent: an artifact from before them, K's lanes only)."""
    from v4compile.errors import ArtifactError

    from artifact_tamper import manifest

    assert manifest(art)["buckets"]["verify_drafts"] == [1, 2, 3]
    t = _with_bucket(art, tmp_path / "t", "verify_drafts", verify_drafts)
    with pytest.raises(ArtifactError, match="verify_drafts|one function per bucket"):
        v4compile.load(t, device="cpu", threads=1)


@pytest.mark.parametrize("mtp_draft", [None, False, 1])
def test_manifest_mtp_draft_must_match_the_draft_functions(art, tmp_path, mtp_draft):
    """The MTP block's functions and its window ring in the pool are there exactly when `mtp_draft` says so."""
    from v4compile.errors import ArtifactError

    from artifact_tamper import manifest

    m = manifest(art)
    assert m["pool"]["n_window_layers"] == 6  # tiny's 5 layers + the MTP block's ring
    assert {n for n in m["targets"][0]["functions"] if n.startswith("draft")} == {
        "draft_b1", "draft_b2", "draft_b4", "draft_c16"} | {f"draft_b{b}_d{k}" for b in (1, 2, 4) for k in (1, 2)}
    t = _with_bucket(art, tmp_path / "t", "mtp_draft", mtp_draft)
    with pytest.raises(ArtifactError, match="mtp_draft|one function per bucket|n_window_layers"):
        v4compile.load(t, device="cpu", threads=1)


@pytest.mark.parametrize("iters", [0, 21, "1", True, None])
def test_manifest_draft_sinkhorn_iters_is_checked(art, no_mtp_art, tmp_path, iters):
    """How the MTP block drafts (`--draft-sinkhorn-iters`) is recorded with it: 1 .. the config's iterations, only
    beside `mtp_draft` (absent: an artifact from before it, the config's)."""
    from v4compile.errors import ArtifactError

    from artifact_tamper import manifest

    assert manifest(art)["buckets"]["draft_sinkhorn_iters"] == 20  # tiny's hc_sinkhorn_iters: the block as trained
    assert "draft_sinkhorn_iters" not in manifest(no_mtp_art)["buckets"]
    if iters is None:  # absent: loads, and an artifact without the block may not state it
        v4compile.load(_with_bucket(art, tmp_path / "t", "draft_sinkhorn_iters", None), device="cpu", threads=1).close()
        t = _with_bucket(no_mtp_art, tmp_path / "u", "draft_sinkhorn_iters", 20)
    else:
        t = _with_bucket(art, tmp_path / "t", "draft_sinkhorn_iters", iters)
    with pytest.raises(ArtifactError, match="draft_sinkhorn_iters"):
        v4compile.load(t, device="cpu", threads=1)


def stopped(ids: list[list[int]], stop: list[int]) -> list[list[int]]:
    """Greedy ids as `generate(..., stop_ids=stop)` ends them: each sequence at its first stop id, included
    (a sequence's greedy ids do not depend on the others in its batch)."""
    return [x[: next((j + 1 for j, t in enumerate(x) if t in stop), len(x))] for x in ids]


def test_stop_ids_end_each_sequence_where_plain_decoding_does(art, plain):
    stop = [plain[0][0][10], plain[0][2][5]]
    want = stopped(plain[0], stop)
    assert [len(x) for x in want] != [NEW] * 3
    got, _ = _run(art, lambda s: s.generate(PROMPTS, NEW, stop_ids=stop, speculative="mtp", draft_tokens=3,
                                            draft=drafts(plain[0], "oracle")))
    assert got == want


def test_host_device(art):
    """The same verify functions in the program the host device runs (the C runtime's buffers, reference
    kernels: the Triton kernels' agreement with them is tested elsewhere), k = 3, 16 new tokens (the 3-token
    prompt's window ring wraps). The fp32
    buffers end close to plain decoding's; the quantised ones (FP4 index rows) are not compared: a verify
    chunk's values differ from decode's in the last bits, which flips FP4 codes near a boundary (the oracle,
    which rolls nothing back, differs as much). Their byte-exact rollback is test_spec_rollback_host's."""
    def run(fn):
        sess = v4compile.load(art, device="host", threads=1, kernels="reference")
        try:
            out, types = fn(sess), undo.access(sess.backend).types
            return out, {n: a.view(np.float32) for n, a in pool_bytes(sess.backend).items() if types[n].dtype == "fp32"}
        finally:
            sess.close()

    new = 16
    want, want_state = run(lambda s: s.generate(PROMPTS, new))
    assert "pool.main" in want_state and "state.layers.1.state_kv" in want_state
    for kind in ("oracle", "wrong"):
        ids, state = run(lambda s: s.generate(PROMPTS, new, speculative="mtp", draft_tokens=3,
                                              draft=drafts(want, kind)))
        assert ids == want, kind
        assert state.keys() == want_state.keys()
        for n in state:
            np.testing.assert_allclose(state[n], want_state[n], rtol=1e-4, atol=1e-5, err_msg=n)


def test_compile_draft_tokens_flag(tmp_path):
    from v4compile.cli import main

    from artifact_tamper import manifest
    from bad_input_util import assert_one_error, run_main

    out = tmp_path / "a"
    assert main(["-q", "compile", "--preset", "tiny", "-o", str(out), "--target", "cpu", "--decode-buckets", "1,2",
                 "--prefill-buckets", "16", "--draft-tokens", "1", "--max-context", "32", "--numerics", "hf",
                 "--dtype", "fp32"]) == 0
    fns = manifest(out)["targets"][0]["functions"]
    assert {n: (f["kind"], f["batch"], f["tokens"]) for n, f in fns.items() if n.startswith("verify")} == \
        {"verify_b1": ("verify", 1, 2), "verify_b2": ("verify", 2, 2)}
    # (GPU targets take --draft-tokens too: tests/runtime/test_spec_step_host.py's gfx950 artifact)
    rc, _, err = run_main("-q", "compile", "--preset", "tiny", "-o", str(tmp_path / "b"), "--draft-tokens", "8")
    assert_one_error(rc, err, "--draft-tokens")
    assert not (tmp_path / "b").exists()


def test_run_json_reports_acceptance(art, plain, capsys):
    """`run --speculative`'s output once a draft source exists (here the oracle, handed in directly)."""
    import argparse
    import json

    from v4compile.cli.run import _run_speculative

    sess = v4compile.load(art, device="cpu", threads=1)
    args = argparse.Namespace(temperature=0.0, top_p=1.0, seed=None, max_new_tokens=8, draft_tokens=2, json=True,
                              device="cpu")
    capsys.readouterr()
    assert _run_speculative(args, sess, PROMPTS[0], drafts(plain[0], "oracle"), 0.0) == 0
    sess.close()
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == plain[0][0][:8]
    assert out["acceptance"] == [1.0, 1.0] and out["tokens_per_step"] > 2


def test_continuous_batching(art):
    """Six prompts, at most four live (the largest bucket): the waiting ones join as sequences finish (their
    own lengths: max_new_tokens, or a stop id); each accepts its own number of drafts."""
    prompts = PROMPTS + [[7] * 5, list(range(100, 117)), [1, 2]]
    want, _ = _run(art, lambda s: s.generate(prompts, 20))
    stop = [want[1][6]]
    want = stopped(want, stop)
    full = [p + o for p, o in zip(prompts, want)]
    rng = np.random.default_rng(1)

    def draft(i, ctx, k):
        return [t if rng.random() < 0.5 else (t + 1) % V for t in (full[i][len(ctx): len(ctx) + k] + [0] * k)[:k]]
    (got, stats), _ = _run(art, lambda s: (s.generate(prompts, 20, stop_ids=stop, speculative="mtp", draft_tokens=3,
                                                      draft=draft), s.last_acceptance))
    assert got == want
    assert 0 < stats.rates()[0] < 1


def spec_alone_and_batched(art, seed: int, j: int = 1) -> tuple[list[int], list[int]]:
    """Prompt j sampled speculatively (temperature 1, the compiled MTP block's drafts, k = 2) alone with
    `seed`, and in a batch of four whose seed gives it the same seed (prompt i draws with seed + i)."""
    prompts = PROMPTS + [[7] * 5]

    def gen(s):
        alone = s.generate([prompts[j]], 16, temperature=1.0, seed=seed, speculative="mtp", draft_tokens=2)[0]
        batched = s.generate(prompts, 16, temperature=1.0, seed=seed - j, speculative="mtp", draft_tokens=2)
        assert s.last_acceptance.offered[0] > 0
        return alone, batched[j]
    return _run(art, gen)[0]


def test_sampled_speculative_ids_alone_equal_in_a_batch(art, plain):
    alone, batched = spec_alone_and_batched(art, 5)
    assert alone != plain[0][1][:16]  # sampled, not greedy
    assert alone == batched


def test_one_generator_shared_by_the_speculative_batch_fails_it(art, monkeypatch):
    """All requests of a call drawing (first tokens, drafts, acceptance) from one generator: the test above
    fails."""
    from v4compile.runtime import batcher

    submit = batcher.Batcher.submit

    def shared(self, req, where="prompt"):
        submit(self, req, where)
        self.__dict__.setdefault("_shared", req.rng)
        req.rng = self._shared
        return req
    monkeypatch.setattr(batcher.Batcher, "submit", shared)
    alone, batched = spec_alone_and_batched(art, 5)
    assert alone != batched




def _shared_prefix_spec(s, want=None):
    """Two requests sharing 50 tokens with a cached prompt (hit 48: inside a pool block, copied), decoded in one
    batch speculatively with always-wrong drafts (each step's rejected rows rolled back) on session `s` (its
    cache emptied first); and (`want` None) the ids of plain greedy decoding with the prefix cache off."""
    rng = np.random.default_rng(3)
    head = rng.integers(0, V, 50).tolist()
    ps = [head + rng.integers(0, V, k).tolist() for k in (3, 9)]
    s.clear_prefix_cache()
    if want is None:
        kept, s.cache = s.cache, None
        want = s.generate(ps, 12)
        s.cache = kept
    full = [p + o for p, o in zip(ps, want)]

    def wrong(i, ctx, k):
        return [(t + 1) % V for t in (full[i][len(ctx): len(ctx) + k] + [0] * k)[:k]]

    s.generate([head + [1, 2]], 1)  # keeps the prefix's pieces
    ids = s.generate(ps, 12, speculative="mtp", draft_tokens=2, draft=wrong)
    return ids, s.last_cached_tokens, want


def test_prefix_cache_hits_under_speculative_decoding(art, monkeypatch):
    """With the prefix cache (`runtime/prefix_cache.py`) the rejected drafts never write a shared block: the
    ids are plain greedy decoding's; with the half-shared block taken by reference (no copy) they are not."""
    from v4compile.runtime.session import Session

    sess = v4compile.load(art, device="cpu", threads=1)
    try:
        ids, cached, want = _shared_prefix_spec(sess)
        assert cached == [48, 48] and ids == want

        def shared(self, s, block, P):
            s.blocks.append(block)
            self.cache.hold(block)
        monkeypatch.setattr(Session, "_take_partial", shared)
        ids, cached, _ = _shared_prefix_spec(sess, want)
        assert cached == [48, 48] and ids != want
    finally:
        sess.close()


# ---- the compiled MTP block's prefill through the prefix cache -------------------------------------------


def _mtp_prompts():
    rng = np.random.default_rng(7)
    sys_ = rng.integers(0, V, 40).tolist()
    warm = sys_ + rng.integers(0, V, 5).tolist()
    reqs = [sys_ + rng.integers(0, V, k).tolist() for k in (3, 9)]
    reqs.insert(1, sys_[:32] + [(sys_[32] + 1) % V] + sys_[33:] + [4, 5])
    return warm, reqs


@pytest.fixture(scope="module")
def mtp_cold(art):
    """The requests' plain greedy ids (prompt + new), and the cold run of `_cached_spec` (the cache off)."""
    warm, reqs = _mtp_prompts()
    sess = v4compile.load(art, device="cpu", threads=1)
    try:
        full = [p + o for p, o in zip(reqs, sess.generate(reqs, MTP_NEW))]
    finally:
        sess.close()
    with pytest.MonkeyPatch.context() as mp:
        return full, _cached_spec(art, full, mp, cache=False)


MTP_NEW = 4


def _cached_spec(art, full, monkeypatch, cache: bool, fault: str | None = None):
    """A warm-up prompt, then three sharing its first 40 tokens (the second differs from it at token 32, right
    after a piece), generated with the compiled MTP block and always-wrong drafts (each draft the right id + 1,
    the right ids being plain greedy's). Per request: ids, every MTP-logits row the drafts were made from (the
    block's ring restored from the cache feeds them), its cached prompt tokens; and whether the pool blocks the
    cache held before the requests ran were left untouched by them."""
    from v4compile.runtime import prefix_cache as pc
    from v4compile.runtime.session import Session
    from v4compile.runtime.speculative import CompiledDraft

    warm, reqs = _mtp_prompts()
    sess = v4compile.load(art, device="cpu", threads=1)
    if not cache:
        sess.cache = None
    else:
        sess.clear_prefix_cache()
    seen, base = [], [0]
    make = CompiledDraft.drafts

    def wrong(self, entries, counts, picks):
        seen.extend(e[2].tobytes() for e in entries)
        out = make(self, entries, counts, picks)
        for e, (toks, _) in zip(entries, out):
            right = full[e[0].id - base[0]]
            for j in range(len(toks)):
                toks[j] = (right[min(e[1] + 1 + j, len(right) - 1)] + 1) % V
        return out
    monkeypatch.setattr(CompiledDraft, "drafts", wrong)
    if fault == "next token not in the key":
        lookup, keep = pc.PrefixCache.lookup, Session._keep
        monkeypatch.setattr(pc.PrefixCache, "lookup", lambda self, prompt, look=0: lookup(self, prompt))
        monkeypatch.setattr(Session, "_keep", lambda self, s, prompt, parent, look=0: keep(self, s, prompt, parent))
    elif fault == "the block run a chunk late":  # the old order: a boundary's snapshot misses its chunk's rows
        def late(self, seq, prompt, pick):
            pending = []

            def run(s, fname, inputs, n, rest):
                r = self.s.backend.run_outputs(fname, inputs)
                if pending:
                    self._chunk(s, *pending.pop(), rest[0])
                pending.append((inputs["ids"].shape[1], r["streams"], rest[:n], s.length))
                return r["logits"][0]
            tok, _ = pick(self.s.prefill_into(seq, list(prompt), run))
            logits, out = self._chunk(seq, *pending[-1], tok)
            return tok, (seq, seq.length, logits[0], out[0, len(pending[-1][2]) - 1])
        monkeypatch.setattr(CompiledDraft, "prefill", late)
    try:
        base[0] = sess._next
        sess.generate([warm], 4, speculative="mtp", draft_tokens=3)
        held = sorted(sess.cache.refs) if sess.cache is not None else []
        before = pool_blocks(sess, held)
        seen.clear()
        base[0] = sess._next
        ids = sess.generate(reqs, MTP_NEW, speculative="mtp", draft_tokens=3)
        stats = sess.last_acceptance
        return ids == full_new(full, reqs), seen, list(sess.last_cached_tokens), before == pool_blocks(sess, held), stats
    finally:
        sess.close()


def full_new(full, reqs):
    return [f[len(p):] for f, p in zip(full, reqs)]


def pool_blocks(sess, blocks) -> list[bytes]:
    from v4compile.runtime.undo import access

    store = access(sess.backend)
    geo = store.geometry
    return [store.get_rows(n, b * geo.envelope_rows, geo.envelope_rows).tobytes()
            for b in blocks for n, _, _ in geo.main_planes()]


def test_compiled_mtp_prefill_takes_and_keeps_pieces(art, mtp_cold, monkeypatch):
    """With the cache, the requests take the shared pieces (32 tokens; the one that differs at token 32 only 16:
    a piece's entry is keyed on the token after it too, which the MTP block's ring row before the boundary
    read), keep their own, and give byte for byte the cold run's MTP logits (every draft's source) and plain
    greedy's ids; every draft is rejected and no block the cache held is written."""
    full, (ok_cold, cold, cached_cold, _, _) = mtp_cold
    ok, hot, cached, untouched, stats = _cached_spec(art, full, monkeypatch, cache=True)
    assert ok and ok_cold and cached_cold == [0, 0, 0]
    assert cached == [32, 16, 32] and untouched and sum(stats.accepted) == 0 and sum(stats.offered) > 0
    assert hot == cold


@pytest.mark.parametrize("fault", ["next token not in the key", "the block run a chunk late"])
def test_compiled_mtp_prefill_broken_variants_fail(art, mtp_cold, monkeypatch, fault):
    """Keying the block's entries on the piece alone, or running the block over a chunk only after the next
    chunk (so that a boundary's snapshot misses the block's rows of the chunk just ended): the MTP logits of
    the requests served from the cache differ from the cold run's (their greedy ids stay plain greedy's)."""
    full, (_, cold, _, _, _) = mtp_cold
    ok, hot, cached, _, _ = _cached_spec(art, full, monkeypatch, cache=True, fault=fault)
    assert ok and hot != cold and cached[0] == 32



# ---- the prefix cache under speculation on the host device -----------------------------------------------

HOST_NEW = 3


def _host_cached_spec(art, cache: bool, full: list[int] | None = None):
    """On the host device (the C runtime's buffers, reference kernels), the prefix cache on or off: a 20-token
    prompt (its first piece, 16 tokens, ends inside the first 32-token pool block: kept when the cache is on),
    then a request sharing its first 18 tokens decoded speculatively, 2 drafts a step, each draft the right id
    + 1 (`full`: prompt + plain greedy ids; None: computed here first), so that every verify rolls its rejected
    rows back. Returns `full`, the request's ids, every logits row it was served from (its prefill's and each
    verify's, as bytes), its cached prompt tokens, and the bytes of the pool blocks the cache held before the
    request, taken before and after it."""
    from v4compile.runtime import speculative

    rng = np.random.default_rng(11)
    head = rng.integers(0, V, 20).tolist()
    prompt = head[:18] + [7, 8, 9]
    rows: list[bytes] = []
    pick, acc = speculative.Picker.__call__, speculative.accept

    def recorded_pick(self, logits):
        rows.append(np.asarray(logits, dtype=np.float32).tobytes())
        return pick(self, logits)

    def recorded_accept(d, logits, *a, **k):
        rows.append(np.asarray(logits, dtype=np.float32).tobytes())
        return acc(d, logits, *a, **k)

    sess = v4compile.load(art, device="host", threads=1, kernels="reference", prefix_cache=cache)
    try:
        if full is None:
            full = prompt + sess.generate([prompt], HOST_NEW)[0]
            sess.clear_prefix_cache()

        def wrong(i, ctx, k):
            return [(t + 1) % V for t in (full[len(ctx): len(ctx) + k] + [0] * k)[:k]]

        sess.generate([head], 1)
        held = sorted(sess.cache.refs) if sess.cache is not None else []
        before = pool_blocks(sess, held)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(speculative.Picker, "__call__", recorded_pick)
            mp.setattr(speculative, "accept", recorded_accept)
            ids = sess.generate([prompt], HOST_NEW, speculative="mtp", draft_tokens=2, draft=wrong)[0]
        return full, ids, rows, list(sess.last_cached_tokens), before, pool_blocks(sess, held)
    finally:
        sess.close()


@pytest.fixture(scope="module")
def host_cold(art):
    """`_host_cached_spec` with the prefix cache off."""
    return _host_cached_spec(art, cache=False)


def test_prefix_cache_under_speculation_on_the_host_device(art, host_cold):
    """The request served from the cached piece (a copy of its half-shared block) under speculation with
    always-wrong drafts: byte for byte the cold run's logits rows, plain greedy's ids, and the blocks the cache
    held keep their bytes (the rejected rows are restored inside the request's own blocks)."""
    full, ids_cold, rows_cold, cached_cold, _, _ = host_cold
    _, ids, rows, cached, before, after = _host_cached_spec(art, cache=True, full=full)
    assert cached_cold == [0] and cached == [16]
    assert ids == ids_cold == full[-HOST_NEW:]
    assert len(rows) == len(rows_cold) > 1 and rows == rows_cold
    assert before and after == before


@pytest.mark.parametrize("fault", ["no copy on write", "no snapshot restore"])
def test_prefix_cache_on_the_host_device_broken_variants_fail(art, host_cold, monkeypatch, fault):
    """The same with the copy on write taken out (the half-shared block held by reference: the request's tail
    and its verifies write into the cached block, which the byte comparison sees), or with the piece's
    snapshot not restored into the slot (the rings start empty: the logits rows differ from the cold run's)."""
    from v4compile.runtime.session import Session

    def shared(self, s, block, P):
        s.blocks.append(block)
        self.caches[s.replica].hold(block)
    if fault == "no copy on write":
        monkeypatch.setattr(Session, "_take_partial", shared)
    else:
        monkeypatch.setattr(Session, "_restore", lambda self, *a, **k: None)
    _, _, rows, cached, before, after = _host_cached_spec(art, cache=True, full=host_cold[0])
    assert cached == [16] and before
    if fault == "no copy on write":
        assert after != before
    else:
        assert rows != host_cold[2]
