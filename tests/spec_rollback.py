"""Speculative rollback on a compiled artifact (`runtime/undo.py`), shared by the cpu and host device tests: decode
two true tokens, then three rejected ones (positions 15-17: they close a CSA and an HCA window, so they write
window rings, compressor rings, compressed and indexer rows), roll them back, go on with the true tokens."""

from __future__ import annotations

import numpy as np

import v4compile
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.cli.driver import compile_artifact
from v4compile.runtime.undo import PoolUndo, access
from v4compile.trace import TraceOptions

PROMPT = list(range(3, 16))  # 13 tokens; two decodes later the next position is 15, closing CSA / HCA windows
TRUE = [21, 7, 99, 4, 250]
WRONG = [300, 301, 302]


def cpu_artifact(out):
    """tiny, hf numerics, fp32, max context 64, the cpu target (and its program for the host device)."""
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    return compile_artifact(fe, out, Buckets(decode=(1,), prefill=(16,)))


def pool_bytes(backend) -> dict[str, np.ndarray]:
    """Every pool plane and state ring, as bytes (cpu: the backend's arrays; host: the C runtime's buffers)."""
    store = access(backend)
    return {n: np.asarray(store.get_all(n)).copy() for n in sorted(store.names()) if n.startswith(("pool.", "state."))}


def host_acceptance(inputs: dict, logits: np.ndarray, drafts: list) -> tuple[np.ndarray, np.ndarray]:
    """The two-call path's greedy acceptance of a verify's `logits` (`speculation.accept`, temperature 0) over
    its step `inputs` and each sequence's `drafts`: the kept positions (-1 past the last kept lane) and the ids
    after each kept lane, as the one-call step's `spec.kept_pos` / `spec.next_ids`."""
    from v4compile.speculation import accept

    kept, nxt = inputs["pos"].copy(), np.zeros_like(inputs["ids"])
    for b, d in enumerate(drafts):
        a, tok = accept(d, logits[b], None, None, 0.0)
        kept[b, a + 1:] = -1
        nxt[b, : a + 1] = d[:a] + [tok]
    return kept, nxt


def run(art, rejected: bool, restore: bool = True, device: str = "cpu", snapshots: dict | None = None):
    """(logits of the true tokens, every pool / state byte at the end); `snapshots`, when given, also gets
    the bytes just before the rejected decodes ("before") and just after the rollback ("restored")."""
    # host: the C runtime's buffers with the ops' reference kernels (the rollback is row copies; the Triton
    # kernels' own agreement with the references is tested elsewhere)
    sess = v4compile.load(art, device=device, threads=1, **({"kernels": "reference"} if device == "host" else {}))
    s = sess.open()
    sess.extend(s, PROMPT)
    logits = [sess.decode([s], [t])[0] for t in TRUE[:2]]
    if rejected:
        L = s.length
        for q in range(L, L + len(WRONG)):  # the blocks a verify step reserves for its lanes
            sess.reserve(s, q)
        undo = PoolUndo(sess.backend, [(s.slot, list(s.blocks), L, L + 2)])
        if snapshots is not None:
            snapshots["before"] = pool_bytes(sess.backend)
        for t in WRONG:
            sess.decode([s], [t])
        if restore:
            undo.restore({s.slot: L})
        if snapshots is not None:
            snapshots["restored"] = pool_bytes(sess.backend)
        s.length = L
    logits += [sess.decode([s], [t])[0] for t in TRUE[2:]]
    state = pool_bytes(sess.backend)
    sess.close()
    return np.stack(logits), state
