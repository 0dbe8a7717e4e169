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
from .rewrite import Namer, make_op, operands_of, rebuild, tags_of, use_counts


def fuse_function(fn: Function) -> tuple[Function, dict[str, int]]:
    namer = Namer(fn)
    prod = fn.producers()
    uses = use_counts(fn)
    replace, drop, n = {}, set(), 0
    for op in fn.ops:
        if op.name == "csr_selected":
            tk = prod.get(id(op.operand("selected")))
            sc = prod.get(id(tk.operand("scores"))) if tk is not None and tk.name == "topk" else None
            if sc is None or sc.name != "indexer_scores_paged" or uses.get(id(tk.result)) != 1 \
                    or uses.get(id(sc.result)) != 1:
                continue
            a = sc.attrs
            operands = {"q": sc.operand("q"), "weights": sc.operand("weights"), "pos": op.operand("pos"),
                        "block_table": op.operand("block_table"), "p0": sc.operand("p0"), "p1": sc.operand("p1")}
            new = make_op(namer, "indexer_select", operands,
                          {"ratio": a["ratio"], "q_scale": a["q_scale"], "w_scale": a["w_scale"], "k": tk.attrs["k"],
                           "block_tokens": a["block_tokens"], "index_envelope_rows": a["envelope_rows"],
                           "index_offset": a["layer_offset"], "envelope_rows": op.attrs["envelope_rows"],
                           "max_rows": a["max_rows"], "fmt": a["fmt"], **tags_of(sc)}, sc.loc, list(op.results))
            replace[id(op)] = new
            drop.update((id(tk), id(sc)))
            n += 1
    for op in fn.ops:
        if op.name == "topk" and id(op) not in drop:
            sc = prod.get(id(op.operand("scores")))
            if sc is None or sc.name != "indexer_scores" or uses.get(id(sc.result)) != 1:
                continue
            replace[id(op)] = make_op(namer, "indexer_topk", operands_of(sc), {**sc.attrs, "k": op.attrs["k"]},
                                      sc.loc, [op.result])
            drop.add(id(sc))
            n += 1
    return rebuild(fn, replace, drop), {"fused": n}


FuseIndexerTopk = function_pass("fuse_indexer_topk", fuse_function)
