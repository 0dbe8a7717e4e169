"""The server's scheduler (`runtime/batcher.py`) on its own, in one process and without thread timing: requests
submitted before the first step, and one more joining mid-flight, share decode steps, and each request's ids
are `Session.generate`'s for that request run alone (greedy and sampled: temperature, top-p and each
request's own seed), `generate` being the path checked against the reference model elsewhere.

What the steps were is observed through public hooks only (the batcher is being reworked): the backend's
`run`, wrapped to count each decode call's live lanes (pos >= 0), and each request's `on_token`, which tags
the token with the decode call it came from. Planted faults, each failing the assertion named in its test:
one request at a time (no shared step), the lanes' logits handed back in the wrong order (a slot mix-up),
and one random stream shared by every sampled request (the per-request sampling branch).
"""

from __future__ import annotations

import numpy as np
import pytest

import v4compile
from artifact_tamper import compile_cpu, restore_torch_threads  # noqa: F401 (an autouse fixture)
from v4compile.runtime.batcher import Batcher, Request

NEW = 12
# (temperature, top_p, seed) per request: two greedy, two sampled with their own seeds; the last one submitted
# after the second step (it joins live sequences)
SAMPLING = [(0.0, 1.0, None), (0.9, 0.95, 11), (0.0, 1.0, None), (1.2, 0.8, 23)]


@pytest.fixture(scope="module")
def sess(tmp_path_factory):
    art = compile_cpu(tmp_path_factory.mktemp("batcher") / "tiny", "1,4")
    s = v4compile.load(art, device="cpu", threads=1)
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompts(sess):
    rng = np.random.default_rng(39)
    return [rng.integers(1, sess.vocab, size=int(n)).tolist() for n in rng.integers(3, 14, size=len(SAMPLING))]


@pytest.fixture(scope="module")
def alone(sess, prompts):
    """Each request's ids from `Session.generate`, run alone (before any fault is planted)."""
    return [sess.generate([p], NEW, temperature=t, top_p=tp, seed=seed)[0]
            for p, (t, tp, seed) in zip(prompts, SAMPLING)]


class Observed:
    """Each decode call's live lanes, and which decode call each request's tokens came from (-1: prefill)."""

    def __init__(self, sess, monkeypatch):
        self.lanes: list[int] = []
        self.tagged: dict[int, set[int]] = {}  # decode call -> the requests that got a token from it
        self._last_kind = None
        run = sess.backend.run

        def counted(fname, inputs):
            kind = sess.backend.functions()[fname].kind
            if kind == "decode":
                self.lanes.append(int((np.asarray(inputs["pos"]) >= 0).any(axis=-1).sum()))
            self._last_kind = kind
            return run(fname, inputs)
        monkeypatch.setattr(sess.backend, "run", counted)

    def on_token(self, i: int):
        def on(_req, _tok) -> bool:
            step = len(self.lanes) - 1 if self._last_kind == "decode" else -1
            self.tagged.setdefault(step, set()).add(i)
            return False
        return on


def _serve(sess, prompts, monkeypatch) -> tuple[list[Request], Observed]:
    """The requests through one Batcher on this thread: three submitted first, the fourth after step 2."""
    seen = Observed(sess, monkeypatch)
    b = Batcher(sess)
    reqs = [Request(p, NEW, t, tp, seed, on_token=seen.on_token(i))
            for i, (p, (t, tp, seed)) in enumerate(zip(prompts, SAMPLING))]
    for r in reqs[:3]:
        b.submit(r)
    steps = [0]

    def on_step():
        steps[0] += 1
        if steps[0] == 2:
            b.submit(reqs[3])
    b.on_step = on_step
    b.run_until_idle()
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return reqs, seen


def _check_shared_steps(seen: Observed) -> None:
    """Requests really were decoded together: a decode call with every request live, and one in which both
    sampled requests (1 and 3) got their tokens, with a greedy one beside them."""
    assert max(seen.lanes) == len(SAMPLING), f"no decode step held every request: lanes {seen.lanes}"
    both = [k for k, who in seen.tagged.items() if k >= 0 and {1, 3} <= who and who & {0, 2}]
    assert both, f"no decode step sampled two requests beside a greedy one: {seen.tagged}"


def _check_own_ids(reqs: list[Request], alone: list[list[int]]) -> None:
    for i, (r, want) in enumerate(zip(reqs, alone)):
        assert r.ids == want, f"request {i} ({SAMPLING[i]}): not its ids run alone with Session.generate"


def test_requests_share_decode_steps_and_each_gets_its_own_ids(sess, prompts, alone, monkeypatch):
    assert len(set(map(tuple, alone))) == len(alone)  # different requests, different ids: a mix-up would show
    reqs, seen = _serve(sess, prompts, monkeypatch)
    _check_shared_steps(seen)
    _check_own_ids(reqs, alone)


def test_one_request_at_a_time_fails_the_shared_step_check(sess, prompts, alone, monkeypatch):
    """The planted fault: the batcher sees a session of one lane (max_batch 1), so each request runs alone.
    The ids are still right (that check alone cannot tell); `_check_shared_steps` fails."""
    monkeypatch.setattr(type(sess), "max_batch", property(lambda self: 1))
    reqs, seen = _serve(sess, prompts, monkeypatch)
    _check_own_ids(reqs, alone)
    with pytest.raises(AssertionError, match="no decode step held every request"):
        _check_shared_steps(seen)


def test_lanes_handed_back_in_the_wrong_order_fail_the_ids_check(sess, prompts, alone, monkeypatch):
    """The planted fault: `Session.decode` returns its lanes' logits reversed (a slot mix-up). The steps are
    still shared; `_check_own_ids` fails."""
    decode = type(sess).decode
    monkeypatch.setattr(type(sess), "decode", lambda self, seqs, toks: decode(self, seqs, toks)[::-1])
    reqs, seen = _serve(sess, prompts, monkeypatch)
    _check_shared_steps(seen)
    with pytest.raises(AssertionError, match="not its ids run alone"):
        _check_own_ids(reqs, alone)


def test_one_random_stream_for_every_request_fails_the_ids_check(sess, prompts, alone, monkeypatch):
    """The planted fault: every request samples from one shared generator (its own seed ignored), the
    per-request sampling branch's state mixed between requests. `_check_own_ids` fails on a sampled request."""
    shared = np.random.default_rng(11)
    submit = Batcher.submit

    def one_stream(self, req):
        out = submit(self, req)
        req.rng = shared
        return out
    monkeypatch.setattr(Batcher, "submit", one_stream)
    reqs, seen = _serve(sess, prompts, monkeypatch)
    _check_shared_steps(seen)
    with pytest.raises(AssertionError, match=r"request [13] \(.*not its ids run alone"):
        _check_own_ids(reqs, alone)
