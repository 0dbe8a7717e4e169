"""ONNX lowerings of the `sparse_attention` kernel family: sparse_attention."""

from __future__ import annotations

import numpy as np

from ...ir.types import TensorType
from . import native_only, pool_rows
from .graph import MS_DOMAIN, NEG_INF
from .pool_rows import Planes, RowList


def _ext_mask(g, pos: str, window: int) -> str:
    """[B, T, 1, T]: query t sees the chunk's own key s when s in (t - window, t]."""
    t = g.unsqueeze(pos, 2)
    s = g.unsqueeze(pos, 1)
    ext = g.op("And", g.op("And", g.op("GreaterOrEqual", s, g.iscalar(0)), g.op("LessOrEqual", s, t)),
                  g.op("And", g.op("Greater", s, g.op("Sub", t, g.iscalar(window))),
                          g.op("GreaterOrEqual", t, g.iscalar(0))))
    return g.unsqueeze(ext, 2)


def sparse_attention(g, q: str, qt: TensorType, kv: str, pos: str, sink: str, parts: list[tuple[RowList, int]],
                     plane: Planes, window: int, scale: float) -> str:
    B, T, H, d = qt.shape
    rows, masks = [], []
    for rl, base in parts:
        m = _mask(g, rl)
        rows.append(g.where(m, g.op("Add", rl.rows, g.iscalar(base)), g.iscalar(0)))
        masks.append(m)
    rows, mask = g.concat(rows, 1), g.concat(masks, 1)  # [L, P]
    keys = pool_rows.read_rows(g, plane, rows, shape=(B, T, -1, d))  # [B, T, P, d]
    sc = g.scalar(scale)
    ninf = g.scalar(NEG_INF)
    s_pool = g.op("Mul", g.matmul_t(q, keys), sc)  # [B, T, H, P]
    s_pool = g.where(g.reshape(mask, (B, T, 1, -1)), s_pool, ninf)
    s_ext = g.op("Mul", g.matmul_t(g.reshape(q, (B, T * H, d)), kv), sc)
    s_ext = g.reshape(s_ext, (B, T, H, T))
    s_ext = g.where(g.cached(("ext", pos, window), lambda: _ext_mask(g, pos, window)), s_ext, ninf)
    sinks = g.op("Expand", g.reshape(sink, (1, 1, H, 1)), g.i64(B, T, H, 1))
    probs = g.op("Softmax", g.concat([s_pool, s_ext, sinks], -1), axis=-1)
    P = g.op("Shape", rows, start=1, end=2)
    p_pool = g.op("Slice", probs, g.i64(0), P, g.i64(3))
    p_ext = g.op("Slice", probs, P, g.op("Add", P, g.i64(T)), g.i64(3))
    out = g.op("MatMul", p_pool, keys)
    ext_out = g.reshape(g.op("MatMul", g.reshape(p_ext, (B, T * H, T)), kv), (B, T, H, d))
    return g.op("Add", out, ext_out)


def _ext_mask_lanes(g, pos: str, T: int, window: int) -> str:
    """`_ext_mask` for a chunk of T <= window lanes whose live ones come first at consecutive positions:
    query lane t sees key lane s iff s <= t and lane t is live (a constant triangle, masked by liveness)."""
    if T > window:
        return _ext_mask(g, pos, window)
    tri = np.tril(np.ones((T, T), bool))[:, None, :]  # [T, 1, T]
    return g.op("And", g.unsqueeze(g.live(pos), -1, -2), g.const(tri, bool))  # [B, T, 1, T]


def sparse_attention_one(g, q: str, qt: TensorType, kv: str, pos: str, sink: str, parts: list[tuple[RowList, int]],
                         plane: Planes, scale: float) -> str:
    """`sparse_attention` for a one-token chunk (a decode step): the token's own key (the chunk's only one,
    visible iff the lane is live) joins the pool keys as one more row, so the scores, the masking and the
    weighted sum are one op each over [pool rows; own key] (`sparse_attention` keeps them apart: ~20 nodes
    a layer here against ~36). The same softmax; the weighted sum adds the own key's term inside the MatMul
    rather than after it (a reordered fp32 sum: within the cpu target's logits tolerance)."""
    B, T, H, d = qt.shape
    rows = []
    for rl, base in parts:  # a masked row reads the layer's first row: finite, and weighted 0
        r0 = rl.safe or g.cached(("rows0", rl.rows), lambda: g.where(_mask(g, rl), rl.rows, g.iscalar(0)))
        rows.append(g.op("Add", r0, g.iscalar(base)) if base else r0)
    # the window rows read are the positions before the token (`csr_window`), never the ring row it writes
    # this step, and the compressed rows lie outside the rings: no window write can hit this read
    keys = pool_rows.read_rows(g, plane, g.concat(rows, 1), unseen=("window",))  # [B, P, d]
    keys = g.reshape(g.concat([keys, kv], 1), (B, 1, -1, d))  # [B, 1, P + 1, d]; kv [B, 1, d]

    def mask():
        live = g.reshape(g.live(pos), (B, 1))
        return g.reshape(g.concat([_mask(g, rl) for rl, _ in parts] + [live], 1), (B, 1, 1, -1))
    s = g.op("FusedMatMul", q, keys, domain=MS_DOMAIN, transB=1, alpha=scale)  # [B, 1, H, P + 1]
    s = g.where(g.cached(("mask1", tuple(rl.rows for rl, _ in parts), pos), mask), s, g.scalar(NEG_INF))
    sinks = g.reshape(sink, (1, 1, H, 1))
    if B > 1:
        sinks = g.op("Expand", sinks, g.i64(B, 1, H, 1))
    probs = g.slice(g.op("Softmax", g.concat([s, sinks], -1), axis=-1), 0, -1, 3)  # the sink's share dropped
    return g.op("MatMul", probs, keys)


