"""ONNX lowerings of the `indexer` kernel family: indexer_select."""

from __future__ import annotations


def lower_indexer_select(g, o, a, r):
    rl = g.indexer_rows(o.q, o.types["q"], o.weights, g.as_i64(o.pos, o.types["pos"].dtype),
                        g.as_i64(o.block_table, o.types["block_table"].dtype), o.p0, ratio=a["ratio"],
                        q_scale=a["q_scale"], w_scale=a["w_scale"], k=a["k"], block_tokens=a["block_tokens"],
                        index_envelope_rows=a["index_envelope_rows"], index_offset=a["index_offset"],
                        envelope_rows=a["envelope_rows"], max_rows=a["max_rows"],
                        n_blocks=o.types["block_table"].shape[1])
    return rl, rl  # (indptr, indices): one padded row list in ONNX (see codegen/onnx_export.RowList)
