"""Rollback of the compiled pool (`runtime/undo.py`) on the cpu device: decode three rejected tokens (they cross a
CSA and an HCA window close, so they write window rings, compressor rings, compressed and indexer rows),
restore, go on with the true tokens: logits and every pool / state byte equal a run that never saw the
rejected tokens. Without the restore they do not (the broken variant)."""

from __future__ import annotations

import numpy as np
import pytest

import v4compile
from v4compile.runtime.undo import access, written_rows

from spec_rollback import PROMPT, TRUE, cpu_artifact, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return cpu_artifact(tmp_path_factory.mktemp("art") / "tiny")


@pytest.fixture(scope="module")
def plain(art):
    return run(art, rejected=False)


def test_the_rejected_positions_write_every_kind_of_state(art):
    sess = v4compile.load(art, device="cpu", threads=1)
    s = sess.open()
    sess.extend(s, PROMPT + TRUE[:2])
    store = access(sess.backend)
    names = {n for n, _ in written_rows(store.geometry, store, s.slot, s.blocks, 15)}
    assert {"pool.main", "pool.index"} <= names
    assert any(n.endswith(".index_state_kv") for n in names) and any(n.endswith(".state_gate") for n in names)
    sess.close()


def test_restored_pool_equals_never_decoding_them(art, plain):
    logits, state = run(art, rejected=True)
    assert np.array_equal(logits, plain[0])
    assert state.keys() == plain[1].keys()
    for k in state:
        assert np.array_equal(state[k], plain[1][k]), k


def test_without_the_restore_the_pool_differs(art, plain):
    logits, state = run(art, rejected=True, restore=False)
    assert any(not np.array_equal(state[k], plain[1][k]) for k in state)
    assert not np.array_equal(logits, plain[0])