def sparse_attention_lanes(g, q: str, qt: TensorType, kv: str, pos: str, sink: str,
                           parts: list[tuple[RowList, int]], plane: Planes, window: int, scale: float) -> str:
    """`sparse_attention` for a chunk of a few lanes (`Graph.few_lanes`: a verify step): the same scores,
    softmax and weighted sums, but masked once over [pool rows; chunk keys; sink] with one mask shared by
    the layers that read the same row lists (`sparse_attention` masks each part in each layer), the scale
    as the GEMMs' alpha (the product rounded as `Mul` rounds it), and, as decode's own key
    (`sparse_attention_one`), the chunk's keys after each lane's pool rows, so that the scores and the
    weighted sum are one GEMM each and the sink's share one constant slice: ~20 nodes a layer for ~31. The
    same scores and softmax; the weighted sum adds the chunk keys' terms inside the MatMul rather than after
    it (a reordered fp32 sum, as decode's: within ATTN_TOL of tests/onnx/test_onnx_decode_lowerings.py)."""
    B, T, H, d = qt.shape
    rows = []
    for rl, base in parts:  # a masked row reads the layer's first row: finite, and weighted 0 (as decode's)
        r0 = rl.safe or g.cached(("rows0", rl.rows), lambda: g.where(_mask(g, rl), rl.rows, g.iscalar(0)))
        rows.append(g.op("Add", r0, g.iscalar(base)) if base else r0)
    keys = pool_rows.read_rows(g, plane, g.concat(rows, 1), shape=(B, T, -1, d))  # [B, T, P, d]
    # the chunk's keys after every lane's pool rows ([B, T, P + T, d]), as decode's own key: one GEMM each
    # for the scores and the weighted sum (a reordered fp32 sum, as `sparse_attention_one`'s)
    keys = g.concat([keys, g.op("Expand", kv if B == 1 else g.unsqueeze(kv, 1), g.i64(B, T, T, d))], 2)

    def mask():  # [B, T, 1, P + T + 1]: the parts' rows, the chunk's own keys, the sink (always)
        pool = g.reshape(g.concat([_mask(g, rl) for rl, _ in parts], 1), (B, T, 1, -1))
        ext = g.cached(("ext_lanes", pos, window), lambda: _ext_mask_lanes(g, pos, T, window))
        return g.concat([pool, ext, g.const(np.ones((B, T, 1, 1), bool), bool)], -1)
    s = g.op("FusedMatMul", q, keys, domain=MS_DOMAIN, transB=1, alpha=scale)  # [B, T, H, P + T]
    sinks = g.op("Expand", g.reshape(sink, (1, 1, H, 1)), g.i64(B, T, H, 1))
    s = g.where(g.cached(("lanes_mask", tuple(rl.rows for rl, _ in parts), pos, window), mask),
                g.concat([s, sinks], -1), g.scalar(NEG_INF))
    return g.op("MatMul", g.slice(g.op("Softmax", s, axis=-1), 0, -1, 3), keys)  # the sink's share dropped


def _mask(g, rl: RowList) -> str:
    return rl.keep or g.cached(("mask", rl.rows), lambda: g.op("GreaterOrEqual", rl.rows, g.iscalar(0)))


def lower_sparse_attention(g, o, a, r):
    native_only(a, o)
    parts = [(o.win_indptr, a["win_base"])] + ([(o.comp_indptr, a["comp_base"])] if o.comp_indptr is not None else [])
    pos = g.as_i64(o.pos, o.types["pos"].dtype)
    if g.one_token(o.types["q"].shape[1], "sparse_attention"):
        return sparse_attention_one(g, o.q, o.types["q"], o.kv, pos, o.sink, parts, o.p0, a["scale"])
    form = sparse_attention_lanes if g.few_lanes(o.types["q"].shape[1], "sparse_attention") else sparse_attention
    return form(g, o.q, o.types["q"], o.kv, pos, o.sink, parts, o.p0, a["window"], a["scale"])
