"""Lower a GPU program's all-reduces to the one-shot all-reduce over symmetric peer memory (issue 34).

Requires: a partitioned module (`partition`), so its all-reduces are the tensor-parallel sums of a group of ranks.
Guarantees: each `all_reduce` whose group lies within one node and whose value is small enough
(`targets.oneshot_allreduce`: up to 8 ranks, under 256 KB) becomes `all_reduce_oneshot` (the same operand, result,
attributes and place; `region_bytes` the largest such value of the module, which sizes the one symmetric region
every rank holds). One group size per module: where all-reduces of several sizes qualify, the largest group's
become one-shot and the others stay on the communicator (hits `<func>.oneshot`, `<func>.kept`).
The one-shot launch is a kernel call of its own (`codegen/kernels/allreduce.py`; `fuse_oneshot_producer` then folds
the EP MoE's into its launch, `fuse_oneshot_consumer` those read by a phased launch into it, as its leading phase)
that adds the ranks' values in
rank order in the value's dtype: bit for bit the IR's reference (`ops/collective._rank_sum`), which NCCL's ring
order is not. The knob is `compile --allreduce oneshot|nccl` (nccl: this pass is left out; the pipeline the
artifact records says which ran). Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime's segments
meet at the communicator's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.targets import oneshot_allreduce

from .base import Pass, PassResult, register
from .rewrite import new_module, rebuild


def _eligible(op) -> bool:
    return op.name == "all_reduce" and oneshot_allreduce(int(op.attrs["group"]), op.operand("x").type.nbytes)


@register
@dataclass(frozen=True)
class OneshotAllreduce(Pass):
    name = "oneshot_allreduce"
    after = {"partition": "it lowers the partition's all-reduces"}

    def run(self, module):
        ops = [op for f in module.functions.values() for op in f.ops if _eligible(op)]
        if not ops:
            return PassResult(module, {})
        group = max(int(op.attrs["group"]) for op in ops)
        region = max(op.operand("x").type.nbytes for op in ops if int(op.attrs["group"]) == group)
        functions, hits = {}, {}
        for name, f in module.functions.items():
            mine = {id(op): op.replace(name="all_reduce_oneshot", attrs={**op.attrs, "region_bytes": region})
                    for op in f.ops if _eligible(op) and int(op.attrs["group"]) == group}
            functions[name] = rebuild(f, mine) if mine else f
            if mine:
                hits[f"{name}.oneshot"] = len(mine)
            kept = sum(op.name == "all_reduce" for op in f.ops) - len(mine)
            if kept:
                hits[f"{name}.kept"] = kept
        return PassResult(new_module(module, functions), hits)
