"""The sampling tests of speculative decoding (reference and compiled): the test's sizes, the exact float64
distributions, Pearson's chi-square p-value (scipy is no dependency of the project: the survival function comes
from torch's regularised incomplete gamma), the broken acceptance rules each test must catch and the sampled
rule's own check (`first_token_pvalue`)."""

from __future__ import annotations

import numpy as np
import torch

from v4compile.speculation import sample

SMALL_VOCAB, N, ALPHA = 8, 400, 1e-3  # chi-square at significance 0.001 (df = 7 when no bin is merged)


def probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The sampling distribution of `logits [..., V]` at `temperature` > 0 in float64: the tests' exact
    marginals (the sampler itself computes `speculation.softmax32`)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test of counts against expected counts (k - 1 degrees of freedom): the survival
    function of the chi-square distribution is the regularised upper incomplete gamma Q(df / 2, stat / 2)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def always_accept(drafts, target, draft_probs, rng, temperature):
    """A broken `speculation.accept`: every draft survives (the output is then the draft's distribution)."""
    return len(drafts), sample(target[-1], temperature, rng)[0]


RATIO_TEST = "u[b, a + 1] * q[a + 1, ids[b, a + 1]] < p[a, ids[b, a + 1]]"  # `sample_accept`'s min(1, p/q)


def inverted_ratio():
    """A broken `speculation.sample_accept`: draft j survives with probability min(1, q/p) (its own source with
    the ratio test's two sides swapped)."""
    import inspect

    from v4compile import speculation

    src = inspect.getsource(speculation.sample_accept)
    assert src.count(RATIO_TEST) == 1
    ns = dict(vars(speculation))
    exec(compile(src.replace(RATIO_TEST, "u[b, a + 1] * p[a, ids[b, a + 1]] < q[a + 1, ids[b, a + 1]]"),
                 speculation.__file__, "exec"), ns)
    return ns["sample_accept"]


def first_token_pvalue(rule, n: int = 4 * N) -> float:
    """`n` sampled steps of the acceptance `rule` (`speculation.sample_accept`'s signature) on one seeded
    verify of 2 drafts (V = SMALL_VOCAB, temperature 0.7), each step's drafts drawn from their own q with the
    sampler's own draw: the p-value of the first emitted token's counts (draft 1 if it survives, else the
    drawn token) against the target's p_0 (float64)."""
    from v4compile.speculation import inverse_cdf, softmax32, uniforms

    rng = np.random.default_rng(0)
    t = np.float32(0.7)
    logits = (rng.normal(size=(1, 3, SMALL_VOCAB)) * 1.5).astype(np.float32)
    q = softmax32((rng.normal(size=(3, SMALL_VOCAB)) * 1.5).astype(np.float32), t)[None]
    first = []
    for _ in range(n):
        d = [inverse_cdf(q[0, j], rng.random(dtype=np.float32)) for j in (1, 2)]
        nxt, _ = rule(logits, np.array([[0, *d]]), np.arange(3)[None], q, uniforms(rng, 2)[None], np.array([t]))
        first.append(int(nxt[0, 0]))
    return chisquare_pvalue(np.bincount(first, minlength=SMALL_VOCAB), probs(logits[0, 0], 0.7) * n)
