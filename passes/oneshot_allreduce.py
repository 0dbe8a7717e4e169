"""Lower a GPU program's all-reduces to the one-shot all-reduce over symmetric peer memory (issue 34).

Requires: a partitioned module (`partition`), so its all-reduces are the tensor-parallel sums of a group of ranks.
Guarantees: each `all_reduce` whose group lies within one node and whose value is small enough
(`targets.oneshot_allreduce`: up to 8 ranks, under 256 KB) becomes `all_reduce_oneshot` (the same operand, result,
attributes and place; `region_bytes` the largest such value of the module, which sizes the one symmetric region
every rank holds); likewise data parallelism's `all_gather_rows` / `reduce_scatter_rows` of one replica a rank
(tp 1) of fp32 / bf16 values (a hash router's gathered token ids stay on the communicator) whose
part (a rank's rows: what it pulls from each peer) is under the same bound become
`all_gather_rows_oneshot` / `reduce_scatter_rows_oneshot` (`region_bytes` then counts the gathered value). One
group size per module: where collectives of several sizes qualify, the largest group's become one-shot and the
others stay on the communicator (hits `<func>.oneshot`, `<func>.kept`).
The one-shot launch is a kernel call of its own (`codegen/kernels/allreduce.py`; `fuse_oneshot_producer` then folds
the EP MoE's into its launch, `fuse_oneshot_consumer` those read by a phased launch into it, as its leading phase,
`fuse_oneshot_rows` the rows collectives into the DP MoE's launch between them)
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


ROWS = ("all_gather_rows", "reduce_scatter_rows")


def _part(op) -> int:
    """The bytes a rank pulls from each peer: an all-reduce's value, a rows collective's part (a rank's rows)."""
    if op.name == "all_gather_rows":
        return op.operand("x").type.nbytes
    return op.results[0].type.nbytes if op.name == "reduce_scatter_rows" else op.operand("x").type.nbytes


def _whole(op) -> int:
    """The bytes the region's slot holds: the value reduced, or the gathered rows."""
    return max(op.operand("x").type.nbytes, op.results[0].type.nbytes)


def _eligible(op) -> bool:
    if op.name not in ("all_reduce", *ROWS) or (op.name in ROWS and int(op.attrs.get("tp", 1)) != 1):
        return False
    if op.operand("x").type.dtype not in ("fp32", "bf16"):  # (a hash router's token ids: kept on the communicator)
        return False
    return oneshot_allreduce(int(op.attrs["group"]), _part(op))


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
        region = max(_whole(op) for op in ops if int(op.attrs["group"]) == group)
        functions, hits = {}, {}
        for name, f in module.functions.items():
            mine = {id(op): op.replace(name=op.name + "_oneshot" if op.name in ROWS else "all_reduce_oneshot",
                                       attrs={**{k: v for k, v in op.attrs.items() if k != "tp"},
                                              "region_bytes": region})
                    for op in f.ops if _eligible(op) and int(op.attrs["group"]) == group}
            functions[name] = rebuild(f, mine) if mine else f
            if mine:
                hits[f"{name}.oneshot"] = len(mine)
            kept = sum(op.name in ("all_reduce", *ROWS) for op in f.ops) - len(mine)
            if kept:
                hits[f"{name}.kept"] = kept
        return PassResult(new_module(module, functions), hits)
