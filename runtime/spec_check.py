"""A device's sampled speculative step against the host's rule (`scripts/gpu_check.py`): one `spec_s<B>` call's kept
lanes and ids against `speculation.sample_accept` run on that call's own verify logits with the same drafts, draft
probabilities q, uniforms and temperatures.

    sampled_differences(logits, ids, pos, draft_probs, uniforms, temperature, next_ids, kept_pos) -> list[dict]

The GPU kernel (`codegen/kernels/spec_accept.py`) computes the rule's float32 formulas with its own division, exp
and chunked sums where the host sums left to right: the two p agree to float32 rounding, not bit for bit, so one
decision may differ where the step's uniform falls within that rounding of its boundary (a ratio test's
u x q(d) = p(d); the draw's u x total = a cumulative weight). A difference is told apart from a fault by taking the
first decision the two make differently again in float64 on the same logits (z = logits / t in float32, as both
sides compute it, then exp and sums in float64): it is excused only when the float64 margin of that decision is
within `tolerance(V, zmax)`, and when the device's id has a positive weight; anything else is a fault. Greedy
sequences (temperature 0: argmax with ties to the lowest id, exact on both sides) and the surviving drafts' ids
must be equal; padding lanes (position -1) must keep nothing.

The tolerance, in u = 2^-24 (a float32 rounding), the two sides' errors added, each against float64 (V the
vocabulary, zmax the largest |z| of the lane):
* z = l / t and x = z - max z: the device's division within 2 ulp (CUDA's `div.full.f32`), the host's correctly
  rounded, each subtraction half an ulp: |dx| <= 10 zmax u, which is exp(x)'s relative error it causes;
* exp: the device's within 2 ulp plus its argument's scaling to base 2 (x log2 e rounded: |x| u <= 2 zmax u), the
  host's within 1 ulp: (6 + 2 zmax) u;
* the normalising sum of V positive terms: <= (V - 1) u each (left to right; the device's chunked sums have the
  smaller bound), and p = e / s within 2 ulp plus half an ulp: 2 V u + 5 u;
* the draw's cumulative weights (absolute, in units of sum p = 1): <= (V - 1) u each; the residual's max(0, p - q)
  adds half an ulp of p each: 2 V u + 1 u.
Together < (4 V + 12 zmax + 12) u; `tolerance` takes (4 V + 16 zmax + 32) u. It bounds a ratio test's relative
margin |u q(d) - p(d)| / p(d) and the draw's absolute margin |u x total - C_j| (C_j the float64 cumulative
weights, p summing to 1). tiny (V = 512, zmax ~ 10): 1.4e-4; a wrong rule moves a decision by far more (the
kernel tests' broken variants: the ratio inverted, the residual's q ignored, the drawn id one too far: a whole
token's weight, caught wherever that weight exceeds the tolerance).
"""

from __future__ import annotations

import numpy as np

from v4compile.speculation import sample_accept

U = 2.0 ** -24


def tolerance(vocab: int, zmax: float) -> float:
    """The largest float64 margin of a decision that float32 rounding may flip between the device and the host
    (module doc)."""
    return (4 * vocab + 16 * zmax + 32) * U


def _p64(logits: np.ndarray, t: float) -> tuple[np.ndarray, float]:
    """softmax(z) per lane in float64, z = logits / t in float32 as both sides compute it; and max |z|."""
    z = np.asarray(logits, dtype=np.float32) / np.float32(t)
    z64 = z.astype(np.float64)
    e = np.exp(z64 - z64.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True), float(np.abs(z64[np.isfinite(z64)]).max(initial=0.0))


def _kept(kept_row: np.ndarray) -> int:
    return int((np.asarray(kept_row) >= 0).sum()) - 1


def _ratio_margin(p: np.ndarray, ids, q, u, j: int) -> float:
    """Draft j's ratio test u x q(d) < p_{j-1}(d) in float64: |u q - p| / p (u q the float32 product both take)."""
    d = int(ids[j])
    uq = float(np.float32(u[j]) * np.float32(q[j, d]))
    pd = float(p[j - 1, d])
    return abs(uq - pd) / pd if pd > 0 else float("inf")


