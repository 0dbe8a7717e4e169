"""Fold data parallelism's one-shot rows collectives into the MoE launch between them (issue 34): the
`all_gather_rows_oneshot` whose result is the `xg` of one `moe_router_experts_dp` (and used by it alone), and the
`reduce_scatter_rows_oneshot` that is the sole user of that MoE's `partial`, become one op with the MoE, two launches
fewer per layer.

Requires: the one-shot rows collectives of `oneshot_allreduce`, the DP MoE of `fuse_moe_router` (under
`partition{dp, ep}`).
Guarantees: each such triple becomes one `ag_moe_router_experts_dp_rs` (`ops/fused_allreduce.py`) in the MoE's place:
the MoE's operands without `xg` (the gather's operand is the MoE's own `x`: checked), its attributes plus the
collectives' `group` and `region_bytes` (the two's: checked equal), its results the reduce-scatter's (this rank's
rows of the routed sum) then the MoE's `shared` (names kept). Its kernel (`codegen/kernels/moe_router.py`,
`allreduce.fold_rows`) runs the all-gather as the launch's leading phase and the reduce-scatter as its trailing part,
the shared expert between the latter's publish and wait: numerics bit-identical (the same copies, the same rank-order
sum). Where `x` is the `y_next` of a norm `mhc_post_pre` (the seam before the MoE, which `fuse_mhc_moe` leaves apart
under DP: its output had two users, the gather and the MoE) used by the two alone, the seam joins too: one
`mhc_ag_moe_router_experts_dp_rs` (the seam's operands first, its fn / base / scale / norm as `in_*`, its attributes
as `in_*`; results the MoE's then the seam's streams / post / comb, names kept), whose launch runs the seam, then
the all-gather of its output. Left as they are: a gather of other tokens than the MoE's own `x`, a gathered value or
partial with another use (their one-shots keep their launches). Under `--allreduce nccl` there is no one-shot to
fold. GPU-only (as
`oneshot_allreduce`). Hits: `<func>.folded`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ops.fused import MHC_ATTRS
from v4compile.ops.fused_allreduce import (AR_ATTRS, DP_MOE, GATHERED, PRODUCED, ROWS_FOLDED, SEAM_ROWS_FOLDED,
                                           folded_attrs)

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of


def fold_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name != DP_MOE:
            continue
        ag = rw.producer(op.operand(GATHERED), "all_gather_rows_oneshot", only_use=True)
        rs = rw.sole_user(op.out(PRODUCED), "reduce_scatter_rows_oneshot")
        if ag is None or rs is None or ag.operand("x") is not op.operand("x"):
            continue
        if any(ag.attrs[n] != rs.attrs[n] for n in AR_ATTRS) or not rw.can_fuse(op, [ag, rs]):
            continue
        operands = {n: v for n, v in operands_of(op).items() if n != GATHERED}
        results = [rs.result if r is op.out(PRODUCED) else r for r in op.results]
        attrs, absorbed = folded_attrs(op, rs), [ag, rs]
        seam = _seam_before(rw, op, absorbed)
        if seam is None:
            rw.replace(op, make_op(rw.namer, ROWS_FOLDED, operands, attrs, op.loc, results), absorbed=absorbed)
            continue
        s_ops = operands_of(seam)
        operands = {**{n: s_ops[n] for n in ("y", "streams", "post", "comb")},
                    **{"in_" + n: s_ops[n] for n in ("fn", "base", "scale", "norm")},
                    **{n: v for n, v in operands.items() if n != "x"}}
        attrs.update({"in_" + n: seam.attrs[n] for n in MHC_ATTRS})
        attrs.update(tags_of(op, role=join_roles(seam, op)))
        results += [seam.out("streams_out"), seam.out("post_next"), seam.out("comb_next")]
        rw.replace(op, make_op(rw.namer, SEAM_ROWS_FOLDED, operands, attrs, op.loc, results),
                   absorbed=[*absorbed, seam])
    return rw.done("folded")


def _seam_before(rw: Rewrite, op, absorbed: list):
    """The norm seam whose `y_next` is `op`'s x, used by `op` and its all-gather alone, where it may join them."""
    x = op.operand("x")
    seam = rw.producer(x, "mhc_post_pre")
    if seam is None or seam.operand("norm") is None or x is not seam.out("y_next") or rw.uses.get(id(x)) != 2:
        return None
    return seam if rw.can_fuse(op, [*absorbed, seam]) else None


FuseOneshotRows = function_pass("fuse_oneshot_rows", fold_function, after={
    "oneshot_allreduce": "it folds the one-shot rows collectives that pass makes",
    "fuse_moe_router": "it folds into that pass's moe_router_experts_dp",
    "fuse_mhc_post_pre": "it folds that pass's seam (the norm variant) before the MoE in",
})
