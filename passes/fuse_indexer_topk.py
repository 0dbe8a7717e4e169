"""Fuse the lightning indexer's scoring with its top-k (and, on the pool, the CSR translation).

Requires: `topk(indexer_scores(...))` (before lowering) or `csr_selected(topk(indexer_scores_paged(...)))`
(after `lower_sparse_attention`), each intermediate used once.
Guarantees: one `indexer_topk` (before lowering) or one `indexer_select` producing the CSA CSR directly
(after), so the `[B, T, rows]` score matrix never reaches memory. Result names kept; numerics identical.
Hits: `<func>.fused`.
"""

from __future__ import annotations

from v4compile.ir.core import Function

from .base import function_pass
from .rewrite import Rewrite, make_op, operands_of, tags_of


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    rw = Rewrite(fn)
    for op in fn.ops:
        if op.name == "csr_selected":
            tk = rw.producer(op.operand("selected"), "topk", only_use=True)
            sc = rw.producer(tk.operand("scores"), "indexer_scores_paged", only_use=True) if tk is not None else None
            if sc is None:
                continue
            a = sc.attrs
            operands = {"q": sc.operand("q"), "weights": sc.operand("weights"), "pos": op.operand("pos"),
                        "block_table": op.operand("block_table"), "p0": sc.operand("p0"), "p1": sc.operand("p1")}
            new = make_op(rw.namer, "indexer_select", operands,
                          {"ratio": a["ratio"], "q_scale": a["q_scale"], "w_scale": a["w_scale"], "k": tk.attrs["k"],
                           "block_tokens": a["block_tokens"], "index_envelope_rows": a["envelope_rows"],
                           "index_offset": a["layer_offset"], "envelope_rows": op.attrs["envelope_rows"],
                           "max_rows": a["max_rows"], "fmt": a["fmt"], **tags_of(sc)}, sc.loc, list(op.results))
            rw.replace(op, new, absorbed=[tk, sc])
    for op in fn.ops:
        if op.name == "topk" and not rw.gone(op):
            sc = rw.producer(op.operand("scores"), "indexer_scores", only_use=True)
            if sc is None:
                continue
            rw.replace(op, make_op(rw.namer, "indexer_topk", operands_of(sc), {**sc.attrs, "k": op.attrs["k"]},
                                   sc.loc, [op.result]), absorbed=[sc])
    return rw.done("fused")


FuseIndexerTopk = function_pass("fuse_indexer_topk", fuse_function)
