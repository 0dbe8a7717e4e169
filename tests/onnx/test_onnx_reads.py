"""The cpu target's reads of a pool plane within a step (`codegen/onnx/pool_rows.read_rows`): the input plane's rows, patched
with the rows the step wrote before the read (a later write of a row wins), in the reader's shape. Exact:
rows are copied, never computed. Each patch fault (no patch, the first write winning) is shown caught."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from v4compile.codegen.onnx import pool_rows
from v4compile.codegen.onnx.graph import Graph, value_info
from v4compile.codegen.onnx.pool_rows import Planes
from v4compile.ir.types import TensorType

ROWS, WIDTH = 16, 8


def _read_after_writes(graph=Graph, shape=None):
    """plane [16, 8]; two writes (rows w1 [3], w2 [2], -1 = skipped) then a read of rows r [2, 3]."""
    g = graph("reads")
    p = Planes("plane")
    p = pool_rows.write_rows(g, p, "w1", "v1")
    p = pool_rows.write_rows(g, p, "w2", "v2")
    before = len(g.nodes)
    out = pool_rows.read_rows(g, p, "r", shape=shape)
    n = len(g.nodes) - before
    g.op("Identity", out, out="y")
    g.inputs += [value_info("plane", TensorType((ROWS, WIDTH), "fp32")),
                 value_info("w1", TensorType((3,), "i64")), value_info("v1", TensorType((3, WIDTH), "fp32")),
                 value_info("w2", TensorType((2,), "i64")), value_info("v2", TensorType((2, WIDTH), "fp32")),
                 value_info("r", TensorType((2, 3), "i64"))]
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape or (2, 3, WIDTH))))
    return g.model(), n


def _check(graph=Graph, shape=None):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    plane = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    v1, v2 = (rng.standard_normal((n, WIDTH)).astype(np.float32) for n in (3, 2))
    w1, w2 = np.array([5, -1, 9]), np.array([9, 2])  # row 9 written twice: the second write wins
    r = np.array([[9, 0, 5], [2, 7, 9]])
    want = plane.copy()
    for rows, vals in ((w1, v1), (w2, v2)):
        for i, row in enumerate(rows):
            if row >= 0:
                want[row] = vals[i]
    want = want[r]
    model, n = _read_after_writes(graph, shape)
    onnx.checker.check_model(model, full_check=True)
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = s.run(None, {"plane": plane, "w1": w1, "v1": v1, "w2": w2, "v2": v2, "r": r})[0]
    want = want if shape is None else want.reshape(shape)
    assert got.shape == want.shape and np.array_equal(got, want)
    return n


def test_a_read_sees_the_steps_earlier_writes():
    """Rows read in the reader's shape ([2, 3] rows -> [2, 3, 8]; or its static `shape`), rows written
    earlier in the step taken from the writes; the read is 13 nodes (2 Concats of the writes, a Gather, 10
    for the patch), 14 with the static Reshape (was 21: the rows flattened and the result reshaped back in
    the graph; 18 with the static Reshape)."""
    assert _check() == 13
    assert _check(shape=(1, 6, WIDTH)) == 14


@pytest.mark.parametrize("fault", ["unpatched", "first_write_wins"])
def test_patch_faults_are_caught(fault):
    """The read left unpatched, or patched with the first of two writes of a row, is caught."""
    class Broken(Graph):
        def op(self, op_type, *inputs, **attrs):
            if fault == "unpatched" and op_type == "ScatterND":
                return inputs[0]
            if fault == "first_write_wins" and op_type == "ArgMax":
                attrs["select_last_index"] = 0
            return super().op(op_type, *inputs, **attrs)

    with pytest.raises(AssertionError):
        _check(Broken)


def _check_single_row_writes(row=(WIDTH,)):
    """plane [16, *row]; three one-row writes (rows 9, 5, 9: the last wins; a -1 skipped one) declared with
    their static shapes, so the read takes the per-write Where patch; then a read of rows r [2, 3]."""
    import onnxruntime as ort

    g = Graph("reads1")
    p = Planes("plane")
    names = ["w1", "w2", "w3", "w4"]
    for n in names:
        p = pool_rows.write_rows(g, p, n, "v" + n[1], (1, *row))
    before = len(g.nodes)
    out = pool_rows.read_rows(g, p, "r")
    n_nodes = len(g.nodes) - before
    g.op("Identity", out, out="y")
    g.inputs += [value_info("plane", TensorType((ROWS, *row), "fp32")), value_info("r", TensorType((2, 3), "i64"))]
    for n in names:
        g.inputs += [value_info(n, TensorType((1,), "i64")), value_info("v" + n[1], TensorType((1, *row), "fp32"))]
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, *row]))
    model = g.model()
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(1)
    feed = {"plane": rng.standard_normal((ROWS, *row)).astype(np.float32), "r": np.array([[9, 0, 5], [2, 9, 7]])}
    want = feed["plane"].copy()
    for n, row_ix in zip(names, (9, 5, -1, 9)):
        feed[n] = np.array([row_ix])
        feed["v" + n[1]] = rng.standard_normal((1, *row)).astype(np.float32)
        if row_ix >= 0:
            want[row_ix] = feed["v" + n[1]][0]
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert got.shape == (2, 3, *row) and np.array_equal(got, want[feed["r"]])
    return n_nodes


def test_one_row_writes_patch_with_a_where_each():
    """A decode step at batch 1 writes one row at a time: the read patches with one Where per write (in
    write order: the later write of row 9 wins; the skipped -1 write hits nothing): 1 Gather, 1 Unsqueeze
    and 2 nodes a write (4 writes: 10 nodes; the general match takes 2 Concats, a Gather and 10), for pool
    rows [8] and state rows [2, 8] alike."""
    assert _check_single_row_writes() == 10
    assert _check_single_row_writes(row=(2, WIDTH)) == 10


@pytest.mark.parametrize("fault", ["unpatched", "first_write_wins"])
def test_one_row_patch_faults_are_caught(fault, monkeypatch):
    """The per-write patch left out, or applied in reverse write order (the first write of row 9 winning),
    is caught."""
    real = pool_rows._patch_single_rows
    monkeypatch.setattr(pool_rows, "_patch_single_rows",
                        lambda g, got, rows, segs: got if fault == "unpatched" else real(g, got, rows, segs[::-1]))
    with pytest.raises(AssertionError):
        _check_single_row_writes()
