"""Ops of the lowered attention: writes into the paged KV pool, CSR index construction, and one sparse
MQA attention over the union of window and compressed rows (see `v4compile/pool.py` for the geometry).

Planes are passed as up to three operands `p0, p1?, p2?` whose meaning the `fmt` attribute gives
(main: native `[N, d]` | fp8 `nope, nope_scale, rope`; index: native `[N, di]` | fp4 `packed, scale` |
fp8 `values, scale`). Writes return the updated planes. CSR lists are flat over query lanes
`b * T + t`: `indptr [B*T + 1]` (i32) and `indices [cap]` (i32, the tail past `indptr[-1]` is unused).
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..formats import FP8_MAX, e8m0_to_float, float_to_e8m0, fp4_dequant, fp4_quant, pow2_scale
from ..ir.registry import Cost, defop, require
from ..ir.types import TensorType
from .attention import attend, ring_lanes
from .compressor import closed_rows, update_ring

# ---- cost rules: a pool op touches only its rows of the planes, never the whole pool -------------------

def row_bytes(*planes: TensorType | None) -> int:
    """Bytes of one row across the planes (a row of every plane)."""
    return sum(p.nbytes // p.shape[0] for p in planes if p is not None and p.shape[0])


def _small(*ts: TensorType | None) -> int:
    return sum(t.nbytes for t in ts if t is not None)



# ---- plane access --------------------------------------------------------------------------------

_BYTE_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _take(plane: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """plane[rows] (float8 planes are indexed through a uint8 view: torch has no float8 gather)."""
    if plane.dtype in _BYTE_DTYPES:
        return plane.view(torch.uint8)[rows].view(plane.dtype)
    return plane[rows]


def _put(plane: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """plane[rows] = values, in place (through a uint8 view for float8 planes)."""
    if plane.dtype in _BYTE_DTYPES:
        plane.view(torch.uint8)[rows] = values.to(plane.dtype).view(torch.uint8)
    else:
        plane[rows] = values.to(plane.dtype)


def read_rows(planes: list, rows: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a plane family as `dtype` (rows < 0 read as zeros)."""
    safe = rows.clamp(min=0)
    if fmt == "fp8" and len(planes) == 3:  # main: NoPE fp8 + scales, RoPE bf16
        nope, scale, rope = planes
        s = e8m0_to_float(_take(scale, safe)).repeat_interleave(nope.shape[1] // scale.shape[1], dim=-1)
        v = torch.cat([(_take(nope, safe).float() * s).to(rope.dtype), rope[safe]], dim=-1)
    elif fmt == "fp4":
        packed, scale = planes
        flat = safe.reshape(-1)
        v = fp4_dequant(packed[flat], _take(scale, flat).view(torch.uint8)).reshape(*safe.shape, -1)
    elif fmt == "fp8":  # index: e4m3 + fp32 row scale
        vals, scale = planes
        v = _take(vals, safe).float() * scale[safe].float()
    else:
        v = planes[0][safe]
    v = v.to(dtype)
    return v.masked_fill((rows < 0).unsqueeze(-1), 0)


def write_rows(planes: list, rows: torch.Tensor, values: torch.Tensor, fmt: str) -> list:
    """Copies of the planes with `values [n, width]` stored at `rows [n]`."""
    out = [p.clone() for p in planes]
    if rows.numel() == 0:
        return out
    if fmt == "fp8" and len(planes) == 3:
        nope_dim = planes[0].shape[1]
        g = values[:, :nope_dim].float().reshape(len(rows), planes[1].shape[1], -1)
        s = pow2_scale(g.abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
        _put(out[0], rows, (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(len(rows), nope_dim))
        _put(out[1], rows, float_to_e8m0(s.squeeze(-1)).view(torch.float8_e8m0fnu))
        _put(out[2], rows, values[:, nope_dim:])
    elif fmt == "fp4":
        packed, scale = fp4_quant(values.float(), 32)
        _put(out[0], rows, packed)
        _put(out[1], rows, scale.view(torch.float8_e8m0fnu))
    elif fmt == "fp8":
        s = pow2_scale(values.float().abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
        _put(out[0], rows, (values.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        _put(out[1], rows, s)
    else:
        _put(out[0], rows, values)
    return out


def _planes(*ps):
    return [p for p in ps if p is not None]


def _plane_types(p0, p1, p2):
    return tuple(p for p in (p0, p1, p2) if p is not None)


def _check_planes(fmt: str, p0, p1, p2, width: int | None = None) -> None:
    n = len(_plane_types(p0, p1, p2))
    want = {"native": 1, "bf16": 1, "fp8": (3, 2), "fp4": 2}[fmt]
    require(n in (want if isinstance(want, tuple) else (want,)), f"plane count does not fit format '{fmt}'",
            expected=want, found=n)


def window_rows(pos: torch.Tensor, slot: torch.Tensor, window: int, slot_rows: int, n_rows: int) -> torch.Tensor:
    """Physical row (before the layer's ring offset) of each position's window entry."""
    base = n_rows - (slot.long() + 1) * slot_rows
    return base.unsqueeze(-1) + torch.remainder(pos, window)


def compressed_row(w: torch.Tensor, b: torch.Tensor, block_table: torch.Tensor, ratio: int, block_tokens: int,
                   envelope_rows: int) -> torch.Tensor:
    """Physical row (before the layer's envelope offset) of window w of sequence b."""
    per_block = block_tokens // ratio
    blk = block_table.long()[b, torch.div(w, per_block, rounding_mode="floor")]
    return blk * envelope_rows + torch.remainder(w, per_block)


# ---- writes --------------------------------------------------------------------------------------

@defop("pool_write_window(kv, pos, slot, p0, p1?, p2?) -> q0, q1?, q2?",
       attrs={"window": int, "slot_rows": int, "n_rows": int, "layer_row": int, "fmt": str}, tied={"q0": "p0", "q1": "p1", "q2": "p2"}, kernel="pool_write",
       offset_attrs=("layer_row",))
def pool_write_window(kv, pos, slot, p0, p1, p2, *, window, slot_rows, n_rows, layer_row, fmt):
    """Store this chunk's raw kv rows in the layer's window ring of each sequence's slot (the last
    `window` positions of each sequence only)."""
    b, i = ring_lanes(pos, window).nonzero(as_tuple=True)
    rows = window_rows(pos, slot, window, slot_rows, n_rows)[b, i] + layer_row
    return tuple(write_rows(_planes(p0, p1, p2), rows, kv[b, i], fmt))


@pool_write_window.infer
def _(kv, pos, slot, p0, p1, p2, *, fmt, **_):
    _check_planes(fmt, p0, p1, p2)
    require(tuple(pos.shape) == tuple(kv.shape[:2]) and slot.shape == (kv.shape[0],), "kv [B, T, d] / pos [B, T] / "
            "slot [B]", found=(list(kv.shape), list(pos.shape), list(slot.shape)))
    return _plane_types(p0, p1, p2)


@pool_write_window.cost
def _(operands, results, attrs):
    kv, pos, slot, p0, p1, p2 = operands
    B, T = kv.shape[0], kv.shape[1]
    return Cost(0, _small(kv, pos, slot), B * min(T, attrs["window"]) * row_bytes(p0, p1, p2))


@defop("compress_paged(kv, gate, ape, norm, state_kv, state_gate, pos, slot, block_table, p0, p1?, p2?) "
       "-> state_kv_out, state_gate_out, q0, q1?, q2?",
       attrs={"ratio": int, "overlap": bool, "eps": float, "rope_dim": int, "theta": float, "yarn": tuple,
              "round": (str, "none"), "block_tokens": int, "envelope_rows": int, "layer_offset": int, "fmt": str}, tied={"state_kv_out": "state_kv", "state_gate_out": "state_gate", "q0": "p0", "q1": "p1", "q2": "p2"}, kernel="compress",
       offset_attrs=("layer_offset",))
def compress_paged(kv, gate, ape, norm, state_kv, state_gate, pos, slot, block_table, p0, p1, p2, *, ratio, overlap,
                   eps, rope_dim, theta, yarn, round, block_tokens, envelope_rows, layer_offset, fmt):
    """`compress` on the pool: the state rings live per slot, and each closed window's row is written at
    its physical row `block_table[b, w // per_block] * envelope + layer_offset + w % per_block`."""
    slot = slot.long()
    # a padding lane (slot -1) would index the last slot: its unchanged ring, written back after the live lane's,
    # undid the write of a sequence in that slot (the host device's reference kernels, issue 34)
    live = slot >= 0
    skv, sg = state_kv[slot.clamp(min=0)], state_gate[slot.clamp(min=0)]
    h, w, closed, g = closed_rows(kv, gate, ape, norm, skv, sg, pos, ratio, overlap, eps, rope_dim, theta, yarn, round)
    b, j = closed.nonzero(as_tuple=True)
    rows = compressed_row(w[b, j], b, block_table, ratio, block_tokens, envelope_rows) + layer_offset
    planes = write_rows(_planes(p0, p1, p2), rows, h[b, j], fmt)
    nkv, ng = update_ring(skv, sg, kv, g, pos)
    out_kv, out_g = state_kv.clone(), state_gate.clone()
    out_kv[slot[live]], out_g[slot[live]] = nkv[live], ng[live]
    return (out_kv, out_g, *planes)


@compress_paged.infer
def _(kv, gate, ape, norm, state_kv, state_gate, pos, slot, block_table, p0, p1, p2, *, fmt, ratio, overlap, **_):
    _check_planes(fmt, p0, p1, p2)
    c = 2 if overlap else 1
    require(state_kv.shape[1:] == (c * ratio, kv.shape[-1]) and state_gate.shape == state_kv.shape,
            "compress_paged state rings must be [slots, c*ratio, c*dk]", found=list(state_kv.shape))
    require(block_table.dtype == "i32" and block_table.shape[0] == kv.shape[0], "block_table must be i32 [B, blocks]",
            found=str(block_table))
    return (state_kv, state_gate, *_plane_types(p0, p1, p2))


@compress_paged.cost
def _(operands, results, attrs):
    """The chunk's rows and the slots' state rings in, the chunk's rows pushed onto the rings; at most one
    closed window per `ratio` positions (+1 at a chunk boundary) written to the pool."""
    kv, gate, ape, norm, skv, sg, pos, slot, bt, p0, p1, p2 = operands
    B, T = kv.shape[0], kv.shape[1]
    ring = B * (skv.nbytes // skv.shape[0] + sg.nbytes // sg.shape[0])  # the slots' rings, read whole
    pushed = B * min(T, skv.shape[1]) * (skv.nbytes + sg.nbytes) // (skv.shape[0] * skv.shape[1])
    return Cost(0, _small(kv, gate, ape, norm, pos, slot, bt) + ring,
                pushed + B * (T // attrs["ratio"] + 1) * row_bytes(p0, p1, p2))



# Two compressors of one layer in one launch (V4's CSA layers: the attention's and the indexer's), each half
# with its own operands, results and attributes (names suffixed _0 / _1); the positions, slots and block table
# are shared.
_HALF_OPERANDS = ("kv", "gate", "ape", "norm", "state_kv", "state_gate")
_HALF_ATTRS = {"ratio": int, "overlap": bool, "eps": float, "rope_dim": int, "theta": float, "yarn": tuple,
               "round": (str, "none"), "block_tokens": int, "envelope_rows": int, "layer_offset": int, "fmt": str}
COMPRESS_PAIR_ATTRS = {f"{k}_{i}": v for i in (0, 1) for k, v in _HALF_ATTRS.items()}


def _pair_half(operands, attrs: dict, i: int) -> tuple[list, dict]:
    """(compress_paged operands, its attributes) of half i of a `compress_pair`'s."""
    per = 9  # kv, gate, ape, norm, state_kv, state_gate, p0, p1, p2
    half = list(operands[i * per:(i + 1) * per])
    pos, slot, bt = operands[2 * per:]
    return [*half[:6], pos, slot, bt, *half[6:]], {k: attrs[f"{k}_{i}"] for k in _HALF_ATTRS}


def _halves(names: tuple[str, ...]) -> str:
    """`a_0, b_0?, ..., a_1, b_1?, ...` of names that may end in `?` (optional)."""
    return ", ".join(f"{n.rstrip('?')}_{i}{'?' * n.endswith('?')}" for i in (0, 1) for n in names)


@defop(f"compress_pair({_halves((*_HALF_OPERANDS, 'p0', 'p1?', 'p2?'))}, pos, slot, block_table) -> "
       f"{_halves(('state_kv_out', 'state_gate_out', 'q0', 'q1?', 'q2?'))}",
       attrs=COMPRESS_PAIR_ATTRS, kernel="compress", offset_attrs=("layer_offset_0", "layer_offset_1"),
       tied={f"{r}_{i}": f"{o}_{i}" for i in (0, 1) for r, o in compress_paged.tied.items()})
def compress_pair(*operands, **attrs):
    """Two `compress_paged` of one chunk (another pool, ring and format each), in one launch: half 0's
    results, then half 1's."""
    out = []
    for i in (0, 1):
        ops, a = _pair_half(operands, attrs, i)
        out += [r for r in compress_paged.ref(*ops, **a) if r is not None]
    return tuple(out)


@compress_pair.infer
def _(*operands, **attrs):
    out = []
    for i in (0, 1):
        ops, a = _pair_half(operands, attrs, i)
        out += compress_paged.result_types(ops, a)
    return tuple(out)


@compress_pair.cost
def _(operands, results, attrs):
    """The two compressors' costs (what two launches would move: each reads the positions once)."""
    costs = [compress_paged.cost_of(*_split_results(operands, results, attrs, i)) for i in (0, 1)]
    return Cost(sum(c.flops for c in costs), sum(c.bytes_read for c in costs), sum(c.bytes_written for c in costs))


def _split_results(operands, results, attrs, i):
    ops, a = _pair_half(operands, attrs, i)
    n0 = 2 + sum(p is not None for p in operands[6:9])
    res = results[:n0] if i == 0 else results[n0:]
    return ops, list(res), a

# ---- CSR construction ----------------------------------------------------------------------------

def _to_csr(rows: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, W] candidate rows + mask -> (indptr [L + 1], indices [L * W]) with kept rows packed in order."""
    L, W = rows.shape
    counts = keep.sum(1)
    indptr = torch.zeros(L + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    indices = torch.zeros(L * W, dtype=torch.int32)
    indices[: int(indptr[-1])] = rows[keep].to(torch.int32)
    return indptr, indices


@defop("csr_window(pos, slot) -> indptr, indices", attrs={"window": int, "slot_rows": int, "n_rows": int}, kernel="csr")
def csr_window(pos, slot, *, window, slot_rows, n_rows):
    """Per query lane: the window-ring rows of the positions before this chunk that it sees
    (p in (t - window, start)), oldest first; the chunk's own tokens are read from the chunk itself."""
    B, T = pos.shape
    start = pos[:, :1].clamp(min=0)
    back = torch.arange(window - 1, 0, -1)  # distance to the query, oldest first
    p = pos.unsqueeze(-1) - back  # [B, T, W - 1]
    keep = (p >= 0) & (p < start.unsqueeze(-1)) & (pos.unsqueeze(-1) >= 0)
    rows = window_rows(p.reshape(B, -1), slot, window, slot_rows, n_rows).reshape(B, T, -1)
    return _to_csr(rows.reshape(B * T, -1), keep.reshape(B * T, -1))


@csr_window.infer
def _(pos, slot, *, window, **_):
    L = pos.shape[0] * pos.shape[1]
    return TensorType((L + 1,), "i32"), TensorType((L * (window - 1),), "i32")


@defop("csr_compressed(pos, block_table) -> indptr, indices",
       attrs={"ratio": int, "block_tokens": int, "envelope_rows": int, "max_rows": int}, kernel="csr")
def csr_compressed(pos, block_table, *, ratio, block_tokens, envelope_rows, max_rows):
    """Per query lane: every compressed row it may see (w < floor((t + 1) / ratio)), translated to
    physical rows through the block table (HCA: no selection)."""
    B, T = pos.shape
    w = torch.arange(max_rows).view(1, 1, -1).expand(B, T, -1)
    keep = (w < torch.div(pos + 1, ratio, rounding_mode="floor").unsqueeze(-1)) & (pos.unsqueeze(-1) >= 0)
    b = torch.arange(B).view(B, 1, 1).expand_as(w)
    rows = torch.where(keep, compressed_row(w.clamp(max=max_rows - 1), b, block_table.clamp(min=0), ratio,
                                            block_tokens, envelope_rows), 0)
    return _to_csr(rows.reshape(B * T, -1), keep.reshape(B * T, -1))


@csr_compressed.infer
def _(pos, block_table, *, max_rows, **_):
    L = pos.shape[0] * pos.shape[1]
    return TensorType((L + 1,), "i32"), TensorType((L * max_rows,), "i32")


@defop("csr_selected(selected, pos, block_table) -> indptr, indices",
       attrs={"ratio": int, "block_tokens": int, "envelope_rows": int}, kernel="csr")
def csr_selected(selected, pos, block_table, *, ratio, block_tokens, envelope_rows):
    """The indexer's picks (sequence-local row numbers, -1 = none) translated to physical rows, -1s
    skipped (ATOM's `csa_translate_pack`)."""
    B, T, K = selected.shape
    keep = (selected >= 0) & (pos.unsqueeze(-1) >= 0)
    b = torch.arange(B).view(B, 1, 1).expand_as(selected)
    rows = torch.where(keep, compressed_row(selected.clamp(min=0), b, block_table.clamp(min=0), ratio, block_tokens,
                                            envelope_rows), 0)
    return _to_csr(rows.reshape(B * T, K), keep.reshape(B * T, K))


@csr_selected.infer
def _(selected, pos, block_table, **_):
    B, T, K = selected.shape
    return TensorType((B * T + 1,), "i32"), TensorType((B * T * K,), "i32")


# ---- the sparse attention ------------------------------------------------------------------------

def _gather_csr(indptr: torch.Tensor, indices: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR over L = len(indptr) - 1 lanes -> padded [L, width] rows and mask."""
    counts = (indptr[1:] - indptr[:-1]).long()
    j = torch.arange(width).view(1, -1)
    mask = j < counts.view(-1, 1)
    flat = (indptr[:-1].long().view(-1, 1) + j).clamp(max=max(indices.shape[0] - 1, 0))
    rows = torch.where(mask, indices.long()[flat], torch.full_like(flat, -1))
    return rows, mask


def _listed(indptr: torch.Tensor, indices: torch.Tensor, layout: torch.Tensor, T: int, what: str) -> torch.Tensor:
    """[B, T, K]: which keys of a sequence's layout `layout [B, K]` (physical rows, < 0 = none) each query
    lane's CSR lists. Equal layout rows resolve to the first (a block table may repeat a block in its
    unused tail). A listed row outside the layout, or listed twice, is an error: the layout holds each
    key once, as `attention`'s key tensor does."""
    B, K = layout.shape
    L = indptr.shape[0] - 1
    counts = (indptr[1:] - indptr[:-1]).long()
    rows, mask = _gather_csr(indptr, indices, max(int(counts.max()) if L else 0, 1))
    srt, order = torch.sort(layout.long(), dim=1, stable=True)
    lane_b = torch.arange(L) // T
    srt_l = srt[lane_b]
    at = torch.searchsorted(srt_l, rows).clamp(max=K - 1)
    found = (srt_l.gather(1, at) == rows) & (rows >= 0)
    if bool((mask & ~found).any()):
        lane = int((mask & ~found).any(1).nonzero()[0])
        raise InputError(f"sparse_attention: a {what} CSR row of lane {lane} is not one of its sequence's {what} "
                         "rows (slot / block table)", found=sorted(set(rows[lane][mask[lane]].tolist())
                                                             - set(layout[lane // T].tolist())))
    key = order[lane_b].gather(1, at)
    hits = torch.zeros(L, K, dtype=torch.long).scatter_add_(1, torch.where(mask, key, 0), mask.long())
    if bool((hits > 1).any()):
        raise InputError(f"sparse_attention: lane {int((hits > 1).any(1).nonzero()[0])} lists a {what} row twice")
    return (hits > 0).view(B, T, K)


@defop("sparse_attention(q, kv, pos, sink, slot, block_table?, win_indptr, win_indices, comp_indptr?, comp_indices?, "
       "p0, p1?, p2?) -> out",
       attrs={"window": int, "scale": float, "win_base": int, "comp_base": int, "fmt": str, "slot_rows": int,
              "n_rows": int,
              # the compressed variant's geometry (the window variant has no compressed rows: sizes 1 / 0)
              "ratio": (int, 1), "block_tokens": (int, 1), "envelope_rows": (int, 0), "comp_rows": (int, 0)},
       kernel="sparse_attention", offset_attrs=("win_base", "comp_base"),
       variants={"window": (), "window_compressed": ("block_table", "comp_indptr", "comp_indices")})
def sparse_attention(q, kv, pos, sink, slot, block_table, win_indptr, win_indices, comp_indptr, comp_indices, p0, p1,
                     p2, *, window, scale, win_base, comp_base, fmt, slot_rows, n_rows, ratio, block_tokens,
                     envelope_rows, comp_rows):
    """One softmax per query over: the pool rows of its window CSR (+ `win_base`), the pool rows of its
    compressed CSR (+ `comp_base`), and the chunk's own kv rows at positions in (t - window, t]; the sink
    joins the denominator only. K = V = the 512-wide latent.

    The CSRs say which keys a query sees; the sum runs over `attention`'s key layout: the sequence's
    `window` ring slots in slot order (rows `window_rows` of `slot`), the chunk's T rows, then its
    `comp_rows` compressed rows w = 0.. (rows `compressed_row` through `block_table`), keys no lane lists
    read as zeros and masked. Same shapes, same order: the result is `attention`'s bit for bit (the
    kernels keep their own order, within their stated tolerance). Each lane lists a row at most once."""
    B, T = q.shape[:2]
    planes = _planes(p0, p1, p2)
    ring = window_rows(torch.arange(window).expand(B, window), slot, window, slot_rows, n_rows)  # [B, W]
    win_vis = _listed(win_indptr, win_indices, ring, T, "window")
    t, s = pos.unsqueeze(-1), pos.unsqueeze(1)
    ext_vis = (s >= 0) & (s <= t) & (s > t - window) & (t >= 0)  # [B, T, T]: the chunk's own keys
    keys = [read_rows(planes, torch.where(win_vis.any(1), ring + win_base, -1), fmt, q.dtype), kv]
    visible = [win_vis, ext_vis]
    if comp_indptr is not None:
        per_block = block_tokens // ratio
        w = torch.arange(comp_rows).expand(B, comp_rows)
        blk = block_table.long().gather(1, torch.div(w, per_block, rounding_mode="floor"))
        comp = torch.where(blk >= 0, blk * envelope_rows + torch.remainder(w, per_block), -1)  # [B, R]
        comp_vis = _listed(comp_indptr, comp_indices, comp, T, "compressed")
        keys.append(read_rows(planes, torch.where(comp_vis.any(1), comp + comp_base, -1), fmt, q.dtype))
        visible.append(comp_vis)
    return attend(q, torch.cat(keys, dim=1), torch.cat(visible, dim=-1), sink, scale)


@sparse_attention.infer
def _(q, kv, pos, sink, slot, block_table, win_indptr, win_indices, comp_indptr, comp_indices, p0, p1, p2, *, fmt,
      ratio, block_tokens, comp_rows, **_):
    _check_planes(fmt, p0, p1, p2)
    B, T, H, d = q.shape
    require(tuple(kv.shape) == (B, T, d) and sink.shape == (H,), "sparse_attention kv [B, T, d] / sink [H]",
            found=(list(kv.shape), list(sink.shape)))
    require(win_indptr.shape == (B * T + 1,) and (comp_indptr is None or comp_indptr.shape == (B * T + 1,)),
            "CSR indptr must be [B*T + 1]")
    require(slot.shape == (B,), "sparse_attention slot must be [B]", found=list(slot.shape))
    if block_table is not None:
        per_block = block_tokens // ratio if ratio > 0 else 0
        require(block_table.dtype == "i32" and block_table.rank == 2 and block_table.shape[0] == B,
                "sparse_attention block_table must be i32 [B, blocks]", found=str(block_table))
        require(per_block > 0 and block_tokens % ratio == 0 and 0 < comp_rows <= block_table.shape[1] * per_block,
                "sparse_attention compressed geometry: ratio divides block_tokens, 0 < comp_rows <= blocks x "
                "block_tokens / ratio", found={"ratio": ratio, "block_tokens": block_tokens, "comp_rows": comp_rows,
                                                "blocks": block_table.shape[1]})
    return q


@sparse_attention.cost
def _(operands, results, attrs):
    """Each query lane reads its CSR rows (capacity: window - 1 ring rows + the compressed rows) once."""
    q, kv, pos, sink, slot, bt, wi, wx, ci, cx, p0, p1, p2 = operands
    B, T, H, d = q.shape
    rows = wx.shape[0] + (cx.shape[0] if cx is not None else 0)
    keys = rows + B * T * T
    return Cost(4 * H * d * keys, _small(q, kv, pos, sink, slot, bt, wi, wx, ci, cx) + rows * row_bytes(p0, p1, p2),
                results[0].nbytes)


@defop("indexer_scores_paged(q, weights, pos, block_table, p0, p1?) -> scores",
       attrs={"ratio": int, "q_scale": float, "w_scale": float, "block_tokens": int, "envelope_rows": int,
              "layer_offset": int, "max_rows": int, "fmt": str})
def indexer_scores_paged(q, weights, pos, block_table, p0, p1, *, ratio, q_scale, w_scale, block_tokens,
                         envelope_rows, layer_offset, max_rows, fmt):
    """`indexer_scores` with the keys read from the index pool through the block table."""
    from .indexer import indexer_scores

    B = q.shape[0]
    w = torch.arange(max_rows).view(1, -1).expand(B, -1)
    b = torch.arange(B).view(B, 1).expand_as(w)
    rows = compressed_row(w, b, block_table.clamp(min=0), ratio, block_tokens, envelope_rows) + layer_offset
    keys = read_rows(_planes(p0, p1), rows, fmt, torch.float32)
    return indexer_scores.ref(q, weights, keys, pos, ratio=ratio, q_scale=q_scale, w_scale=w_scale)


@indexer_scores_paged.infer
def _(q, weights, pos, block_table, p0, p1, *, max_rows, **_):
    return TensorType((q.shape[0], q.shape[1], max_rows), "fp32")
