"""Fold the attention output's inverse RoPE (and its FP8 quantisation) into `wo_a`'s loader: one launch
fewer per layer.

Requires: `fold_inverse_rope_wo_a_quant` has run: `inv_rope_group_quant(o, pos)` whose results (the
rotated output and, with fmt fp8, its scales) have no user but one `grouped_out_proj` (as `o` / `o_scale`).
Guarantees: the pair becomes one `rope_out_proj(o, pos, w, scale)`: the GEMM rotates each K tile as it
loads it and, when the pair quantised (fmt fp8 or a GEMM with act fp8), quantises it per 128-wide K block
itself (`act="fp8"`): the same e4m3 values and scales the fold made, so numerics are bit-identical
(tests/kernels/test_gemm_numerics.py shows the pre-quantised and self-quantising GEMMs agree).
The result keeps its name. The pass runs in both pipelines: the cpu target's ONNX lowering composes the
rotation and the GEMM (`codegen/onnx/grouped_gemm.py`).
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import Rewrite, make_op, tags_of


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != "grouped_out_proj":
            continue
        q = rw.producer(op.operand("o"), "inv_rope_group_quant", only_use=True)
        if q is None:
            continue
        s = q.out("scale") if q.attrs["fmt"] == "fp8" else None
        if op.operand("o_scale") is not s or (s is not None and rw.uses.get(id(s)) != 1):
            continue
        act = "fp8" if s is not None else op.attrs["act"]
        attrs = {k: q.attrs[k] for k in ("dim", "theta", "yarn")}
        attrs.update({k: op.attrs[k] for k in ("groups", "block", "acc", "out_dtype")}, act=act)
        rw.replace(op, make_op(rw.namer, "rope_out_proj", {"o": q.operand("x"), "pos": q.operand("pos"),
                                                           "w": op.operand("w"), "scale": op.operand("scale")},
                               {**attrs, **tags_of(op)}, op.loc, [op.result]), absorbed=[q])
    return rw.done("fused")


FuseInvRopeWoA = function_pass("fuse_inv_rope_wo_a", fuse_function, after={
    "fold_inverse_rope_wo_a_quant": "it fuses the fold's op into wo_a",
})
