"""The cpu lowerings' one-token forms (decode b1 / the decode buckets): `last_token` at T = 1 is a Reshape
(`codegen/onnx/last_token.py`), `grouped_out_proj` at B * T = 1 runs its group GEMMs with Reshapes for the
Transposes (`codegen/onnx/grouped_gemm.py`). Each against the op's reference on seeded inputs, and the
grouped GEMM bit for bit against the Transpose form at one token (the same bytes, the same GEMMs), and a
batch-1 verify step's few lanes bit for bit the one-token form lane by lane."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from v4compile.codegen.onnx import grouped_gemm, last_token
from v4compile.codegen.onnx.graph import Graph
from v4compile.codegen.onnx_export import Operands
from v4compile.ir.types import TensorType
from v4compile.ops import op


def _run(g: Graph, out: str, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    g.op("Identity", out, out="y")
    g.inputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT if v.dtype == np.float32 else TensorProto.INT64,
                                               list(v.shape)) for k, v in feeds.items()]
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    s = ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


def _last_token(B: int, T: int, lower=last_token.lower_last_token):
    rng = np.random.default_rng(B * 10 + T)
    x = rng.standard_normal((B, T, 6)).astype(np.float32)
    pos = np.where(rng.random((B, T)) < 0.3, -1, rng.integers(0, 50, (B, T))).astype(np.int64)
    pos[0] = -1  # a lane with no valid token: lane 0, as the reference takes it
    g = Graph("last")
    o = Operands({"x": "x", "pos": "pos"}, {"x": TensorType((B, T, 6), "fp32"), "pos": TensorType((B, T), "i64")})
    got = _run(g, lower(g, o, {}, None), {"x": x, "pos": pos})
    return got, op.last_token.ref(torch.from_numpy(x), torch.from_numpy(pos)).numpy()


@pytest.mark.parametrize("T", [1, 3])
def test_last_token_matches_the_reference(T):
    got, want = _last_token(4, T)
    assert np.array_equal(got, want)


def test_a_broken_one_token_last_token_is_caught():
    """Lanes taken in reversed order at T = 1 fail the same comparison."""
    def reversed_lanes(g, o, a, r):
        y = last_token.lower_last_token(g, o, a, r)
        return g.op("Slice", y, g.i64(-1), g.i64(-(2 ** 63)), g.i64(0), g.i64(-1))

    got, want = _last_token(4, 1, reversed_lanes)
    assert not np.array_equal(got, want)


G, H, D, R = 2, 4, 8, 12  # groups, heads, head dim, rows of W (R / G per group)


def _grouped(B: int, T: int, x: np.ndarray, w: np.ndarray, module=grouped_gemm) -> np.ndarray:
    g = Graph("grouped")
    ot, wt = TensorType((B, T, H, D), "fp32"), TensorType((R, H * D // G), "fp32")
    o = Operands({"o": "o", "w": "w", "scale": None, "o_scale": None}, {"o": ot, "w": wt})
    a = {"groups": G, "block": 128, "act": "native", "acc": "fp32", "out_dtype": ""}
    return _run(g, module.lower_grouped_out_proj(g, o, a, None), {"o": x, "w": w})


def _grouped_inputs(T: int):
    rng = np.random.default_rng(5)
    return rng.standard_normal((1, T, H, D)).astype(np.float32), rng.standard_normal((R, H * D // G)).astype(np.float32)


def _grouped_ref(x, w):
    return op.grouped_out_proj.ref(torch.from_numpy(x), torch.from_numpy(w), None, None, groups=G, block=128,
                                   act="native", acc="fp32", out_dtype="").numpy()


def _transposed_form(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The many-token form at one token: [BT, G, k] -> Transpose -> [G, BT, k] GEMMs -> Transpose back."""
    g = Graph("transposed")
    k = H * D // G
    t = g.op("Transpose", g.reshape("o", (1, G, k)), perm=[1, 0, 2])
    z = g.matmul_t(t, g.reshape("w", (G, R // G, k)))
    return _run(g, g.reshape(g.op("Transpose", z, perm=[1, 0, 2]), (1, 1, R)), {"o": x, "w": w})


def test_one_token_grouped_out_proj_is_the_transposed_form():
    x, w = _grouped_inputs(1)
    one = _grouped(1, 1, x, w)
    assert np.array_equal(one, _transposed_form(x, w))
    assert np.abs(one - _grouped_ref(x, w)).max() <= 1e-6 * np.abs(one).max()
    many = _grouped(1, 3, np.repeat(x, 3, 1), w)  # the many-token path: the same within GEMM rounding
    assert np.abs(many[:, :1] - one).max() <= 1e-6 * np.abs(one).max()


def test_a_broken_one_token_grouped_out_proj_is_caught(monkeypatch):
    """The groups' K slices read from the wrong token layout (x as [k, G] reinterpreted) fail."""
    x, w = _grouped_inputs(1)
    orig = Graph.reshape

    def bad(self, t, shape):
        if tuple(shape) == (G, 1, H * D // G):
            t = self.op("Transpose", orig(self, t, (H * D // G, G)), perm=[1, 0])
        return orig(self, t, shape)

    monkeypatch.setattr(Graph, "reshape", bad)
    got = _grouped(1, 1, x, w)
    assert np.abs(got - _grouped_ref(x, w)).max() > 1e-3


def _lanes_grouped(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the few-lane form on x's T lanes, the one-token form lane by lane)."""
    T = x.shape[1]
    return _grouped(1, T, x, w), np.concatenate([_grouped(1, 1, x[:, t:t + 1], w) for t in range(T)], 1)


@pytest.mark.parametrize("T", [2, 4])
def test_few_lane_grouped_out_proj_is_the_one_token_form_per_lane(T):
    """A batch-1 verify step's lanes (`Graph.few_lanes`) each through the one-token GEMMs: bit for bit what
    a decode step computes at that lane; against the Transpose form, GEMM rounding."""
    x, w = _grouped_inputs(T)
    few, one = _lanes_grouped(x, w)
    assert np.array_equal(few, one)
    assert np.abs(few - _grouped_ref(x, w)).max() <= 1e-6 * np.abs(few).max()


def test_a_broken_few_lane_grouped_out_proj_is_caught(monkeypatch):
    """The lanes' K slices read with lanes and groups swapped ([G, BT] reinterpreted) fail."""
    x, w = _grouped_inputs(2)
    orig = Graph.reshape

    def bad(self, t, shape):
        if tuple(shape) == (2, G, 1, H * D // G):
            t = self.op("Transpose", orig(self, t, (G, 2, H * D // G)), perm=[1, 0, 2])
        return orig(self, t, shape)

    monkeypatch.setattr(Graph, "reshape", bad)
    few, one = _lanes_grouped(x, w)
    assert not np.array_equal(few, one)