def _draw_margin(p: np.ndarray, ids, pos, q, u, a: int, host: int, dev: int) -> float:
    """The draw after lane a (from max(0, p_a - q_{a+1}) if draft a + 1 was offered and that is not all 0, else
    p_a) in float64: the largest |u x total - C_j| over the boundaries between ids `host` and `dev`; inf where
    the device's id has no weight."""
    T = len(ids)
    w = p[a]
    if a + 1 < T and pos[a + 1] >= 0:
        r = np.maximum(p[a] - np.asarray(q[a + 1], dtype=np.float64), 0.0)
        w = r if (r > 0).any() else w
    if not w[dev] > 0:
        return float("inf")
    c = np.cumsum(w)
    x = float(np.float32(u[0])) * c[-1]
    lo, hi = sorted((host, dev))
    return float(np.abs(x - c[lo:hi]).max())


def sampled_differences(logits, ids, pos, draft_probs, uniforms, temperature, next_ids, kept_pos) -> list[dict]:
    """Every sequence whose device result (`next_ids`, `kept_pos` [B, T]) differs from `sample_accept` on the same
    inputs (`logits` [B, T, V] the device's verify logits): {sequence, what (`kept lanes`, `id`, `surviving
    drafts`, `padding`), host, device, margin, tolerance, excused} (margin and tolerance where a float32 boundary
    can explain it; `excused` only when the float64 margin is within the tolerance)."""
    logits = np.asarray(logits, dtype=np.float32)
    ids, pos = np.asarray(ids), np.asarray(pos)
    next_ids, kept_pos = np.asarray(next_ids), np.asarray(kept_pos)
    want_next, want_kept = sample_accept(logits, ids, pos, draft_probs, uniforms, temperature)
    V = logits.shape[-1]
    out = []
    for b in range(ids.shape[0]):
        t = float(np.float32(temperature[b]))
        a_host, a_dev = _kept(want_kept[b]), _kept(kept_pos[b])

        def diff(what, host, dev, margin=None, tol=None):
            out.append({"sequence": b, "what": what, "host": host, "device": dev,
                        "margin": margin, "tolerance": tol,
                        "excused": margin is not None and tol is not None and margin <= tol})

        if pos[b, 0] < 0:  # padding: nothing kept, its ids unused
            if not np.array_equal(kept_pos[b], want_kept[b]):
                diff("padding", want_kept[b].tolist(), kept_pos[b].tolist())
            continue
        # the device's kept lanes must be a prefix of the positions, -1 after (else no margin explains them)
        if a_dev < 0 or not np.array_equal(kept_pos[b], np.where(np.arange(len(pos[b])) <= a_dev, pos[b], -1)):
            diff("kept lanes", want_kept[b].tolist(), kept_pos[b].tolist())
            continue
        if t == 0:
            if a_host != a_dev or not np.array_equal(next_ids[b], want_next[b]):
                diff("greedy", want_next[b].tolist(), next_ids[b].tolist())
            continue
        p, zmax = _p64(logits[b], t)
        tol = tolerance(V, zmax)
        if a_host != a_dev:  # the first ratio test taken differently: draft min(a) + 1
            j = min(a_host, a_dev) + 1
            diff("kept lanes", a_host, a_dev, _ratio_margin(p, ids[b], draft_probs[b], uniforms[b], j), tol)
            continue
        if not np.array_equal(next_ids[b, :a_dev], ids[b, 1: a_dev + 1]):
            diff("surviving drafts", ids[b, 1: a_dev + 1].tolist(), next_ids[b, :a_dev].tolist())
        elif next_ids[b, a_dev] != want_next[b, a_dev]:
            h, g = int(want_next[b, a_dev]), int(next_ids[b, a_dev])
            diff("id", h, g, _draw_margin(p, ids[b], pos[b], draft_probs[b], uniforms[b], a_dev, h, g), tol)
    return out
