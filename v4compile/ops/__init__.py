"""Every op of the IR, with its torch reference and shape rule (see `ir/registry.py`), in op sets that are
loaded explicitly: `load("core")` registers the elementary ops only (no torch, no model ops), `load_all()`
everything. The registry itself never imports this package; whoever reads or builds IR loads the op sets
it needs (the frontend, the CLI, the runtimes call `load_all()`).

* `core`: embed, linear, rms_norm, swiglu, reshape, split, add, last_token, spec_accept,
  spec_sample, draft_next (`basic`);
* `model`: the ops the reference model is written in (mHC, RoPE, attention, compressor, indexer, MoE,
  the official numerics' roundings);
* `lowered`: the ops passes create (fusions, the paged pool);
* `parallel`: the collectives and the expert ownership mask of a partitioned module (`partition` pass), the
  fused MoE ops of an expert-parallel module (`fused_ep`), and those ops with the one-shot all-reduce of their
  input, or of their output, folded in (`fused_allreduce`).

The reference model calls ops through `op` (`op.rms_norm(...)`), which loads every set on first use. The
package's own attributes are its modules: `ops.rope` is `ops/rope.py`, `op.rope` the op.
"""

from __future__ import annotations

import importlib
from typing import Any

OPSETS: dict[str, tuple[str, ...]] = {
    "core": ("basic",),
    "model": ("mhc", "rope", "attention", "compressor", "indexer", "moe", "numerics"),
    "lowered": ("fused", "front", "attn_tail", "paged", "rope_compress"),
    "parallel": ("collective", "fused_ep", "fused_allreduce"),
}


def load(*names: str) -> None:
    """Register the ops of these op sets (idempotent)."""
    for name in names:
        if name not in OPSETS:
            raise KeyError(f"unknown op set {name!r} (one of {', '.join(OPSETS)})")
        for mod in OPSETS[name]:
            importlib.import_module(f"{__name__}.{mod}")


def load_all() -> None:
    load(*OPSETS)


class _Ops:
    """`op.<name>`: the registered op of that name."""

    def __getattr__(self, name: str) -> Any:
        load_all()
        from ..ir.optable import REGISTRY

        if name in REGISTRY:
            return REGISTRY[name]
        raise AttributeError(f"no op {name!r}")


op = _Ops()
