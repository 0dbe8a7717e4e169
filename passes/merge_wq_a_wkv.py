"""Merge the two projections of the attention input, `wq_a` and `wkv`, into one `wqkv_a` GEMM.

Requires: a traced module (each attention reads its normalised input `x` with the GEMMs of roles
`attn.wq_a` and `attn.wkv`, same `layer`).
Guarantees: per layer, one `linear(x, wqkv_a)` (role `attn.wq_a+attn.wkv`) (`[q_lora + head_dim, D]`; FP8 with the two 128x128 scale
grids concatenated) followed by a `split` into the original two results; the merged weight is built at
compile time from the two checkpoint tensors. Numerics: identical values (same dot products).
Skips (and counts as `unaligned`) quantised layers whose q_lora rank is not a multiple of the scale
block, where the scale grids could not simply be stacked.
Hits: `<func>.merged`, `<func>.unaligned`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Pass, PassResult, register
from .gemm_merge import can_merge, merge_module


@register
@dataclass(frozen=True)
class MergeWqAWkv(Pass):
    name = "merge_wq_a_wkv"

    def run(self, module):
        return PassResult(*merge_module(module, _groups, lambda g: "wqkv_a"))


def _groups(fn):
    by_input: dict[tuple, dict[str, object]] = {}
    for op in fn.ops:
        if op.name != "linear":
            continue
        for role in ("attn.wq_a", "attn.wkv"):
            if op.attrs.get("role") == role:
                by_input.setdefault((id(op.operand("x")), op.attrs.get("layer")), {})[role] = op
    groups, unaligned = [], 0
    for pair in by_input.values():
        if len(pair) == 2:
            g = [pair["attn.wq_a"], pair["attn.wkv"]]
            if can_merge(g):
                groups.append(g)
            else:
                unaligned += 1
    return groups, {"unaligned": unaligned}
