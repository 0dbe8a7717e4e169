"""Parameter access for the model code.

The model reads weights through a `Params` object, never directly, so that the same code runs eagerly
(tensors) and under the tracer (IR weight values). Linear weights come back as keyword arguments for
`ops.linear` (`w`, `scale`, `block`); routed experts as one stacked tensor per projection.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import V4Config
from ..ir.core import Value


def experts_name(prefix: str, w: str) -> str:
    """Name of the stacked `[E, out, in]` tensor of projection `w` (w1 / w2 / w3) of a layer's experts."""
    return f"{prefix}ffn.experts.{w}"


class Params:
    """Named tensors (or IR values) with the linear-weight conventions of the model code."""

    def __init__(self, cfg: V4Config, store: dict[str, Any], scales: dict[str, Any] | None = None,
                 quantized: frozenset[str] = frozenset()):
        self.cfg = cfg
        self.store = store
        self.scales = scales or {}
        self.quantized_names = quantized  # eager: weights the checkpoint stores in FP8 / FP4 (held dequantised)

    def quantized(self, name: str) -> bool:
        """Whether the checkpoint stores weight `name` in FP8 / FP4 (a traced weight says it by its dtype)."""
        w = self.store[name]
        if isinstance(w, Value):
            return w.type.dtype in ("fp8e4m3", "fp4x2")
        return name in self.quantized_names

    def t(self, name: str) -> Any:
        return self.store[name]

    def get(self, name: str) -> Any:
        return self.store.get(name)

    def _block(self, w: Any) -> int:
        dt = w.type.dtype if isinstance(w, Value) else ("fp4x2" if w.dtype == torch.int8 else "")
        return self.cfg.expert_scale_block if dt == "fp4x2" else self.cfg.quant_block

    def lin(self, name: str) -> dict[str, Any]:
        w = self.store[name]
        return {"w": w, "scale": self.scales.get(name), "block": self._block(w)}

    def experts(self, prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in ("w1", "w2", "w3"):
            n = experts_name(prefix, k)
            out[k] = self.store[n]
            out[f"{k}_scale"] = self.scales.get(n)
        out["block"] = self._block(out["w1"])
        return out
