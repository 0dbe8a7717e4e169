"""Launch two GEMMs of one input together when their weights cannot be stacked into one.

Requires: the GEMM merges have run (`merge_wq_a_wkv`, `merge_sibling_gemms`: what is left of one input's
`linear`s differs in weight format or numerics), and `fuse_norm_linear` (a `linear` of a weighted
RMSNorm becomes `norm_linear` first; pairing it would keep the norm's own launch).
Guarantees: in op order, each two `linear`s of one input value and one layer become one `linear_pair`
(V4: the FP8 `wqkv_a` and the BF16 compressor / indexer `x_gemm` of the attention input: one launch fewer
per layer), at the first one's place, each half with its own weight, scale and numerics; result values
keep their names; numerics identical (each half is the `linear` it replaces). Both pipelines: the cpu
target's ONNX lowering is the two GEMMs (`codegen/onnx/gemm.py`).
Hits: `<func>.paired`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, tags_of


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    waiting: dict[tuple, object] = {}  # (input, layer) -> the first linear of a pair still to be made
    for op in fn.ops:
        if op.name != "linear" or op.operand("w").kind != "weight":
            continue
        key = (id(op.operand("x")), op.attrs.get("layer"))
        first = waiting.pop(key, None)
        if first is None:
            waiting[key] = op
            continue
        attrs = {"acc": first.attrs["acc"]}
        if op.attrs["acc"] != first.attrs["acc"]:
            waiting[key] = op
            continue
        for i, g in enumerate((first, op)):
            attrs.update({f"block{i}": g.attrs["block"], f"act{i}": g.attrs["act"], f"out_dtype{i}": g.attrs["out_dtype"]})
        pair = make_op(rw.namer, "linear_pair", {"x": first.operand("x"), "w0": first.operand("w"), "w1": op.operand("w"),
                                                 "scale0": first.operand("scale"), "scale1": op.operand("scale")},
                       {**attrs, **tags_of(first, role=join_roles(first, op))}, first.loc, [first.result, op.result])
        rw.replace(first, pair, absorbed=[op])
    return rw.done("paired")


PairSiblingGemms = function_pass("pair_sibling_gemms", fuse_function, after={
    "merge_wq_a_wkv": "it pairs what the GEMM merges leave",
    "merge_sibling_gemms": "it pairs what the GEMM merges leave",
    "fuse_norm_linear": "pairing a normed GEMM first would keep the norm's own launch",
})
