"""`draft_tokens="auto"`: the number of drafts k chosen per step (`speculative.SpecStep`), 0 = a plain decode step.

The rule. For the step's batch bucket B and each k in 0..K (K: the artifact's `draft_tokens`, the verify
functions' lanes - 1), the expected tokens per unit of time are

    E(k) = (1 + sum_{j <= k} prod_{i <= j} a_i) / c(B, k)

with a_j the running acceptance of draft position j (draft j accepted given drafts 1..j-1 were: an exponential
moving average over the sequences' offers, `ALPHA` the weight of each new one, starting at `PRIOR`; the
session's, carried from one generate call or request to the next) and
c(B, k) the cost of a step that verifies k drafts and drafts k (c(B, 0): the decode step). The step takes the
largest E(k) (the smaller k on a tie), but plain decoding unless that beats E(0) by `MARGIN`: speculation has
costs outside its steps (the MTP block over each prompt, a request's first drafts) and the step costs are
measured on a shared machine, so a marginal gain is not worth them. k is a choice of how many drafts to make for the next step; the
verify then checks whatever drafts each sequence holds, so the ids are those of plain decoding whatever k
is chosen (greedy: the verify's argmax decides every token).

Costs. On the cpu device they are measured at the bucket's first step of the session (`measure`: the
process's CPU time, the median of `RUNS` interleaved rounds of the decode graph and of the one-call step
graphs drafting k, `codegen/onnx_spec.py`, on live lanes whose writes are dropped, never stored), then each
step's own CPU time moves its c(B, k) (an exponential moving average, `BETA`: a step in a generation costs
its host work too, and its graph on a real text's pool and experts, which an isolated run misses). Elsewhere
(the C runtime's devices) they are modeled from the artifact's compile report (`report.json`
`speculative_step`: the modeled verify / decode cost ratio of a GPU target at the drafts it models,
interpolated linearly in k, batch 1 figures for every bucket); an artifact without them drafts K every step.

k = 0 writes nothing of the MTP block's ring (a plain decode step), so the estimates a_j do not move while it
is chosen: after `PROBE` plain steps in a row one step drafts one token (the cheapest probe: a verify of one
draft follows), so a machine or a text that changes is seen again. A step whose sequences hold no drafts at
k = 0 is the plain decode step itself, and sequences admitted while the rule says 0 get no first drafts.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import numpy as np

log = logging.getLogger(__name__)

ALPHA = 0.1  # the weight of each new offer in the running acceptance
PRIOR = 0.8  # the running acceptance before any offer (the V3 report's 85 %, a little below)
RUNS = 15  # timed rounds over the graphs when measuring a bucket's costs (each graph's median)
BETA = 0.2  # the weight of each step's own CPU time in its c(B, k)
MARGIN = 0.2  # drafting must beat plain decoding by this much per unit time (see the module doc)
OUTLIER = 4.0  # a step over this many times its c(B, k) is not taken into it
WARM = 2  # untimed rounds first (a session's first runs plan its memory)
LIVE_POS = 40  # the measured steps' first position: past the window and a few compressed windows, as mid-text
PROBE = 64  # plain steps in a row after which one step drafts again


class AutoK:
    """The per-step choice of k for a `SpecStep` (its `k` is K here)."""

    def __init__(self, step, K: int):
        self.step, self.K = step, K
        # the session's running acceptance, carried from one generate call (or request) to the next
        known = step.s.spec_auto if step is not None else {}
        self.rates = known.setdefault(("rates", K), [PRIOR] * K)
        self.costs: dict[int, list[float] | None] = {}  # bucket -> c(B, 0..K)
        self.measured: dict[int, bool] = {}  # bucket -> its costs are CPU seconds (refined by `timed`)
        self.plain_run = 0
        self.chosen: list[int] = []  # each step's k (the bench and the tests read it)

    def observe(self, a: int, offered: int) -> None:
        """One sequence's verify: `a` of its `offered` drafts accepted (position j offered when j <= a + 1)."""
        for j in range(min(a + 1, offered, self.K)):
            self.rates[j] += ALPHA * ((1.0 if j < a else 0.0) - self.rates[j])

    def expected(self, k: int) -> float:
        out, run = 1.0, 1.0
        for a in self.rates[:k]:
            run *= a
            out += run
        return out

    def best(self, B: int) -> int:
        """The rule's k for bucket `B` (no probe, nothing recorded)."""
        c = self.cost(B)
        if c is None:
            return self.K
        k = max(range(self.K + 1), key=lambda k: (self.expected(k) / c[k], -k))
        return k if self.expected(k) / c[k] > (1 + MARGIN) / c[0] else 0

    def pick(self, B: int) -> int:
        """This step's k: the rule's, but one draft after `PROBE` plain steps in a row."""
        k = self.best(B)
        self.plain_run = self.plain_run + 1 if k == 0 else 0
        if self.plain_run > PROBE:
            k, self.plain_run = 1, 0
        self.chosen.append(k)
        return k

    def timed(self, B: int, k: int, seconds: float) -> None:
        """A step of bucket `B` at `k` took `seconds` of CPU time: c(B, k) moves toward it (`BETA`)."""
        c = self.costs.get(B)
        if c is not None and self.measured.get(B) and seconds < OUTLIER * c[k]:  # not a one-off (a session made)
            c[k] += BETA * (seconds - c[k])

    def cost(self, B: int) -> list[float] | None:
        if B not in self.costs:
            # measured once per session and bucket (a generate call, a request, reuses them)
            known, key = self.step.s.spec_auto, ("costs", B, self.K)
            if key not in known:
                c = measure(self.step, B, self.K)
                known[key] = (c, True) if c is not None else (modeled(self.step.s, self.K), False)
                log.debug("speculation auto: bucket %d step costs %s", B, known[key][0])
            self.costs[B], self.measured[B] = known[key]
        return self.costs[B]


