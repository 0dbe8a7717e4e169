"""Pool row addressing in the cpu target's graphs: the value kinds of a pool plane (`Planes`) and of a CSR
row list (`RowList`), the physical rows of ring windows and paged blocks, and the reads and writes of rows.

No copy of the pool: a write op only records its rows (`write_rows`); a later reader in the same step
gathers the rows it needs from the input plane and patches those that an earlier write in this step
replaced (`read_rows`), so a step costs what it reads, never the pool's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import TensorProto

from ...ir.types import TensorType

# a written row that is no row, so far below 0 that a layer's row offset added to it leaves it negative: one
# Add offsets a shared row list (a compare and a Where to keep a -1 a -1 otherwise)
SKIP_ROW = -(1 << 40)


@dataclass(frozen=True)
class Planes:
    """A pool plane or state tensor as the step sees it: the input tensor `base` plus the writes made so far
    in this step, in write order (a later row wins): (layer scope, rows int64 [N] (negative = none), vals
    [N, *row], vals' static shape or None, kind or None) each. A reader patches only its own layer's writes
    (`read_rows`); the function's outputs `X.rows` / `X.vals` are all of them concatenated once, at
    the end (`onnx_export.lower_function`), not a Concat per write."""

    base: str
    segs: tuple = ()

    @property
    def written(self) -> bool:
        return bool(self.segs)


@dataclass(frozen=True)
class RowList:
    """What a CSR construction op hands to its readers in ONNX: padded physical rows `[L, W]` (int64,
    -1 = no row). The packed indptr / indices form is a device layout; in ONNX a reader wants the rows
    padded, so the pair (indptr, indices) of the IR both map to this one object."""

    rows: str
    # where the maker has them at no cost: the mask `rows >= 0` and the rows with an in-range row (weighted
    # 0 by the reader) in place of each -1, so a reader needs neither a compare nor a Where of its own
    keep: str | None = None
    safe: str | None = None


def read_rows(g, p: Planes, rows: str, n_rows: int | None = None, shape: tuple | None = None,
              unseen: tuple = ()) -> str:
    """`plane[rows]` (rows int64 of any shape, >= 0) as this step sees it: the input plane, patched
    with the rows written earlier in the step (a later write wins), shaped rows' shape + the row's;
    `shape`: the caller's shape for the result instead (one static Reshape); `unseen`: kinds of write
    (`write_rows`) the caller knows its rows never hit, left out of the patch."""
    got = g.op("Gather", p.base, rows, axis=0)  # [*rows, *row]
    # A layer's pool rows (and state) are its own: only that layer's writes can hit its reads, so the
    # [reads x writes] match below is over this layer's writes, not every earlier layer's too.
    key = pool_scope(g, )
    segs = [sg for sg in p.segs if (key is None or sg[0] in (key, None)) and sg[4] not in unseen]
    if not segs:
        return got if shape is None else g.reshape(got, shape)
    if all(sg[3] is not None and sg[3][0] == 1 for sg in segs):
        out = _patch_single_rows(g, got, rows, segs)
        return out if shape is None else g.reshape(out, shape)
    w_rows = g.concat([sg[1] for sg in segs], 0)
    w_vals = g.concat([sg[2] for sg in segs], 0)
    # hit[..., w]: the read row is write w's (a skipped write's -1 never is); kept in rows' own shape, so
    # the patched rows come out in the reader's shape with no flattening or reshaping back
    hit = g.cast(g.op("Equal", g.unsqueeze(rows, -1), w_rows), TensorProto.INT32)  # [*rows, W]
    j = g.op("ArgMax", hit, axis=-1, keepdims=0, select_last_index=1)  # a later write wins
    # only the hit reads take their row from the writes: a ScatterND of those K rows into the gathered
    # ones (a Where over all M rows costs ~4x an elementwise op in ONNX Runtime: prefill reads are big)
    at = g.op("Transpose", g.op("NonZero", g.max(hit, -1)), perm=[1, 0])  # [K, rank of rows]
    new = g.op("Gather", w_vals, g.op("GatherND", j, at), axis=0)
    out = g.op("ScatterND", got, at, new)
    return out if shape is None else g.reshape(out, shape)


def _patch_single_rows(g, got: str, rows: str, segs: list) -> str:
    """The patch when every write is one row (a decode step at batch 1): one Where per write, in write
    order, so a later write of a row wins; 2 nodes a write and one Unsqueeze (the general match takes 10
    and two Concats). The reads are few there, so a Where over all of them is cheap."""
    row_rank = len(segs[0][3]) - 1
    ru = g.unsqueeze(rows, *range(-row_rank, 0))  # [*rows, 1 * row_rank]
    for _, w_row, w_val, _, _ in segs:  # w_row [1] vs ru [*rows, 1 * row_rank]; w_val [1, *row]
        got = g.where(g.op("Equal", ru, w_row), w_val, got)
    return got


def write_rows(g, p: Planes, rows: str, vals: str, vals_shape: tuple | None = None,
               kind: str | None = None) -> Planes:
    """Record `plane[rows] = vals` (rows int64 [N], negative = skip; vals [N, *row], of static shape
    `vals_shape` where the caller knows it: a read patches a one-row write with a Where; `kind`: what
    the rows are, for a reader that knows it never reads such rows, `read_rows(unseen=)`)."""
    if p.base in g.bf16_planes:
        vals = g.bf16_round(vals)
    return Planes(p.base, p.segs + ((pool_scope(g, ), rows, vals, vals_shape, kind),))


def pool_scope(g) -> str | None:
    """The layer the op being lowered belongs to (`layers.3`, `mtp.0`), from its location; None when
    it names none (its reads then patch with every write)."""
    parts = g.loc.split(" ")[-1].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] in ("layers", "mtp") and parts[1].isdigit() \
        else None


def ring_lanes(g, pos: str, slots: int) -> str:
    """Lanes whose token a ring of `slots` entries keeps after this chunk (`ops.attention.ring_lanes`)."""
    key = ("ring", pos, slots)
    if key not in g.memo:
        valid = g.op("GreaterOrEqual", pos, g.iscalar(0))
        n = g.sum(g.cast(valid, TensorProto.INT64), 1, 1)
        last = g.op("Sub", g.op("Add", g.clamp_min0(g.slice(pos, 0, 1, 1)), n), g.iscalar(1))
        keep = g.op("And", valid, g.op("Greater", pos, g.op("Sub", last, g.iscalar(slots))))
        g.memo[key] = keep
    return g.memo[key]


def window_rows(g, pos: str, slot: str, window: int, slot_rows: int, n_rows: int) -> str:
    """Physical ring row of each position (before the layer's ring offset); pos [B, X], slot [B]. A
    padding lane (slot -1) gets slot 0's rows: in range, so a reader may read them masked (weight 0)."""
    base = g.cached(("slot_rows", slot, slot_rows, n_rows), lambda: g.unsqueeze(g.op(
        "Sub", g.iscalar(n_rows), g.op("Mul", g.op("Add", g.cached(("clamp0", slot), lambda: g.clamp_min0(
            slot)), g.iscalar(1)), g.iscalar(slot_rows))), -1))
    return g.op("Add", base, g.op("Mod", pos, g.iscalar(window)))


def block_rows(g, w: str, bt: str, ratio: int, block_tokens: int, envelope_rows: int, n_blocks: int,
               per_lane: bool, lanes: tuple | None = None) -> str:
    """Physical row of window `w` (`ops.paged.compressed_row`): w `[W]` shared by all sequences
    (-> `[B, W]`) or `[B, ...]` per sequence (`per_lane`; `lanes`: w's static shape with -1 for at most
    one dynamic axis, where the caller knows it: constant reshapes, none for `[B, k]`)."""
    return g.cached(("block_rows", w, bt, ratio, block_tokens, envelope_rows, per_lane),
                    lambda: _block_rows(g, w, bt, ratio, block_tokens, envelope_rows, n_blocks, per_lane, lanes))


def _block_rows(g, w, bt, ratio, block_tokens, envelope_rows, n_blocks, per_lane, lanes) -> str:
    per_block = block_tokens // ratio
    bi = g.op("Clip", g.op("Div", w, g.iscalar(per_block)), g.iscalar(0), g.iscalar(n_blocks - 1))
    btc = g.cached(("clamp0", bt), lambda: g.clamp_min0(bt))
    if per_lane and lanes is not None and len(lanes) == 2:
        blk = g.op("GatherElements", btc, bi, axis=1)
    elif per_lane and lanes is not None:
        blk = g.reshape(g.op("GatherElements", btc, g.reshape(bi, (lanes[0], -1)), axis=1), lanes)
    elif per_lane:
        shape = g.op("Shape", w)
        B = g.op("Shape", bt, start=0, end=1)
        blk = g.op("GatherElements", btc, g.op("Reshape", bi, g.concat([B, g.i64(-1)], 0)), axis=1)
        blk = g.op("Reshape", blk, shape)
    else:
        blk = g.op("Gather", btc, bi, axis=1)
    return g.op("Add", g.op("Mul", blk, g.iscalar(envelope_rows)),
                g.op("Mod", w, g.iscalar(per_block)))


def visible_limit(g, pos: str, ratio: int) -> str:
    """floor((t + 1) / ratio): compressed rows a query at t may see."""
    return g.cached(("limit", pos, ratio),
                    lambda: g.op("Div", g.op("Add", pos, g.iscalar(1)), g.iscalar(ratio)))


def dyn_range(g, limit: str, max_rows: int) -> str:
    """0..W-1 with W = the largest limit of the step (at least 1, at most `max_rows`): the rows a
    static kernel would mask are never read, so the cost follows the context, not the capacity."""
    def make():
        w = g.op("Clip", g.op("ReduceMax", limit, keepdims=0), g.iscalar(1), g.iscalar(max_rows))
        return g.op("Range", g.iscalar(0), w, g.iscalar(1))
    return g.cached(("range", limit, max_rows), make)


def window_write(g, plane: Planes, kv: str, kvt: TensorType, pos: str, slot: str, a: dict) -> Planes:
    B, T, d = kvt.shape
    key = ("winrows", pos, slot, a["window"], a["slot_rows"], a["n_rows"])
    # a chunk of one token, or of a few (no more than the ring holds), keeps every live lane's token
    # (`ring_lanes` of lanes that all fit)
    few = g.one_token(T, "window_write") or (g.few_lanes(T, "window_write") and T <= a["window"])
    lanes = (lambda: g.live(pos)) if few else (lambda: ring_lanes(g, pos, a["window"]))
    base = g.cached(key, lambda: g.reshape(g.where(
        lanes(), window_rows(g, pos, slot, a["window"], a["slot_rows"], a["n_rows"]),
        g.iscalar(SKIP_ROW)), (B * T,)))
    rows = g.op("Add", base, g.iscalar(a["layer_row"])) if a["layer_row"] else base
    return write_rows(g, plane, rows, g.reshape(kv, (B * T, d)), (B * T, d), "window")
