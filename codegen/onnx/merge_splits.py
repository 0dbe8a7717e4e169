"""The cpu target's one graph optimisation: a chain of Splits, each cutting a part the one before made,
becomes one Split with the same parts (run by the exporter on each finished graph)."""

from __future__ import annotations

import onnx
from onnx import TensorProto


def merge_splits(g) -> None:
    """A Split of a part that another Split made (same axis, static sizes, the part read by nothing
    else) becomes more parts of that Split: a merged GEMM's output cut by a chain of `split` ops is one
    node (each costs a decode step ~0.3 us; the parts are the same values)."""
    sizes = {t.name: [int(v) for v in onnx.numpy_helper.to_array(t).ravel()]
             for t in g.inits if t.data_type == TensorProto.INT64}
    readers: dict[str, int] = {}
    for n in g.nodes:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    outs = {o.name for o in g.outputs}  # a part the graph outputs stays a value of its own
    made: dict[str, onnx.NodeProto] = {}  # a part -> the Split that makes it
    keep = []
    for n in g.nodes:
        if n.op_type != "Split" or len(n.input) != 2 or n.input[1] not in sizes:
            keep.append(n)
            continue
        p = made.get(n.input[0])
        if p is None or readers[n.input[0]] != 1 or n.input[0] in outs or list(n.attribute) != list(p.attribute):
            keep.append(n)
            made.update({o: n for o in n.output})
            continue
        at = list(p.output).index(n.input[0])
        parts = sizes[p.input[1]]
        merged = [*parts[:at], *sizes[n.input[1]], *parts[at + 1:]]
        p.input[1] = g.i64(*merged)
        sizes[p.input[1]] = merged
        p.output[:] = [*p.output[:at], *n.output, *p.output[at + 1:]]
        made.update({o: p for o in n.output})
    g.nodes[:] = keep
    g.drop_unread_consts()  # the replaced size lists
