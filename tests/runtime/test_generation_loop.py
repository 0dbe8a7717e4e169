"""The one generation loop (`runtime/batcher.py`) through `Session.generate`, on the cpu device:

* a request's sampled ids (seeded, temperature 1) are the same alone and in a batch of 8 (each request its
  own generator; `generate` seeds prompt i with seed + i): one generator shared by the batch, as before,
  fails the same assertion;
* one session used from several threads at once (greedy and seeded sampling, several rounds): each call
  gets exactly the ids it gets alone, run one after another; with the session's lock dropped the same
  assertion fails (a short sleep after the cpu backend places a step's inputs widens the real race: the
  backend writes a step's inputs into the arrays bound to a function's one ONNX Runtime binding, then runs
  it).
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

import v4compile
from artifact_tamper import compile_cpu
from v4compile.runtime import batcher as batcher_mod
from v4compile.runtime import cpu_backend

NEW = 10
VOCAB = 512  # tiny's


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return compile_cpu(tmp_path_factory.mktemp("loop") / "tiny", "1,8")  # 8 slots


@pytest.fixture
def session(art):
    s = v4compile.load(art, device="cpu", threads=1)
    yield s
    s.close()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(k)).tolist() for k in rng.integers(2, 15, n)]


# ---- a request's sampled ids do not depend on its batch ----------------------------------------------


def alone_and_batched(s, seed: int, j: int = 5) -> tuple[list[int], list[int]]:
    """Prompt j of 8 sampled (temperature 1) alone with `seed`, and in one `generate` over all 8 whose
    seed gives prompt j the same seed (seed - j: prompt i draws with seed + i)."""
    ps = prompts(8, seed)
    alone = s.generate([ps[j]], NEW, temperature=1.0, seed=seed)[0]
    batched = s.generate(ps, NEW, temperature=1.0, seed=seed - j)
    assert len({tuple(x) for x in batched}) == 8  # 8 different requests, really sampled
    return alone, batched[j]


def test_sampled_ids_alone_equal_in_a_batch_of_8(session):
    """Catches a generator shared by a call's requests (the next test plants it)."""
    greedy = session.generate(prompts(8, 11)[5:6], NEW)[0]
    alone, batched = alone_and_batched(session, 11)
    assert alone != greedy  # temperature 1 samples (else this test shows nothing)
    assert alone == batched


def test_one_generator_shared_by_the_batch_fails_it(session, monkeypatch):
    """The old rule (every request of a call drawing from one generator) fails the test above."""
    submit = batcher_mod.Batcher.submit

    def shared(self, req, where="prompt"):
        submit(self, req, where)
        if not hasattr(self, "_shared"):
            self._shared = req.rng
        req.rng = self._shared
        return req
    monkeypatch.setattr(batcher_mod.Batcher, "submit", shared)
    alone, batched = alone_and_batched(session, 11)
    assert alone != batched


# ---- one session, several threads --------------------------------------------------------------------

THREADS, ROUNDS = 3, 3


def calls() -> list[list[dict]]:
    """[thread][round] -> generate's arguments: two prompts each, greedy or seeded temperature 1."""
    return [[{"prompts": prompts(2, 100 * t + r), "max_new_tokens": NEW,
              "temperature": 0.0 if (t + r) % 2 == 0 else 1.0, "seed": 10 * t + r} for r in range(ROUNDS)]
            for t in range(THREADS)]


def slow_binding(monkeypatch) -> None:
    """A sleep after each step's inputs are placed in a session's bound arrays (wider windows for another
    thread between placing them and the run)."""
    real = cpu_backend._StepInputs.place

    def place(self, inputs):
        real(self, inputs)
        time.sleep(0.002)
    monkeypatch.setattr(cpu_backend._StepInputs, "place", place)


def threaded(s, work: list[list[dict]]) -> list[list]:
    """Each thread's rounds of `generate` on the one session, all threads at once: [thread][round] -> ids
    (or the error's text)."""
    out = [[None] * ROUNDS for _ in work]
    start = threading.Barrier(len(work), timeout=60)

    def worker(t):
        start.wait()
        for r, kw in enumerate(work[t]):
            try:
                kw = dict(kw)
                out[t][r] = s.generate(kw.pop("prompts"), **kw)
            except Exception as e:  # noqa: BLE001 (a race may raise instead: a result that differs)
                out[t][r] = f"{type(e).__name__}: {e}"
    ts = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(len(work))]
    for x in ts:
        x.start()
    for x in ts:
        x.join(timeout=300)
    assert not any(x.is_alive() for x in ts), "a generate thread hangs"
    return out


def sequential(s, work) -> list[list]:
    return [[s.generate(kw["prompts"], **{k: v for k, v in kw.items() if k != "prompts"}) for kw in rounds]
            for rounds in work]


def test_threads_get_what_each_gets_alone(session, monkeypatch):
    """Catches a session whose calls from several threads interleave (the next test drops the lock)."""
    work = calls()
    want = sequential(session, work)
    slow_binding(monkeypatch)
    assert threaded(session, work) == want
    assert not session.seqs and len(session.free_slots) == 8


def test_without_the_lock_threads_get_other_ids(session, monkeypatch):
    """The session's lock dropped: the same comparison fails (wrong ids, or an error from the race)."""
    work = calls()
    want = sequential(session, work)
    slow_binding(monkeypatch)
    monkeypatch.setattr(session, "lock", contextlib.nullcontext())
    assert threaded(session, work) != want
