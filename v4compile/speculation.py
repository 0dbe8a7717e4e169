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


# The sampled speculative step's arithmetic, defined once: the host's two-call path and the `spec_sample` op's
# reference (the one-call step on the C runtime) run these very functions, so the two are bit-identical on the
# host device by construction. float32, every sum left to right along V (np.cumsum: a sequential accumulation),
# the random numbers float32 uniforms in [0, 1) drawn from the sequence's generator before the step. The op's
# GPU kernel computes the same formulas, but its exp and its chunked sums round differently: it agrees to fp32
# rounding, not bit for bit (`codegen/kernels/spec_accept.py`).

def uniforms(rng: np.random.Generator, k: int) -> np.ndarray:
    """The random numbers of one sampled step with `k` drafts, drawn before it: `[k + 1]` float32, [0] for the
    token drawn after the last survivor, [j] for draft j's ratio test."""
    return rng.random(k + 1, dtype=np.float32)


def softmax32(logits: np.ndarray, temperature) -> np.ndarray:
    """softmax(logits / t) over the last axis in float32: z = l / t, e = exp(z - max z), e / (e's left-to-right
    sum). `temperature`: a float32 scalar or one per row (broadcast as `[..., 1]`)."""
    z = np.asarray(logits, dtype=np.float32) / np.asarray(temperature, dtype=np.float32)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / np.cumsum(e, axis=-1, dtype=np.float32)[..., -1:]


def inverse_cdf(w: np.ndarray, u) -> int:
    """The id drawn from the non-negative weights `w [V]` (float32, some positive) with the uniform `u`: the
    first id whose left-to-right cumulative weight exceeds u x (the total), never one of weight 0."""
    c = np.cumsum(w, dtype=np.float32)
    i = int((c <= np.float32(u) * c[-1]).sum())
    return min(i, len(w) - 1 - int(np.argmax(w[::-1] > 0)))  # u x total may round up to the total


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """A token drawn from softmax32(logits / t) with one uniform from `rng`, and that distribution (a
    draft's q)."""
    p = softmax32(logits, np.float32(temperature))
    return inverse_cdf(p, rng.random(dtype=np.float32)), p


def sample_accept(logits: np.ndarray, ids: np.ndarray, pos: np.ndarray, draft_probs: np.ndarray,
                  u: np.ndarray, temperature: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The speculative acceptance of a verify step, sampled or greedy per sequence (the `spec_sample` op).

    `logits [B, T, V]`, lane j predicting the token after lane j's id; `ids`, `pos [B, T]`: lane 0 the last
    accepted token, lane j >= 1 draft j (pos -1: no draft); `draft_probs [B, T, V]`: lane j's draft's q;
    `u [B, T]` (`uniforms`); `temperature [B]`. Temperature 0: the greedy rule (`spec_accept`: every lane's
    argmax in `next_ids`). Otherwise, with p_j = softmax32(lane j): draft j survives while every earlier one
    did and u[j] x q_j(d_j) < p_{j-1}(d_j) (probability min(1, p/q)); after the last survivor a, the token is
    drawn with u[0] (`inverse_cdf`) from max(0, p_a - q_{a+1}) if draft a + 1 was rejected (p_a where that is
    all 0), else from p_a; `next_ids` = the surviving drafts, that token, then 0. Returns (next_ids, kept_pos:
    pos on lanes 0..a, -1 after)."""
    ids, pos = np.asarray(ids), np.asarray(pos)
    B, T = ids.shape
    nxt, kept = np.zeros((B, T), dtype=np.int64), np.full((B, T), -1, dtype=np.int64)
    for b in range(B):
        t = np.float32(temperature[b])
        if t == 0:
            best = np.argmax(logits[b], axis=-1)
            a = 0
            while a + 1 < T and pos[b, a + 1] >= 0 and best[a] == ids[b, a + 1]:
                a += 1
            nxt[b], kept[b, : a + 1] = best, pos[b, : a + 1]
            continue
        p = softmax32(logits[b], t)
        q = np.asarray(draft_probs[b], dtype=np.float32)
        a = 0
        while a + 1 < T and pos[b, a + 1] >= 0 and u[b, a + 1] * q[a + 1, ids[b, a + 1]] < p[a, ids[b, a + 1]]:
            a += 1
        w = p[a]
        if a + 1 < T and pos[b, a + 1] >= 0:
            r = np.maximum(p[a] - q[a + 1], np.float32(0))
            w = r if (r > 0).any() else w
        nxt[b, :a] = ids[b, 1: a + 1]
        nxt[b, a] = inverse_cdf(w, u[b, 0])
        kept[b, : a + 1] = pos[b, : a + 1]
    return nxt, kept


def accept(drafts: list[int], target: np.ndarray, draft_probs: np.ndarray | None, rng: np.random.Generator | None,
           temperature: float) -> tuple[int, int]:
    """How many of `drafts` (k ids) survive, and the token that follows the last survivor.

    `target [k + 1, V]`: the main model's logits at the verify lanes (lane j predicts the token after draft j).
    Greedy (`temperature` 0): draft j survives while it equals lane j - 1's argmax; the next token is the argmax
    of the first lane that disagrees (or of lane k). Sampling (`sample_accept`, with k + 1 `uniforms` drawn from
    `rng`): draft j (drawn from `draft_probs[j]`) survives with probability min(1, p/q); at the first rejection
    the next token is drawn from the normalised residual max(0, p - q); if all survive, from lane k's p. The
    output is then distributed exactly as the target's."""
    k = len(drafts)
    if temperature == 0:
        best = target.argmax(-1)
        a = 0
        while a < k and int(best[a]) == drafts[a]:
            a += 1
        return a, int(best[a])
    V = target.shape[-1]
    q = np.zeros((1, k + 1, V), dtype=np.float32)
    if k:
        q[0, 1:] = draft_probs
    nxt, kept = sample_accept(target[None], np.array([[0, *drafts]]), np.arange(k + 1)[None], q,
                              uniforms(rng, k)[None], np.array([temperature], dtype=np.float32))
    return survivors(nxt[0], kept[0])


def survivors(next_ids: np.ndarray, kept_pos: np.ndarray) -> tuple[int, int]:
    """(a, the token after the last survivor) from one sequence's acceptance results (`sample_accept`'s row,
    or the `spec_sample` op's): a = its kept lanes less lane 0."""
    a = int((np.asarray(kept_pos) >= 0).sum()) - 1
    return a, int(next_ids[a])


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
