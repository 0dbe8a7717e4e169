"""`draft_tokens="auto"`: the number of drafts k chosen per step (`speculative.SpecStep`), 0 = a plain decode step.

The rule. For the step's batch bucket B and each k in 0..K (K: the artifact's `draft_tokens`, the verify
functions' lanes - 1), the expected tokens per unit of time are

    E(k) = (1 + sum_{j <= k} prod_{i <= j} a_i) / c(B, k)

with a_j the running acceptance of draft position j (draft j accepted given drafts 1..j-1 were: an exponential
moving average over the sequences' offers, `ALPHA` the weight of each new one, starting at `PRIOR`; the session's,
carried from one generate call or request to the next) and c(B, k) the cost of a step that verifies the drafts held
and drafts k (c(B, 0): the plain decode step). The side, drafting or plain decoding, is decided on the costs of the
last probe's verdict (below; before the first verdict, the costs of now): drafting where the best drafting k's E(k)
beats E(0) by `MARGIN` (`MARGIN_STAY` while the rule's last choice for the bucket drafted: a band, so that one
noisy measurement does not flip the choice back and forth); speculation has costs outside its steps (the MTP block
over each prompt, a request's first drafts, the probes below) and the step costs are measured on a shared machine,
so a marginal gain is not worth them. While drafting, the k is the largest E(k) on the costs of now (the smaller k
on a tie). So between verdicts the side changes only with the acceptance: the costs of the side that runs follow the
machine's load while the other side's stay as its last steps measured them, so load that rose over plain steps made
k = 3 look cheap (batch 8, bench logs: drafted at 0.8-0.9x plain), and load rising over drafting steps makes plain
decoding look cheap (`test_auto_sides_change_at_verdicts`: batch 1, 3.5 % under k = 3, plain ~3x as often). k is a
choice of how many drafts to make for the next step; the verify then checks whatever drafts each sequence holds, so
the ids are those of plain decoding whatever k is chosen (greedy: the verify's argmax decides every token).

The acceptance is taken from drafts the MTP block made with its whole window ring: a plain step, a verify without
drafting and a prefill without the block do not run the block over their positions (`SpecStep.skipped`), and the
drafts of the next `window` positions come from a ring with holes (a probe's after plain steps measured 0.42 at
batch 8 against 0.92, and kept the rule on plain decoding): their offers are not observed.

Costs on the cpu device: the bucket's isolated measurement (`measure`, at its first step in the session: the
process's CPU time, the median of `RUNS` interleaved rounds of the decode graph and of the one-call step graphs
drafting k on the lanes of k drafts, `codegen/onnx_spec.py`, on live lanes whose writes are dropped) gives each
k's prior, and steps in the generation scale them: each step's CPU time (the whole step, its graph calls and its Python, the same way for every
k) over its k's prior is a sample of that k's scale, and a k's scale is the lower third of its last `WINDOW` samples
(`low`: load on a shared machine only adds to a step's CPU time, so a burst of it over one k's steps must not make
another k look cheap; no outlier gate and no moving average, so a wrong prior is replaced by a few steps of the
truth, never locked in); a k without samples takes the scale interpolated linearly in k between the nearest sampled
ks either side (the nearest's past the last); between verdicts while drafting, the drafting ks among themselves
(plain's samples are then as old as the last plain probe: through them, a burst of load over the k = 3 steps made
the unsampled k = 1 look cheap, and the rule drafted k = 1, 2 at 1.04x plain, batch 1). The first `SETTLE` plain
steps after drafting ones (of any bucket: the process's caches) are no samples: they run 1.7x and 1.25x a settled
plain step (measured at batch 8), and a plain probe's verdict on them kept drafting (the drafting steps after plain
ones measured within 10 % of the next). While drafting, another drafting k whose last sample is over `STALE`
steps old is left out (interpolated again, so it runs again if that makes it the better k) and its window starts
afresh when it runs: one burst of load over a k's steps must not rule it out for good (at batch 1, where k = 2 and
k = 3 are a few % apart a step, a stale window held the rule at k = 2, 0.92x of k = 3). So a k's cost, once it has
run, is what its steps cost in this generation (the prior's only until then; c(B, 0) what the generation loop's own
plain steps cost), and the prior gives only the shape between the ks measured. One scale a k, not one for plain
steps and one for all drafting steps: an isolated graph misses the step's host work and a real text's pool and
experts, by an amount that differs between the decode graph and the step graphs and among the step graphs too (at
batch 8 plain steps run ~1.5x their isolated prior, drafting steps ~1.15x, and a k = 3 step ~3.1x a plain step in
the generation against 2.85x in isolation: one drafting scale, fed by k = 1 and k = 3 steps alike, made k = 3 look
2.2-2.6x plain and chose it, at 0.8-0.9x plain). A step that verifies drafts without making any (k = 0 chosen while
drafts are held: a plain step's cost it is not) is no sample. Elsewhere (the C runtime's devices) the costs are
modeled from the artifact's compile report (`report.json` `spec_step`: the bucket's one-call step modeled from the
compiled program for the device's target; else `speculative_step`: the modeled verify / decode cost ratio of a GPU
target at the drafts it models, interpolated linearly in k, batch 1 figures for every bucket) and not refined (a
step's CPU time there is not its cost); an artifact without them drafts K every step.

Probes, so that the side not chosen is seen again (a machine, a load, a batch or a text that changes). While
plain decoding is chosen the acceptance and the drafting costs do not move: after `PROBE` plain steps in a
row, the steps draft the k the rule rates best on the costs of now (not k = 1: each k's scale is its own only
once it runs, and k = 1's scale taken for K's kept the rule plain at batch 1 where k = 3 gave 1.35x plain)
until `PROBE_STEPS` of them are timed; where no drafting k
could beat plain decoding by `MARGIN` even with every draft accepted (on the last verdict's costs), the probe
waits for the longest interval instead (at batch 8 the probes were most of the rule's cost over plain decoding).
While drafting is chosen (cpu device) the plain cost does not move: after `PROBE_SPEC` drafting steps in a row
the steps are plain until `PROBE_STEPS` plain steps are timed (the first verifies the drafts held, without new
ones). A probe's side (plain, or every drafting k) starts its samples afresh, and its verdict (the rule's next
choice) is taken on the costs of now, compared close together on a machine whose load changes; the side is then
decided on those costs until the next verdict. Each probe after which the rule keeps its side makes that
side's interval `PROBE_GROW` times longer (up to `PROBE_MAX` times its start; doubling, to 16x, a probe of
~3 % of the steps at batch 8 even where plain decoding was settled: most of the rule's cost over plain decoding
there), a change of side resets both: a settled choice costs ever fewer
probes. Counters, samples, verdict costs and acceptance are the session's, carried from one generate call or
request to the next. The side, its probe counters and intervals, the samples and the verdict costs are each
bucket's own (`Loop`), as its costs are; the acceptance, the text's, is every bucket's (one probe state for
every bucket: a batch-8 run's last sequence alone, in bucket 1, drafted there and reset bucket 8's probe count,
so bucket 8 never probed again, `test_auto_buckets_apart`). A step whose sequences hold no drafts at k = 0 is
the plain decode step itself, and sequences admitted while the rule says 0 for their bucket are prefilled
without the MTP block (plain steps do not write its ring either: their drafts' offers are then not observed for a
window, above, never the ids) and get no first drafts; a plain probe from drafting does not change that
(`prefills_mtp`: a prompt prefilled without the block drafted at 0.7 for a window after).

The rule's own cost a plain step: while plain decoding is chosen after a verdict, the answer depends only on
the acceptance, which plain steps do not move, and the verdict's costs: a plain answer is kept while they are
what it was computed from (`AutoK.best`; the answers are the full rule's, `_rule`: a test compares them every
step).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from v4compile.artifact import spec_name

log = logging.getLogger(__name__)

ALPHA = 0.05  # the weight of each new offer in the running acceptance
PRIOR = 0.8  # the running acceptance before any offer (the V3 report's 85 %, a little below)
RUNS = 15  # timed rounds over the graphs when measuring a bucket's prior costs (each graph's median)
WINDOW = 5  # the in-generation samples of a k (0: plain steps) whose lower third (`low`) is its scale
MARGIN = 0.2  # drafting must beat plain decoding by this much per unit time to start (see the module doc)
MARGIN_STAY = 0.1  # and by this much to go on: a band, so that a step's noisy CPU time does not flip the choice
WARM = 2  # untimed rounds first (a session's first runs plan its memory)
LIVE_POS = 40  # the measured steps' first position: past the window and a few compressed windows, as mid-text
PROBE = 16  # plain steps in a row after which a drafting probe (the acceptance may have changed with the text)
PROBE_SPEC = 16  # drafting steps in a row after which a plain probe (cpu device)
PROBE_STEPS = 3  # the samples a probe takes (their least, `low`: one step's time can be a one-off)
STALE = 16  # while drafting, another drafting k's samples older than this many steps are left out
PROBE_GROW = 4  # a probe interval's growth after each probe that keeps the rule's side
PROBE_MAX = 64  # and its longest, this many times its start
SETTLE = 2  # plain steps after drafting ones that are no samples: they run 1.7x and 1.25x a settled one


@dataclass
class Loop:
    """The session's probe state for one bucket and K (carried across generate calls, as the samples are): the
    side and its verdicts are a bucket's, as its costs are (a batch's last sequence alone steps in bucket 1, and
    with one state for every bucket its steps counted toward bucket 8's probe and reset it)."""

    plain_run: int = 0  # plain steps in a row
    spec_run: int = 0  # drafting steps in a row
    plain_every: int = PROBE  # the current intervals (doubled while probes confirm the choice)
    spec_every: int = PROBE_SPEC
    steps: int = 0  # the steps picked (the age of a k's last sample, `STALE`)
    probe_k: int = 0  # the k of the probe under way (0: plain steps)
    probe_left: int = 0  # its samples still to take
    pending: str | None = None  # the side ("plain" / "spec") a probe was taken from: the first choice after it is its verdict
    drafting: bool = False  # the rule's last choice (not a probe's) drafted


