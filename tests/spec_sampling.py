"""The sampling tests of speculative decoding (reference and compiled): the test's sizes, Pearson's chi-square
p-value (scipy is no dependency of the project: the survival function comes from torch's regularised
incomplete gamma) and the broken acceptance rule each test must catch."""

from __future__ import annotations

import numpy as np
import torch

from v4compile.speculation import draw, probs

SMALL_VOCAB, N, ALPHA = 8, 400, 1e-3  # chi-square at significance 0.001 (df = 7 when no bin is merged)


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test of counts against expected counts (k - 1 degrees of freedom): the survival
    function of the chi-square distribution is the regularised upper incomplete gamma Q(df / 2, stat / 2)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def always_accept(drafts, target, draft_probs, rng, temperature):
    """A broken `speculation.accept`: every draft survives (the output is then the draft's distribution)."""
    return len(drafts), draw(probs(target[-1], temperature), rng)
