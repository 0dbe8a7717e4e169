"""Seeded random weights for any config (`v4compile init-random`).

Each tensor is drawn from its own generator, seeded from (seed, tensor name), so a value never
depends on which other tensors were drawn. GEMM weights have std 1/sqrt(fan_in) (unit-scale
activations); the parameters HF initialises to constants (attention sinks, compressor position
biases, mHC base / scale, router bias, `tid2eid`, norm weights) are randomised so that every feature
moves the logits; `tid2eid` rows never repeat an expert.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from .checkpoint import write_checkpoint
from .config import V4Config
from .weights import TensorSpec


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))


def random_tensor(spec: TensorSpec, cfg: V4Config, seed: int) -> torch.Tensor:
    g = _gen(seed, spec.name)
    n = spec.name
    shape = spec.shape

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    if n.endswith("tid2eid"):
        rows = torch.stack([torch.randperm(cfg.n_experts, generator=g)[: cfg.n_active_experts]
                            for _ in range(shape[0])])
        return rows.to(torch.int64)
    if n.endswith("norm.weight"):
        return uniform(0.7, 1.3)
    if n.endswith("_fn"):
        return normal(1.0 / math.sqrt(shape[1]))
    if n.endswith("_base"):
        return normal(0.5)
    if n.endswith("_scale") and not n.endswith(".scale"):
        return uniform(0.5, 1.5)
    if n.endswith("attn_sink"):
        return normal(1.0)
    if n.endswith(".ape"):
        return normal(0.5)
    if n.endswith("gate.bias"):
        return normal(0.3)
    if n == "embed.weight":
        return normal(1.0)
    if len(shape) == 2:
        return normal(1.0 / math.sqrt(shape[1]))
    return normal(0.1)


def random_source(cfg: V4Config, seed: int) -> Callable[[TensorSpec], torch.Tensor]:
    return lambda spec: random_tensor(spec, cfg, seed)


def init_random(out: str | Path, cfg: V4Config, seed: int = 0, quantized: bool = False,
                include_mtp: bool = True, progress: Callable[[int, int], None] | None = None,
                force: bool = False) -> Path:
    """Write a random checkpoint in the official layout: fp32, or the released formats (`quantized`)."""
    return write_checkpoint(out, cfg, random_source(cfg, seed), dtype="released" if quantized else "fp32",
                            include_mtp=include_mtp, progress=progress, force=force)
