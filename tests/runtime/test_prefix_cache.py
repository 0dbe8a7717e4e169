"""The prefix cache (`runtime/prefix_cache.py`) is bit-exact: the logits of every step of requests served
from cached blocks equal, byte for byte, those of the same requests run with the cache off (on the same
session: `session.cache` set aside), on tiny and tiny-pro, cpu and host.

The cases: several requests sharing a system prompt, prefilled one after another and then decoding in
one batch, each writing its own tail (the failure of a per-request window ring shared across requests);
the shared prompt ends inside compression windows and inside the sliding window (50 tokens: the hit is 48,
a boundary inside a pool block of 32 x 2, so that block is copied; 71: the hit is 64, whole blocks only);
pool pressure that evicts entries while a request holds their blocks, then reuse of the prefix; a hit whose
last whole block was kept by a request that had copied its first half. Each check has its deliberately
broken variant, shown to fail: the window rings not restored, the compressor and indexer state rings not
restored, the half-shared block taken by reference (the tails write into it), a whole block taken from the
entry of its first half (whose second half another request wrote), an evicted entry's block freed though a
request holds it.

The host device runs the C runtime with the reference kernels (`kernels="reference"`): what the cache adds
there is the runtime's buffer reads and writes of the rings and blocks; the interpreted Triton kernels (a
minute a prefill chunk on a busy 2-core machine) are covered by the host tests themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

import v4compile
from v4compile.pool import Allocator
from v4compile.runtime import prefix_cache as pc
from v4compile.runtime.session import Session

VOCAB = 512
SEQ_SLOTS = 4


@pytest.fixture(scope="module", params=["tiny", "tiny-pro"])
def art(request, tmp_path_factory):
    from v4compile import frontend
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_artifact
    from v4compile.trace import TraceOptions

    fe = frontend.load(None, request.param, "random", TraceOptions(numerics="hf", dtype="fp32", capacity=128))
    return request.param, compile_artifact(fe, tmp_path_factory.mktemp("pc") / request.param,
                                           Buckets(decode=(SEQ_SLOTS,), prefill=(16,)))


@pytest.fixture(scope="module")
def sessions(art):
    """One session per device for the preset, reused by every case (`fresh` empties it between cases)."""
    name, path = art
    out = {"cpu": v4compile.load(path, device="cpu", threads=1),
           "host": v4compile.load(path, device="host", threads=1, kernels="reference")}
    yield name, out
    for s in out.values():
        s.close()


def fresh(sess: Session) -> Session:
    """An empty cache and pool (a broken variant may have left either wrong)."""
    assert not sess.seqs
    pool = sess.art.manifest["pool"]
    sess.allocs = [Allocator(int(pool["n_slots"]), int(pool["n_blocks"]))]  # one replica: a fresh pool
    sess.cache = pc.PrefixCache(sess.cache.g)
    return sess


def drive(sess: Session, prompts: list[list[int]], steps: int, cache: bool = True):
    """Prefill each prompt (one after another), then `steps` greedy decode steps of all of them in one batch.
    Every step's logits per request `[1 + steps, V]` and the prompt tokens each took from the cache."""
    kept = sess.cache
    if not cache:
        sess.cache = None
    seqs, logs = [], []
    try:
        for p in prompts:
            seqs.append(sess.open())
            logs.append([sess.extend(seqs[-1], p)])
        toks = [int(l[0].argmax()) for l in logs]
        for _ in range(steps):
            out = sess.decode(seqs, toks)
            for l, row in zip(logs, out):
                l.append(row)
            toks = [int(r.argmax()) for r in out]
        cached = [s.cached for s in seqs]
    finally:
        for s in seqs:
            sess.release(s)
        sess.cache = kept
    return [np.stack(l) for l in logs], cached