def _lanes(session, B: int, T: int) -> dict[str, np.ndarray]:
    """Step inputs with every lane live (positions LIVE_POS .. + T - 1 of slot b, every block 0, seeded ids): run
    held and never stored, so they change nothing, and cost what a live step costs (padding lanes may cost
    less)."""
    start = min(LIVE_POS, session.max_context - 2 * T)
    # varied ids: one id everywhere would route every token to the same experts, cheaper than a text
    ids = np.random.default_rng(0).integers(0, session.vocab, (B, T), dtype=np.int64)
    return {"ids": ids,
            "pos": np.tile(np.arange(start, start + T, dtype=np.int64), (B, 1)),
            "block_table": np.zeros((B, session.blocks_per_seq), dtype=np.int32),
            "slot": np.arange(B, dtype=np.int32) % max(session.max_live, 1)}


def measure(step, B: int, K: int) -> list[float] | None:
    """c(B, 0..K) in seconds, measured (the cpu device's decode graph and one-call step graphs: `RUNS` rounds
    over all of them in turn after `WARM` untimed ones, the median of each), or None."""
    s, mtp = step.s, step.mtp
    if mtp is None or s.dp > 1 or not hasattr(s.backend, "run_held") or getattr(s.backend, "ranks", None) is not None:
        return None  # data parallel: a replica's step is not this process's alone
    names = [next((f for b, f in s.decode_fns if b == B), None)] + [mtp.fused(B, k) for k in range(1, K + 1)]
    if any(n is None for n in names):
        return None
    T = next(f[2] for f in step.fns if f[0] == B)
    # the bucket's other graphs (a verify without drafting, the separate draft calls) made now, not in a step
    s.backend.prepare([f for f in (f"verify_b{B}", next((n for b, n, _ in mtp.batch_fns if b == B), None))
                       if f in s.backend.functions()])
    ins = [_lanes(s, B, 1)] + [_lanes(s, B, T)] * K
    ts: list[list[float]] = [[] for _ in names]
    for r in range(RUNS + WARM):
        for i, (n, x) in enumerate(zip(names, ins)):
            t0 = time.process_time()
            s.backend.run_held(n, x)  # its writes dropped: nothing stored
            if r >= WARM:
                ts[i].append(time.process_time() - t0)
    return [statistics.median(t) for t in ts]


def modeled(session, K: int) -> list[float] | None:
    """c(0..K) relative to the decode step from the compile report's modeled verify step, or None."""
    try:
        rep = json.loads((session.art.path / "report.json").read_text())
    except (OSError, ValueError):
        return None
    models = rep.get("speculative_step") or {}
    rows = next((v for v in models.values() if v), None)
    if not rows:
        return None
    pts = sorted({(0, 1.0), *((int(m["draft_tokens"]), float(m["cost_ratio"])) for m in rows)})
    ks, cs = [p[0] for p in pts], [p[1] for p in pts]
    slope = (cs[-1] - cs[-2]) / max(ks[-1] - ks[-2], 1)  # past the last modeled k: the last segment's slope
    return [float(np.interp(k, ks, cs)) if k <= ks[-1] else cs[-1] + (k - ks[-1]) * slope for k in range(K + 1)]
