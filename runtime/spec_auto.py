"""`draft_tokens="auto"`: the number of drafts k chosen per step (`speculative.SpecStep`), 0 = a plain decode step.

The rule. For the step's batch bucket B and each k in 0..K (K: the artifact's `draft_tokens`, the verify
functions' lanes - 1), the expected tokens per unit of time are

    E(k) = (1 + sum_{j <= k} prod_{i <= j} a_i) / c(B, k)

with a_j the running acceptance of draft position j (draft j accepted given drafts 1..j-1 were: an exponential
moving average over the sequences' offers, `ALPHA` the weight of each new one, starting at `PRIOR`; the
session's, carried from one generate call or request to the next) and c(B, k) the cost of a step that
verifies the drafts held and drafts k (c(B, 0): the plain decode step). The step takes the largest E(k) (the
smaller k on a tie), but plain decoding unless that beats E(0) by `MARGIN`: speculation has costs outside its
steps (the MTP block over each prompt, a request's first drafts, the probes below) and the step costs are
measured on a shared machine, so a marginal gain is not worth them. k is a choice of how many drafts to make
for the next step; the verify then checks whatever drafts each sequence holds, so the ids are those of plain
decoding whatever k is chosen (greedy: the verify's argmax decides every token).

Costs on the cpu device: measured in the generation itself, every k the same way. Each step's CPU time (the
whole step: its graph calls and its Python) is a sample of c(B, k) for the k it ran; c(B, k) is the median of
the last `WINDOW` samples of that k (a median, no outlier gate and no moving average: a wrong estimate is
replaced by `WINDOW // 2 + 1` steps of the truth, never locked in). A step that verifies drafts without
making any (k = 0 chosen while drafts are held: neither a plain step nor a k > 0 one) is no sample. The
prior, until a k has samples, is the bucket's isolated measurement (`measure`, at its first step in the
session: the process's CPU time, the median of `RUNS` interleaved rounds of the decode graph and of the
one-call step graphs drafting k, `codegen/onnx_spec.py`, on live lanes whose writes are dropped), scaled to the
generation by the median ratio of sample to prior over the k that have samples: an isolated graph misses the
step's host work and a real text's pool and experts, and the k compared are then both in situ or both
scaled alike. Elsewhere (the C runtime's devices) the costs are modeled from the artifact's compile report
(`report.json` `speculative_step`: the modeled verify / decode cost ratio of a GPU target at the drafts it
models, interpolated linearly in k, batch 1 figures for every bucket) and not refined (a step's CPU time
there is not its cost); an artifact without them drafts K every step.

Probes, so that the k not chosen are seen again (a machine, a batch or a text that changes). While plain
decoding is chosen the acceptance does not move: after `PROBE` plain steps in a row one step drafts the
rule's best k > 0 (its step a sample of that k). While drafting is chosen (cpu device) c(B, 0) gets no
samples: after `PROBE_SPEC` drafting steps in a row the steps are plain until one plain decode step is timed
(the first verifies the drafts held, without new ones). Each probe after which the rule keeps its side
doubles that side's interval (up to `PROBE_MAX` times), a change of side resets both: a settled choice
costs ever fewer probes. Counters, samples and acceptance are the session's, carried from one generate call
or request to the next. A step whose sequences hold no drafts at k = 0 is the plain decode step itself, and
sequences admitted while the rule (or a probe) says 0 for their bucket are prefilled without the MTP block
(plain steps do not write its ring either: a later probe's drafts may be the worse for it, never the ids)
and get no first drafts.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

ALPHA = 0.1  # the weight of each new offer in the running acceptance
PRIOR = 0.8  # the running acceptance before any offer (the V3 report's 85 %, a little below)
RUNS = 15  # timed rounds over the graphs when measuring a bucket's prior costs (each graph's median)
WINDOW = 5  # the in-generation steps of each k whose median is its c(B, k)
MARGIN = 0.2  # drafting must beat plain decoding by this much per unit time (see the module doc)
WARM = 2  # untimed rounds first (a session's first runs plan its memory)
LIVE_POS = 40  # the measured steps' first position: past the window and a few compressed windows, as mid-text
PROBE = 64  # plain steps in a row after which one step drafts again
PROBE_SPEC = 16  # drafting steps in a row after which plain steps until one is timed (cpu device)
PROBE_MAX = 16  # a probe interval doubles at most to this many times its start


@dataclass
class Loop:
    """The session's probe state for one K (carried across generate calls, as the samples are)."""

    plain_run: int = 0  # plain steps in a row
    spec_run: int = 0  # drafting steps in a row
    plain_every: int = PROBE  # the current intervals (doubled while probes confirm the choice)
    spec_every: int = PROBE_SPEC
    want_plain: bool = False  # a plain probe under way: plain steps until one is timed
    pending: str | None = None  # the side ("plain" / "spec") a finished probe was taken from: the next choice is its verdict


