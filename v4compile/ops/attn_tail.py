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
