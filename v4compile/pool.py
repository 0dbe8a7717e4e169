"""Geometry of the paged KV pool (seed figure 4; ATOM's `v4_pool_geometry`).

One row space per plane family:

* main planes (the attention KV): compressed history in *blocks* growing up from row 0. A block is an
  envelope of `block_tokens` tokens (2 x lcm of the ratios: 256 for the releases) holding every
  compressed layer's rows for those tokens, grouped by class, narrowest class first (HCA: 2 rows a
  layer, then CSA: 64 rows a layer; 1982 rows for V4-Pro). Per-request *slots* grow down from the top;
  a slot holds one sliding-window ring of `window` rows per layer. Physical rows:
      compressed row r of layer l in block b:  b * envelope + offset[l] + r
      window row of position p, layer l, slot s: n_rows - (s + 1) * slot_rows + l * window + p % window
* index planes (CSA indexer keys): their own blocks, `block_tokens / 4` rows per CSA layer.

Row formats: main `native` (the compute dtype; exact), `bf16` (one 2*d-byte row), `fp8` (NoPE plane
e4m3 with one UE8M0 scale per 64 values + a RoPE plane in the compute dtype; rows of 512 + 128 bytes on
device with BF16 compute); index
`native`, `fp4` (e2m1 packed + UE8M0 per 32: 68 bytes for 128 dims), `fp8` (e4m3 + a power-of-two fp32
scale: 132 bytes). The compressor's FP32 state rings stay per slot in their own tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .config import CSA, HCA, V4Config

MAIN_FORMATS = ("native", "bf16", "fp8")
INDEX_FORMATS = ("native", "fp4", "fp8")
FP8_KV_BLOCK = 64


@dataclass(frozen=True)
class PoolGeometry:
    block_tokens: int
    envelope_rows: int
    layer_offset: tuple[tuple[int, int], ...]  # (layer, row offset in the envelope), compressed layers
    index_envelope_rows: int
    index_offset: tuple[tuple[int, int], ...]  # (layer, row offset in the index envelope), CSA layers
    n_blocks: int
    blocks_per_seq: int
    window: int
    n_window_layers: int
    n_slots: int
    head_dim: int
    rope_dim: int
    index_dim: int
    main_fmt: str
    index_fmt: str
    compute_dtype: str

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, layers: list[tuple[int, str, int]], window: int, capacity: int, n_seqs: int, head_dim: int,
              rope_dim: int, index_dim: int, main_fmt: str, index_fmt: str, compute_dtype: str) -> "PoolGeometry":
        """`layers`: (layer, kind, ratio) of every layer (kind swa / csa / hca)."""
        ratios = sorted({r for _, k, r in layers if k in (CSA, HCA)}) or [1]
        bt = 2 * math.lcm(*ratios)
        offsets, off = [], 0
        for kind in (HCA, CSA):  # narrowest class first
            for layer, k, r in layers:
                if k == kind:
                    offsets.append((layer, off))
                    off += bt // r
        ioff, io = [], 0
        for layer, k, r in layers:
            if k == CSA:
                ioff.append((layer, io))
                io += bt // r
        bps = math.ceil(capacity / bt)
        return cls(bt, off, tuple(offsets), io, tuple(ioff), bps * n_seqs, bps, window, len(layers), n_seqs,
                   head_dim, rope_dim, index_dim, main_fmt, index_fmt, compute_dtype)

    @classmethod
    def for_config(cls, cfg: V4Config, capacity: int, n_seqs: int, main_fmt: str, index_fmt: str,
                   compute_dtype: str, mtp_layers: int = 0) -> "PoolGeometry":
        """`mtp_layers`: the compiled MTP block's layers (sliding-window only: one more ring per slot each)."""
        layers = [(i, cfg.kind(i), cfg.ratio(i)) for i in range(cfg.n_layers + mtp_layers)]
        return cls.build(layers, cfg.window, capacity, n_seqs, cfg.head_dim, cfg.rope_dim, cfg.index_head_dim,
                         main_fmt, index_fmt, compute_dtype)

    @property
    def kv_block(self) -> int:
        """Values per UE8M0 scale of the FP8 NoPE plane: 64 (448 = 7 x 64), a divisor for small models."""
        return math.gcd(FP8_KV_BLOCK, self.head_dim - self.rope_dim)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def slot_rows(self) -> int:
        return self.n_window_layers * self.window

    @property
    def n_rows(self) -> int:
        return self.n_blocks * self.envelope_rows + self.n_slots * self.slot_rows

    @property
    def n_index_rows(self) -> int:
        return max(self.n_blocks * self.index_envelope_rows, 1)

    def offset(self, layer: int) -> int:
        return dict(self.layer_offset)[layer]

    def index_offset_of(self, layer: int) -> int:
        return dict(self.index_offset)[layer]

    def main_planes(self) -> list[tuple[str, tuple[int, ...], str]]:
        n, d, r = self.n_rows, self.head_dim, self.rope_dim
        if self.main_fmt == "fp8":
            nope = d - r
            # The RoPE dims are never quantised: their plane has the compute dtype (BF16 on device).
            return [("pool.nope", (n, nope), "fp8e4m3"), ("pool.nope_scale", (n, nope // self.kv_block), "e8m0"),
                    ("pool.rope", (n, r), self.compute_dtype)]
        dt = "bf16" if self.main_fmt == "bf16" else self.compute_dtype
        return [("pool.main", (n, d), dt)]

    def index_planes(self) -> list[tuple[str, tuple[int, ...], str]]:
        n, di = self.n_index_rows, self.index_dim
        if self.index_fmt == "fp4":
            return [("pool.index", (n, di // 2), "fp4x2"), ("pool.index_scale", (n, di // 32), "e8m0")]
        if self.index_fmt == "fp8":
            return [("pool.index", (n, di), "fp8e4m3"), ("pool.index_scale", (n, 1), "fp32")]
        return [("pool.index", (n, di), self.compute_dtype)]

    def row_bytes(self) -> tuple[int, int]:
        """Device bytes of one main row and one index row (aligned layouts of the seed)."""
        d, r, di = self.head_dim, self.rope_dim, self.index_dim
        es = {"fp32": 4, "bf16": 2}[self.compute_dtype]
        main = {"native": d * es, "bf16": 2 * d, "fp8": d + es * r}[self.main_fmt]
        index = {"native": di * es, "fp4": di // 2 + di // 32, "fp8": di + 4}[self.index_fmt]
        return main, index

    def kv_bytes_per_token(self) -> float:
        main, index = self.row_bytes()
        return (self.envelope_rows * main + self.index_envelope_rows * index) / self.block_tokens

    # ---- module attributes (the IR carries its own geometry) ----------------------------------
    def to_attrs(self) -> dict[str, Any]:
        return {
            "pool.block_tokens": self.block_tokens, "pool.envelope_rows": self.envelope_rows,
            "pool.layer_offset": tuple(x for p in self.layer_offset for x in p),
            "pool.index_envelope_rows": self.index_envelope_rows,
            "pool.index_offset": tuple(x for p in self.index_offset for x in p),
            "pool.n_blocks": self.n_blocks, "pool.blocks_per_seq": self.blocks_per_seq, "pool.window": self.window,
            "pool.n_window_layers": self.n_window_layers, "pool.n_slots": self.n_slots,
            "pool.head_dim": self.head_dim, "pool.rope_dim": self.rope_dim, "pool.index_dim": self.index_dim,
            "pool.main_fmt": self.main_fmt, "pool.index_fmt": self.index_fmt,
            "pool.compute_dtype": self.compute_dtype, "pool.kv_bytes_per_token": self.kv_bytes_per_token(),
        }

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> "PoolGeometry":
        def pairs(t):
            return tuple((t[i], t[i + 1]) for i in range(0, len(t), 2))

        a = {k[len("pool."):]: v for k, v in attrs.items() if k.startswith("pool.")}
        return cls(a["block_tokens"], a["envelope_rows"], pairs(a["layer_offset"]), a["index_envelope_rows"],
                   pairs(a["index_offset"]), a["n_blocks"], a["blocks_per_seq"], a["window"], a["n_window_layers"],
                   a["n_slots"], a["head_dim"], a["rope_dim"], a["index_dim"], a["main_fmt"], a["index_fmt"],
                   a["compute_dtype"])


class Allocator:
    """Sequence slots and pool blocks: the host-side bookkeeping before each step of a pool-lowered function,
    shared by the runtime's session and the IR harness. Free lists are stacks: `descending` hands out the
    highest slot / block first (the harness: blocks interleave across sequences from the top of the row
    space, so the block-table translation is really exercised), else the lowest first (the session)."""

    def __init__(self, n_slots: int, n_blocks: int, descending: bool = False):
        def stack(n: int) -> list[int]:
            return list(range(n)) if descending else list(range(n - 1, -1, -1))

        self.free_slots = stack(n_slots)
        self.free_blocks = stack(n_blocks)

    def slot(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self.free_slots.pop() if self.free_slots else None

    def grow(self, blocks: list[int], need: int) -> bool:
        """Append free blocks to `blocks` until it holds `need`; False (and as many as there were) if the
        pool runs out."""
        while len(blocks) < need:
            if not self.free_blocks:
                return False
            blocks.append(self.free_blocks.pop())
        return True

    def release(self, slot: int, blocks: list[int]) -> None:
        self.free_slots.append(slot)
        self.free_blocks.extend(reversed(blocks))