@dataclass
class Settle:
    """The session's `SETTLE` state for one K, whatever the bucket: what a step after a drafting one costs is
    the process's (its caches), not a bucket's."""

    last_drafting: bool = False  # the last timed step was a drafting one
    settle: int = 0  # steps still to pass before a sample is taken


class AutoK:
    """The per-step choice of k for a `SpecStep` (its `k` is K here)."""

    def __init__(self, step, K: int):
        self.step, self.K = step, K
        # the session's running acceptance, samples and probe state, carried from one generate call to the next
        self.known = known = step.s.spec_auto if step is not None else {}
        self.rates = known.setdefault(("rates", K), [PRIOR] * K)
        self.settling: Settle = known.setdefault(("settle", K), Settle())
        self._loops: dict[int, Loop] = {}  # bucket -> `loop`
        self.priors: dict[int, list[float] | None] = {}  # bucket -> the isolated (or modeled) c(B, 0..K)
        self.measured: dict[int, bool] = {}  # bucket -> its priors are CPU seconds (then refined in situ)
        self._costs: dict[int, list[float] | None] = {}  # bucket -> c(B, 0..K) until its next sample (per step: cheap)
        self.chosen: list[int] = []  # each step's k (the bench and the tests read it)
        self._seen: dict[int, list[deque]] = {}  # bucket -> `_samples`
        self._lasts: dict[int, list[int]] = {}  # bucket -> `_last`
        self._side: dict[int, tuple] = {}  # bucket -> what its kept plain answer was computed from (`best`)

    def observe(self, a: int, offered: int) -> None:
        """One sequence's verify: `a` of its `offered` drafts accepted (position j offered when j <= a + 1)."""
        for j in range(min(a + 1, offered, self.K)):
            self.rates[j] += ALPHA * ((1.0 if j < a else 0.0) - self.rates[j])

    def expected(self, k: int) -> float:
        return self.gains()[k]

    def gains(self) -> list[float]:
        """E(0..K), the expected tokens of a step drafting k, in one pass over the acceptance."""
        out, e, run = [1.0], 1.0, 1.0
        for a in self.rates:
            run *= a
            e += run
            out.append(e)
        return out

    def loop(self, B: int) -> Loop:
        """Bucket `B`'s probe state and side (the session's; looked up once per bucket)."""
        got = self._loops.get(B)
        if got is None:
            got = self._loops[B] = self.known.setdefault(("loop", B, self.K), Loop())
        return got

    def _samples(self, B: int) -> list[deque]:
        """Bucket `B`'s last in-generation step costs over their priors, one window a k (0: plain steps; the
        session's; looked up once per bucket: every step reads them)."""
        got = self._seen.get(B)
        if got is None:
            got = self._seen[B] = self.known.setdefault(("seen", B, self.K),
                                                        [deque(maxlen=WINDOW) for _ in range(self.K + 1)])
        return got

    def _last(self, B: int) -> list[int]:
        """Bucket `B`'s step (`Loop.steps`) of each k's last sample (the session's)."""
        got = self._lasts.get(B)
        if got is None:
            got = self._lasts[B] = self.known.setdefault(("last", B, self.K), [-STALE - 1] * (self.K + 1))
        return got

    def cost(self, B: int) -> list[float] | None:
        """c(B, 0..K): each k's prior times its scale (`scales`: its steps' ratios' lower third, else interpolated)."""
        if B not in self._costs:
            self._costs[B] = self._cost(B)
        return self._costs[B]

    def _cost(self, B: int, verdict: bool = False) -> list[float] | None:
        """`cost`, computed (`verdict`: at a probe's verdict, plain's samples and the drafting ones of now)."""
        prior = self.prior(B)
        if prior is None or not self.measured.get(B):
            return prior
        last, L = self._last(B), self.loop(B)
        # while drafting, another drafting k's samples go stale: it runs again (at the interpolated scale) if
        # that says it is the better k, so that one unlucky burst over its steps does not rule it out for good
        got = {k: low(q) for k, q in enumerate(self._samples(B))
               if q and (k == 0 or not L.drafting or L.steps - last[k] <= STALE)}
        if not got:
            return prior
        if L.drafting and not verdict and len(got) > (0 in got):
            # between verdicts while drafting, plain's samples are as old as the last plain probe: the drafting
            # ks are interpolated among themselves (through plain's scale, a burst of load over the k = 3 steps
            # made the unsampled k = 1 look cheap, and the rule drafted k = 1, 2 at 1.04x plain, batch 1)
            sc = scales({k: v for k, v in got.items() if k}, self.K)
            sc[0] = got.get(0, sc[0])
        else:
            sc = scales(got, self.K)
        return [p * c for p, c in zip(prior, sc)]

    def best(self, B: int) -> int:
        """The rule's k for bucket `B` (no probe, nothing recorded). While plain decoding is the choice after a
        verdict, the answer depends only on the acceptance (which plain steps do not move) and the verdict's
        costs, so a plain answer is kept while they are what it was computed from (each plain step would
        otherwise recompute every k's cost: ~25 us a step at batch 8, the Python cold after the graph call).
        The same answers as `_rule`, to the bit."""
        frozen = self.known.get(("frozen", B, self.K))
        if self.loop(B).drafting or frozen is None:
            return self._rule(B)
        key = (self._side_key(), frozen)
        if self._side.get(B) == key:
            return 0
        k = self._rule(B)
        if k == 0:
            self._side[B] = key
        return k

    def _side_key(self) -> tuple:
        """What a plain answer depends on besides the bucket's verdict costs: the acceptance."""
        return tuple(self.rates)

    def _best_drafting(self, c: list[float]) -> tuple[int, float]:
        """(k, E(k) / c(k)) of the best drafting k, the smaller on a tie; `c[j - 1]` is k = j's cost."""
        k, v = 0, 0.0
        for j, (cj, e) in enumerate(zip(c, self.gains()[1:]), 1):
            w = e / cj
            if w > v:
                k, v = j, w
        return k, v

    def _rule(self, B: int, fresh: bool = False) -> int:
        """`best` computed: drafting or plain decoding on the last verdict's costs (`fresh`: on the costs of now,
        the verdict itself; also before the first verdict): the best drafting k's E(k) / c(k) against plain
        decoding's E(0) / c(0), then the margin over it; and while drafting, the drafting k on the costs of
        now (the largest E(k) / c(k), the smaller k on a tie)."""
        c = self._cost(B, verdict=True) if fresh else self.cost(B)
        if c is None:
            return self.K
        side = c if fresh else self.known.get(("frozen", B, self.K)) or c
        k, v = self._best_drafting(side[1:])
        if v <= 1.0 / side[0]:  # E(0) = 1
            return 0
        margin = MARGIN_STAY if self.loop(B).drafting else MARGIN
        if not v > (1 + margin) / side[0]:
            return 0
        return k if side is c else self._best_drafting(c[1:])[0]

    def first(self, B: int) -> int:
        """The drafts of sequences admitted now: the rule's, or the probe's under way."""
        L = self.loop(B)
        return L.probe_k if L.probe_left else self.best(B)

    def prefills_mtp(self, B: int) -> bool:
        """Whether sequences admitted now are prefilled with the MTP block: unless the rule says plain decoding
        (a plain probe from the drafting side included: a prompt prefilled without the block leaves its ring
        empty, and its drafts are the worse for a window of positions after)."""
        return bool(self.loop(B).probe_left) or self.best(B) > 0

    def _probe(self, B: int, k: int) -> int:
        """Start a probe at `k` (0: plain steps) from the other side: the samples of that side (plain, or
        every drafting k) start afresh, so that the verdict compares costs of now, not of a machine as loaded
        as it was a while ago."""
        L = self.loop(B)
        L.probe_k, L.probe_left, L.pending = k, PROBE_STEPS, "spec" if k == 0 else "plain"
        for q in self._samples(B)[1:] if k else self._samples(B)[:1]:
            q.clear()
        self._costs.pop(B, None)
        return k

    def pick(self, B: int) -> int:
        """This step's k: the rule's, or a probe's (module doc)."""
        L = self.loop(B)
        if L.probe_left:
            k = L.probe_k
        elif L.pending is not None:  # the first choice after a probe, on the costs of now: its verdict
            k = self._rule(B, fresh=True)
            if self.measured.get(B):  # the side decided on these costs until the next verdict (module doc)
                self.known[("frozen", B, self.K)] = tuple(self._cost(B, verdict=True))
            if (k > 0) == (L.pending == "spec"):  # kept its side
                if L.pending == "spec":
                    L.spec_every = min(PROBE_GROW * L.spec_every, PROBE_SPEC * PROBE_MAX)
                else:
                    L.plain_every = min(PROBE_GROW * L.plain_every, PROBE * PROBE_MAX)
            else:
                L.spec_every, L.plain_every = PROBE_SPEC, PROBE
            L.pending = None
        else:
            k = self.best(B)
        if not L.probe_left:
            L.drafting = k > 0
            L.plain_run, L.spec_run = (L.plain_run + 1, 0) if k == 0 else (0, L.spec_run + 1)
            if k == 0 and L.plain_run > L.plain_every:
                k, L.plain_run = self._drafting_probe(B), 0
            elif k > 0 and self.measured.get(B) and L.spec_run > L.spec_every:
                k, L.spec_run = self._probe(B, 0), 0
        L.steps += 1
        self.chosen.append(k)
        return k

    def _drafting_probe(self, B: int) -> int:
        """The probe from plain decoding: at the drafting k the rule rates best (each k's scale is its own
        only once it runs: k = 1's said little of K's), unless no drafting k could beat plain decoding by
        `MARGIN` even with every draft accepted; then plain steps go on (the probe interval at its longest):
        at batch 8 a probe was most of the rule's cost over plain decoding."""
        L, c = self.loop(B), self.cost(B)
        seen = self.known.get(("frozen", B, self.K)) or c  # the last verdict's costs (taken close together)
        if seen is not None and max((j + 1) / seen[j] for j in range(1, self.K + 1)) <= (1 + MARGIN) / seen[0] \
                and L.plain_every < PROBE * PROBE_MAX:
            L.plain_every = PROBE * PROBE_MAX
            return 0
        return self._probe(B, self._best_drafting(c[1:])[0] if c is not None else self.K)

    def timed(self, B: int, k: int | None, seconds: float) -> None:
        """A step of bucket `B` took `seconds` of CPU time: a plain decode step (k = 0), a step drafting k, or
        (None) a verify of the drafts held without new ones, which is no sample. The first `SETTLE` plain steps
        after drafting ones are no samples either."""
        L, S = self.loop(B), self.settling
        side = k != 0  # (a verify without drafting runs a drafting step's graph, right after one)
        if side != S.last_drafting:
            S.last_drafting, S.settle = side, 0 if side else SETTLE
        if k is None:
            return
        if S.settle and self.measured.get(B):
            S.settle -= 1
            return
        if L.probe_left and (k == 0) == (L.probe_k == 0):
            L.probe_left -= 1
        if self.measured.get(B):
            q, last = self._samples(B)[k], self._last(B)
            if k and L.steps - last[k] > STALE:
                q.clear()  # a stale window starts afresh, as a probe's does
            q.append(seconds / self.priors[B][k])
            last[k] = L.steps
            self._costs.pop(B, None)

    def prior(self, B: int) -> list[float] | None:
        if B not in self.priors:
            # measured once per session and bucket (a generate call, a request, reuses them)
            key = ("costs", B, self.K)
            if key not in self.known:
                c = measure(self.step, B, self.K)
                self.known[key] = (c, True) if c is not None else (modeled(self.step.s, self.K, B), False)
                log.debug("speculation auto: bucket %d prior step costs %s", B, self.known[key][0])
            self.priors[B], self.measured[B] = self.known[key]
        return self.priors[B]


