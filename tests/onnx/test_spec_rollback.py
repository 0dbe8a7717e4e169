"""Rollback of the compiled pool (`runtime/undo.py`) on the cpu device: decode three rejected tokens (they cross a
CSA and an HCA window close, so they write window rings, compressor rings, compressed and indexer rows),
restore, go on with the true tokens: logits and every pool / state byte equal a run that never saw the
rejected tokens. Without the restore they do not (the broken variant)."""

from __future__ import annotations

import numpy as np
import pytest

import v4compile
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.driver import compile_artifact
from v4compile.runtime.undo import PoolUndo, access, geometry_of, written_rows
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = list(range(3, 16))  # 13 tokens; two decodes later the next position is 15, closing CSA / HCA windows
TRUE = [21, 7, 99, 4, 250]
WRONG = [300, 301, 302]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    return compile_artifact(fe, tmp_path_factory.mktemp("art") / "tiny", Buckets(decode=(1,), prefill=(16,)))


def pool_bytes(backend) -> dict[str, np.ndarray]:
    """Every pool plane and state ring, as bytes (cpu: the backend's arrays; host: the C runtime's buffers)."""
    store = access(backend)
    return {n: np.asarray(store.get_all(n)).copy() for n in sorted(store.names()) if n.startswith(("pool.", "state."))}


def run(art, rejected: bool, restore: bool = True, device: str = "cpu"):
    # host: the C runtime's buffers with the ops' reference kernels (the rollback is row copies; the Triton
    # kernels' own agreement with the references is tested elsewhere)
    sess = v4compile.load(art, device=device, threads=1, **({"kernels": "reference"} if device == "host" else {}))
    s = sess.open()
    sess.extend(s, PROMPT)
    logits = [sess.decode([s], [t])[0] for t in TRUE[:2]]
    if rejected:
        L = s.length
        for q in range(L, L + len(WRONG)):  # the blocks a verify step reserves for its lanes
            sess._reserve(s, q)
        undo = PoolUndo(sess.backend, geometry_of(sess.art.manifest), [(s.slot, list(s.blocks), L, L + 2)])
        for t in WRONG:
            sess.decode([s], [t])
        if restore:
            undo.restore({s.slot: L})
        s.length = L
    logits += [sess.decode([s], [t])[0] for t in TRUE[2:]]
    state = pool_bytes(sess.backend)
    sess.close()
    return np.stack(logits), state


@pytest.fixture(scope="module")
def plain(art):
    return run(art, rejected=False)


@pytest.fixture(scope="module")
def plain_host(art):
    return run(art, rejected=False, device="host")


def test_the_rejected_positions_write_every_kind_of_state(art):
    sess = v4compile.load(art, device="cpu", threads=1)
    s = sess.open()
    sess.extend(s, PROMPT + TRUE[:2])
    names = {n for n, _ in written_rows(geometry_of(sess.art.manifest), access(sess.backend), s.slot, s.blocks, 15)}
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


def test_the_host_device_restores_its_buffers(art, plain_host, plain):
    """The C runtime's buffers (host device: the GPU's stand-in), read and written a row at a time."""
    logits, state = run(art, rejected=True, device="host")
    assert np.allclose(plain_host[0], plain[0], atol=1e-4)  # the same model on both devices
    assert np.array_equal(logits, plain_host[0])
    for k in state:
        assert np.array_equal(state[k], plain_host[1][k]), k
