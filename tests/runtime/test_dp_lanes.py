"""`Session.run_lanes` (a speculative step's verify and draft calls on a data-parallel artifact): each replica's
sequences go to its own batch, in their order, padding after them and for a replica without any, and every
output comes back to its sequence's lane. A backend standing in for the ranks echoes each replica's inputs
as its outputs (what rank r of replica d would see), so the mapping is checked alone, in this process."""

from __future__ import annotations

import numpy as np
import pytest

from v4compile.runtime.session import SeqState, Session


class Echo:
    """`run_outputs` of a data-parallel backend: the stacked step inputs `[dp, B, ...]`, kept, echoed back."""

    def __init__(self):
        self.seen = None

    def run_outputs(self, fname, inputs):
        self.seen = inputs
        return {"logits": inputs["ids"].astype(np.float32), "streams": inputs["hidden"]}


def session(dp: int) -> Session:
    s = Session.__new__(Session)
    s.dp, s.blocks_per_seq, s.backend = dp, 3, Echo()
    return s


def test_lanes_go_to_their_replicas_and_back():
    s = session(3)
    seqs = [SeqState(i, slot=i % 2, blocks=[10 + i], replica=r) for i, r in enumerate([1, 0, 1, 1, 0])]
    B, T = 4, 2
    n = len(seqs)
    ids = np.arange(1, n * T + 1, dtype=np.int64).reshape(n, T)
    pos = np.arange(n * T, dtype=np.int64).reshape(n, T) + 100
    hidden = np.random.default_rng(0).standard_normal((n, T, 2)).astype(np.float32)
    assert s.lanes(seqs) == 3
    out = s.run_lanes("verify_b4", B, seqs, {"ids": ids, "pos": pos, "hidden": hidden})
    got = s.backend.seen
    assert got["ids"].shape == (3, B, T) and got["hidden"].shape == (3, B, T, 2)
    for d, mine in enumerate([[1, 4], [0, 2, 3], []]):
        k = len(mine)
        assert np.array_equal(got["ids"][d, :k], ids[mine]) and not got["ids"][d, k:].any()
        assert np.array_equal(got["pos"][d, :k], pos[mine]) and (got["pos"][d, k:] == -1).all()
        assert np.array_equal(got["slot"][d, :k], [seqs[i].slot for i in mine]) and (got["slot"][d, k:] == -1).all()
        assert np.array_equal(got["block_table"][d, :k, 0], [seqs[i].blocks[0] for i in mine])
    assert np.array_equal(out["logits"][:n], ids.astype(np.float32))  # back in the sequences' order
    assert np.array_equal(out["streams"][:n], hidden)


def test_a_lane_sent_back_to_another_sequence_is_caught(monkeypatch):
    """The check above with the echo handing replica 1's first two lanes back swapped: it fails."""
    real = Echo.run_outputs

    def swapped(self, fname, inputs):
        out = real(self, fname, inputs)
        out["logits"] = out["logits"].copy()
        out["logits"][1, [0, 1]] = out["logits"][1, [1, 0]]
        return out

    monkeypatch.setattr(Echo, "run_outputs", swapped)
    with pytest.raises(AssertionError):
        test_lanes_go_to_their_replicas_and_back()
