"""Pearson's chi-square p-value (the sampling tests of speculative decoding: reference and compiled). scipy is
no dependency of the project, so the survival function comes from torch's regularised incomplete gamma."""

from __future__ import annotations

import numpy as np
import torch


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test of counts against expected counts (k - 1 degrees of freedom): the survival
    function of the chi-square distribution is the regularised upper incomplete gamma Q(df / 2, stat / 2)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
