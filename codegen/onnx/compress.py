"""ONNX lowerings of the `compress` kernel family: compress_paged."""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from ...ir.types import TensorType
from . import native_only, pool_rows, quant, rotary
from .graph import NEG_INF
from .pool_rows import SKIP_ROW, Planes


def _compress_index(g, pos: str, m: int, overlap: bool, B: int, T: int) -> dict[str, str]:
    """Which windows this chunk closes and where each pooling slot's token comes from (state ring or
    chunk lane): a function of the positions only, shared by every compressor with the same ratio."""
    c = 2 if overlap else 1
    S, J = c * m, T // m + 1
    start = g.clamp_min0(g.slice(pos, 0, 1, 1))  # [B, 1]
    valid = g.op("GreaterOrEqual", pos, g.iscalar(0))
    n = g.sum(g.cast(valid, TensorProto.INT64), 1, 1)  # [B, 1]
    w = g.op("Add", g.op("Div", start, g.iscalar(m)), g.const(np.arange(J), np.int64))  # [B, J]
    end = g.op("Sub", g.op("Add", start, n), g.iscalar(1))
    live = g.op("Greater", n, g.iscalar(0))
    closed = g.op("And", g.op("LessOrEqual", g.op("Sub", g.op("Mul", g.op("Add", w, g.iscalar(1)),
                                                                            g.iscalar(m)), g.iscalar(1)), end),
                     live)
    first = g.op("Sub", w, g.iscalar(1)) if overlap else w
    p = g.op("Add", g.unsqueeze(g.op("Mul", first, g.iscalar(m)), -1),
                g.const(np.arange(S), np.int64))  # [B, J, S]
    # each slot's row in the table [state rows (B * S); chunk rows (B * T); one fill row] that `compress`
    # gathers from: one Gather per source instead of two and two Wheres (the index is shared by every
    # compressor with this ratio; the values are the same, moved, not computed)
    boff = g.reshape(g.const(np.arange(B), np.int64), (B, 1, 1))
    lane = g.op("Clip", g.op("Sub", p, g.unsqueeze(start, -1)), g.iscalar(0), g.iscalar(T - 1))
    lane = g.op("Add", g.op("Mul", boff, g.iscalar(T)), g.op("Add", lane, g.iscalar(B * S)))
    ring = g.op("Add", g.op("Mul", boff, g.iscalar(S)), g.op("Mod", p, g.iscalar(S)))
    src = g.where(g.op("Less", p, g.unsqueeze(start, -1)), ring, lane)
    src = g.where(g.op("GreaterOrEqual", p, g.iscalar(0)), src, g.iscalar(B * S + B * T))  # [B, J, S]
    if overlap:  # slots [0, m) read columns [0, dk) ("A"), slots [m, 2m) columns [dk, 2dk) ("B"): half-rows
        src = g.op("Add", g.op("Mul", src, g.iscalar(2)), g.const(np.repeat(np.arange(2), m), np.int64))
    # the state ring after the chunk: slot p % S takes the token of each sequence's last S positions
    hit = g.op("And", g.op("Equal", g.unsqueeze(g.op("Mod", pos, g.iscalar(S)), 1),
                                 g.const(np.arange(S).reshape(1, S, 1), np.int64)),
                  g.unsqueeze(pool_rows.ring_lanes(g, pos, S), 1))  # [B, S, T]
    onehot = g.cast(hit, TensorProto.FLOAT)
    has = g.unsqueeze(g.op("Greater", g.max(onehot, 2), g.scalar(0.0)), -1)
    return {"w": w, "closed": closed, "src": src, "onehot": onehot, "has": has, "live": g.reshape(live, (B,))}


