"""Expert counts over sampled routings: the independent expectation for the MoE cost models (which state
a closed form for uniform routing). Each token picks k distinct experts of E uniformly at random."""

from __future__ import annotations

import torch


def sampled_routing(E: int, k: int, tokens: int, block: int = 1, samples: int = 4000, seed: int = 0
                    ) -> tuple[tuple[float, float], tuple[float, float]]:
    """((mean, standard error) of the distinct experts, (mean, standard error) of the MMA rows when each
    active expert's pairs are padded to a multiple of `block`) over `samples` routings."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(samples, tokens, E, generator=g).topk(k, dim=-1).indices  # k distinct per token
    pairs = torch.zeros(samples, E).scatter_add_(1, picks.reshape(samples, -1), torch.ones(samples, tokens * k))
    active = (pairs > 0).sum(1).double()
    rows = (torch.ceil(pairs / block) * block).sum(1).double()
    return tuple((float(v.mean()), float(v.std()) / samples ** 0.5) for v in (active, rows))
