"""Fused ops of the attention's tail (the `fuse_out_proj` pass): the output projection's two GEMMs as one
op. The reference is the composition of the references it replaces, so the fusion never changes a value."""

from __future__ import annotations

from ..ir.registry import Cost, defop
from .basic import GEMM_ATTRS, linear
from .fused import rope_out_proj

# `wo_b`'s GEMM attributes, suffixed (the op's unsuffixed GEMM attributes are `wo_a`'s; `acc` is shared)
WO_B_ATTRS = {"block_b": (int, 128), "act_b": (str, "native"), "out_dtype_b": (str, "")}
ROPE_OUT_PROJ_ATTRS = {"dim": int, "theta": float, "yarn": tuple, "groups": int, **GEMM_ATTRS}


def wo_b_attrs(attrs: dict) -> dict:
    """The `linear` attributes of the op's second GEMM."""
    return {"block": attrs["block_b"], "act": attrs["act_b"], "acc": attrs["acc"], "out_dtype": attrs["out_dtype_b"]}


def wo_a_attrs(attrs: dict) -> dict:
    """The `rope_out_proj` attributes of the op's first GEMM."""
    return {n: attrs[n] for n in ROPE_OUT_PROJ_ATTRS}


@defop("rope_out_proj_linear(o, pos, w, scale?, wb, wb_scale?) -> y",
       attrs={**ROPE_OUT_PROJ_ATTRS, **WO_B_ATTRS}, kernel="out_proj")
def rope_out_proj_linear(o, pos, w, scale, wb, wb_scale, **attrs):
    """The attention's output projection in one op: `linear(rope_out_proj(o, pos, w, scale), wb, wb_scale)`
    (`wo_a` reading the attention output through its inverse RoPE, then `wo_b` on every group's output)."""
    z = rope_out_proj.ref(o, pos, w, scale, **wo_a_attrs(attrs))
    return linear.ref(z, wb, wb_scale, **wo_b_attrs(attrs))


@rope_out_proj_linear.infer
def _(o, pos, w, scale, wb, wb_scale, **attrs):
    z = rope_out_proj.result_types([o, pos, w, scale], wo_a_attrs(attrs))[0]
    return linear.result_types([z, wb, wb_scale], wo_b_attrs(attrs))


@rope_out_proj_linear.cost
def _(operands, results, attrs):
    """The two GEMMs' costs, summed: the fused kernel still writes `wo_a`'s output (scratch) and its second
    phase reads it back, as the two launches did; the fusion saves a launch, not traffic."""
    o, pos, w, scale, wb, wb_scale = operands
    z = rope_out_proj.result_types([o, pos, w, scale], wo_a_attrs(attrs))[0]
    a = rope_out_proj.cost_of([o, pos, w, scale], [z], wo_a_attrs(attrs))
    b = linear.cost_of([z, wb, wb_scale], results, wo_b_attrs(attrs))
    return Cost(a.flops + b.flops, a.bytes_read + b.bytes_read, a.bytes_written + b.bytes_written)


SPARSE_ATTENTION_OPERANDS = ("q", "kv", "pos", "sink", "slot", "block_table", "win_indptr", "win_indices",
                             "comp_indptr", "comp_indices", "p0", "p1", "p2")


def _split(operands, attrs):
    """(sparse_attention operands, its attrs, rope_out_proj_linear operands without o and pos, its attrs)."""
    from .paged import sparse_attention
    a_attrs = {n: attrs[n] for n in sparse_attention.attrs if n != "variant"}
    p_attrs = {n: attrs[n] for n in (*ROPE_OUT_PROJ_ATTRS, *WO_B_ATTRS)}
    return list(operands[:13]), a_attrs, list(operands[13:]), p_attrs


@defop("sparse_attention_out_proj(q, kv, pos, sink, slot, block_table?, win_indptr, win_indices, comp_indptr?, "
       "comp_indices?, p0, p1?, p2?, w, w_scale?, wb, wb_scale?) -> y",
       attrs={"window": int, "scale": float, "win_base": int, "comp_base": int, "fmt": str, "slot_rows": int,
              "n_rows": int, "ratio": (int, 1), "block_tokens": (int, 1), "envelope_rows": (int, 0),
              "comp_rows": (int, 0), **ROPE_OUT_PROJ_ATTRS, **WO_B_ATTRS},
       kernel="out_proj", offset_attrs=("win_base", "comp_base"),
       variants={"window": (), "window_compressed": ("block_table", "comp_indptr", "comp_indices")})
def sparse_attention_out_proj(*operands, **attrs):
    """The attention's tail at decode in one op: `sparse_attention` (split-KV and its merge), then
    `rope_out_proj_linear` on its output with the same positions (wo_a through the inverse RoPE, then wo_b);
    the attention output never leaves the op."""
    from .paged import sparse_attention
    a_ops, a_attrs, p_ops, p_attrs = _split(operands, attrs)
    o = sparse_attention.ref(*a_ops, **a_attrs)
    return rope_out_proj_linear.ref(o, a_ops[2], p_ops[0], p_ops[1], p_ops[2], p_ops[3], **p_attrs)


@sparse_attention_out_proj.infer
def _(*operands, **attrs):
    from .paged import sparse_attention
    a_ops, a_attrs, p_ops, p_attrs = _split(operands, attrs)
    o = sparse_attention.result_types(a_ops, a_attrs)[0]
    return rope_out_proj_linear.result_types([o, a_ops[2], *p_ops], p_attrs)


@sparse_attention_out_proj.cost
def _(operands, results, attrs):
    """The attention's and the projection's costs, summed: the fused kernel still writes the attention output
    (scratch) and the projection's phases read it back, as the launches did; the fusion saves a launch."""
    from .paged import sparse_attention
    a_ops, a_attrs, p_ops, p_attrs = _split(operands, attrs)
    o = sparse_attention.result_types(a_ops, a_attrs)[0]
    a = sparse_attention.cost_of(a_ops, [o], a_attrs)
    b = rope_out_proj_linear.cost_of([o, a_ops[2], *p_ops], results, p_attrs)
    return Cost(a.flops + b.flops, a.bytes_read + b.bytes_read, a.bytes_written + b.bytes_written)