def scales(got: dict[int, float], K: int) -> list[float]:
    """Each k's in-situ scale (0..K) from those with samples (`got`, k -> its steps' ratio, `low`): its own, else
    interpolated linearly in k between the nearest sampled k either side, the nearest's past the last."""
    if len(got) == K + 1:  # every k sampled (the common case while a side runs): its own
        return [got[k] for k in range(K + 1)]
    # plain Python, one pass (every step after a sample calls this: np.interp costs ~3 us a call, and a
    # nearest-either-side search per k cost ~8 us a step at K = 3)
    ks = sorted(got)
    out, j = [], 0  # ks[j]: the first sampled k >= k
    for k in range(K + 1):
        while j < len(ks) and ks[j] < k:
            j += 1
        hi = ks[j] if j < len(ks) else ks[-1]
        lo = ks[j] if j < len(ks) and ks[j] == k else ks[j - 1] if j else ks[0]
        out.append(got[lo] if lo == hi else got[lo] + (got[hi] - got[lo]) * (k - lo) / (hi - lo))
    return out


def low(q) -> float:
    """The lower third of a few samples (sorted, index (n - 1) // 3: the least of up to 3, the second of 5).
    Load on a shared machine only adds to a step's CPU time (the core's caches and pipelines shared), so
    the low samples are the step's own cost; a burst of load over one k's steps must not make another look
    cheap (a median of 5 went with 3 plain steps at 2x, and the rule drafted k = 3 for 16 steps at batch 8)."""
    s = sorted(q)
    return s[(len(s) - 1) // 3]


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
    # a step drafting k verifies, in the steady state, the k drafts the last one made: on their lanes
    lanes = [step.verify_of(B, k)[0] for k in range(1, K + 1)]
    names = [next((f for b, f in s.decode_fns if b == B), None)] + [mtp.fused(B, k, T)
                                                                      for k, T in zip(range(1, K + 1), lanes)]
    if any(n is None for n in names):
        return None
    # the bucket's other graphs (a verify without drafting, the separate draft calls) made now, not in a step
    fns = s.backend.functions()
    s.backend.prepare([f for f in fns if fns[f].batch == B and fns[f].kind in ("verify", "draft")
                       and f.startswith(("verify_b", "draft_b"))])
    ins = [_lanes(s, B, 1)] + [_lanes(s, B, T) for T in lanes]
    ts: list[list[float]] = [[] for _ in names]
    for r in range(RUNS + WARM):
        for i, (n, x) in enumerate(zip(names, ins)):
            t0 = time.process_time()
            s.backend.run_held(n, x)  # its writes dropped: nothing stored
            if r >= WARM:
                ts[i].append(time.process_time() - t0)
    return [statistics.median(t) for t in ts]


def modeled(session, K: int, B: int | None = None) -> list[float] | None:
    """c(0..K) relative to the decode step from the compile report: bucket B's one-call step modeled from the
    compiled program (`spec_step`, the device's target: `spec_b<B>` drafting one, `spec_b<B>_d<k>` drafting k;
    a report without them: each further draft one `draft_b<B>` call), else the modeled verify step of the traced graphs; or None."""
    from v4compile.targets import DEVICE_TARGET

    try:
        rep = json.loads((session.art.path / "report.json").read_text())
    except (OSError, ValueError):
        return None
    by_target = rep.get("spec_step") or {}
    m = (by_target.get(DEVICE_TARGET.get(getattr(session, "device", None)))
         or next(iter(by_target.values()), {})).get(spec_name(B))
    if m is not None:
        steps = m.get("steps_us") or []  # drafting k in one call (`spec_b<B>_d<k>`); an older report: draft calls
        return [1.0] + [(steps[k - 1] if k <= len(steps) else m["spec_us"] + (k - 1) * m["draft_us"]) / m["decode_us"]
                        for k in range(1, K + 1)]
    models = rep.get("speculative_step") or {}
    rows = next((v for v in models.values() if v), None)
    if not rows:
        return None
    pts = sorted({(0, 1.0), *((int(m["draft_tokens"]), float(m["cost_ratio"])) for m in rows)})
    ks, cs = [p[0] for p in pts], [p[1] for p in pts]
    slope = (cs[-1] - cs[-2]) / max(ks[-1] - ks[-2], 1)  # past the last modeled k: the last segment's slope
    return [float(np.interp(k, ks, cs)) if k <= ks[-1] else cs[-1] + (k - ks[-1]) * slope for k in range(K + 1)]
