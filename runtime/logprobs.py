"""Log-probabilities of tokens from one row of a step's logits, as the server's `logprobs` fields give them.

The values are a log-softmax over the whole vocabulary of the device's own logits row (float32, computed in
float32 with the row's maximum taken out), before any sampling transform: no `logit_bias`, no temperature,
no top-p. They are the model's distribution, whatever the request samples with (OpenAI's and vLLM's default
meaning). `top` alternatives are the k most likely ids, ties broken by the smaller id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per token (OpenAI's top_logprobs bound; completions' logprobs allow 5)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely ids at its position [(id, logprob)]."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(row: np.ndarray) -> np.ndarray:
    """log softmax of one logits row `[V]` in float32 (the row's maximum out first: no overflow)."""
    x = np.asarray(row, dtype=np.float32)
    shifted = x - x.max()
    with np.errstate(under="ignore"):
        return shifted - np.log(np.exp(shifted).sum(dtype=np.float32))


def token_logprob(row: np.ndarray, tok: int, k: int = 0) -> TokenLogprob:
    """`tok`'s log-probability under `row` and the `k` most likely ids (0 <= k <= MAX_TOP)."""
    lp = log_softmax(row)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, lp.shape[0])
        part = np.argpartition(-lp, k - 1)[:k]
        # ties at the cut are settled by the sort below only among the chosen: take every id tied with the
        # k-th value, then the k smallest ids of them, so the choice never depends on argpartition's order
        cut = lp[part].min()
        cand = np.flatnonzero(lp >= cut)
        order = cand[np.lexsort((cand, -lp[cand]))][:k]
        top = tuple((int(i), float(lp[i])) for i in order)
    return TokenLogprob(int(tok), float(lp[tok]), top)
