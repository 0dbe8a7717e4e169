"""Launch the two compressors of one layer together.

Requires: `lower_sparse_attention` (the compressors are `compress_paged` ops on the pool).
Guarantees: in op order, each two `compress_paged` of one layer of a decode step (one token per sequence)
that read the same positions, slots and block table become one `compress_pair` at the first one's place (V4:
a CSA layer's attention compressor and its indexer's compressor: one launch fewer per CSA layer; a prefill
chunk's pair would spill 10 bytes on gfx950 at V4-Pro shapes, so chunks keep two launches), when no operand of the second is computed after
the first (nothing between them feeds it); each half keeps its own operands, attributes and result values
(so every use of them is kept); numerics identical (each half is the `compress_paged` it replaces: they
touch disjoint rings and pool planes). Kept out of the cpu pipeline (`passes/pipeline.py`): ONNX Runtime
runs graph nodes, not launches.
Hits: `<func>.paired`.
"""

from __future__ import annotations

from v4compile.ir.core import Function
from v4compile.ops.paged import COMPRESS_PAIR_ATTRS

from .base import function_pass
from .rewrite import Rewrite, join_roles, make_op, operands_of, tags_of

SHARED = ("pos", "slot", "block_table")


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    defined_at = {id(r): i for i, op in enumerate(fn.ops) for r in op.results}
    waiting: dict[tuple, tuple[int, object]] = {}  # (layer, shared operands) -> (place, first compressor)
    for i, op in enumerate(fn.ops):
        if op.name != "compress_paged" or op.operand("kv").type.shape[1] != 1:
            continue
        key = (op.attrs.get("layer"), *(id(op.operand(n)) for n in SHARED))
        at, first = waiting.pop(key, (None, None))
        if first is None or any(defined_at.get(id(v), -1) > at for v in op.operands if v is not None):
            waiting[key] = (i, op)
            continue
        operands = {f"{n}_{h}": v for h, g in enumerate((first, op))
                    for n, v in operands_of(g).items() if n not in SHARED}
        operands.update({n: op.operand(n) for n in SHARED})
        attrs = {k: g.attrs[k[:-2]] for k in COMPRESS_PAIR_ATTRS for g in [(first, op)[int(k[-1])]]}
        attrs.update(tags_of(first, role=join_roles(first, op)))
        pair = make_op(rw.namer, "compress_pair", operands, attrs, first.loc, [*first.results, *op.results])
        rw.replace(first, pair, absorbed=[op])
    return rw.done("paired")


PairCompressors = function_pass("pair_compressors", fuse_function, after={
    "lower_sparse_attention": "it pairs the compress_paged ops the lowering makes",
})