def compress(g, o, a, plane_in: Planes, skv_in: Planes, sg_in: Planes) -> tuple[Planes, Planes, Planes]:
    """`compress_paged`: pool the windows this chunk closes (softmax over their slots), norm, RoPE,
    round; write them at their physical rows; push the chunk into the slot's state ring."""
    B, T, cw = o.types["kv"].shape
    m, overlap = a["ratio"], a["overlap"]
    c = 2 if overlap else 1
    dk, S, J = cw // c, c * m, T // m + 1
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    slot = g.as_i64(o.slot, o.types["slot"].dtype)
    bt = g.as_i64(o.block_table, o.types["block_table"].dtype)
    n_blocks = o.types["block_table"].shape[1]
    gate = g.op("Add", o.gate, g.op("Gather", o.ape, g.cached(
        ("mod", pos, m), lambda: g.op("Mod", g.clamp_min0(pos), g.iscalar(m))), axis=0))
    sl = g.cached(("clamp0", slot), lambda: g.clamp_min0(slot))
    skv, sg = pool_rows.read_rows(g, skv_in, sl), pool_rows.read_rows(g, sg_in, sl)  # [B, S, cw]
    ix = g.cached(("compress", pos, m, overlap, B, T), lambda: _compress_index(g, pos, m, overlap, B, T))
    w, closed = ix["w"], ix["closed"]

    def pick(state: str, chunk: str, fill: float) -> str:
        """[B, J, S, dk]: each slot's values from the state ring, the chunk, or `fill` (no token there)."""
        t = g.concat([g.reshape(state, (B * S, cw)), g.reshape(chunk, (B * T, cw)),
                      g.const(np.full((1, cw), fill, np.float32))], 0)
        return g.op("Gather", g.reshape(t, (-1, dk)) if overlap else t, ix["src"], axis=0)

    v = pick(skv, o.kv, 0.0)
    gl = pick(sg, gate, NEG_INF)
    pooled = g.sum(g.op("Mul", v, g.op("Softmax", gl, axis=2)), 2)  # [B, J, dk]
    h = g.rms(pooled, o.norm, a["eps"])
    ht = TensorType((B, J, dk), "fp32")
    # the windows' first positions as one value per ratio: compressors with the same RoPE share its tables
    wpos = g.cached(("window_pos", w, m), lambda: g.op("Mul", w, g.iscalar(m)))
    h = rotary.rotate(g, h, ht, wpos, 2, a["rope_dim"], a["theta"], tuple(a["yarn"]))
    rnd = a.get("round", "none")
    if rnd == "fp8":
        h = quant.fp8_round(g, h, ht, dk - a["rope_dim"], math.gcd(64, dk - a["rope_dim"]))
    elif rnd == "fp4":
        h = quant.hadamard_fp4(g, h, ht, 32)
    rows = g.cached(("closed_rows", w, bt, m, a["block_tokens"], a["envelope_rows"]), lambda: g.where(
        closed, pool_rows.block_rows(g, w, bt, m, a["block_tokens"], a["envelope_rows"], n_blocks, True, (B, J)),
        g.iscalar(-1)))
    rows = g.reshape(g.where(closed, g.op("Add", rows, g.iscalar(a["layer_offset"])), rows), (B * J,))
    plane = pool_rows.write_rows(g, plane_in, rows, g.reshape(h, (B * J, dk)), (B * J, dk))
    onehot, has, srows = ix["onehot"], ix["has"], g.cached(
        ("srows", pos, slot), lambda: g.where(ix["live"], slot, g.iscalar(-1)))
    new_kv = g.where(has, g.op("MatMul", onehot, o.kv), skv)
    new_g = g.where(has, g.op("MatMul", onehot, gate), sg)
    return (plane, pool_rows.write_rows(g, skv_in, srows, new_kv, (B, S, cw)),
            pool_rows.write_rows(g, sg_in, srows, new_g, (B, S, cw)))


def _decode_index(g, pos: str, m: int, overlap: bool, B: int) -> dict[str, str]:
    """The chunk is one token a sequence (a decode step, m >= 2): it closes window w = p // m when p % m is
    m - 1, and enters the state ring at slot p % S. The closed window's tokens are then exactly the ring
    after this token went in (the last S positions), so `compress_decode` pools the updated ring: no lane
    / fill table. Shared by every compressor with this ratio."""
    S = (2 if overlap else 1) * m
    pc = g.cached(("clamp0", pos), lambda: g.clamp_min0(pos))  # [B, 1]; a padding lane (-1) as position 0
    mod = g.cached(("mod", pos, m), lambda: g.op("Mod", pc, g.iscalar(m)))
    closed = g.op("Equal", mod, g.iscalar(m - 1))  # a padding lane: 0, never m - 1
    w = g.op("Div", pc, g.iscalar(m))
    start = g.op("Sub", pc, mod)  # w * m: the window's RoPE position
    # (sequence, ring slot) the token enters, for a ScatterND (a broadcast Where costs ONNX Runtime ~2x as
    # much); a padding lane's goes to slot 0 of its state copy, which is never written back (its row is -1)
    at = g.unsqueeze(g.concat([g.const(np.arange(B).reshape(B, 1), np.int64), g.op("Mod", pc, g.iscalar(S))], -1), 1)
    ix = {"at": at, "wpos": g.reshape(start, (B,)), "closed": g.reshape(closed, (B,)), "w": w}  # at [B, 1, 2]
    if overlap:  # slot s holds position (w - 1) * m + s: ring slot ((w - 1) * m + s) % S; half A for s < m
        p = g.op("Add", g.op("Sub", start, g.iscalar(m)), g.const(np.arange(S), np.int64))  # [B, S]
        half = np.repeat(np.arange(2), m)[None, :] + 2 * S * np.arange(B)[:, None]  # + each sequence's rows
        ix["src"] = g.op("Add", g.op("Mul", g.op("Mod", p, g.iscalar(S)), g.iscalar(2)), g.const(half, np.int64))
        # a slot before position 0 (the first window) weighs 0: its gate -inf (its stale value then adds 0)
        ix["bias"] = g.unsqueeze(g.where(g.op("GreaterOrEqual", p, g.iscalar(0)), g.scalar(0.0), g.scalar(NEG_INF)), -1)
    return ix


