"""ONNX lowerings of the `indexer` kernel family: indexer_select."""

from __future__ import annotations

from ...ir.types import TensorType
from . import pool_rows
from .graph import MS_DOMAIN, NEG_INF
from .pool_rows import Planes, RowList


def indexer_rows(g, q: str, qt: TensorType, weights: str, pos: str, bt: str, plane: Planes, *, ratio: int,
                 q_scale: float, w_scale: float, k: int, block_tokens: int, index_envelope_rows: int,
                 index_offset: int, envelope_rows: int, max_rows: int, n_blocks: int) -> RowList:
    """Indexer scores over the index plane, top-k, picks translated to main-pool rows (`indexer_select`)."""
    B, T, Hi, di = qt.shape
    limit = pool_rows.visible_limit(g, pos, ratio)  # [B, T]; a padding lane (-1): 0, so it sees no row
    w = pool_rows.dyn_range(g, limit, max_rows)  # [W]
    irow = pool_rows.block_rows(g, w, bt, ratio, block_tokens, index_envelope_rows, n_blocks, False)  # [B, W]
    irow = g.op("Add", irow, g.iscalar(index_offset)) if index_offset else irow
    keys = pool_rows.read_rows(g, plane, irow, shape=(B, 1, -1, di))  # [B, 1, W, di]
    # relu(q k * q_scale) as relu(q k) * q_scale bit for bit (a positive scale commutes with relu and
    # rounds the same product): the scale is the GEMM's alpha
    s = g.op("Relu", g.op("FusedMatMul", q, keys, domain=MS_DOMAIN, transB=1, alpha=q_scale))  # [B, T, H, W]
    s = g.op("Mul", s, g.unsqueeze(g.op("Mul", weights, g.scalar(w_scale)), -1))
    one = g.one_token(T, "indexer_select")  # a one-token chunk: [B, W] scores, picks and rows are already the [B * T, .] row list
    s = g.op("ReduceSum", s, g.i64(1, 2) if one else g.i64(2), keepdims=0)  # [B, W] or [B, T, W]
    lim = limit if one else g.unsqueeze(limit, -1)
    s = g.where(g.op("GreaterOrEqual", w, lim), g.scalar(NEG_INF), s)
    kk = g.cached(("topk", w, k), lambda: g.op("Min", g.i64(k), g.op("Shape", w)))
    vals, idx = g.op("TopK", s, kk, n_out=2, axis=-1, largest=1, sorted=1)
    keep = g.op("Greater", vals, g.scalar(NEG_INF))  # a hidden row's -inf never picked
    if one:  # the picks' rows out of every window's, shared by the layers; in range whether kept or not
        rows = g.op("GatherElements",
                    pool_rows.block_rows(g, w, bt, ratio, block_tokens, envelope_rows, n_blocks, False), idx, axis=1)
        return RowList(g.where(keep, rows, g.iscalar(-1)), keep, rows)
    if g.few_lanes(T, "indexer_select"):  # the picks' rows out of every window's [B, T, W] (shared by the layers)
        def every_window():
            rows = pool_rows.block_rows(g, w, bt, ratio, block_tokens, envelope_rows, n_blocks, False)  # [B, W]
            return g.op("Expand", g.unsqueeze(rows, 1), g.op("Concat", g.i64(B, T), g.op("Shape", w), axis=0))
        every = g.cached(("lanes_rows", w, bt, ratio, block_tokens, envelope_rows, T), every_window)
        rows = g.reshape(g.op("GatherElements", every, idx, axis=2), (B * T, -1))  # in range whether kept or not
        keep = g.reshape(keep, (B * T, -1))
        return RowList(g.where(keep, rows, g.iscalar(-1)), keep, rows)
    rows = pool_rows.block_rows(g, idx, bt, ratio, block_tokens, envelope_rows, n_blocks, True, (B, T, -1))
    return RowList(g.reshape(g.where(keep, rows, g.iscalar(-1)), (B * T, -1)))


def lower_indexer_select(g, o, a, r):
    rl = indexer_rows(g, o.q, o.types["q"], o.weights, g.as_i64(o.pos, o.types["pos"].dtype),
                        g.as_i64(o.block_table, o.types["block_table"].dtype), o.p0, ratio=a["ratio"],
                        q_scale=a["q_scale"], w_scale=a["w_scale"], k=a["k"], block_tokens=a["block_tokens"],
                        index_envelope_rows=a["index_envelope_rows"], index_offset=a["index_offset"],
                        envelope_rows=a["envelope_rows"], max_rows=a["max_rows"],
                        n_blocks=o.types["block_table"].shape[1])
    return rl, rl  # (indptr, indices): one padded row list in ONNX (see codegen/onnx_export.RowList)
