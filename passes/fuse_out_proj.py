"""Fold the attention's tail into one launch: `wo_b` into `wo_a`'s op, and at decode the sparse attention
that feeds them; up to two launches fewer per layer.

Requires: `fuse_inv_rope_wo_a` has run (a `rope_out_proj`: wo_a reading the attention output through its
inverse RoPE) and, for the attention, `lower_sparse_attention` (a `sparse_attention` op).
Guarantees:
* a `rope_out_proj` whose result `z` has no user but one `linear` (wo_b, as its `x`) of the same accumulation
  becomes (where `Rewrite.can_fuse` allows the place), with it, one `rope_out_proj_linear(o, pos, w, scale, wb, wb_scale)` in the linear's place (wo_a's
  attributes as they were, wo_b's as `block_b` / `act_b` / `out_dtype_b`, wo_a's layer tag, both roles), its
  result the linear's value (name kept); `z` never leaves the op (hits `<func>.fused`);
* if moreover `o` is a decode `sparse_attention`'s output (one query per sequence, T = 1) used by wo_a alone,
  rotated back at the attention's own positions, the three become one `sparse_attention_out_proj` (the
  attention's operands, then w, w_scale, wb, wb_scale; the attention's attributes and the projection's) in
  the attention's place (so it reads the pool before any in-place write after it), its result the linear's
  value; the attention output never leaves the op (hits `<func>.attention`). Prefill keeps its attention
  launch.
The kernels (`codegen/kernels/out_proj.py`) run the attention's programs (its split merge included), wo_a's
and wo_b's as ticketed phases of one launch, each the unfused launch's body with its own roundings, so
numerics are bit-identical (each op's reference is the composition of the ones it replaces).
Under data parallelism the mHC seam after the tail (its MoE input gathered next) stays its own launch: as the
tail's fourth phase the V4-Pro decode kernel, already at 254 registers on sm_90a, spilled 88-104 bytes there
(tried: inlined, a noinline call, in the last wo_b program, fewer pipeline stages).
Runs after the passes that make and rewrite the attention (`lower_sparse_attention`, `fuse_qkv_norm_rope`).
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of

WO_A_ATTRS = ("dim", "theta", "yarn", "groups", "block", "act", "acc", "out_dtype")


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    n_attn = 0
    for op in fn.ops:
        if op.name != "linear":
            continue
        wo_a = rw.producer(op.operand("x"), "rope_out_proj", only_use=True)
        if wo_a is None or wo_a.attrs["acc"] != op.attrs["acc"]:
            continue
        attrs = {n: wo_a.attrs[n] for n in WO_A_ATTRS}
        attrs.update(block_b=op.attrs["block"], act_b=op.attrs["act"], out_dtype_b=op.attrs["out_dtype"])
        proj = {"w": wo_a.operand("w"), "scale": wo_a.operand("scale"), "wb": op.operand("w"),
                "wb_scale": op.operand("scale")}
        attn = rw.producer(wo_a.operand("o"), "sparse_attention", only_use=True)
        if (attn is not None and attn.operand("q").type.shape[1] == 1 and attn.operand("pos") is wo_a.operand("pos")
                and rw.can_fuse(attn, [wo_a, op])):
            attrs.update({n: v for n, v in attn.attrs.items() if n in get_op(attn.name).attrs and n != "variant"})
            attrs.update(tags_of(wo_a, role=join_roles(attn, wo_a, op)))
            operands = {**operands_of(attn), "w": proj["w"], "w_scale": proj["scale"], "wb": proj["wb"],
                        "wb_scale": proj["wb_scale"]}
            # in the attention's place: it reads the pool planes before any later in-place write of them (the
            # decode window write, until fuse_qkv_norm_rope folds it; `can_fuse` refuses wo_b's place for that)
            rw.replace(attn, make_op(rw.namer, "sparse_attention_out_proj", operands, attrs, op.loc, [op.result]),
                       absorbed=[wo_a, op])
            n_attn += 1
            continue
        if not rw.can_fuse(op, [wo_a]):
            continue
        attrs.update(tags_of(wo_a, role=join_roles(wo_a, op)))
        operands = {"o": wo_a.operand("o"), "pos": wo_a.operand("pos"), **proj}
        rw.replace(op, make_op(rw.namer, "rope_out_proj_linear", operands, attrs, op.loc, [op.result]),
                   absorbed=[wo_a])
    return rw.done({"fused": rw.count, "attention": n_attn})


FuseOutProj = function_pass("fuse_out_proj", fuse_function, after={
    "fuse_inv_rope_wo_a": "it fuses fuse_inv_rope_wo_a's op with wo_b",
    "lower_sparse_attention": "at decode it fuses the sparse attention the lowering makes",
    "fuse_qkv_norm_rope": "it fuses the ops fuse_qkv_norm_rope makes",
})