def compress_decode(g, o, a, plane_in: Planes, skv_in: Planes, sg_in: Planes) -> tuple[Planes, Planes, Planes]:
    """`compress_paged` for a one-token chunk (`_decode_index`): the token enters the ring (one ScatterND a
    state), the closed windows pool the updated ring; 11-16 nodes a compressor at batch 1 where `compress`
    takes ~32. The same values in the same order as `compress`, so bit-identical results (but for the
    RoPE, which at batch 1 is one MatMul: `rotary.rotate(fused=True)`)."""
    B, T, cw = o.types["kv"].shape
    m, overlap = a["ratio"], a["overlap"]
    S, dk = (2 if overlap else 1) * m, cw // (2 if overlap else 1)
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    slot = g.as_i64(o.slot, o.types["slot"].dtype)
    bt = g.as_i64(o.block_table, o.types["block_table"].dtype)
    n_blocks = o.types["block_table"].shape[1]
    ix = g.cached(("compress1", pos, m, overlap, B), lambda: _decode_index(g, pos, m, overlap, B))
    gate = g.op("Add", o.gate, g.op("Gather", o.ape, g.memo[("mod", pos, m)], axis=0))  # [B, 1, cw]
    sl = g.cached(("clamp0", slot), lambda: g.clamp_min0(slot))
    new_kv = g.op("ScatterND", pool_rows.read_rows(g, skv_in, sl), ix["at"], o.kv)  # [B, S, cw]
    new_g = g.op("ScatterND", pool_rows.read_rows(g, sg_in, sl), ix["at"], gate)
    v, gl = new_kv, new_g
    if overlap:
        v = g.op("Gather", g.reshape(new_kv, (B * S * 2, dk)), ix["src"], axis=0)  # [B, S, dk]
        gl = g.op("Add", g.op("Gather", g.reshape(new_g, (B * S * 2, dk)), ix["src"], axis=0), ix["bias"])
    # a window not closed pools whatever the ring holds: its row is negative, never written nor read
    h = g.rms(g.sum(g.op("Mul", v, g.op("Softmax", gl, axis=1)), 1), o.norm, a["eps"])  # [B, dk]
    ht = TensorType((B, dk), "fp32")
    rnd = a.get("round", "none")  # FP8 rounds the unrotated channels only: a fused rotation keeps them exact
    h = rotary.rotate(g, h, ht, ix["wpos"], 1, a["rope_dim"], a["theta"], tuple(a["yarn"]), fused=rnd != "fp4")
    if rnd == "fp8":
        h = quant.fp8_round(g, h, ht, dk - a["rope_dim"], math.gcd(64, dk - a["rope_dim"]))
    elif rnd == "fp4":
        h = quant.hadamard_fp4(g, h, ht, 32)
    base = g.cached(("block_rows1", ix["w"], bt, m, a["block_tokens"], a["envelope_rows"]), lambda: g.where(
        ix["closed"], g.reshape(pool_rows.block_rows(g, ix["w"], bt, m, a["block_tokens"], a["envelope_rows"],
                                                     n_blocks, True, (B, 1)), (B,)), g.iscalar(SKIP_ROW)))
    rows = g.op("Add", base, g.iscalar(a["layer_offset"]))  # a window not closed: still negative
    srows = g.cached(("srows", pos, slot), lambda: g.where(g.reshape(g.live(pos), (B,)), slot, g.iscalar(-1)))
    return (pool_rows.write_rows(g, plane_in, rows, h, (B, dk)),
            pool_rows.write_rows(g, skv_in, srows, new_kv, (B, S, cw)),
            pool_rows.write_rows(g, sg_in, srows, new_g, (B, S, cw)))


