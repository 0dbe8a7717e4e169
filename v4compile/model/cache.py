"""Explicit, fixed-size decode state of the reference model.

Per layer (`v4-reference.md` section 9), for a batch of B sequences with room for `capacity` tokens:

* `win` `[B, W, d]`: ring of the raw kv rows of the last W tokens (slot `p % W`);
* CSA / HCA: `rows` `[B, capacity // m, d]` compressed rows by window index; `state_kv` /
  `state_gate` `[B, c*m, c*d]`: ring of the last c*m tokens' compressor projections (gate with
  the position bias added, fp32);
* CSA: the indexer's own `index_rows` `[B, capacity // m, di]` and `index_state_kv` / `_gate`.

Shapes never change, which is what lets the same code be traced into a static graph. The host side
keeps each sequence's length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..config import CSA, HCA, V4Config


def layer_cache_shapes(cfg: V4Config, layer: int, batch: int, capacity: int, dtype: str = "fp32",
                       numerics: str = "hf") -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, IR dtype) of one layer's state (layer >= n_layers: an MTP layer). The compressor
    gate rings are fp32; official numerics keep the kv rings fp32 too (as DeepSeek's code does)."""
    d = cfg.head_dim
    kind = cfg.kind(layer)
    out = {"win": ((batch, cfg.window, d), dtype)}
    if kind in (CSA, HCA):
        m = cfg.ratio(layer)
        c = 2 if kind == CSA else 1
        r = max(capacity // m, 1)
        out["rows"] = ((batch, r, d), dtype)
        state = "fp32" if numerics == "official" else dtype
        out["state_kv"] = ((batch, c * m, c * d), state)
        out["state_gate"] = ((batch, c * m, c * d), "fp32")
        if kind == CSA:
            di = cfg.index_head_dim
            out["index_rows"] = ((batch, r, di), dtype)
            out["index_state_kv"] = ((batch, 2 * m, 2 * di), state)
            out["index_state_gate"] = ((batch, 2 * m, 2 * di), "fp32")
    return out


_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}

# ---- names of the state as IR function inputs / outputs -------------------------------------------
# A traced function takes each layer's cache tensor `key` (a name of `layer_cache_shapes`) as input and
# returns its new value as output, both named `cache.layers.<layer>.<key>`; after lowering to the pool
# the per-slot compressor rings are `state.layers.<layer>.<key>`. Function inputs carry no attributes,
# so these names are the one convention that says which layer's state an input is; they are made and
# read only here.
_CACHE_INPUT = re.compile(r"^cache\.layers\.(\d+)\.(\w+)$")


def cache_input_name(layer: int, key: str) -> str:
    return f"cache.layers.{layer}.{key}"


def state_input_name(layer: int, key: str) -> str:
    return f"state.layers.{layer}.{key}"


def parse_cache_input(name: str) -> tuple[int, str] | None:
    """(layer, key) of a `cache.layers.<layer>.<key>` input / output name, None for any other name."""
    m = _CACHE_INPUT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass
class Cache:
    """State of B sequences: one dict of tensors per backbone layer, one per MTP layer."""

    batch: int
    capacity: int
    layers: list[dict[str, torch.Tensor]]
    mtp: list[dict[str, torch.Tensor]]
    lengths: list[int] = field(default_factory=list)
    mtp_lengths: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, cfg: V4Config, batch: int, capacity: int, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu", numerics: str = "hf") -> "Cache":
        name = "bf16" if dtype == torch.bfloat16 else "fp32"

        def make(layer: int) -> dict[str, torch.Tensor]:
            return {k: torch.zeros(shape, dtype=_TORCH[dt], device=device)
                    for k, (shape, dt) in layer_cache_shapes(cfg, layer, batch, capacity, name, numerics).items()}

        return cls(batch, capacity, [make(i) for i in range(cfg.n_layers)],
                   [make(cfg.n_layers + j) for j in range(cfg.n_mtp_layers)], [0] * batch, [0] * batch)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers + self.mtp for t in layer.values())
