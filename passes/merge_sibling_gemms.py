"""Merge every other group of GEMMs that read the same input with the same weight format.

Requires: a module after `merge_wq_a_wkv` (optional).
Guarantees: linears sharing one input value, one layer, one weight format (dtype, scale block, columns)
and one numerics (`act`, `acc`, `out_dtype`) become one merged `linear` + `split`s, as in `merge_wq_a_wkv`. In the released formats this merges the BF16
GEMMs of an attention input (compressor wkv + wgate, and on CSA layers the indexer compressor's wkv +
wgate and `weights_proj`) into one launch, and the indexer's `wq_b` with the main `wq_b` (both read
`qr`); with dense weights everything reading `x` merges. On an expert-parallel module the shared expert's
w1 / w3 stay apart: there `fuse_moe_router` (gpu pipeline only) takes them unmerged into its op, and the
cpu and gpu pipelines must take the same weights (one weights directory serves both). Numerics: identical
values.
Hits: `<func>.merged` (groups), `<func>.gemms` (linears folded away).
"""

from __future__ import annotations

from dataclasses import dataclass

import functools

from .base import Pass, PassResult, register
from v4compile.ir.semantics import roles_of
from v4compile.parallel import ParallelLayout

from .gemm_merge import SHARED_ATTRS, can_merge, merge_module


def _suffix(group) -> str:
    """Name of the merged weight (`layers.<l>.<common path>.<suffix>.weight`), from the members' roles."""
    roles = [r for g in group for r in roles_of(g.attrs.get("role", ""))]
    if roles and set(roles) <= {"attn.wq_b", "attn.indexer.wq_b"}:
        return "wq_b_merged"
    if roles and all(r.startswith("attn.") for r in roles):
        return "x_gemm"  # GEMMs of the attention input x (compressors, indexer weights, wqkv_a)
    return "merged_" + "_".join(r.rsplit(".", 1)[-1] for r in roles)


@register
@dataclass(frozen=True)
class MergeSiblingGemms(Pass):
    name = "merge_sibling_gemms"
    after = {"fuse_moe": "it would otherwise merge the shared expert's w1 / w3",
             "merge_wq_a_wkv": "it merges what merge_wq_a_wkv leaves"}

    def run(self, module):
        layout = ParallelLayout.of(module)
        apart = layout is not None and layout.ep > 1
        return PassResult(*merge_module(module, functools.partial(_groups, shared_apart=apart), _suffix))


def _groups(fn, shared_apart: bool = False):
    groups: dict[tuple, list] = {}
    for op in fn.ops:
        w = op.operand("w") if op.name == "linear" else None
        if w is None or w.kind != "weight":
            continue
        if shared_apart and any(r.startswith("ffn.shared.") for r in roles_of(op.attrs.get("role", ""))):
            continue
        key = (id(op.operand("x")), w.type.dtype, w.type.shape[1:], op.operand("scale") is None,
               op.attrs.get("layer"), *(op.attrs.get(k) for k in SHARED_ATTRS))
        groups.setdefault(key, []).append(op)
    merged = [g for g in groups.values() if len(g) > 1 and can_merge(g)]
    return merged, {"gemms": sum(len(g) - 1 for g in merged)}
