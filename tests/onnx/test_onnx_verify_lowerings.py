"""The cpu target's few-lane (verify step) lowerings against the general ones they shortcut
(`Graph.few_lanes`), and their size against a decode step's.

Each form is lowered alone into a small graph beside the general lowering of the same op, and both run on the
same seeded inputs: many sequences a batch, each with its own start position (before, at and after the first
window boundaries, the overlapping window's half before position 0 included) and its own count of live
lanes (0 = a padding sequence, up to all T). compress_paged (T = 2..4, both kinds of compressor: overlapping
ratio 4, plain ratio 16): every row it writes (compressed plane, both state rings) and its values
bit-identical; indexer_select and csr_window: the same row lists. Reordered fp32 sums, as decode's forms
(within the ATTN_TOL that tests/onnx/test_onnx_decode_lowerings.py holds those to): sparse_attention (the
chunk's keys after each lane's pool rows, one GEMM) and the fused rotation vectorised over a batch-1 verify
step's lanes (`rotary.rotate`). Each form's deliberate fault (a window one slot late, the ring missing a lane,
every share one key late, the scores unscaled, the picks off by a window, the chunk's own lanes seen in the
window, the lanes' rotation matrices turning the other way) is caught.

The size test pins the gain on the tiny preset's verify graph: per op family, verify's node count within a
stated margin of decode's (the general forms back in place shown to exceed every margin).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from v4compile.codegen.onnx import compress, csr, indexer, rotary, sparse_attention
from v4compile.codegen.onnx.graph import Graph, value_info
from v4compile.codegen.onnx.pool_rows import Planes, RowList
from v4compile.codegen.onnx_export import Operands
from v4compile.ir.types import TensorType

N_SEQ, SLOTS, BLOCKS, BT = 24, 32, 4, 32  # sequences a batch, state slots, blocks a sequence, block tokens
RATIOS = ((4, True), (16, False))  # (ratio, overlap): the compressors of V4's CSA and HCA layers
ATTN_TOL = 2e-5  # the reordered fp32 sums of decode's forms are held to it (tests/onnx/test_onnx_decode_lowerings.py)


def _compress_graph(form, T: int, m: int, overlap: bool, B: int = N_SEQ) -> onnx.ModelProto:
    """compress_paged of `form` (the general `compress` or `compress_lanes`) on B sequences of T lanes: its
    writes (rows and values of the compressed plane and of both state rings) as the graph's outputs."""
    c = 2 if overlap else 1
    cw, S, dk = 16 * c, m * c, 16
    g = Graph("compress")
    g.loc = "compress_paged layers.1.attn.compressor"
    ty = {"kv": TensorType((B, T, cw), "fp32"), "gate": TensorType((B, T, cw), "fp32"),
          "ape": TensorType((m, cw), "fp32"), "norm": TensorType((dk,), "fp32"),
          "pos": TensorType((B, T), "i64"), "slot": TensorType((B,), "i64"),
          "block_table": TensorType((B, BLOCKS), "i64")}
    states = {"plane": TensorType((BLOCKS * N_SEQ * 16, dk), "fp32"), "skv": TensorType((SLOTS, S, cw), "fp32"),
              "sg": TensorType((SLOTS, S, cw), "fp32")}
    g.inputs += [value_info(n, t) for n, t in {**ty, **states}.items()]
    o = Operands({n: n for n in ty}, ty)
    a = {"ratio": m, "overlap": overlap, "eps": 1e-6, "rope_dim": 8, "theta": 160000.0, "yarn": (16.0, 256, 32.0, 1.0),
         "block_tokens": BT, "envelope_rows": 16, "layer_offset": 3, "round": "none"}
    outs = form(g, o, a, Planes("plane"), Planes("skv"), Planes("sg"))
    for name, p in zip(states, outs):
        (_, rows, vals, _, _), = p.segs
        g.op("Identity", rows, out=f"{name}.rows")
        g.op("Identity", vals, out=f"{name}.vals")
        g.outputs += [helper.make_tensor_value_info(f"{name}.rows", TensorProto.INT64, None),
                      helper.make_tensor_value_info(f"{name}.vals", TensorProto.FLOAT, None)]
    return g.model()


