"""Fold the seam before the MoE into it: the `mhc_post_pre` after the attention (its `hc_post` on wo_b's
output, the FFN's `hc_pre` and ffn_norm) and the `moe_mhc_post_pre` that reads it become one op, so at decode
the attention's output goes through the seam, the router, both kinds of expert, the combine and the next
seam in one launch.

Requires: `moe_mhc_post_pre` (from `fuse_moe_mhc`) whose `x`, `streams`, `post` and `comb` are the `y_next`,
`streams_out`, `post_next` and `comb_next` of one `mhc_post_pre` (from `fuse_mhc_post_pre`, its RMSNorm
folded: the `norm` variant), each used by it alone.
Guarantees: the pair becomes one `mhc_moe_mhc` in the MoE's place (the seam's operands, its fn / base /
scale / norm as `in_*`, then the MoE's and the seam after it; the seam's attributes as `in_*`, the MoE's
layer tag, roles joined), its results the MoE's values (names kept); the seam's four results never leave the
op (its kernel keeps them in scratch: the first phase of the one decode launch writes them, the router,
experts and the seam after read them, `codegen/kernels/moe_router.py`). Numerics bit-identical (the
reference is the composition).
Left as they are: layer 0 (its seam before the MoE is an `hc_pre_norm`, not an `mhc_post_pre`) and the last
layer (its MoE is a `moe_router_experts_shared`: the seam after it is `mhc_post_head`).
Expert-parallel modules: `moe_router_experts_ep` (from `fuse_moe_router`) whose `x` is the `y_next` of one
`mhc_post_pre` (norm variant) and used by it alone: the pair becomes one `mhc_moe_ep` in the MoE's place,
its results the MoE's (routed partial sum, shared expert output) then the seam's streams / post / comb
(names kept: the seam after the all-reduce, `mhc_post_pre_add`, reads them); the MoE's input never leaves
the op. Numerics bit-identical (`ops/fused_ep.py`). Data-parallel modules: the MoE's `x` has two users (the
all-gather and the MoE), so the pair is left here; `fuse_oneshot_rows` joins the seam to the MoE and its folded
one-shot collectives instead (`mhc_ag_moe_router_experts_dp_rs`).
Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime runs graph nodes, not launches.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ir.registry import get_op
from v4compile.ops.fused import MHC_ATTRS

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of

# moe_mhc_post_pre's operand <- the seam's result it must be
FROM_SEAM = {"x": "y_next", "streams": "streams_out", "post": "post_next", "comb": "comb_next"}


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name == "moe_router_experts_ep":
            _fuse_ep(rw, op)
        if op.name != "moe_mhc_post_pre":
            continue
        seam = rw.producer(op.operand("x"), "mhc_post_pre", only_use=True)
        if seam is None or seam.operand("norm") is None:
            continue
        if not all(op.operand(n) is seam.out(r) and rw.uses.get(id(seam.out(r))) == 1 for n, r in FROM_SEAM.items()):
            continue
        front = operands_of(seam)
        operands = {n: front[n] for n in ("y", "streams", "post", "comb")}
        operands.update({"in_" + n: front[n] for n in ("fn", "base", "scale", "norm")})
        operands.update({n: v for n, v in operands_of(op).items() if n not in FROM_SEAM})
        attrs = {n: v for n, v in op.attrs.items() if n in get_op(op.name).attrs and n != "variant"}
        attrs.update({"in_" + n: seam.attrs[n] for n in MHC_ATTRS})
        attrs.update(tags_of(op, role=join_roles(seam, op)))  # the MoE's layer: its weights are the launch's bulk
        rw.replace(op, make_op(rw.namer, "mhc_moe_mhc", operands, attrs, op.loc, list(op.results)), absorbed=[seam])
    return rw.done("fused")


def seam_before(rw: Rewrite, op, seam_name: str, inputs: tuple[str, ...]):
    """The norm seam (`seam_name`, RMSNorm folded) whose `y_next` is `op`'s x and used by it alone, where the two
    can become one op with the seam as its first phase: (the seam, its operands `inputs` then its fn / base /
    scale / norm as `in_*`, its attributes as `in_*`), else None."""
    seam = rw.producer(op.operand("x"), seam_name, only_use=True)
    if seam is None or seam.operand("norm") is None or op.operand("x") is not seam.out("y_next"):
        return None
    if not rw.can_fuse(op, [seam]):
        return None
    s_ops = operands_of(seam)
    operands = {n: s_ops[n] for n in inputs}
    operands.update({"in_" + n: s_ops[n] for n in ("fn", "base", "scale", "norm")})
    return seam, operands, {"in_" + n: seam.attrs[n] for n in MHC_ATTRS}


def _fuse_ep(rw: Rewrite, moe) -> None:
    found = seam_before(rw, moe, "mhc_post_pre", ("y", "streams", "post", "comb"))
    if found is None:
        return
    seam, operands, seam_attrs = found
    operands.update({n: v for n, v in operands_of(moe).items() if n != "x"})
    attrs = {n: v for n, v in moe.attrs.items() if n in get_op(moe.name).attrs and n != "variant"}
    attrs.update(seam_attrs)
    attrs.update(tags_of(moe, role=join_roles(seam, moe)))
    results = [moe.out("partial"), moe.out("shared"), seam.out("streams_out"), seam.out("post_next"),
               seam.out("comb_next")]
    rw.replace(moe, make_op(rw.namer, "mhc_moe_ep", operands, attrs, moe.loc, results), absorbed=[seam])


FuseMhcMoe = function_pass("fuse_mhc_moe", fuse_function, after={
    "fuse_moe_mhc": "it folds the seam before the MoE into fuse_moe_mhc's op",
})
