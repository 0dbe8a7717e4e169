"""Rollback of the compiled pool (`runtime/undo.py`) on the cpu device: decode three rejected tokens (they cross a
CSA and an HCA window close, so they write window rings, compressor rings, compressed and indexer rows),
restore, go on with the true tokens: logits and every pool / state byte equal a run that never saw the
rejected tokens. What each rejected decode writes is observed (the pool and state bytes before and after
it), not taken from `undo.py`'s table: every kind of state changes, and every changed row is one the undo
saves. Broken variants: no restore at all, and a rollback that leaves only the compressor rings
(`state_kv` / `state_gate`) unrestored."""

from __future__ import annotations

import numpy as np
import pytest

import v4compile
from v4compile.runtime import undo

from spec_rollback import PROMPT, TRUE, WRONG, cpu_artifact, pool_bytes, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = {"window ring", "compressed row", "indexer row", "state_kv", "state_gate", "index_state_kv",
         "index_state_gate"}


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return cpu_artifact(tmp_path_factory.mktemp("art") / "tiny")


@pytest.fixture(scope="module")
def plain(art):
    return run(art, rejected=False)


def _rows(a: np.ndarray) -> np.ndarray:
    """A buffer as the undo's rows (its last axis one row), each row's bytes."""
    return np.ascontiguousarray(a).reshape(-1, a.shape[-1]).view(np.uint8)


def _observe(art) -> list[tuple[int, set, set]]:
    """Per rejected position q: (q, the (buffer, row)s whose bytes its decode changed, the rows the undo
    saves for q)."""
    sess = v4compile.load(art, device="cpu", threads=1)
    s = sess.open()
    sess.extend(s, PROMPT)
    for t in TRUE[:2]:
        sess.decode([s], [t])
    L = s.length
    for q in range(L, L + len(WRONG)):  # the blocks a verify step reserves for its lanes
        sess.reserve(s, q)
    store = undo.access(sess.backend)
    out = []
    for q, t in zip(range(L, L + len(WRONG)), WRONG):
        before = pool_bytes(sess.backend)
        sess.decode([s], [t])
        after = pool_bytes(sess.backend)
        changed = {(n, int(r)) for n in after for r in np.flatnonzero((_rows(after[n]) != _rows(before[n])).any(-1))}
        out.append((q, changed, set(undo.written_rows(store.geometry, store, s.slot, list(s.blocks), q))))
    sess.close()
    return out


def _kind(geo, name: str, row: int) -> str:
    if name.startswith("pool.main"):  # a slot's window rings lie after every block's envelope
        return "window ring" if row >= geo.n_rows - geo.n_slots * geo.slot_rows else "compressed row"
    if name.startswith("pool.index"):
        return "indexer row"
    return name.rsplit(".", 1)[1]


def _check_writes_saved(art, observed) -> None:
    geo = undo.geometry_of(v4compile.load(art, device="cpu", threads=1).art.manifest)
    kinds = {_kind(geo, n, r) for _, changed, _ in observed for n, r in changed}
    assert kinds == KINDS, f"the rejected decodes changed {sorted(kinds)}"
    for q, changed, saved in observed:
        assert changed <= saved, f"position {q} wrote rows the undo does not save: {sorted(changed - saved)[:4]}"


def _drop_compressor_rings(monkeypatch) -> None:
    """The planted fault: the undo's table without the compressor rings (`state_kv`, `state_gate`; the
    indexer's rings and every pool row still saved and restored)."""
    table = undo.written_rows
    monkeypatch.setattr(undo, "written_rows", lambda *a, **k: [(n, r) for n, r in table(*a, **k)
                                                               if not n.endswith((".state_kv", ".state_gate"))])


def test_the_rejected_positions_write_every_kind_of_state(art):
    """Observed, not taken from the table: the three rejected decodes change window rings, compressed and
    indexer rows and all four compressor / indexer rings, and each changed row is one the undo saves."""
    _check_writes_saved(art, _observe(art))


def test_a_table_without_the_compressor_rings_fails_the_observation(art, monkeypatch):
    _drop_compressor_rings(monkeypatch)
    with pytest.raises(AssertionError, match="wrote rows the undo does not save"):
        _check_writes_saved(art, _observe(art))


def _check_restored(got, plain) -> None:
    logits, state = got
    assert state.keys() == plain[1].keys()
    differ = [k for k in state if not np.array_equal(state[k], plain[1][k])]
    assert differ == [], f"not restored: {differ}"
    assert np.array_equal(logits, plain[0]), "the logits after the rollback differ"


def test_restored_pool_equals_never_decoding_them(art, plain):
    _check_restored(run(art, rejected=True), plain)


def test_without_the_restore_the_pool_differs(art, plain):
    logits, state = run(art, rejected=True, restore=False)
    assert any(not np.array_equal(state[k], plain[1][k]) for k in state)
    assert not np.array_equal(logits, plain[0])
    with pytest.raises(AssertionError, match="not restored"):
        _check_restored((logits, state), plain)


def test_a_rollback_that_skips_the_compressor_rings_is_caught(art, plain, monkeypatch):
    """The compressor-state-only fault (`_drop_compressor_rings`): right after the rollback exactly the
    compressor rings differ from before the rejected decodes (the pool rows and indexer rings came back);
    the true tokens decoded after it then carry the difference on, and `_check_restored` fails."""
    _drop_compressor_rings(monkeypatch)
    snaps: dict = {}
    got = run(art, rejected=True, snapshots=snaps)
    left = {k for k in snaps["before"] if not np.array_equal(snaps["before"][k], snaps["restored"][k])}
    assert left and all(k.endswith((".state_kv", ".state_gate")) and ".index_" not in k for k in left), left
    with pytest.raises(AssertionError, match="not restored"):
        _check_restored(got, plain)
