"""Merge every other group of GEMMs that read the same input with the same weight format.

Requires: a module after `merge_wq_a_wkv` (optional).
Guarantees: linears sharing one input value and one weight format (dtype, scale block, columns) become
one merged `linear` + `split`s, as in `merge_wq_a_wkv`. In the released formats this merges the BF16
GEMMs of an attention input (compressor wkv + wgate, and on CSA layers the indexer compressor's wkv +
wgate and `weights_proj`) into one launch, and the indexer's `wq_b` with the main `wq_b` (both read
`qr`); with dense weights everything reading `x` merges. Numerics: identical values.
Hits: `<func>.merged` (groups), `<func>.gemms` (linears folded away).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Pass, PassResult, register
from .gemm_merge import can_merge, merge_linears
from .rewrite import new_module, prune_weights


def _suffix(group) -> str:
    names = [g.operands[1].name for g in group]
    roles = {n.split(".attn.", 1)[1].rsplit(".", 1)[0] if ".attn." in n else n for n in names}
    if roles <= {"wq_b", "indexer.wq_b"}:
        return "wq_b_merged"
    if all(".attn." in n for n in names):
        return "x_gemm"  # GEMMs of the attention input x (compressors, indexer weights, wqkv_a)
    return "merged_" + "_".join(n.rsplit(".", 2)[-2] for n in names)


@register
@dataclass(frozen=True)
class MergeSiblingGemms(Pass):
    name = "merge_sibling_gemms"

    def run(self, module):
        weights = dict(module.weights)
        funcs, hits = {}, {}
        for fname, fn in module.functions.items():
            groups: dict[tuple, list] = {}
            for op in fn.ops:
                if op.name != "linear" or op.operands[1].kind != "weight":
                    continue
                w, s = op.operands[1], op.operands[2]
                key = (id(op.operands[0]), w.type.dtype, w.type.shape[1:], s is None, op.attrs["block"])
                groups.setdefault(key, []).append(op)
            merged = [g for g in groups.values() if len(g) > 1 and can_merge(g)]
            funcs[fname], n = merge_linears(fn, merged, weights, _suffix)
            hits[f"{fname}.merged"] = n
            hits[f"{fname}.gemms"] = sum(len(g) - 1 for g in merged)
        return PassResult(prune_weights(new_module(module, funcs, weights)), hits)
