"""The cpu target's one-token (decode) lowerings against the general ones they shortcut.

`compress_paged` on a one-token chunk (`codegen/onnx/compress.compress_decode`) pools the updated state ring
instead of gathering from a [ring; chunk; fill] table: the same values in the same order, so a decode
artifact built with it must give bit-identical logits to one built with the general lowering, step after
step, from position 0 (the first overlapping window, whose first half lies before position 0) through
several closed windows of both ratios (tiny: CSA 4 overlapping, HCA 16), at batch 1 and in a batch-4
bucket with a padding lane. A wrong ring order (the overlapping window's halves read unrotated) is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.driver import compile_artifact
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 36  # positions up to ~40: ten CSA windows and two HCA windows close at decode


def _build(tmp_path, name):
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    return compile_artifact(fe, tmp_path / name, Buckets(decode=(1, 4), prefill=(8,)))


def _run(art) -> list[np.ndarray]:
    """Every decode step's logits: one sequence alone (b1, from a 1-token prompt), then three together (the
    b4 bucket, one lane padding), fixed token ids so both artifacts see the same inputs."""
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


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if not np.array_equal(x, y)]
    assert not bad, f"decode steps {bad[:5]} differ (max {max(float(np.abs(a[i] - b[i]).max()) for i in bad)})"


@pytest.fixture(scope="module")
def general(tmp_path_factory):
    """The logits with every compressor lowered by the general (any chunk) lowering."""
    from v4compile.codegen.onnx import compress

    mp = pytest.MonkeyPatch()
    mp.setattr(compress, "compress_decode", compress.compress)
    try:
        art = _build(tmp_path_factory.mktemp("general"), "tiny")
    finally:
        mp.undo()
    return _run(art)


def test_decode_compress_is_bit_identical_to_the_general_lowering(general, tmp_path):
    from v4compile.codegen.onnx import compress

    art = _build(tmp_path, "tiny")
    import onnx

    ops = [n.doc_string.split(" ")[0] for n in onnx.load(str(art / "onnx/decode_b1.onnx")).graph.node]
    assert ops.count("compress_paged") < 220, ops.count("compress_paged")  # the shortcut is the one used
    assert compress.compress_decode is not compress.compress
    _same(_run(art), general)


def test_a_wrong_ring_order_is_caught(general, tmp_path, monkeypatch):
    """The overlapping window read in ring order (not rotated to start at its first position) differs."""
    from v4compile.codegen.onnx import compress

    real = compress._decode_index

    def unrotated(g, pos, m, overlap, B):
        ix = real(g, pos, m, overlap, B)
        if overlap:
            S = 2 * m
            half = np.repeat(np.arange(2), m)[None, :] + 2 * S * np.arange(B)[:, None]
            ix["src"] = g.const(2 * np.arange(S)[None, :] + half, np.int64)
        return ix

    monkeypatch.setattr(compress, "_decode_index", unrotated)
    art = _build(tmp_path, "tiny")
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        _same(_run(art), general)
