"""`merge_splits` (codegen/onnx/merge_splits.py): a chain of Splits, each cutting a part the one before made,
is one Split with the same parts; a part something else also reads, or a Split on another axis, stays as it
is. Checked by running both graphs in ONNX Runtime on seeded inputs: the merged one gives every output bit
for bit, with fewer nodes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from v4compile.codegen.onnx.graph import Graph
from v4compile.codegen.onnx.merge_splits import merge_splits


def _graph(merge=merge_splits):
    """x [2, 12] cut as a merged GEMM's output is: (3, 9) then the 9 as (4, 5) then the 5 as (2, 3); the 4
    also read by a Neg (so its Split of (1, 3) stays); the 2 split on axis 0 (stays). Then `merge(g)`, unless
    None."""
    g = Graph("splits")
    a, r = g.split("x", (3, 9))
    b, r2 = g.split(r, (4, 5))
    c, d = g.split(r2, (2, 3))
    e, f = g.split(b, (1, 3))
    h, i = g.split(c, (1, 1), axis=0)
    outs = [a, g.op("Neg", b), c, d, e, f, h, i]
    for k, o in enumerate(outs):
        g.op("Identity", o, out=f"y{k}")
    g.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12]))
    g.outputs += [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None) for k in range(len(outs))]
    if merge:
        merge(g)
    return g


def _run(g):
    import onnxruntime as ort

    s = ort.InferenceSession(g.model().SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 12)).astype(np.float32)
    return s.run(None, {"x": x})


def _splits(g) -> list[int]:
    return sorted(len(n.output) for n in g.nodes if n.op_type == "Split")


def test_a_split_chain_is_one_split_with_the_same_parts():
    plain, merged = _graph(merge=None), _graph()
    assert _splits(plain) == [2, 2, 2, 2, 2]
    assert _splits(merged) == [2, 2, 4]  # (3, 4, 2, 3); (1, 3) of the 4 read twice; axis 0
    for want, got in zip(_run(plain), _run(merged)):
        assert np.array_equal(want, got)
    assert {t.name for t in merged.inits} <= {i for n in merged.nodes for i in n.input}  # no stale sizes


def _no_reader_check(g):
    """A merge that ignores whether the part is read elsewhere: the Neg of the 4 is hidden from it."""
    neg = next(n for n in g.nodes if n.op_type == "Neg")
    g.nodes.remove(neg)
    merge_splits(g)
    g.nodes.insert(len(g.nodes) - 8, neg)


def test_a_part_read_elsewhere_is_kept():
    """The part the Neg reads stays a Split output; a merge that took it anyway leaves the Neg reading a
    name no node makes, which ONNX Runtime refuses."""
    with pytest.raises(Exception, match="(?i)graph|input|invalid|node"):
        _run(_graph(_no_reader_check))
