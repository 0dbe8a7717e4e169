"""Speculative decoding's host-side rules (numpy only, so the reference model and the runtime session
share one copy): which cache entries a verify step can overwrite (the undo log's index), the acceptance
rule, and the acceptance statistics.

A verify step feeds `1 + k` lanes per sequence at positions `L .. L + k`: the last accepted token and
`k` drafts. It writes every kind of decode state at those positions; `accept` then decides how many
drafts `a` survive, and every entry written for a rejected position (`> L + a`) is put back to what it
held before the step (`clobbered` says which entries a position writes). See `v4compile/model/
speculative.py` for the reference decoder and the state-by-state account.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import InputError

MAX_DRAFT_TOKENS = 7  # < the smallest ring (a CSA compressor's 2 x ratio = 8 slots for V4): see `check_draft_tokens`


def check_draft_tokens(k, rings: int) -> int:
    """`k` drafts need every ring (window, compressor state) to have more than k slots, so that no slot is
    written twice by one verify step (the undo log restores one saved value per slot)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= min(MAX_DRAFT_TOKENS, rings - 1):
        raise InputError("draft_tokens out of range", expected=f"an integer in 1..{min(MAX_DRAFT_TOKENS, rings - 1)}",
                         found=repr(k)[:40])
    return int(k)


def clobbered(key: str, slots: int, ratio: int, q: int) -> int | None:
    """Index along the sequence axis (dim 1 of the reference cache tensor) that decoding position `q` writes in
    a state tensor `key` of `slots` entries: the window ring and the compressor rings slot `q % slots`;
    compressed rows (`rows`, `index_rows`) the window `q // ratio` when `q` closes it (else nothing)."""
    if key in ("rows", "index_rows"):
        w = q // ratio
        return w if (q + 1) % ratio == 0 and w < slots else None
    return q % slots


def probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The sampling distribution of `logits [..., V]` at `temperature` > 0 (float64)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(len(p), p=p / p.sum()))


def accept(drafts: list[int], target: np.ndarray, draft_probs: np.ndarray | None, rng: np.random.Generator | None,
           temperature: float) -> tuple[int, int]:
    """How many of `drafts` (k ids) survive, and the token that follows the last survivor.

    `target [k + 1, V]`: the main model's logits at the verify lanes (lane j predicts the token after draft j).
    Greedy (`temperature` 0): draft j survives while it equals lane j - 1's argmax; the next token is the argmax
    of the first lane that disagrees (or of lane k). Sampling: draft j (drawn from `draft_probs[j]`) survives
    with probability min(1, p/q); at the first rejection the next token is drawn from the normalised residual
    max(0, p - q); if all survive, from lane k's p. The output is then distributed exactly as the target's."""
    k = len(drafts)
    if temperature == 0:
        best = target.argmax(-1)
        a = 0
        while a < k and int(best[a]) == drafts[a]:
            a += 1
        return a, int(best[a])
    p = probs(target, temperature)
    for j, d in enumerate(drafts):
        q = draft_probs[j]
        if q[d] > 0 and rng.random() < min(1.0, p[j, d] / q[d]):
            continue
        residual = np.maximum(p[j] - q, 0.0)
        return j, draw(residual if residual.sum() > 0 else p[j], rng)
    return k, draw(p[k], rng)


@dataclass
class Acceptance:
    """Per draft position j: how often it was offered (drafts 1..j-1 accepted) and accepted."""

    k: int
    offered: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0

    def __post_init__(self):
        self.offered = [0] * self.k
        self.accepted = [0] * self.k

    def add(self, a: int, emitted: int, offered: int | None = None) -> None:
        """One step: `a` of `offered` drafts (default k; fewer near a sequence's end) accepted."""
        self.steps += 1
        self.tokens += emitted
        for j in range(min(a + 1, self.k if offered is None else offered)):
            self.offered[j] += 1
            self.accepted[j] += j < a

    def rates(self) -> list[float]:
        """The acceptance rate of each draft position, given the drafts before it were accepted."""
        return [a / o if o else 0.0 for a, o in zip(self.accepted, self.offered)]

    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0