def _lanes_tables(m: int, overlap: bool, T: int) -> tuple[np.ndarray, np.ndarray]:
    """The few-lane form's index tables, as `compress` computes its sources, for one sequence whose chunk
    holds n of T lanes at positions start.. (T <= m: at most one window closes, the one of lane 0's
    position). Rows of the sequence's table [state ring (S); chunk lanes (T); one fill row (overlap)].
    `win[key]`: the source of each of the window's S slots (as half-row numbers when overlapping); key =
    start % S, + S when start >= m (overlap: whether the window's first half lies before position 0).
    `ring[(start % S) * (T + 1) + n]`: the ring slot s after the chunk: the lane that lands on s, else s."""
    S = (2 if overlap else 1) * m
    win = np.zeros((2 * S if overlap else S, S), np.int64)
    for key in range(len(win)):
        start = key  # a start with this key (key >= S: start % S = key - S, start >= m)
        if overlap and m <= key < S:
            continue  # no start has it
        first = (start // m - (1 if overlap else 0)) * m
        for s in range(S):
            p = first + s
            src = S + T if p < 0 else p % S if p < start else S + min(p - start, T - 1)
            win[key, s] = 2 * src + s // m if overlap else src
    ring = np.tile(np.arange(S, dtype=np.int64), ((T + 1) * S, 1))
    for r in range(S):
        for n in range(T + 1):
            for t in range(n):
                ring[r * (T + 1) + n, (r + t) % S] = S + t
    return win, ring


def _lanes_index(g, pos: str, m: int, overlap: bool, B: int, T: int, cw: int) -> dict[str, str]:
    """`_compress_index` for a chunk of T <= m lanes (a verify step): one window at most closes, so each
    sequence's sources (window slots and the ring after the chunk) are rows of constant tables picked by
    its start position and lane count (`_lanes_tables`): ~22 nodes for ~46. Shared by every compressor
    with this ratio."""
    S = (2 if overlap else 1) * m
    R = S + T + (1 if overlap else 0)  # table rows a sequence: ring, chunk, fill
    win, ring = _lanes_tables(m, overlap, T)
    start = g.slice(g.cached(("clamp0", pos), lambda: g.clamp_min0(pos)), 0, 1, 1)  # [B, 1]
    n = g.cached(("n_live", pos), lambda: g.sum(g.cast(g.live(pos), TensorProto.INT64), 1, 1))  # [B, 1]: lanes 0..n-1
    smod = g.op("Mod", start, g.iscalar(S))
    key = g.where(g.op("GreaterOrEqual", start, g.iscalar(m)), g.op("Add", smod, g.iscalar(S)), smod) \
        if overlap else smod
    c = 2 if overlap else 1
    src = g.reshape(g.op("Gather", g.const(win, np.int64), key, axis=0), (B, S) if B > 1 else (S,))
    at = g.reshape(g.op("Gather", g.const(ring, np.int64), g.op("Add", g.op("Mul", smod, g.iscalar(T + 1)), n),
                        axis=0), (B, S) if B > 1 else (S,))
    if B > 1:  # rows of the flat table ([B, S]); the ring after the chunk when overlapping: GatherElements'
        # index [B, S, cw] into the [B, R, cw] table (no flat copy of it). At batch 1: [S], rows of the one
        # sequence's table, each a Gather on its axis 1 (no offsets, no flat copy)
        src = g.op("Add", src, g.const((c * R * np.arange(B)).reshape(B, 1), np.int64))
        at = g.op("Expand", g.unsqueeze(at, -1), g.i64(B, S, cw)) if overlap else \
            g.op("Add", at, g.const((R * np.arange(B)).reshape(B, 1), np.int64))
    r = smod if not overlap else g.op("Mod", start, g.iscalar(m))
    closed = g.op("GreaterOrEqual", g.op("Add", r, n), g.iscalar(m))  # lane m - 1 - r is live: [B, 1]
    w = g.op("Div", start, g.iscalar(m))
    live = g.reshape(g.op("Greater", n, g.iscalar(0)), (B,))
    return {"src": src, "at": at, "closed": closed, "w": w, "wpos": g.reshape(g.op("Mul", w, g.iscalar(m)), (B,)),
            "live": live, "R": R}


def compress_lanes(g, o, a, plane_in: Planes, skv_in: Planes, sg_in: Planes) -> tuple[Planes, Planes, Planes]:
    """`compress_paged` for a chunk of T <= m lanes (`Graph.few_lanes`: a verify step): each source (state
    ring, chunk, fill) one table a sequence, from which the window's slots and the ring after the chunk
    are each one Gather (`_lanes_index`), in place of `compress`'s per-window masks and its one-hot MatMul
    ring update; ~20 nodes a compressor where `compress` takes ~30. The same values pooled in the same
    order, so bit-identical results."""
    B, T, cw = o.types["kv"].shape
    m, overlap = a["ratio"], a["overlap"]
    c = 2 if overlap else 1
    dk, S = cw // c, c * m
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    slot = g.as_i64(o.slot, o.types["slot"].dtype)
    bt = g.as_i64(o.block_table, o.types["block_table"].dtype)
    n_blocks = o.types["block_table"].shape[1]
    ix = g.cached(("compress_lanes", pos, m, overlap, B, T, cw), lambda: _lanes_index(g, pos, m, overlap, B, T, cw))
    gate = g.op("Add", o.gate, g.op("Gather", o.ape, g.cached(("mod", pos, m), lambda: g.op(
        "Mod", g.cached(("clamp0", pos), lambda: g.clamp_min0(pos)), g.iscalar(m))), axis=0))
    sl = g.cached(("clamp0", slot), lambda: g.clamp_min0(slot))

    def table(state: Planes, chunk: str, fill: float) -> tuple[str, str]:
        """(the window's slots [B, S, dk], the ring after the chunk [B, S, cw])."""
        ring = pool_rows.read_rows(g, state, sl)  # [B, S, cw]
        parts = [ring, chunk] + ([g.const(np.full((B, 1, cw), fill, np.float32))] if overlap else [])
        t = g.concat(parts, 1)  # [B, R, cw]
        if B == 1:
            half = g.reshape(t, (1, ix["R"] * 2, dk)) if overlap else t
            return g.op("Gather", half, ix["src"], axis=1), g.op("Gather", t, ix["at"], axis=1)
        if overlap:
            return (g.op("Gather", g.reshape(t, (B * ix["R"] * 2, dk)), ix["src"], axis=0),
                    g.op("GatherElements", t, ix["at"], axis=1))
        flat = g.reshape(t, (B * ix["R"], cw))
        return g.op("Gather", flat, ix["src"], axis=0), g.op("Gather", flat, ix["at"], axis=0)

    v, new_kv = table(skv_in, o.kv, 0.0)
    gl, new_g = table(sg_in, gate, NEG_INF)
    # `compress`'s [B, 1, S] window axes without the 1: the same values, reduced in the same order
    h = g.rms(g.sum(g.op("Mul", v, g.op("Softmax", gl, axis=1)), 1), o.norm, a["eps"])  # [B, dk]
    ht = TensorType((B, dk), "fp32")
    rnd = a.get("round", "none")  # one window closes at most: at batch 1 decode's fused rotation, as there
    h = rotary.rotate(g, h, ht, ix["wpos"], 1, a["rope_dim"], a["theta"], tuple(a["yarn"]), fused=rnd != "fp4")
    if rnd == "fp8":
        h = quant.fp8_round(g, h, ht, dk - a["rope_dim"], math.gcd(64, dk - a["rope_dim"]))
    elif rnd == "fp4":
        h = quant.hadamard_fp4(g, h, ht, 32)
    base = g.cached(("lanes_rows", ix["w"], bt, m, a["block_tokens"], a["envelope_rows"]), lambda: g.reshape(g.where(
        ix["closed"], pool_rows.block_rows(g, ix["w"], bt, m, a["block_tokens"], a["envelope_rows"], n_blocks, True,
                                           (B, 1)), g.iscalar(SKIP_ROW)), (B,)))
    rows = g.op("Add", base, g.iscalar(a["layer_offset"])) if a["layer_offset"] else base  # not closed: negative
    srows = g.cached(("srows", pos, slot), lambda: g.where(ix["live"], slot, g.iscalar(-1)))
    return (pool_rows.write_rows(g, plane_in, rows, h, (B, dk)),
            pool_rows.write_rows(g, skv_in, srows, new_kv, (B, S, cw)),
            pool_rows.write_rows(g, sg_in, srows, new_g, (B, S, cw)))


def lower_compress_paged(g, o, a, r):
    native_only(a, o)
    T = o.types["kv"].shape[1]
    form = compress_decode if g.one_token(T, "compress_paged") and a["ratio"] >= 2 else \
        compress_lanes if g.few_lanes(T, "compress_paged") and T <= a["ratio"] else compress
    plane, skv, sg = form(g, o, a, o.p0, o.state_kv, o.state_gate)
    return skv, sg, plane