class AutoK:
    """The per-step choice of k for a `SpecStep` (its `k` is K here)."""

    def __init__(self, step, K: int):
        self.step, self.K = step, K
        # the session's running acceptance, samples and probe state, carried from one generate call to the next
        self.known = known = step.s.spec_auto if step is not None else {}
        self.rates = known.setdefault(("rates", K), [PRIOR] * K)
        self.loop: Loop = known.setdefault(("loop", K), Loop())
        self.priors: dict[int, list[float] | None] = {}  # bucket -> the isolated (or modeled) c(B, 0..K)
        self.measured: dict[int, bool] = {}  # bucket -> its priors are CPU seconds (then refined in situ)
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

    def _samples(self, B: int) -> list[deque]:
        return self.known.setdefault(("seen", B, self.K), [deque(maxlen=WINDOW) for _ in range(self.K + 1)])

    def cost(self, B: int) -> list[float] | None:
        """c(B, 0..K): each k's in-generation median, the prior (scaled to the generation) where it has none."""
        prior = self.prior(B)
        if prior is None or not self.measured.get(B):
            return prior
        seen = {k: statistics.median(q) for k, q in enumerate(self._samples(B)) if q}
        if not seen:
            return prior
        scale = statistics.median(seen[k] / prior[k] for k in seen)
        return [seen[k] if k in seen else prior[k] * scale for k in range(self.K + 1)]

    def _best(self, B: int, ks) -> int:
        c = self.cost(B)
        if c is None:
            return self.K
        return max(ks, key=lambda k: (self.expected(k) / c[k], -k))

    def best(self, B: int) -> int:
        """The rule's k for bucket `B` (no probe, nothing recorded)."""
        k = self._best(B, range(self.K + 1))
        if k == 0:
            return 0
        c = self.cost(B)
        return k if c is None or self.expected(k) / c[k] > (1 + MARGIN) / c[0] else 0

    def first(self, B: int) -> int:
        """The drafts of sequences admitted now: the rule's, none during a plain probe."""
        return 0 if self.loop.want_plain else self.best(B)

    def pick(self, B: int) -> int:
        """This step's k: the rule's, or a probe's (module doc)."""
        L = self.loop
        if L.want_plain:
            k = 0
        else:
            k = self.best(B)
            if L.pending is not None:  # the first choice after a probe: kept its side, or changed it
                if (k > 0) == (L.pending == "spec"):
                    if L.pending == "spec":
                        L.spec_every = min(2 * L.spec_every, PROBE_SPEC * PROBE_MAX)
                    else:
                        L.plain_every = min(2 * L.plain_every, PROBE * PROBE_MAX)
                else:
                    L.spec_every, L.plain_every = PROBE_SPEC, PROBE
                L.pending = None
        L.plain_run, L.spec_run = (L.plain_run + 1, 0) if k == 0 else (0, L.spec_run + 1)
        if not L.want_plain and k == 0 and L.plain_run > L.plain_every:
            k, L.plain_run, L.pending = self._best(B, range(1, self.K + 1)), 0, "plain"
        elif k > 0 and self.measured.get(B) and L.spec_run > L.spec_every:
            k, L.spec_run, L.want_plain, L.pending = 0, 0, True, "spec"
        self.chosen.append(k)
        return k

    def timed(self, B: int, k: int | None, seconds: float) -> None:
        """A step of bucket `B` took `seconds` of CPU time: a plain decode step (k = 0), a step drafting k, or
        (None) a verify of the drafts held without new ones, which is no sample."""
        if k is None:
            return
        if k == 0:
            self.loop.want_plain = False
        if self.measured.get(B):
            self._samples(B)[k].append(seconds)

    def prior(self, B: int) -> list[float] | None:
        if B not in self.priors:
            # measured once per session and bucket (a generate call, a request, reuses them)
            key = ("costs", B, self.K)
            if key not in self.known:
                c = measure(self.step, B, self.K)
                self.known[key] = (c, True) if c is not None else (modeled(self.step.s, self.K), False)
                log.debug("speculation auto: bucket %d prior step costs %s", B, self.known[key][0])
            self.priors[B], self.measured[B] = self.known[key]
        return self.priors[B]


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