def same(a, b) -> bool:
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def shared_prompts(shared: int, tails=(3, 11, 20), seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A warm-up prompt and requests (tails of these lengths), all starting with the same `shared` tokens."""
    rng = np.random.default_rng(seed)
    sys_ = rng.integers(0, VOCAB, shared).tolist()
    warm = sys_ + rng.integers(0, VOCAB, 9).tolist()
    return warm, [sys_ + rng.integers(0, VOCAB, k).tolist() for k in tails]


def batch_case(sess: Session, shared: int, steps: int = 4, tails=(3, 11, 20)) -> tuple[bool, list[int]]:
    """Cold and cached logits of requests sharing a prefix, decoding together: equal?"""
    fresh(sess)
    warm, reqs = shared_prompts(shared, tails)
    cold, _ = drive(sess, reqs, steps, cache=False)
    drive(sess, [warm], 0)
    hot, cached = drive(sess, reqs, steps)
    return same(cold, hot), cached


# ---- bit-exact ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "host"])
def test_shared_prefix_decoding_in_one_batch_is_bit_exact(sessions, device):
    """Prefix 50 (hit 48: inside a pool block, which each request copies) on both devices (the host: two
    requests, two steps: its steps are slower); on the cpu with tiny also prefix 71 (hit 64: whole blocks by
    reference). The stats count what happened."""
    name, ss = sessions
    sess = ss[device]
    tails = (3, 11, 20) if device == "cpu" else (3, 20)
    ok, cached = batch_case(sess, 50, 4 if device == "cpu" else 2, tails)
    assert cached == [48] * len(tails) and ok
    st = sess.prefix_cache_stats()
    assert st["copies"] == len(tails) and st["hits"] == len(tails) and st["lookups"] == 1 + len(tails)
    assert st["cached_tokens"] == 48 * len(tails) and st["cached_blocks"] == 3
    # the snapshot size the report states for V4 (`snapshot_bytes`, from the config), here with fp32 rows
    from v4compile.config import preset

    want = pc.snapshot_bytes(preset(name), main_row_bytes=4 * 32, mtp_layers=0)["snapshot_bytes"]
    assert st["snapshot_bytes"] == want * st["entries"]
    if device == "cpu":
        assert later_hit(sess)
    if device == "cpu" and name == "tiny":
        ok, cached = batch_case(sess, 71, steps=3)
        assert cached == [64, 64, 64] and ok
        assert sess.prefix_cache_stats()["copies"] == 0


def later_hit(sess: Session) -> bool:
    """After `batch_case(sess, 50)`: a request whose hit (64) ends with the piece the third request kept
    (48..64, in its copy of the block): bit-exact?"""
    _, reqs = shared_prompts(50)
    later = reqs[2][:66] + [7, 8, 9]
    cold, _ = drive(sess, [later], 2, cache=False)
    hot, cached = drive(sess, [later], 2)
    assert cached == [64]
    return same(cold, hot)


def test_eviction_under_pool_pressure_and_reuse(sessions):
    """Four cached prompts fill 12 of the 16 blocks; a request hitting one of them and three fresh ones then
    need 15 blocks at once: entries go (LRU leaves), never the blocks the hitting request holds; bit-exact,
    and the prefix is hit again after."""
    _, ss = sessions
    sess = fresh(ss["cpu"])
    cold, hot = eviction_case(sess)
    assert same(cold, hot)
    assert sess.prefix_cache_stats()["evicted"] > 0
    assert not sess.cache.refs or all(n > 0 for n in sess.cache.refs.values())


def eviction_case(sess: Session):
    rng = np.random.default_rng(5)
    warm = [rng.integers(0, VOCAB, 100).tolist() for _ in range(4)]
    a = warm[0][:70] + rng.integers(0, VOCAB, 6).tolist()
    fresh_ = [rng.integers(0, VOCAB, 100).tolist() for _ in range(3)]
    cold, _ = drive(sess, [a, *fresh_], 3, cache=False)
    cold_a, _ = drive(sess, [a], 2, cache=False)
    for w in warm:
        drive(sess, [w], 0)
    assert len(sess.free_blocks) == 4
    hot, cached = drive(sess, [a, *fresh_], 3)
    assert cached[0] == 64
    again, cached = drive(sess, [a], 2)  # after the evictions: cached again (by the fresh prompts) or not
    assert same(cold_a, again)
    return cold, hot


# ---- the broken variants fail the checks ---------------------------------------------------------------


@pytest.mark.parametrize("skip", ["pool.", "state."])
def test_rings_not_restored_fail(sessions, monkeypatch, skip):
    """Restoring the snapshot without the window rings (pool.*) or without the compressor / indexer state
    rings (state.*) changes the logits."""
    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")
    restore = Session._restore
    monkeypatch.setattr(Session, "_restore", lambda self, slot, snap, P, replica=0: restore(
        self, slot, {k: (v if not k.startswith(skip) else self._snapshot(slot, P)[k]) for k, v in snap.items()}, P))
    ok, cached = batch_case(ss["cpu"], 50)
    assert cached == [48, 48, 48] and not ok


def test_half_shared_block_by_reference_fails(sessions, monkeypatch):
    """The block the boundary is inside, taken by reference instead of copied: the tails of the requests
    decoding together write into it (each other's compressed rows)."""
    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")

    def shared(self, s, block, P):
        s.blocks.append(block)
        self.cache.hold(block)
    monkeypatch.setattr(Session, "_take_partial", shared)
    ok, cached = batch_case(ss["cpu"], 50)
    assert cached == [48, 48, 48] and not ok


def test_block_of_the_first_half_fails(sessions, monkeypatch):
    """A whole block taken as the block of its first half's entry: that block's second half is the tail of
    the request that kept the first half, not the prefix's."""
    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")
    from v4compile.runtime import session as session_mod

    def first(hit, n, g, bt):  # the entry holding the block's first token
        return [hit[j * bt // g].blocks[j - hit[j * bt // g].index * g // bt] for j in range(n)]
    monkeypatch.setattr(session_mod, "whole_blocks", first)
    sess = ss["cpu"]
    ok, _ = batch_case(sess, 50)
    assert ok and not later_hit(sess)


def test_evicting_a_block_in_use_fails(sessions, monkeypatch):
    """An evicted entry's block freed whoever holds it: a fresh request gets the block the hitting one reads."""
    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")
    evict = pc.PrefixCache._evict_one

    def careless(self, keep=None):
        before = dict(self.refs)
        out = evict(self, keep)
        if out == []:  # held by a sequence: freed anyway
            gone = [b for b, n in before.items() if self.refs.get(b, 0) < n]
            for b in gone:
                self.refs.pop(b, None)
            return gone
        return out
    monkeypatch.setattr(pc.PrefixCache, "_evict_one", careless)
    sess = fresh(ss["cpu"])
    with pytest.raises(AssertionError):
        cold, hot = eviction_case(sess)
        assert same(cold, hot)
    fresh(sess)


def test_off(sessions):
    """`prefix_cache=False` is no cache (None stats); a bad value is one typed error."""
    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")
    sess = ss["cpu"]
    kept, sess.cache = sess.cache, None
    assert sess.prefix_cache_stats() is None
    sess.cache = kept
    for bad, param in (("yes", "prefix_cache"), (-1, "prefix_cache_bytes")):
        with pytest.raises(v4compile.errors.InputError) as e:
            v4compile.load(sess.art.path, device="cpu", **{param: bad})
        assert e.value.param == param


def test_snapshot_bound_and_lru_leaves():
    """No device: the snapshot bound keeps the least recently used leaves out (never the new entry's chain),
    an entry that cannot fit is not kept, and a dropped entry frees its block only when nothing holds it."""
    snap = {"x": np.zeros(10, np.uint8)}
    c = pc.PrefixCache(2, max_bytes=30)
    a, _ = c.insert(None, [1, 2], 0, [7], snap)  # block 7: a sequence's own, held by it and the entry now
    b, _ = c.insert(a, [3, 4], 1, [7], snap)
    other, _ = c.insert(None, [9, 9], 0, [8], snap)
    c.drop(8)  # its sequence ended
    assert c.refs == {7: 3, 8: 1} and c.nbytes == 30
    assert [e.end for e in c.lookup([1, 2, 3, 4, 5])] == [2, 4]  # a and b used last: `other` is the LRU leaf
    d, freed = c.insert(b, [5, 6], 2, [9], snap)
    assert d is not None and freed == [8] and other.key not in c.entries
    big, _ = c.insert(d, [7, 7], 3, [9], {"x": np.zeros(40, np.uint8)})
    assert big is None and c.stats.skipped == 1
    assert c.clear() == [] and c.refs == {7: 1, 9: 1}  # blocks 7 and 9: their sequences still hold them
    assert c.drop(7) and c.drop(9) and not c.refs and not c.entries and c.nbytes == 0


# ---- the copies: issued by the C runtime from its copy table, checked by the host device ----------------


def _host(ss) -> Session:
    sess = fresh(ss["host"])
    sess.backend._copies = None  # the copy table made again from `snapshot.copy_ranges` (a test may patch it)
    return sess


def test_copies_are_issued_by_the_runtime_and_checked(sessions, monkeypatch):
    """On the host device the snapshot, its restore and the block copy of a hit are copies the C runtime issues
    from its copy table, each handed to the host device's check (`copy_check.py`) before it is made: bytes
    within what the program says the copy needs, all of it, the right direction."""
    from v4compile.runtime import copy_check

    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")
    seen = []
    check = copy_check.CopyCheck.copy
    monkeypatch.setattr(copy_check.CopyCheck, "copy", lambda self, i, kind, dst, src, n: (
        seen.append((self.cur[0], kind)), check(self, i, kind, dst, src, n))[1])
    sess = _host(ss)
    ok, cached = batch_case(sess, 50, steps=1, tails=(3,))
    assert ok and cached == [48]
    assert {("save", 0), ("restore", 1), ("block", 2)} <= set(seen)


@pytest.mark.parametrize("fault", ["slot range", "block range", "late snapshot", "tail after restore",
                                   "wrong direction"])
def test_a_planted_copy_fault_is_caught(sessions, monkeypatch, fault):
    """Each fault is refused by the host device's check with one clear DeviceError: a slot range or a block
    range of the copy table one row off (a slot's one row down: one up is past the buffer's end, which the C
    runtime refuses itself); a snapshot taken after the next chunk ran (the ring rows past the
    boundary written already); a step after a restore that does not continue from the boundary; a restore
    issued as a save (the wrong direction)."""
    from v4compile.errors import DeviceError
    from v4compile.runtime import snapshot

    name, ss = sessions
    if name != "tiny":
        pytest.skip("one preset shows it")
    if fault.endswith("range"):
        group = snapshot.SLOT if fault == "slot range" else snapshot.BLOCK
        ranges = snapshot.copy_ranges

        def shifted(*a):
            out = ranges(*a)
            i = next(i for i, r in enumerate(out) if r[1] == group)
            n, g, first, stride, rows = out[i]
            return out[:i] + [(n, g, first + (-1 if group == snapshot.SLOT else 1), stride, rows)] + out[i + 1:]
        monkeypatch.setattr(snapshot, "copy_ranges", shifted)
    sess = _host(ss)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 40).tolist()
    try:
        with pytest.raises(DeviceError) as e:
            if fault == "late snapshot":  # 32 tokens in (two chunks), the snapshot of the first boundary
                kept, sess.cache = sess.cache, None
                s = sess.open()
                sess.extend(s, prompt[:32])
                sess.cache = kept
                sess._snapshot(s.slot, 32)  # in order: accepted
                sess._snapshot(s.slot, 16)
            elif fault == "tail after restore":
                s = sess.open()
                sess.extend(s, prompt[:20])
                snap = sess._snapshot(s.slot, 20)
                sess._restore(s.slot, snap, 16)
                sess.decode([s], [1])  # position 20, not the boundary 16
            elif fault == "wrong direction":
                copies = snapshot.copies(sess.backend)
                monkeypatch.setattr(copies, "kinds", (copies.kinds[0],) * 3)
                drive(sess, [prompt], 0)
                drive(sess, [prompt[:36]], 0)
            else:  # the ranges: the first snapshot (slot) or the first hit's block copy
                drive(sess, [prompt], 0)
                drive(sess, [prompt[:20]], 0)
        msg = str(e.value)
        assert {"slot range": "not rows the program says", "block range": "not rows the program says",
                "late snapshot": "out of order", "tail after restore": "then a step wrote from position 20",
                "wrong direction": "wrong direction"}[fault] in msg, msg
    finally:
        for s in list(sess.seqs.values()):
            sess.release(s)
        sess.backend._copies = None


# ---- data parallel: one cache per replica, placement by cached prefix -------------------------------------


class Replicas:
    """Data parallelism simulated in one process: each replica an unpartitioned cpu backend of its own (its own
    pool and rings), a step's inputs one entry per replica as the session stacks them (`Session._run`)."""

    def __init__(self, backends):
        self.backends = backends

    def functions(self):
        return self.backends[0].functions()

    def replica(self, d: int):
        return self.backends[d]

    def run(self, fname, stacked):
        return [b.run(fname, {k: v[d] for k, v in stacked.items()}) for d, b in enumerate(self.backends)]

    def close(self):
        for b in self.backends:
            b.close()


def dp_session(path, cache: bool) -> Session:
    import copy

    from v4compile.artifact import load_artifact
    from v4compile.runtime.cpu_backend import OrtBackend

    art = load_artifact(path)
    dp_art = copy.copy(art)
    dp_art.manifest = {**art.manifest, "parallel": {"dp": 2}}
    return Session(dp_art, Replicas([OrtBackend(art, threads=1) for _ in range(2)]), prefix_cache=cache)


@pytest.fixture(scope="module")
def dp_sessions(art):
    """Two-replica sessions of tiny, the cache on and off (reused by the cases: `dp_case` empties them)."""
    name, path = art
    if name != "tiny":
        pytest.skip("one preset shows it")
    out = {True: dp_session(path, True), False: dp_session(path, False)}
    yield out
    for sess in out.values():
        sess.close()


def dp_case(sessions, monkeypatch, fault: str | None = None):
    """A warm-up prompt, then one unrelated prompt and two sharing the warm-up's first 50 tokens, in one
    `generate` (greedy, 3 new tokens): the replica each lands on, the tokens each took from the cache, and
    whether every logits row each request sampled from equals byte for byte the cache-off run's with the same
    placement (each replica's batches alike)."""
    from v4compile.runtime.batcher import Batcher

    warm, reqs = shared_prompts(50, tails=(3, 11))
    reqs.insert(0, np.random.default_rng(9).integers(0, VOCAB, 40).tolist())
    rows, placed = {}, []
    pick, place = Batcher._pick, Session.place
    monkeypatch.setattr(Batcher, "_pick", lambda self, r, row: (
        rows.setdefault(r.index, []).append(np.asarray(row).tobytes()), pick(self, r, row))[1])

    def run(cache, forced=None):
        rows.clear()
        placed.clear()
        monkeypatch.setattr(Session, "place", lambda self, prompt=None: placed.append(
            forced.pop(0) if forced else place(self, prompt)) or placed[-1])
        sess = sessions[cache]
        pool = sess.art.manifest["pool"]
        sess.allocs = [Allocator(int(pool["n_slots"]), int(pool["n_blocks"])) for _ in range(2)]
        kept = sess.caches
        if cache:  # empty caches (the broken variant: one object for both replicas)
            c = pc.PrefixCache(kept[0].g)
            sess.caches = [c, c] if fault == "one cache for both replicas" else [c, pc.PrefixCache(c.g)]
        try:
            sess.generate([warm], 3)
            sess.generate(reqs, 3)
            return dict(rows), list(placed), list(sess.last_cached_tokens)
        finally:
            sess.caches = kept
    forced = [0, 1, 1, 0] if fault == "one cache for both replicas" else None
    hot, where, cached = run(True, list(forced) if forced else None)
    cold, _, _ = run(False, list(where))
    return where, cached, hot == cold


def test_data_parallel_replicas_keep_their_own_cache(dp_sessions, monkeypatch):
    """Rank-local under data parallelism (two replicas in one process): the prompts sharing the warm-up's prefix
    land on the replica holding it (placement: cache hit first, then the fewest live sequences, the most free
    blocks), take its 48 tokens there, and are bit-exact with the cache off; the unrelated prompt goes to the
    other replica (it has more free blocks). Broken: one cache for both replicas, the shared prompts sent to the
    other replica, hit blocks of a pool they are not in: the logits differ."""
    where, cached, ok = dp_case(dp_sessions, monkeypatch)
    assert where == [0, 1, 0, 0] and cached == [0, 48, 48] and ok
    where, cached, ok = dp_case(dp_sessions, monkeypatch, "one cache for both replicas")
    assert cached == [0, 48, 48] and not ok
