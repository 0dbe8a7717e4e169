"""ONNX lowerings of the `csr` kernel family: csr_window, csr_compressed, csr_selected."""

from __future__ import annotations

import numpy as np

from . import pool_rows
from .pool_rows import RowList


def lower_csr_window(g, o, a, r):
    pos, W = g.as_i64(o.pos, o.types["pos"].dtype), a["window"]
    B, T = o.types["pos"].shape
    if g.one_token(T, "csr_window"):  # one token: every p - k (k >= 1) precedes the chunk; kept iff >= 0 (so a padding lane: none)
        p = g.op("Sub", pos, g.const(np.arange(W - 1, 0, -1), np.int64))  # [B, W-1], oldest first
        rows = pool_rows.window_rows(g, p, g.as_i64(o.slot, o.types["slot"].dtype), W, a["slot_rows"], a["n_rows"])
        keep = g.op("GreaterOrEqual", p, g.iscalar(0))  # rows of p < 0: in the ring all the same (Mod)
        rl = RowList(g.where(keep, rows, g.iscalar(-1)), keep, rows)
        return rl, rl
    p = g.op("Sub", g.unsqueeze(pos, -1), g.const(np.arange(W - 1, 0, -1), np.int64))  # [B, T, W-1], oldest first
    if g.few_lanes(T, "csr_window"):  # live lanes hold start.. in order: lane t's p - k precedes the chunk iff k > t
        before = np.arange(W - 1, 0, -1)[None, :] > np.arange(T)[:, None]  # [T, W-1]
        keep = g.reshape(g.op("And", g.op("GreaterOrEqual", p, g.iscalar(0)), g.const(before, bool)), (B * T, W - 1))
        rows = g.reshape(pool_rows.window_rows(g, g.reshape(p, (B, -1)), g.as_i64(o.slot, o.types["slot"].dtype), W,
                                               a["slot_rows"], a["n_rows"]), (B * T, W - 1))
        rl = RowList(g.where(keep, rows, g.iscalar(-1)), keep, rows)  # a padding lane: p < 0, none kept
        return rl, rl
    start = g.unsqueeze(g.clamp_min0(g.slice(pos, 0, 1, 1)), -1)
    keep = g.op("And", g.op("And", g.op("GreaterOrEqual", p, g.iscalar(0)), g.op("Less", p, start)),
                g.unsqueeze(g.op("GreaterOrEqual", pos, g.iscalar(0)), -1))
    rows = g.reshape(pool_rows.window_rows(g, g.reshape(p, (B, -1)), g.as_i64(o.slot, o.types["slot"].dtype), W,
                                           a["slot_rows"], a["n_rows"]), (B, T, W - 1))
    rl = RowList(g.reshape(g.where(keep, rows, g.iscalar(-1)), (B * T, W - 1)))
    return rl, rl


def lower_csr_compressed(g, o, a, r):
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    B, T = o.types["pos"].shape
    limit = pool_rows.visible_limit(g, pos, a["ratio"])  # a padding lane (-1): 0, so it sees no row
    w = pool_rows.dyn_range(g, limit, a["max_rows"])
    rows = pool_rows.block_rows(g, w, g.as_i64(o.block_table, o.types["block_table"].dtype), a["ratio"],
                                a["block_tokens"], a["envelope_rows"], o.types["block_table"].shape[1], False)  # [B, W]
    if g.one_token(T, "csr_compressed"):  # [B, 1] limits against [W]: [B, W] is already the [B * T, W] row list
        keep = g.op("Less", w, limit)
        return (RowList(g.where(keep, rows, g.iscalar(-1)), keep, rows),) * 2
    keep = g.op("Less", w, g.unsqueeze(limit, -1))
    rl = RowList(g.reshape(g.where(keep, g.unsqueeze(rows, 1), g.iscalar(-1)), (B * T, -1)))
    return rl, rl


def lower_csr_selected(g, o, a, r):
    pos, sel = g.as_i64(o.pos, o.types["pos"].dtype), g.as_i64(o.selected, o.types["selected"].dtype)
    B, T, K = o.types["selected"].shape
    keep = g.op("And", g.op("GreaterOrEqual", sel, g.iscalar(0)), g.unsqueeze(g.op("GreaterOrEqual", pos, g.iscalar(0)), -1))
    rows = pool_rows.block_rows(g, g.clamp_min0(sel), g.as_i64(o.block_table, o.types["block_table"].dtype), a["ratio"],
                                a["block_tokens"], a["envelope_rows"], o.types["block_table"].shape[1], True, (B, T, K))
    rl = RowList(g.reshape(g.where(keep, rows, g.iscalar(-1)), (B * T, K)))
    return rl, rl
