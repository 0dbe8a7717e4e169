"""The cpu target's one-token (decode step) lowerings against the general ones they shortcut
(`Graph.one_token`).

Exact rewrites: `compress_paged` pooling the updated state ring (`codegen/onnx/compress.compress_decode`),
`csr_window`, `csr_compressed` and `indexer_select` building their `[B, .]` row lists directly and
`window_write` keeping a live lane's token: a decode artifact built with them gives bit-identical logits to
one built with the general lowerings, step after step, from position 0 (the first overlapping CSA window,
half before position 0) through ten CSA and two HCA closed windows, at batch 1 and in a batch-4 bucket
with a padding lane. Reordered sums: `sparse_attention` scoring the token's own key as one more pool row,
and at batch 1 `rotate` as one MatMul with the step's rotation matrix (`codegen/onnx/rotary.rotate(fused=True)`): within
ATTN_TOL of the general lowerings (measured 3.9e-6 at most, 3.1e-6 from the attention alone; logits |x| ~
4.4). Each kind of fault (a wrong ring order, a window row off by one, the indexer's mask off by one, the
own key left out, the sink's share kept, this step's compressed row unpatched, the rotation matrix turning
the other way) is caught by the same comparison.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.codegen.onnx import pool_rows, rotary
from v4compile.codegen.onnx.graph import Graph
from v4compile.cli.driver import compile_artifact
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 36  # positions up to ~40: ten CSA windows and two HCA windows close at decode
ATTN_TOL = 2e-5


def _build(tmp_path, name, monkeypatch=None, forms=None):
    """A tiny artifact; `forms`: the one-token forms used (None: all), the others lowered in general."""
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    mp = monkeypatch or pytest.MonkeyPatch()
    if forms is not None:
        mp.setattr(Graph, "one_token", lambda self, T, what: T == 1 and what in forms)
    try:
        return compile_artifact(fe, tmp_path / name, Buckets(decode=(1, 4), prefill=(8,)))
    finally:
        mp.undo()


def _run(art) -> list[np.ndarray]:
    """Every decode step's logits: one sequence alone (b1, from a 1-token prompt), then three together (the
    b4 bucket, one lane padding); fixed token ids, so every artifact sees the same inputs."""
    import v4compile

    s = v4compile.load(art, device="cpu", threads=1)
    out = []
    seqs, _ = s.prefill([[5]])
    for i in range(STEPS):
        out.append(s.decode(seqs, [(7 * i + 3) % 500])[0])
    s.release(seqs[0])
    seqs, _ = s.prefill([[1], [2, 3], [4, 5, 6]])
    for i in range(STEPS // 2):
        out.append(s.decode(seqs, [(11 * i + k) % 500 for k in range(3)]))
    return out


def _same(a: list[np.ndarray], b: list[np.ndarray], tol: float = 0.0) -> None:
    errs = [float(np.abs(x - y).max()) for x, y in zip(a, b)]
    bad = [i for i, e in enumerate(errs) if not e <= tol]
    assert not bad, f"decode steps {bad[:5]} differ by up to {max(errs[i] for i in bad)} (tolerance {tol})"


EXACT = ("compress_paged", "csr_window", "csr_compressed", "indexer_select", "window_write")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Logits of the general lowerings, and of the exact one-token forms (sparse_attention general in both)."""
    d = tmp_path_factory.mktemp("decode_forms")
    return {"general": _run(_build(d, "general", forms=())), "exact": _run(_build(d, "exact", forms=EXACT))}


def test_exact_forms_are_bit_identical_to_the_general_lowerings(runs, tmp_path):
    import onnx

    art = _build(tmp_path, "exact", forms=EXACT)
    nodes = onnx.load(str(art / "onnx/decode_b1.onnx")).graph.node
    assert sum(n.doc_string.startswith("compress_paged") for n in nodes) < 200  # the shortcut is in use
    _same(runs["exact"], runs["general"])


def test_reordered_forms_are_within_tolerance(runs, tmp_path):
    _same(_run(_build(tmp_path, "all")), runs["exact"], ATTN_TOL)


def _ring_unrotated(mp):
    from v4compile.codegen.onnx import compress

    real = compress._decode_index

    def unrotated(g, pos, m, overlap, B):  # the overlapping window read in ring order, not from its start
        ix = real(g, pos, m, overlap, B)
        if overlap:
            half = np.repeat(np.arange(2), m)[None, :] + 4 * m * np.arange(B)[:, None]
            ix["src"] = g.const(2 * np.arange(2 * m)[None, :] + half, np.int64)
        return ix
    mp.setattr(compress, "_decode_index", unrotated)


def _window_off_by_one(mp):  # csr_window keeps p - k > 0: position 0 never seen again
    real = pool_rows.window_rows
    mp.setattr(pool_rows, "window_rows", lambda g, pos, *a: real(g, g.op("Sub", pos, g.iscalar(1)), *a)
               if len(a) == 4 and g.loc.startswith("csr_window") else real(g, pos, *a))


def _indexer_mask_off_by_one(mp):  # the indexer hides the last visible compressed row too
    real = pool_rows.visible_limit
    mp.setattr(pool_rows, "visible_limit", lambda g, pos, ratio: g.op("Sub", real(g, pos, ratio), g.iscalar(1))
               if g.loc.startswith("indexer_select") else real(g, pos, ratio))


@pytest.mark.parametrize("fault", [_ring_unrotated, _window_off_by_one, _indexer_mask_off_by_one])
def test_a_wrong_exact_form_is_caught(runs, tmp_path, monkeypatch, fault):
    fault(monkeypatch)
    bad = _run(_build(tmp_path, "bad", monkeypatch, forms=EXACT))
    with pytest.raises(AssertionError):
        _same(bad, runs["general"])


@pytest.mark.parametrize("fault", ["own_key_hidden", "sink_share_kept", "compressed_write_unseen", "rotation_inverted"])
def test_a_wrong_reordered_form_is_caught(runs, tmp_path, monkeypatch, fault):
    real, read, rotate, live = Graph.op, pool_rows.read_rows, rotary.rotate, Graph.live
    if fault == "own_key_hidden":  # the own key's mask: a live lane's own key hidden
        monkeypatch.setattr(Graph, "live", lambda self, pos: self.op("Not", live(self, pos))
                            if self.loc.startswith("sparse_attention") else live(self, pos))
    if fault == "rotation_inverted":  # the fused (one-position) matrix built for the other direction
        monkeypatch.setattr(rotary, "rotate", lambda g, x, xt, pos, pos_rank, *a, inverse=False, fused=False, **k: rotate(
            g, x, xt, pos, pos_rank, *a, inverse=inverse ^ (fused and math.prod(xt.shape[:pos_rank]) == 1),
            fused=fused, **k))
    if fault == "compressed_write_unseen":  # the row a compressor closed this step left unpatched
        monkeypatch.setattr(pool_rows, "read_rows", lambda g, p, rows, n_rows=None, shape=None, unseen=(): read(
            g, p, rows, n_rows, shape, unseen + (None,) if unseen else unseen))

    def op(self, op_type, *inputs, **attrs):
        if self.loc.startswith("sparse_attention"):
            if fault == "sink_share_kept" and op_type == "Slice" and inputs[2] == self.i64(-1):
                inputs = (inputs[0], self.i64(1), self.i64(1 << 30), inputs[3])  # drops the first row instead
        return real(self, op_type, *inputs, **attrs)

    monkeypatch.setattr(Graph, "op", op)
    bad = _run(_build(tmp_path, "bad", monkeypatch))
    with pytest.raises(AssertionError):
        _same(bad, runs["exact"], ATTN_TOL)
