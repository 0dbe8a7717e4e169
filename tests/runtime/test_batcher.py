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


# ---- lockstep: a partitioned artifact's serving ranks (runtime/lockstep.py), two ranks in this process ----


class _Link:
    """Rank 0's broadcasts to rank 1, in call order, through a queue; `step` checks rank 1's step inputs
    against rank 0's as `distributed.Ranks.step` does (the same typed error)."""

    def __init__(self):
        import queue

        self.q = queue.Queue()

    def ranks(self, rank: int):
        link = self

        class One:
            world = 2

            def __init__(self):
                self.rank = rank

            def _bcast(self, kind, value):
                import queue

                from v4compile.errors import RANKS_DIVERGED, DeviceError, InputError

                if rank == 0:
                    link.q.put((kind, value))
                    return value
                try:
                    k, v = link.q.get(timeout=60)
                except queue.Empty:
                    raise DeviceError("rank 1: broadcast failed (a rank died or did not arrive)") from None
                if k != kind:
                    raise InputError(f"rank 1 waits for a {kind}, rank 0 sent a {k}", code=RANKS_DIVERGED)
                return v

            def share_bytes(self, data):
                return self._bcast("bytes", data)

            def share_ids(self, ids):
                return list(self._bcast("ids", list(ids)))

            def step(self, fname, inputs):
                from v4compile.errors import RANKS_DIVERGED, InputError

                f0, in0 = self._bcast("step", (fname, {k: np.array(v) for k, v in inputs.items()}))
                if f0 != fname or any(not np.array_equal(in0[k], inputs[k]) for k in in0):
                    raise InputError("rank 1's step inputs differ from rank 0's", code=RANKS_DIVERGED)
                return in0
        return One()


@pytest.fixture(scope="module")
def two(sess):
    """Rank 0's session (the module's) and rank 1's (one more of the artifact)."""
    other = v4compile.load(sess.art.path, device="cpu", threads=1)
    yield [sess, other]
    other.close()


def _lockstep(two, prompts, monkeypatch):
    """Rank 1's Batcher on a thread, in lockstep with rank 0's, stepped here: 5 requests for 4 slots; two
    end by their consumer's word at their 2nd token and one at its 1st (decoded once more in the step that
    admitted it), one by its length; the waiting fifth is cancelled; three more join into the freed slots.
    Returns (rank 0's requests, rank 1's by key, rank 1's Batcher)."""
    from v4compile.runtime.lockstep import Lockstep

    import copy

    link = _Link()
    # the ranks start alike, as two ranks that made the same calls (rank 0's session served this module's
    # tests before: its free lists are stacked otherwise than a fresh one's, its prefix cache holds their prompts)
    two[0].clear_prefix_cache()
    monkeypatch.setattr(two[1], "allocs", copy.deepcopy(two[0].allocs))
    bs = []
    for r, s in enumerate(two):
        one = link.ranks(r)
        run = s.backend.run
        monkeypatch.setattr(s.backend, "run", lambda f, i, one=one, run=run: run(f, one.step(f, i)))
        monkeypatch.setattr(s, "share_ids", one.share_ids)
        bs.append(Batcher(s, lockstep=Lockstep(one)))
    b0, b1 = bs
    got = {}  # rank 1's requests by key, as its ticks bring them

    def noted(b, closing, new, cancels):
        got.update((r.key, r) for r in new)
        type(b1.lockstep).apply(b, closing, new, cancels)
    b1.lockstep.apply = noted
    t = __import__("threading").Thread(target=b1.run_forever, daemon=True)
    t.start()

    def ends_at(n):
        return lambda req, _tok: len(req.ids) >= n
    p = [prompts[i % len(prompts)] for i in range(8)]
    reqs = [Request(p[0], 3), Request(p[1], NEW, on_token=ends_at(2)), Request(p[2], NEW, on_token=ends_at(2)),
            Request(p[3], NEW, on_token=ends_at(1)), Request(p[0], NEW)]
    reqs += [Request(p[i], NEW) for i in (1, 2, 3)]
    for r in reqs[:5]:
        b0.submit(r)
    b0.step()
    b0.cancel(reqs[4])
    b0.step()
    for r in reqs[5:]:
        b0.submit(r)
    while b0.busy:
        b0.step()
    b0.lockstep.stop()
    t.join(timeout=60)
    assert not t.is_alive()
    assert [r.finish_reason for r in reqs] == ["length", "stop", "stop", "stop", "cancelled"] + ["length"] * 3
    return reqs, got, b1


def _check_in_step(reqs, theirs, b1) -> None:
    assert b1.died is None, f"rank 1 left the lockstep: {b1.died}"
    assert [theirs[r.key].ids for r in reqs] == [r.ids for r in reqs], "rank 1's ids are not rank 0's"


def test_lockstep_ranks_run_the_same_steps(two, prompts, monkeypatch):
    """Every step of rank 1 is rank 0's (checked at each step, as `Ranks.step` checks it), its requests end
    with rank 0's ids, and its loop ends at rank 0's stop tick."""
    reqs, theirs, b1 = _lockstep(two, prompts, monkeypatch)
    _check_in_step(reqs, theirs, b1)
    assert b1.stopping and not b1.live and not b1.waiting


def test_consumer_ends_applied_out_of_order_leave_the_lockstep(two, prompts, monkeypatch):
    """The planted fault: rank 1 applies a tick's consumer ends in reverse order. Its freed slots stack up
    otherwise, a joining request gets another slot than on rank 0, and the step check ends rank 1's loop."""
    from v4compile.runtime.lockstep import Lockstep

    apply = Lockstep.apply
    monkeypatch.setattr(Lockstep, "apply", staticmethod(
        lambda b, closing, new, cancels: apply(b, closing[::-1] if not b.lockstep.leader else closing, new, cancels)))
    with pytest.raises(AssertionError, match="rank 1 left the lockstep"):
        _check_in_step(*_lockstep(two, prompts, monkeypatch))


def test_a_cancel_not_told_to_the_ranks_leaves_the_lockstep(two, prompts, monkeypatch):
    """The planted fault: rank 0 cancels at once, as a single process does, instead of at the next tick: rank
    1 admits the request rank 0 dropped, and the step check ends its loop."""
    def cancel(self, req):
        req.cancelled = True
    monkeypatch.setattr(Batcher, "cancel", cancel)
    with pytest.raises(AssertionError, match="rank 1 left the lockstep"):
        _check_in_step(*_lockstep(two, prompts, monkeypatch))