def _inputs(T: int, m: int, overlap: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded values; each sequence a start position (around the first window boundaries, and far on) and a
    live lane count 0..T (its first lanes, as a verify step's: the last token, then its drafts)."""
    rng = np.random.default_rng(seed)
    c = 2 if overlap else 1
    cw, S = 16 * c, m * c
    closing = [w * m - 1 - t for w in (1, 2, 3, 7) for t in range(T)]  # a live lane ends window w - 1
    starts = np.concatenate([closing, [0, 1, m, m + 1, S, S + 1], rng.integers(0, BLOCKS * BT - T, N_SEQ)])[:N_SEQ]
    n = rng.integers(0, T + 1, N_SEQ)
    n[len(closing):len(closing) + T + 1] = np.arange(T + 1)
    n[:len(closing)] = T
    pos = np.where(np.arange(T)[None, :] < n[:, None], starts[:, None] + np.arange(T)[None, :], -1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {"kv": f(N_SEQ, T, cw), "gate": f(N_SEQ, T, cw), "ape": f(m, cw), "norm": f(16) + 1,
            "pos": pos.astype(np.int64), "slot": np.where(n > 0, rng.permutation(SLOTS)[:N_SEQ], -1).astype(np.int64),
            "block_table": rng.permutation(BLOCKS * N_SEQ).reshape(N_SEQ, BLOCKS).astype(np.int64),
            "plane": f(BLOCKS * N_SEQ * 16, 16), "skv": f(SLOTS, S, cw), "sg": f(SLOTS, S, cw)}


def _writes(model: onnx.ModelProto, x: dict, one_by_one: bool = False) -> dict[str, dict[int, bytes]]:
    """Each written tensor's {row: its values' bytes} (skipped rows left out); `one_by_one`: a batch-1 model
    run on each sequence in turn."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    seqs = [slice(i, i + 1) for i in range(N_SEQ)] if one_by_one else [slice(None)]
    out: dict[str, dict[int, bytes]] = {n: {} for n in ("plane", "skv", "sg")}
    for b in seqs:
        xb = {k: v[b] if k in ("kv", "gate", "pos", "slot", "block_table") else v for k, v in x.items()}
        res = dict(zip([o.name for o in s.get_outputs()], s.run(None, xb)))
        for n in out:
            out[n].update({int(r): res[f"{n}.vals"][i].tobytes() for i, r in enumerate(res[f"{n}.rows"]) if r >= 0})
    return out


def _same_writes(T: int, m: int, overlap: bool, batch1: bool = False) -> None:
    """compress_lanes against compress on N_SEQ sequences; `batch1`: its batch-1 form (verify_b1's) on each
    (the rings bit for bit; the compressed rows within ATTN_TOL: the rotation is decode's fused one)."""
    x = _inputs(T, m, overlap)
    want = _writes(_compress_graph(compress.compress, T, m, overlap), x)
    got = _writes(_compress_graph(compress.compress_lanes, T, m, overlap, 1 if batch1 else N_SEQ), x, batch1)
    assert want["plane"], "no window closed: the case proves nothing"
    for n in want:
        assert got[n].keys() == want[n].keys(), f"{n}: rows written differ"
        # at batch 1 the closed window's rotation is decode's fused one (one MatMul): within ATTN_TOL
        tol = ATTN_TOL if batch1 and n == "plane" else 0.0
        bad = [r for r in want[n] if not np.abs(np.frombuffer(got[n][r], np.float32)
                                                 - np.frombuffer(want[n][r], np.float32)).max() <= tol]
        assert not bad, f"{n}: rows {bad[:5]} differ"


@pytest.mark.parametrize("T", [2, 3, 4])
def test_compress_lanes_writes_what_the_general_lowering_writes(T):
    for m, overlap in RATIOS:
        _same_writes(T, m, overlap)


def test_compress_lanes_at_batch_1_writes_what_the_general_lowering_writes():
    for m, overlap in RATIOS:
        _same_writes(2, m, overlap, batch1=True)


def _window_late(mp):  # each window slot reads the next slot's source (the first never read, the last twice)
    real = compress._lanes_tables
    mp.setattr(compress, "_lanes_tables", lambda m, overlap, T: (
        (lambda w: np.concatenate([w[:, 1:], w[:, -1:]], 1))(real(m, overlap, T)[0]), real(m, overlap, T)[1]))


def _ring_short(mp):
    real = compress._lanes_tables

    def short(m, overlap, T):
        win, ring = real(m, overlap, T)
        S = ring.shape[1]
        for r in range(S):  # n live lanes land as n - 1
            ring[r * (T + 1) + 1: (r + 1) * (T + 1)] = ring[r * (T + 1): (r + 1) * (T + 1) - 1].copy()
        return win, ring
    mp.setattr(compress, "_lanes_tables", short)


@pytest.mark.parametrize("fault", [_window_late, _ring_short])
def test_a_wrong_compress_lanes_table_is_caught(monkeypatch, fault):
    fault(monkeypatch)
    for batch1 in (False, True):
        with pytest.raises(AssertionError, match="differ"):
            for m, overlap in RATIOS:
                _same_writes(2, m, overlap, batch1)


def _attention_graph(form, T: int, n_parts: int) -> onnx.ModelProto:
    """sparse_attention of `form` on N_SEQ sequences of T lanes reading `n_parts` row lists of the plane (the
    window's, a compressed or indexer one) and the chunk's own keys."""
    g = Graph("attention")
    g.loc = "sparse_attention layers.2.attn"
    B, H, d = N_SEQ, 4, 16
    ins = {"q": TensorType((B, T, H, d), "fp32"), "kv": TensorType((B, T, d), "fp32"), "pos": TensorType((B, T), "i64"),
           "sink": TensorType((H,), "fp32"), "plane": TensorType((64, d), "fp32")}
    ins.update({f"rows{i}": TensorType((B * T, 5 + 3 * i), "i64") for i in range(n_parts)})
    g.inputs += [value_info(n, t) for n, t in ins.items()]
    parts = [(RowList(f"rows{i}"), 7 * i) for i in range(n_parts)]
    out = form(g, "q", ins["q"], "kv", "pos", "sink", parts, Planes("plane"), 3, 0.25)
    g.op("Identity", out, out="y")
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    return g.model()


def _attention(model: onnx.ModelProto, T: int, n_parts: int) -> np.ndarray:
    import onnxruntime as ort

    rng = np.random.default_rng(T)
    n = rng.integers(0, T + 1, N_SEQ)
    start = rng.integers(0, 30, N_SEQ)
    x = {"q": rng.standard_normal((N_SEQ, T, 4, 16)).astype(np.float32),
         "kv": rng.standard_normal((N_SEQ, T, 16)).astype(np.float32),
         "pos": np.where(np.arange(T)[None, :] < n[:, None], start[:, None] + np.arange(T)[None, :], -1),
         "sink": rng.standard_normal(4).astype(np.float32), "plane": rng.standard_normal((64, 16)).astype(np.float32)}
    for i in range(n_parts):  # some rows hidden (-1), a few queries seeing none of this part
        r = rng.integers(0, 64 - 7 * i, (N_SEQ * T, 5 + 3 * i))
        x[f"rows{i}"] = np.where(rng.random(r.shape) < 0.3, -1, r)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, x)[0]


def _same_attention(T: int) -> None:
    for n_parts in (1, 2):
        want = _attention(_attention_graph(sparse_attention.sparse_attention, T, n_parts), T, n_parts)
        got = _attention(_attention_graph(sparse_attention.sparse_attention_lanes, T, n_parts), T, n_parts)
        assert np.isfinite(want).all()
        err = float(np.abs(got - want).max())
        assert err <= ATTN_TOL, f"{n_parts} parts: values differ by up to {err} (tolerance {ATTN_TOL})"


@pytest.mark.parametrize("T", [2, 4])
def test_sparse_attention_lanes_is_the_general_lowering(T):
    _same_attention(T)


@pytest.mark.parametrize("fault", ["chunk_share_shifted", "scale_dropped"])
def test_a_wrong_sparse_attention_lanes_is_caught(monkeypatch, fault):
    real_slice, real_op = Graph.slice, Graph.op

    def shifted(self, x, s, e, axis):  # every share one key late: the first pool row's dropped, the sink's kept
        return real_slice(self, x, 1, 1 << 30, axis) if self.loc.startswith("sparse_attention") and e == -1 else \
            real_slice(self, x, s, e, axis)

    def unscaled(self, op_type, *inputs, **attrs):  # the few-lane form's scores left unscaled
        attrs.pop("alpha", None) if op_type == "FusedMatMul" and self.loc.startswith("sparse_attention") else None
        return real_op(self, op_type, *inputs, **attrs)
    monkeypatch.setattr(Graph, *(("slice", shifted) if fault == "chunk_share_shifted" else ("op", unscaled)))
    with pytest.raises(AssertionError, match="differ"):
        _same_attention(2)


def _indexer(few: bool, T: int, monkeypatch) -> dict[str, np.ndarray]:
    """indexer_select's row list (rows, and the maker's keep / safe where it gives them) on N_SEQ sequences of
    T lanes, lowered in the few-lane form or the general one, on seeded inputs."""
    import onnxruntime as ort

    monkeypatch.setattr(Graph, "few_lanes", lambda self, T_, what: few and 1 < T_ <= 4)
    B, Hi, di, W_MAX = N_SEQ, 2, 8, 24
    g = Graph("indexer")
    g.loc = "indexer_select layers.2.attn.indexer"
    ins = {"q": TensorType((B, T, Hi, di), "fp32"), "weights": TensorType((B, T, Hi), "fp32"),
           "pos": TensorType((B, T), "i64"), "bt": TensorType((B, BLOCKS), "i64"),
           "plane": TensorType((1024, di), "fp32")}
    g.inputs += [value_info(n, t) for n, t in ins.items()]
    rl = indexer.indexer_rows(g, "q", ins["q"], "weights", "pos", "bt", Planes("plane"), ratio=4, q_scale=0.3,
                              w_scale=0.7, k=4, block_tokens=BT, index_envelope_rows=8, index_offset=0,
                              envelope_rows=16, max_rows=W_MAX, n_blocks=BLOCKS)
    for n, v in {"rows": rl.rows, "keep": rl.keep, "safe": rl.safe}.items():
        if v is not None:
            g.op("Identity", v, out=n)
            g.outputs.append(helper.make_tensor_value_info(n, TensorProto.BOOL if n == "keep" else TensorProto.INT64,
                                                           None))
    rng = np.random.default_rng(T)
    n = rng.integers(0, T + 1, B)
    start = rng.integers(0, 4 * W_MAX, B)
    x = {"q": rng.standard_normal((B, T, Hi, di)).astype(np.float32),
         "weights": rng.standard_normal((B, T, Hi)).astype(np.float32),
         "pos": np.where(np.arange(T)[None, :] < n[:, None], start[:, None] + np.arange(T)[None, :], -1),
         "bt": rng.permutation(BLOCKS * B).reshape(B, BLOCKS).astype(np.int64),
         "plane": rng.standard_normal((1024, di)).astype(np.float32)}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(g.model().SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, x)))


def _same_indexer(monkeypatch, T: int) -> None:
    want, got = _indexer(False, T, monkeypatch), _indexer(True, T, monkeypatch)
    assert (want["rows"] >= 0).sum() > N_SEQ, "too few rows picked: the case proves nothing"
    assert np.array_equal(got["rows"], want["rows"]), "rows differ"
    assert np.array_equal(got["keep"], want["rows"] >= 0), "keep differs from the rows kept"
    assert np.array_equal(np.where(got["keep"], got["safe"], -1), want["rows"]), "safe rows differ"


@pytest.mark.parametrize("T", [2, 4])
def test_indexer_lanes_rows_are_the_general_lowering(monkeypatch, T):
    _same_indexer(monkeypatch, T)


def test_a_wrong_indexer_lanes_rows_is_caught(monkeypatch):
    real = Graph.op

    def op(self, op_type, *inputs, **attrs):  # the picks read from the next window's rows
        if op_type == "GatherElements" and attrs.get("axis") == 2:
            inputs = (inputs[0], real(self, "Min", real(self, "Add", inputs[1], self.iscalar(1)), self.iscalar(2)))
        return real(self, op_type, *inputs, **attrs)
    monkeypatch.setattr(Graph, "op", op)
    with pytest.raises(AssertionError, match="differ"):
        _same_indexer(monkeypatch, 2)


# verify_b1's nodes over decode_b1's, by op family, that the few-lane forms leave (the general forms: compress
# +152, sparse_attention +88, window +41, indexer +12, qkv_norm_rope +12, rope_out_proj +6, all +313; measured
# now: +21, +14, +24, +10, -8, -4, all +59); the rest is structure the lanes keep: the chunk keys and the sink
# broadcast to every lane, the lanes' window rows and writes (decode's write counts as qkv_norm_rope), the
# compressor's table of the ring, the chunk and the fill row
MARGINS = {"compress_paged": 23, "sparse_attention": 16, "window": 26, "indexer_select": 10, "qkv_norm_rope": -6,
           "rope_out_proj": -2, "TOTAL": 65}


@pytest.fixture(scope="module")
def tiny_verify_module():
    """The tiny preset's decode_b1 and verify_b1 (one draft token), traced and through the cpu pipeline once."""
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import trace_buckets
    from v4compile.config import preset
    from v4compile.passes import CPU_PIPELINE, PassManager, PipelineOptions
    from v4compile.trace import TraceOptions

    traced = trace_buckets(preset("tiny"), TraceOptions(numerics="hf", dtype="fp32", capacity=64),
                           Buckets((1,), (16,), draft_tokens=1))
    return PassManager(CPU_PIPELINE, PipelineOptions()).run(traced).module


def _family_nodes(module, fname: str) -> dict[str, int]:
    import collections

    from v4compile.codegen.onnx_export import lower_function

    nodes = lower_function(module, fname).graph.node
    c = collections.Counter(n.doc_string.split(" ")[0] for n in nodes)
    c["window"] = c["csr_window"] + c["pool_write_window"]
    c["TOTAL"] = len(nodes)
    return c


def _over_margins(module) -> dict[str, tuple[int, int]]:
    d, v = _family_nodes(module, "decode_b1"), _family_nodes(module, "verify_b1")
    return {f: (v[f], d[f]) for f, margin in MARGINS.items() if v[f] > d[f] + margin}


def test_verify_costs_about_what_decode_costs(tiny_verify_module):
    assert not _over_margins(tiny_verify_module), "verify_b1's nodes (verify, decode) over the margins"


def test_the_general_forms_in_verify_are_caught(tiny_verify_module, monkeypatch):
    monkeypatch.setattr(Graph, "few_lanes", lambda self, T, what: False)
    assert set(_over_margins(tiny_verify_module)) == set(MARGINS)


def _window_rows(few: bool, T: int, monkeypatch) -> np.ndarray:
    """csr_window's row list on N_SEQ sequences of T lanes (few-lane or general form), seeded positions."""
    import onnxruntime as ort

    monkeypatch.setattr(Graph, "few_lanes", lambda self, T_, what: few and 1 < T_ <= 4)
    g = Graph("window")
    g.loc = "csr_window layers.0.attn"
    ty = {"pos": TensorType((N_SEQ, T), "i64"), "slot": TensorType((N_SEQ,), "i64")}
    g.inputs += [value_info(n, t) for n, t in ty.items()]
    rl, _ = csr.lower_csr_window(g, Operands({n: n for n in ty}, ty), {"window": 8, "slot_rows": 8, "n_rows": 512}, None)
    g.op("Identity", rl.rows, out="rows")
    g.outputs.append(helper.make_tensor_value_info("rows", TensorProto.INT64, None))
    rng = np.random.default_rng(T)
    n = rng.integers(0, T + 1, N_SEQ)
    start = np.concatenate([np.arange(10), rng.integers(0, 100, N_SEQ)])[:N_SEQ]
    x = {"pos": np.where(np.arange(T)[None, :] < n[:, None], start[:, None] + np.arange(T)[None, :], -1),
         "slot": np.where(n > 0, rng.permutation(SLOTS)[:N_SEQ], -1)}
    return ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]


@pytest.mark.parametrize("T", [2, 4])
def test_csr_window_lanes_rows_are_the_general_lowering(monkeypatch, T):
    want = _window_rows(False, T, monkeypatch)
    assert (want >= 0).sum() > N_SEQ
    assert np.array_equal(_window_rows(True, T, monkeypatch), want)


def test_a_wrong_csr_window_lanes_is_caught(monkeypatch):
    real = Graph.const  # lane t sees its own earlier lanes' positions too (a triangle one lane wide)
    monkeypatch.setattr(Graph, "const", lambda self, v, dtype=np.float32: real(self, np.ones_like(v), dtype)
                        if self.loc.startswith("csr_window") and dtype is bool else real(self, v, dtype))
    assert not np.array_equal(_window_rows(True, 2, monkeypatch), _window_rows(False, 2, monkeypatch))


def _rotations(few: bool, T: int, monkeypatch, inverse: bool = False) -> list[np.ndarray]:
    """`rotary.rotate(fused=True)` of seeded x [1, T, H, D] and [1, T, D] (q's and kv's shapes) at a batch-1
    verify step's positions (0 < start, so rotated channels move), few-lane form or the general four nodes."""
    import onnxruntime as ort

    monkeypatch.setattr(Graph, "few_lanes", lambda self, T_, what: few and 1 < T_ <= 4)
    H, D, dim = 3, 24, 8
    g = Graph("rotate")
    g.loc = "qkv_norm_rope layers.0.attn"
    ins = {"q": TensorType((1, T, H, D), "fp32"), "kv": TensorType((1, T, D), "fp32"), "pos": TensorType((1, T), "i64")}
    g.inputs += [value_info(n, t) for n, t in ins.items()]
    for n in ("q", "kv"):
        g.op("Identity", rotary.rotate(g, n, ins[n], "pos", 2, dim, 160000.0, (16.0, 256, 32.0, 1.0), inverse=inverse,
                                       fused=True), out=f"{n}.out")
        g.outputs.append(helper.make_tensor_value_info(f"{n}.out", TensorProto.FLOAT, None))
    rng = np.random.default_rng(T)
    x = {"q": rng.standard_normal((1, T, H, D)).astype(np.float32),
         "kv": rng.standard_normal((1, T, D)).astype(np.float32), "pos": 37 + np.arange(T)[None, :]}
    return ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)


@pytest.mark.parametrize("T", [2, 4])
def test_rotation_lanes_is_within_tolerance_of_the_four_nodes(monkeypatch, T):
    for inverse in (False, True):
        want, got = _rotations(False, T, monkeypatch, inverse), _rotations(True, T, monkeypatch, inverse)
        for w, x in zip(want, got):
            assert np.abs(w[..., :16] - x[..., :16]).max() == 0  # the unrotated channels come out exactly
            assert np.abs(w - x).max() <= ATTN_TOL


def test_a_wrong_rotation_lanes_is_caught(monkeypatch):
    real = Graph.cached  # the lanes' matrices transposed: each position rotated the other way

    def cached(self, key, make):
        return real(self, key, (lambda: self.op("Transpose", make(), perm=[0, 1, 3, 2]))
                    if key[0] == "rope_matrices" else make)
    monkeypatch.setattr(Graph, "cached", cached)
    want, got = _rotations(False, 2, monkeypatch), _rotations(True, 2, monkeypatch)
    assert all(float(np.abs(w - x).max()) > ATTN_TOL for w, x in zip(want, got))
