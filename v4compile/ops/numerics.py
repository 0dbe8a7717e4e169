"""Official-numerics rounding simulations (`v4-reference.md` 13.2 and 13.3)."""

from __future__ import annotations

import torch

from ..formats import fp4_qdq, fp8_qdq, hadamard
from ..ir.registry import defop


def fp8_round_ref(x: torch.Tensor, dims: int, block: int) -> torch.Tensor:
    head = fp8_qdq(x[..., :dims], block)
    return torch.cat([head, x[..., dims:]], dim=-1)


def hadamard_fp4_round_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    h = hadamard(x.shape[-1]).to(x.device)
    return fp4_qdq((x.float() @ h).to(x.dtype), block)


@defop("fp8_round(x) -> y", attrs={"dims": int, "block": (int, 64)})
def fp8_round(x, *, dims, block):
    """Round the first `dims` channels through FP8 e4m3 with one UE8M0 scale per `block` values (the
    KV cache's QAT simulation; the RoPE channels stay as they are)."""
    return fp8_round_ref(x, dims, block)


@fp8_round.infer
def _(x, *, dims, block):
    return x


@defop("hadamard_fp4_round(x) -> y", attrs={"block": (int, 32)})
def hadamard_fp4_round(x, *, block):
    """Rotate by the orthonormal Walsh-Hadamard matrix, then round through FP4 e2m1 with one UE8M0
    scale per `block` values (the indexer's QAT simulation)."""
    return hadamard_fp4_round_ref(x, block)


@hadamard_fp4_round.infer
def _(x, *, block):
    return x
