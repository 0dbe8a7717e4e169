"""`Session.self_check()` / `run --self-check` / `serve`'s start-up check (issue 35): the artifact's golden
(`v4compile/golden.py`) run on this device through the same generation loop, functions and graphs users get,
compared with the reference model's answer.

The golden's prompts are requests of the one generation loop (`batcher.Batcher`): prefill in the session's
chunk buckets, decode steps of both sequences in a batch bucket (captured graphs on GPUs). Each request is
fed the golden's greedy ids (teacher-forced: every step's logits compare, even past a step where a near tie
flips the device's pick); what the device would have picked is its row's argmax.

Checks, each a line with its measured error beside its tolerance (errors in units of the golden's logit scale,
`max |reference logit|`):
* `numerics`: the golden was made in the artifact's numerics mode and dtype;
* `logits`: the largest |device - golden| over every judged step and lane (top-k form: at the golden's top-k
  ids, and the log-sum-exp). A flipped discrete choice at a near tie (a router / indexer top-k whose golden
  margin is within its rounding bound, `golden.choice_bound`) is rounding, yet moves the logits by more than any
  rounding bound, so the rows it reaches are not judged. Where the device shows its router picks (`ChoiceReader`:
  the cpu device, a check-mode variant of each graph with the router's top-k as extra outputs; the host device,
  `HostChoiceReader`, check-mode hooks of the C runtime's launch callback; hip / cuda, `ProbeChoiceReader`: the
  fused MoE launch's router phase leaves its ids in scratch `route_indices` for the experts phase, copied after
  the launch by the C runtime's probe table in a second golden run, launch by launch, after one on the captured
  graphs; both runs' logits are judged), only a pick that actually differs
  excuses rows, those it reaches (`judged_steps`); elsewhere a lane's steps from its first near-tie choice in the
  golden on. A partitioned artifact's ranks each read their own picks (the cpu device's variant per segment, host /
  hip / cuda each rank's program): without data parallelism every rank routes every token of the step; with it
  (`--dp`) a rank reads its own replica's rows (of the gathered rows, where the routers route every replica's),
  and the other replicas' lanes keep the margins' rule there (their ranks judge them by their picks). The compile
  picks prompts without near ties where a seeded candidate has none (fp32 always has so far; bf16 on random
  weights never: its check judges about half the rows on cpu, host, hip and cuda; the line says which rows were
  left out and their error);
* `choices` (cpu, host, hip and cuda devices): the device's router picks and scores against the golden's wherever
  no earlier differing pick reaches; a score off by more than its layer's `choice_bound`, or a swap of an expert
  clear of its near-tie threshold, fails, naming the layer, step and lane. hip / cuda: picks only (the scores stay
  in the kernel's registers; the line says they are not compared), so a fault shows once it moves a pick;
* `greedy ids`: steps whose argmax differs from the golden's id, at every step whose golden top-2 margin exceeds
  2 x tolerance x scale (each logit may move by the tolerance: a nearer tie may flip). The issue asks for the
  steps up to the first near tie; fed the golden's ids, a flip does not carry on, so the later steps compare too;
* `layers` (on a failure: "with the layer statistics on"): the golden's per-layer fingerprint against the
  device's residual streams on prompt 0's first chunk, naming the first layer that departs. The cpu device
  shows them (its prefill graph run once more with those values as outputs); host, hip and cuda through the C
  runtime's probe table (`v4rt_probe_table`: each layer's last launch result copied to host memory after that
  launch, on the stream in order with the kernels, in one uncaptured prefill run; the probes are cleared after
  it, no captured graph holds one). A partitioned artifact on host / hip / cuda without data parallelism: when
  any rank failed, every rank runs that chunk (its collectives need them all) and localises its own streams;
  on cpu, or with `--dp`, not yet (the line says so, and the failure names the rank, step and lane).
A partitioned artifact: every rank checks its own logits; rank 0's result holds the worst rank's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from v4compile.golden import read_golden, tolerance
from v4compile.program.execute import _typed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    name: str
    error: float  # measured (units: the check's own; `logits`: of the golden's logit scale)
    tolerance: float
    passed: bool
    note: str = ""
    measured: bool = True  # False: the device cannot give this check's figures (it neither passes nor fails)

    def line(self) -> str:
        if not self.measured:
            return f"  {self.name:<11} not measured  ({self.note})"
        verdict = "ok" if self.passed else "FAILED"
        tail = f"  ({self.note})" if self.note else ""
        return f"  {self.name:<11} error {self.error:.3g}  tolerance {self.tolerance:.3g}  {verdict}{tail}"


@dataclass(frozen=True)
class SelfCheckResult:
    """What `Session.self_check()` found. `max_error` / `tolerance`: the logits check's (relative to the golden's
    logit scale); `first_step` (0: the prefill's token), `first_lane` (the prompt), `first_layer` (None: not
    localised) and `first_rank`: where the first departure is, when it failed."""

    passed: bool
    device: str
    max_error: float
    tolerance: float
    seconds: float
    checks: tuple[Check, ...]
    reason: str = ""
    first_step: int | None = None
    first_lane: int | None = None
    first_layer: int | None = None
    first_rank: int | None = None
    tolerance_basis: str = ""
    covers: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"self-check on {self.device}: the golden's {self.covers.get('prompts', '?')} prompts, "
               f"{self.covers.get('new_tokens', '?')} steps; tolerance: {self.tolerance_basis}"]
        out += [c.line() for c in self.checks]
        if self.passed:
            out.append("self-check: passed")
        else:
            where = ", ".join(f"{k} {v}" for k, v in (("rank", self.first_rank), ("step", self.first_step),
                                                       ("lane", self.first_lane), ("layer", self.first_layer))
                              if v is not None)
            out.append(f"self-check: FAILED: {self.reason}" + (f" (first departure: {where})" if where else ""))
        return out

    def to_json(self) -> dict:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks]
        return d


def self_check(sess, device: str = "") -> SelfCheckResult:
    """Run the artifact's golden on `sess` and compare (see the module doc)."""
    from .batcher import Batcher, Request

    from v4compile.errors import InputError

    t0 = time.perf_counter()
    if not sess.free_slots:  # else the loop's "no free slot" would read as the device failing the golden
        raise InputError("the self-check needs a free sequence slot (release the session's open sequences first)",
                         found=f"{len(sess.seqs)} open")
    g = read_golden(sess.art)
    m = sess.art.manifest
    f = g.facts
    tol, basis = tolerance(m["numerics"], m["dtype"], m["config"], device)
    covers = {"prompts": len(f["prompts"]), "new_tokens": f["new_tokens"], **f.get("covers", {})}
    checks: list[Check] = []
    same = (f["numerics"], f["dtype"]) == (m["numerics"], m["dtype"])
    checks.append(Check("numerics", 0.0 if same else 1.0, 0.0, same,
                        "" if same else f"golden {f['numerics']} {f['dtype']}, artifact {m['numerics']} {m['dtype']}"))
    if not same:
        return _done(sess, SelfCheckResult(False, device, float("inf"), tol, time.perf_counter() - t0, tuple(checks),
                                           f"the golden was made with {f['numerics']} numerics in {f['dtype']}, the "
                                           f"artifact computes {m['numerics']} in {m['dtype']}",
                                           tolerance_basis=basis, covers=covers))
    gold_ids = g.ids
    lane_of: dict[tuple[int, int], int] = {}  # (replica, slot) -> golden prompt, for the device's choices

    def golden_run(reader) -> dict[int, list[np.ndarray]]:
        """The golden's prompts through the loop, each request fed the golden's ids: the rows the device gave."""
        rows: dict[int, list[np.ndarray]] = {}

        class Forced(Batcher):
            def _pick(self, r, row):
                rows.setdefault(r.index, []).append(np.array(row, dtype=np.float32, copy=True))
                lane_of[r.seq.replica, r.seq.slot] = r.index
                return gold_ids[r.index][len(r.ids)]

        loop = Forced(sess, raise_errors=True)
        try:
            for i, p in enumerate(g.prompts):
                loop.submit(Request(p, f["new_tokens"], index=i), where=f"golden prompt {i}")
            loop.run_until_idle()
        except Exception as e:  # noqa: BLE001 (the caller names it)
            e.rows = rows
            raise
        finally:
            loop.abort()
            if reader is not None:
                reader.detach()
        return rows

    # A GPU's picks come from a probed, uncaptured run (`ProbeChoiceReader`); the logits are judged on the users'
    # captured graphs first (where decode-graph-only faults live), then on the probed run as well.
    probed = ChoiceReader.probes_needed(sess, g)
    runs: list[dict[int, list[np.ndarray]]] = []
    reader = None
    # the prefix cache set aside: every run computes every token (a second run served from the first's blocks
    # would skip the prefill it is to check), and the golden's prompts leave no entries behind
    caches, sess.caches = sess.caches, [None] * len(sess.caches)
    with sess.lock:
        try:
            if probed:
                runs.append(golden_run(None))
            reader = ChoiceReader.attach(sess, g)
            runs.append(golden_run(reader))
        except Exception as e:  # noqa: BLE001 (a device that cannot run the golden fails the check, named)
            step = min((len(v) for v in getattr(e, "rows", {}).values()), default=0)
            checks.append(Check("run", 1.0, 0.0, False, f"{type(e).__name__}: {str(e)[:200]}"))
            _any_rank(sess, False, able=False)  # the other ranks' vote on the layer statistics: not with this one
            return _done(sess, SelfCheckResult(False, device, float("inf"), tol, time.perf_counter() - t0,
                                               tuple(checks), f"the device failed to run the golden: {str(e)[:200]}",
                                               step, tolerance_basis=basis, covers=covers))
        finally:
            sess.caches = caches
    reqs = range(len(g.prompts))
    scale = float(f["scale"])
    errs, picks = [], None
    for rows in runs:  # each run's error; the worse of them judged (the ids: both runs' must agree)
        dev = np.stack([np.stack(rows[i]) for i in reqs])  # [B, steps, V]
        if f["logits"]["form"] == "full":
            errs.append(np.abs(dev - g.tensors["logits"]).max(axis=-1) / scale)  # [B, steps]
        else:
            idx = g.tensors["topk_ids"]
            at = np.take_along_axis(dev, idx, axis=-1)
            lse = np.log(np.exp(dev.astype(np.float64) - dev.max(-1, keepdims=True)).sum(-1)) + dev.max(-1)
            errs.append(np.maximum(np.abs(at - g.tensors["topk_values"]).max(-1),
                                   np.abs(lse - g.tensors["lse"])) / scale)
        got = dev.argmax(-1)
        picks = got if picks is None else np.where(picks == got, picks, -1)  # -1: the runs disagree
    err = np.fmax.reduce(errs) if len(errs) > 1 else errs[0]
    err = np.where(np.isnan(errs).any(0), np.nan, err)
    gid = np.asarray(gold_ids)
    margin = g.tensors["margin"] / scale
    B, S = err.shape
    # a rank reads the picks of its own replica's rows (data parallel: the other replicas' lanes are their ranks')
    mine = _replica(sess.backend)[0]
    dev = None if reader is None else reader.router_picks({slot: lane for (d, slot), lane in lane_of.items()
                                                           if d == mine}, g.tensors["router_ids"].shape)
    from v4compile.config import V4Config
    from v4compile.golden import choice_bound

    cfg = V4Config.from_dict(m["config"], name="manifest config")
    bounds = [choice_bound(m["numerics"], m["dtype"], cfg, i) for i in range(cfg.n_layers)]
    judged, excluded, flips, worst = judged_steps(g, B, S, dev, bounds)
    # greedy ids: at every judged step whose golden top-2 margin exceeds 2 x tol (a nearer tie may flip; teacher-
    # forced, a flip does not carry on to the next step, so the steps after a near tie still compare)
    clear = (margin > 2 * tol) & judged
    wrong = [(s, b) for b in range(B) for s in range(S) if clear[b, s] and picks[b, s] != gid[b, s]]
    # a NaN is never rounding: it fails on any step; the rest only where no discrete choice was a near tie
    bad = [(s, b) for b in range(B) for s in range(S) if (judged[b, s] and not err[b, s] <= tol) or np.isnan(err[b, s])]
    max_err = float(np.nan_to_num(np.where(judged, err, 0.0), nan=np.inf).max()) if judged.any() else 0.0
    compared = int(clear.sum())
    note = f"{int(judged.sum())} of {B * S} rows"
    if excluded:
        note += (f"; not judged ({excluded}), as rounding alone may flip such a choice (largest error there "
                 f"{float(np.nanmax(np.where(judged, 0.0, err))):.3g})")
    checks.append(Check("logits", max_err, tol, not bad, note))
    checks.append(_choices_check(g, dev, flips, worst, sess))
    checks.append(Check("greedy ids", float(len(wrong)), 0.0, not wrong,
                        f"{compared} of {B * S} steps compared; the rest are near ties or not judged" if compared < B * S
                        else f"{compared} steps"))
    first = min(bad + wrong) if bad or wrong else None
    routed = bool(flips) and (first is None or (flips[0][1], flips[0][0]) < first)  # a choice no rounding explains
    if routed:
        first = (flips[0][1], flips[0][0])
    layer = None
    # with the layer statistics on (on a failure): the first chunk's streams against the fingerprint. A partitioned
    # artifact's ranks run that chunk together (its collectives) when any rank failed: each rank its own streams.
    if _any_rank(sess, first is not None):
        lc, layer = layer_check(sess, g, tol)
        checks.append(lc if first is not None else
                      Check("layers", 0.0, tol, True, "this rank passed (measured for another rank's failure)",
                            measured=False))
    else:
        checks.append(Check("layers", 0.0, tol, True, "measured on a failure only", measured=False))
    if routed:
        lane, step, at, _ = flips[0]
        # the streams departing at an earlier layer (a partitioned rank's heads: every rank's router input) are
        # the first departure; the router's layer is where it first moved a choice
        if layer is None or not layer < at:
            layer = at
        res = SelfCheckResult(False, device, max_err, tol, time.perf_counter() - t0, tuple(checks),
                              f"the device's router departs from the golden at layer {at}, step {step}, lane "
                              f"{lane}: {flips[0][3]}",
                              step, lane, layer, tolerance_basis=basis, covers=covers)
        return _done(sess, res)
    res = SelfCheckResult(
        not first, device, max_err, tol, time.perf_counter() - t0, tuple(checks),
        "" if first is None else (f"logits depart by {err[first[1], first[0]]:.3g} of their scale (tolerance "
                                  f"{tol:.3g})" if first in bad else "a greedy id differs where the golden has no near tie"),
        first[0] if first else None, first[1] if first else None, layer, tolerance_basis=basis, covers=covers)
    return _done(sess, res)


def judged_steps(g, B: int, S: int, dev=None, bounds=None) -> tuple[np.ndarray, str, list, tuple]:
    """`[B, S]` True where the logits are judged, a description of the rest ("" when none), the choices no
    rounding explains (`(lane, step, layer, what)`, first first), and the router scores' worst agreement
    `(error in units of its layer's choice_bound, lane, step, layer)` (error 0: none compared).

    Without the device's choices (`dev` None, or a golden without `router_ids`): each lane's steps before its
    first near-tie discrete choice (`golden.clean_steps`; a flipped choice there may move that step and, through
    the caches, every later step of the lane by more than any rounding bound).

    With them (`dev` = (picks, scores), each `[B, P, L, k]` by golden lane, position and layer, `ChoiceReader`;
    scores None where the device shows its picks only, hip / cuda: then the picks alone decide):
    a near tie excuses nothing unless the device's pick actually differs. A router pick that differs at layer l0,
    position p0 changes what layers after l0 compute at p0 and after (through their caches), nothing else: the
    choices and scores of every other (position, layer) are still the golden's to compare. There: a pick that
    differs must swap only experts within the near-tie threshold (`unexplained_swap`; else it is a fault), and
    where it agrees, the device's scores of the chosen experts must agree with the golden's within the layer's
    `choice_bound` (a fault moves scores before it flips anything). A logits row (position q) is judged unless a
    differing pick at q or before (before: at a layer but the last) reaches it. The indexer's picks are not read:
    its near ties keep the margins' rule (`indexer_margin`), ending the lane's comparisons at that step."""
    from v4compile.golden import clean_steps

    cm = g.tensors.get("choice_margin")
    flips: list = []
    worst = (0.0, None, None, None)
    if dev is None or "router_ids" not in g.tensors:
        clean = [S] * B if cm is None else clean_steps(cm)
        judged = np.arange(S)[None, :] < np.asarray(clean)[:, None]
        why = "a router / indexer choice of the golden within its rounding bound there"
    else:
        picks, vals = dev
        clean = clean_steps(g.tensors["indexer_margin"])
        gold, gz = g.tensors["router_ids"], g.tensors["router_z"]
        gv, gs = g.tensors["router_scores"], g.tensors["router_scale"]
        k, L = picks.shape[-1], gold.shape[2]
        judged = np.zeros((B, S), bool)
        unread: set[int] = set()
        for b, p in enumerate(g.prompts):
            n = len(p) + clean[b] - 1 if clean[b] > 0 else 0  # positions before the lane's indexer near tie
            moved: list[tuple[int, int]] = []  # (position, layer) of each pick that differs
            for pos in range(n):
                for layer in range(L):
                    if gold[b, pos, layer, 0] < 0 or any(layer > l0 for p0, l0 in moved if p0 <= pos):
                        continue
                    if picks[b, pos, layer, 0] < 0:  # not seen (a step run another way): the margins' rule
                        unread.add(b)
                        continue
                    ranked = gold[b, pos, layer]
                    if set(picks[b, pos, layer].tolist()) != set(ranked[:k].tolist()):
                        if pos < len(p) - 1 and layer == L - 1:
                            continue  # its own output only, which no row reads
                        what = unexplained_swap(ranked, gz[b, pos, layer], picks[b, pos, layer], k)
                        if what and not any(f[0] == b for f in flips):
                            flips.append((b, max(0, pos - len(p) + 1), layer, what, pos))
                        moved.append((pos, layer))
                        continue
                    if vals is None:  # picks only (hip / cuda): a fault shows once it moves a pick
                        continue
                    at = {int(e): float(v) for e, v in zip(ranked, gv[b, pos, layer])}
                    e = max(abs(float(d) - at[int(i)]) for i, d in zip(picks[b, pos, layer], vals[b, pos, layer]))
                    e /= float(gs[b, pos, layer]) * bounds[layer]
                    step = max(0, pos - len(p) + 1)
                    if not e <= worst[0]:
                        worst = (e, b, step, layer)
                    if not e <= 1.0 and not any(f[0] == b for f in flips):  # a lane's first departure only
                        flips.append((b, step, layer, f"scores off by {e:.3g} x the bound", pos))
            for s_ in range(clean[b]):
                q = len(p) - 1 + s_
                judged[b, s_] = not any(p0 == q or (p0 < q and l0 < L - 1) for p0, l0 in moved)
            if b in unread and cm is not None:
                judged[b] &= np.arange(S) < clean_steps(cm)[b]
        flips = [f[:4] for f in sorted(flips, key=lambda f: (f[1], f[0], f[4], f[2]))]
        why = ("a router pick of the device's differs from the golden's at a near tie at or before it, or an "
               "indexer choice of the golden is within its rounding bound (its picks are not read)")
    parts = [f"lane {b} steps {_ranges(np.flatnonzero(~judged[b]))}" for b in range(B) if not judged[b].all()]
    return judged, (f"{'; '.join(parts)}: {why}" if parts else ""), flips, worst


def _ranges(steps) -> str:
    """"0-3, 7" of sorted step numbers."""
    out, start = [], None
    for i, x in enumerate(steps):
        if start is None:
            start = x
        if i + 1 == len(steps) or steps[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def unexplained_swap(ranked: np.ndarray, z: np.ndarray, picked: np.ndarray, k: int) -> str:
    """"" when the device's picks `picked` differ from the golden's top k of `ranked` (score order, with its
    runners-up and their distances `z`, `golden.router_choices`) only by experts rounding may swap (each within
    its near-tie threshold); else what is not rounding."""
    gold = {int(e): (r, float(z[r])) for r, e in enumerate(ranked) if e >= 0}
    mine = {int(e) for e in picked}
    top = {e for e, (r, _) in gold.items() if r < k}
    out = sorted(e for e in top - mine if not gold[e][1] <= 1.0)
    came = sorted(e for e in mine - top if e not in gold or not gold[e][1] <= 1.0)
    parts = ([f"expert(s) {out} dropped, clear of the tie"] if out else []) + \
            ([f"expert(s) {came} picked, clear of the tie"] if came else [])
    return "; ".join(parts)


def _choices_check(g, dev, flips, worst, sess) -> Check:
    if dev is None or "router_ids" not in g.tensors:
        why = ("the golden records no choices (compiled before them)" if "router_ids" not in g.tensors else
               f"the {sess.device} device does not show its router picks")
        return Check("choices", 0.0, 1.0, True, f"not measured: {why}; near ties end a lane's judged steps",
                     measured=False)
    e, b, s_, layer = worst
    if flips:
        b, s_, layer, why = flips[0]
        return Check("choices", e, 1.0, False,
                     f"a router choice no rounding explains: layer {layer}, step {s_}, lane {b} ({why})")
    if dev[1] is None:
        return Check("choices", 0.0, 1.0, True, f"router picks only (the {sess.device} device's scores are not read, "
                     "not compared); picks that differ only at near ties")
    where = "" if b is None else f", worst at layer {layer}, step {s_}, lane {b}"
    return Check("choices", e, 1.0, e <= 1.0,
                 f"router scores in units of their layer's choice bound{where}; picks that differ only at near ties")


class ChoiceReader:
    """The cpu device's router picks during the golden run: each function is run as a check-mode variant of its
    graph (built at check time, `OrtBackend.built`; the users' graphs are unchanged) whose router TopK indices
    are extra outputs, recorded with the step's `pos` and `slot`. The host device: `HostChoiceReader`; hip / cuda:
    `ProbeChoiceReader` (the kernels' own picks, not a reference recomputed from the launch's input, which could
    pick otherwise at a near tie). Partitioned artifacts: each rank its own (`record`)."""

    def __init__(self, be, names: dict[str, dict[int, str]]):
        self.be, self.names = be, names
        self.seen: list[tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]] = []

    @staticmethod
    def probes_needed(sess, g) -> bool:
        """Whether `attach` will read the picks through probes in an uncaptured run while the users' runs replay
        captured graphs (hip / cuda): then the self-check runs the golden twice, captured first."""
        be = sess.backend
        return ("router_ids" in g.tensors and hasattr(be, "rt")
                and getattr(be, "device", None) in ("hip", "cuda") and bool(getattr(be, "graphs", False))
                and any(route_reads(fs) for fs in be.rt.sched.functions))

    @classmethod
    def attach(cls, sess, g) -> "ChoiceReader | None":
        be = sess.backend
        if "router_ids" not in g.tensors:
            return None
        if getattr(be, "device", None) == "host" and hasattr(be, "rt"):
            return HostChoiceReader.attach_host(be)
        if getattr(be, "device", None) in ("hip", "cuda") and hasattr(be, "rt"):
            return ProbeChoiceReader.attach_probes(be)
        if not hasattr(be, "built") or getattr(be, "device", None) != "cpu":
            return None
        r = cls(be, {})
        inner = be.run_outputs

        def run_outputs(fname, inputs):
            if fname not in r.names and fname in be._graphs and "pos" in inputs:
                r._variant(fname)
            if fname not in r.names:
                return inner(fname, inputs)
            outs = inner(f"{fname}.choices", inputs)
            r.record(inputs, {layer: (outs.pop(i), outs.pop(v)) for layer, (i, v) in r.names[fname].items()})
            return outs

        be.run_outputs = run_outputs  # the instance's: `run` goes through it too
        return r

    def detach(self) -> None:
        self.be.__dict__.pop("run_outputs", None)

    def _variant(self, fname: str) -> None:
        """`fname.choices`: each of the function's graphs (a partitioned function's segments: the rank's own, whose
        routers route every token of the step, or under data parallelism every replica's gathered tokens) with
        its routers' TopK values and indices as extra outputs (`OrtBackend.variant`)."""
        import onnx

        def edit(model):
            # each pick under a name of its layer: segments name their values alone (two may hold a `topk_11`)
            added = []
            for nd in list(model.graph.node):
                doc = nd.doc_string.split(" ")
                if nd.op_type == "TopK" and doc[0] == "router" and len(doc) > 1 and doc[1].startswith("layers."):
                    layer = int(doc[1].split(".")[1])
                    for o, n, t in ((nd.output[1], f"choices.{layer}.ids", onnx.TensorProto.INT64),
                                    (nd.output[0], f"choices.{layer}.scores", onnx.TensorProto.FLOAT)):
                        model.graph.node.append(onnx.helper.make_node("Identity", [o], [n]))
                        model.graph.output.append(onnx.helper.make_tensor_value_info(n, t, None))
                        added.append(n)
            return added

        # from the names (the variant is built once per session; a later check's reader finds it built)
        _, added = self.be.variant(fname, "choices", edit)
        self.names[fname] = {int(n.split(".")[1]): (n, n[: -len("ids")] + "scores") for n in added
                             if n.endswith(".ids")}

    def record(self, inputs: dict[str, np.ndarray], outs: dict[int, tuple]) -> None:
        """One step's picks `{layer: (indices, scores or None)}` with the step's `pos` and `slot`: this rank's own
        rows. Data parallel: the step's inputs hold every replica's (`[dp, ...]`), the rank runs its replica's,
        and where its routers route the gathered tokens of every replica (`all_gather_rows`: replica d's rows the
        d-th block, in replica order) only its replica's block is its lanes'."""
        d, dp = _replica(self.be)
        pos, slot = np.asarray(inputs["pos"]), np.asarray(inputs["slot"])
        if dp > 1:
            pos, slot = pos[d], slot[d]
            n = pos.size
            own = {}
            for layer, (idx, val) in outs.items():
                k = idx.shape[-1]
                idx = np.asarray(idx).reshape(-1, k)
                val = None if val is None else np.asarray(val).reshape(-1, k)
                if idx.shape[0] == dp * n:
                    idx, val = idx[d * n:(d + 1) * n], None if val is None else val[d * n:(d + 1) * n]
                own[layer] = (idx, val)
            outs = own
        self.seen.append((pos, slot, outs))

    def router_picks(self, lane_of: dict[int, int], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """The device's router picks (sorted) and their scores, each `[B, P, L, k]` by golden lane, position and
        layer (`shape`: the golden's `router_ids`, `[B, P, L, m]`; pick -1: none seen)."""
        if not any(outs for _, _, outs in self.seen):
            return None
        k = next(v[0] for _, _, o in self.seen for v in o.values()).shape[-1]
        scored = all(v[1] is not None for _, _, o in self.seen for v in o.values())
        ids = np.full((*shape[:-1], k), -1, dtype=np.int32)
        vals = np.zeros((*shape[:-1], k), dtype=np.float32)
        for pos, slot, outs in self.seen:
            for layer, (idx, val) in outs.items():
                idx = idx.reshape(*pos.shape, -1)
                order = np.argsort(idx, axis=-1)
                idx = np.take_along_axis(idx, order, -1)
                if scored:
                    val = np.take_along_axis(val.reshape(*pos.shape, -1), order, -1)
                for row in range(pos.shape[0]):
                    lane = lane_of.get(int(slot[row]))
                    ok = pos[row] >= 0
                    if lane is not None and ok.any():
                        ids[lane, pos[row][ok], layer] = idx[row][ok]
                        if scored:
                            vals[lane, pos[row][ok], layer] = val[row][ok]
        return ids, (vals if scored else None)


class HostChoiceReader(ChoiceReader):
    """The host device's router picks during the golden run. Every launch comes back to Python there (graph
    replays too), so check-mode hooks of the C runtime's callback (`CRuntime.before_call` / `after_call`, set for
    the golden run only) read each learned router's choice, at its gate weight's layer (`_router_layer`):
    * a `router` launch (a cpu-target program: the router apart): the picks are its `indices` result as the device
      wrote them, read after its last call; the scores `s + bias` of those picks are computed with the op's
      reference from the launch's own operand bytes (`x`, `w`, `bias`) before its first call (the launch writes
      only the routing weights, not the scores);
    * a fused launch holding the router (`moe_router_experts_shared`, `moe_mhc_post_pre`, `mhc_moe_mhc`: a
      GPU-target program): the scores (and, where the launch runs as the op's reference, the picks) are the
      router's reference (`moe.selection_scores`, top-k) on that launch's operand bytes (`x`, `gate`, `bias`;
      `mhc_moe_mhc`: its seam's reference gives `x`, `_router_part`) before its first call; where it runs as its
      Triton kernels (interpreted), the picks are the kernels' own, read after its last call from the scratch its
      router phase left them in (`route_reads`), as hip / cuda read them.
    Hash-routed layers choose by token id (nothing to compare); the golden records none for them."""

    @classmethod
    def attach_host(cls, be) -> "HostChoiceReader":
        import torch

        r = cls(be, {})
        rt = be.rt
        inner = be.run_outputs
        spans: dict[int, tuple[dict[int, int], dict[int, int]]] = {}  # id(fs) -> (first, last) call per launch
        now: dict[int, tuple] = {}

        def span(fs):
            if id(fs) not in spans:
                first, last = {}, {}
                for c, li in enumerate(fs.launch_of):
                    first.setdefault(li, c)
                    last[li] = c
                spans[id(fs)] = (first, last)
            return spans[id(fs)]

        def before(fs, cidx, launch):
            li = fs.launch_of[cidx]
            if span(fs)[0][li] == cidx and (got := _router_part(rt, launch)) is not None:
                now[got[0]] = got[1:]

        reads: dict[int, dict[int, tuple]] = {}  # id(fs) -> {last call: a fused launch's route read}

        def after(fs, cidx, launch):
            li = fs.launch_of[cidx]
            if id(fs) not in reads:
                reads[id(fs)] = {r[0]: r[1:] for r in route_reads(fs)}
            if (got := reads[id(fs)].get(cidx)) is not None and got[0] in now:  # its Triton kernel's own picks
                layer, buf, off, rows, k = got
                raw = rt.views[rt.sched.buffer_names[buf]][off:off + rows * k * 8]
                idx = raw.clone().view(torch.int64).reshape(rows, k)
                scores = now[layer][2].reshape(rows, -1)
                now[layer] = (idx.numpy(), scores.gather(-1, idx).float().numpy(), None)
                return
            if launch.op != "router" or span(fs)[1][li] != cidx:
                return
            layer = _router_layer(dict(launch.operands)["w"])
            if layer not in now:
                return
            a = dict(launch.results)["indices"]
            idx = _typed(rt.views[a.buffer], a).clone().long()
            scores = now[layer][2]  # the selection scores of every expert, from the launch's operands
            now[layer] = (idx.numpy(), scores.gather(-1, idx).float().numpy(), None)

        def run_outputs(fname, inputs):
            now.clear()
            outs = inner(fname, inputs)
            if now:
                r.record(inputs, {layer: (i, v) for layer, (i, v, _) in now.items()})
            return outs

        rt.before_call, rt.after_call = before, after
        be.run_outputs = run_outputs
        return r

    def detach(self) -> None:
        self.be.rt.before_call = self.be.rt.after_call = None
        super().detach()


class ProbeChoiceReader(ChoiceReader):
    """The hip / cuda device's router picks during the golden run, through the C runtime's probe table
    (`CRuntime.probe_table`): a GPU-target program's learned routers sit inside fused MoE launches, whose router
    phase hands its expert ids to the experts phase through scratch (`route_indices`, `moe_router.route_ids_at`);
    after the launch they still hold its picks, copied to host memory after its last call (`route_reads`). The
    probed run goes launch by launch (a captured graph refuses probes; the users' runs keep theirs), the probes
    set for it only, after a run of the golden on the captured graphs (`self_check`: both runs' logits judged). The picks are the kernels' own; their scores are not read (they stay in registers): a
    fault shows once it moves a pick clear of its near-tie threshold."""

    @classmethod
    def attach_probes(cls, be) -> "ProbeChoiceReader | None":
        from .c_backend import PROBE_AFTER

        rt = be.rt
        r = cls(be, {})
        r.reads: dict[str, list[tuple[int, np.ndarray]]] = {}
        for fs in rt.sched.functions:
            got = route_reads(fs)
            if got:
                hosts = [np.zeros((rows, k), np.int64) for _, _, _, _, rows, k in got]
                rt.probe_table(fs.name, [(c, PROBE_AFTER, buf, off, h)
                                         for (c, _, buf, off, _, _), h in zip(got, hosts)])
                r.reads[fs.name] = [(layer, h) for (_, layer, *_), h in zip(got, hosts)]
        if not r.reads:
            return None
        r.graphs, be.graphs = be.graphs, False
        inner = be.run_outputs

        def run_outputs(fname, inputs):
            outs = inner(fname, inputs)
            if fname in r.reads:
                r.record(inputs, {layer: (h.copy(), None) for layer, h in r.reads[fname]})
            return outs

        be.run_outputs = run_outputs
        return r

    def detach(self) -> None:
        for fname in self.reads:
            self.be.rt.probe_table(fname, [])
        self.be.graphs = self.graphs
        super().detach()


def route_reads(fs) -> list[tuple[int, int, int, int, int, int]]:
    """Where each learned router's picks lie after its launch in a function's schedule `fs`: the fused MoE launches
    run as kernels (a GPU-target program; `moe_router.route_ids_at`), as (the launch's last call, layer, buffer
    index, byte offset, rows, k) each. Hash-routed layers (no bias; chosen by token id) are left out."""
    last, found = {}, {}
    for c, li in enumerate(fs.launch_of):
        last[li] = c
    for c, call in enumerate(fs.calls):
        if call.kernel is None or "R_R" not in call.kernel.constexprs and "KSEL" not in call.kernel.constexprs:
            continue
        from v4compile.codegen.kernels.moe_router import route_ids_at

        at = route_ids_at(call.kernel)
        launch = fs.program.launches[fs.launch_of[c]]
        ops = dict(launch.operands)
        if at is None or ops.get("gate") is None or ops.get("bias") is None:
            continue
        if (layer := _router_layer(ops["gate"])) is None:
            continue
        p = next(p for p in call.params if p.role == f"scratch:{at.scratch}")
        found[fs.launch_of[c]] = (last[fs.launch_of[c]], layer, p.buffer, p.offset + at.offset, at.rows, at.k)
    return [found[li] for li in sorted(found)]


def _router_layer(w) -> int | None:
    """The decoder layer of a router's weight operand (`layers.<i>.ffn.gate.weight`): a fused launch's `loc` may be
    the next layer's seam (`moe_mhc_post_pre` and `mhc_moe_mhc` stand at `layers.<i + 1>.attn_hc`)."""
    parts = w.buffer.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else None


def _router_part(rt, launch) -> tuple | None:
    """A learned router's choice from a launch's operand bytes by the reference: (layer, picks, their scores, every
    expert's score), or None for a launch without a learned router. The router's input: the launch's `x`, or for
    `mhc_moe_mhc` (the seam before the MoE fused in front of it) that seam's `x` as its reference computes it from
    the launch's `y`, `streams`, `post`, `comb` and `in_*` operands."""
    import torch

    from v4compile.ops import fused
    from v4compile.ops.moe import selection_scores

    ops = dict(launch.operands)
    w = ops.get("w") if launch.op == "router" else ops.get("gate") if "route_scale" in launch.attrs else None
    if w is None or ops.get("bias") is None or (layer := _router_layer(w)) is None:
        return None  # not a router, a hash-routed layer (chosen by token id), or not a decoder layer's
    t = {n: _typed(rt.views[a.buffer], a) for n, a in ops.items() if a is not None}
    if "x" in t:
        x = t["x"]
    elif launch.op == "mhc_moe_mhc":
        seam = ("y", "streams", "post", "comb", "in_fn", "in_base", "in_scale", "in_norm")
        x = fused.mhc_post_pre.ref(*(t.get(n) for n in seam),
                                   **{n[len("in_"):]: launch.attrs[n] for n in fused.IN_MHC_ATTRS})[1]
    else:
        log.warning("self-check: %s at %s holds a router whose input is not known here: its picks are not read",
                    launch.op, launch.loc)
        return None
    scores = selection_scores(x, t[next(n for n, a in ops.items() if a is w)], t["bias"],
                              bool(launch.attrs.get("fp32", False))).float()
    idx = torch.topk(scores, int(launch.attrs["k"]), dim=-1).indices
    return layer, idx.numpy(), scores.gather(-1, idx).numpy(), scores


def layer_check(sess, g, tol: float) -> tuple[Check, int | None]:
    """The golden's per-layer fingerprint against the device's streams on prompt 0's first chunk (`layer_streams`):
    each layer's largest |device - golden| relative to that layer's fingerprint scale, against the logits'
    tolerance. Returns the check and the first departing layer (-1: the embedding; L - 1 when every stream the
    device shows agrees: the last layer or the head, whose streams a fused head never materialises)."""
    streams = layer_streams(sess, g)
    if streams is None:
        return Check("layers", 0.0, tol, True, f"not measured: the {sess.device} device reports no per-layer "
                     "streams", measured=False), None
    from v4compile.golden import fingerprint

    fp = g.tensors["fingerprint"]  # [L + 1, T, dims]: the embedding, then each layer
    n = fp.shape[1]
    worst, first = 0.0, None
    for k, x in enumerate(streams):
        e = float(np.abs(fingerprint(x, 0, n) - fp[k]).max() / max(float(np.abs(fp[k]).max()), 1e-30))
        worst = max(worst, e)
        if first is None and not e <= tol:
            first = k - 1
    last = fp.shape[0] - 2  # the last layer
    agree = first is None
    if agree:
        first = last
        note = f"the {len(streams)} streams the device shows of {fp.shape[0]} agree: the departure is in layer {last} or the head"
    else:
        note = f"layer {first} departs first" if first >= 0 else "the embedding departs"
    return Check("layers", worst, tol, agree, note), first


def layer_streams(sess, g) -> list | None:
    """The device's residual streams on prompt 0's first prefill chunk (as `torch` tensors `[1, T, hc, D]`): after
    the embedding and after each layer whose streams the graph materialises (a fused head takes the last
    layer's). cpu device only (its prefill graph run once more with those values as extra outputs, on a
    sequence opened for it and released); None elsewhere."""
    import torch

    be = sess.backend
    ranks = getattr(be, "ranks", None)
    if hasattr(be, "rt") and (ranks is None or ranks.layout.dp == 1):  # host, hip, cuda: the C runtime's probes
        return _program_streams(sess, be, g)
    if ranks is not None:  # cpu: its segments' streams are not read; data parallel: prompt 0 is one replica's
        return None
    if not hasattr(be, "built"):
        return None
    import onnx

    cfg = sess.art.manifest["config"]
    want = (cfg["hc_mult"], cfg["dim"])
    s = sess.open()
    try:
        fname, inputs, _ = sess.prefill_chunk(s, g.prompts[0])
        key, spec = be._graphs[fname][0]
        cache = be.__dict__.setdefault("_stream_names", {})  # per function: the candidates (the graph is built once)

        def build():
            from .artifact_checks import onnx_model

            model = onnx_model(be.art, key, spec)
            cache[fname] = _stream_candidates(model)
            have = {o.name for o in model.graph.output}
            for c in sorted({c for cs in cache[fname] for c in cs} - have):
                model.graph.output.append(onnx.helper.make_tensor_value_info(c, onnx.TensorProto.FLOAT, None))
            return model, spec

        outs = be.run_outputs(be.built(f"{fname}.streams", build), inputs)
        found = []
        for cs in cache[fname]:
            x = next((outs[c] for c in cs if c in outs and outs[c].ndim == 4 and outs[c].shape[2:] == want), None)
            if x is None:
                break
            found.append(torch.from_numpy(np.array(x)))
        return found or None
    finally:
        sess.release(s)


def _program_streams(sess, be, g) -> list | None:
    """The host / hip / cuda device's streams on prompt 0's first chunk, through the C runtime's probe table
    (`CRuntime.probe_table`, v4rt.h `v4rt_probe_table`): each stream's launch result (`stream_launches`) copied
    to host memory after that launch's last call, on the runtime's stream in order with the kernels, before the
    arena reuses the bytes. The prefill chunk runs launch by launch (as prefill always does); the probes are
    cleared after this one run, so no captured graph ever holds one."""
    import dataclasses

    import torch

    from .c_backend import PROBE_AFTER

    s = sess.open()
    try:
        fname, inputs, _ = sess.prefill_chunk(s, g.prompts[0])
        rt = be.rt
        fs = rt.sched.functions[rt.sched.function_index(fname)]
        last = {li: c for c, li in enumerate(fs.launch_of)}  # a launch's results are complete after its last call
        probes, args = [], {}
        for li, (k, name) in stream_launches(be.program.functions[fname]).items():
            a = dict(fs.program.launches[li].results)[name]
            first, end = a.extent
            host = np.zeros(end - first, dtype=np.uint8)
            probes.append((last[li], PROBE_AFTER, rt.sched.buffer_index(fname, a.buffer), first, host))
            args[k] = (host, dataclasses.replace(a, offset=a.offset - first))
        rt.probe_table(fname, probes)
        try:
            be.run_outputs(fname, inputs)
        finally:
            rt.probe_table(fname, [])
        found = []
        for k in range(len(args)):
            if k not in args:
                break
            host, a = args[k]
            found.append(_typed(torch.from_numpy(host), a).float())
        return found or None
    finally:
        sess.release(s)


def stream_launches(f) -> dict[int, tuple[int, str]]:
    """Launch index -> (stream, result name) of a function program: the embedding's `hc_expand` (stream 0), and
    the launch that finishes layer i's residual (stream i + 1): `hc_post` of `layers.i.ffn_hc` or, fused into the
    next seam, the `mhc_post_pre` of `layers.{i+1}.attn_hc` (the last layer's goes into the fused head)."""
    out = {}
    for li, l in enumerate(f.launches):
        res = dict(l.results)
        if l.loc == "embed" and l.op == "hc_expand":
            out[li] = (0, "streams")
        elif l.loc.startswith("layers.") and "streams_out" in res:
            _, i, part = l.loc.split(".", 2)
            if part == "attn_hc" and l.op != "hc_post" and int(i) > 0:
                out[li] = (int(i), "streams_out")
            elif part == "ffn_hc" and l.op == "hc_post":
                out[li] = (int(i) + 1, "streams_out")
    return out


def _stream_candidates(model) -> list[list[str]]:
    """Per stream (the embedding, then layer 0, 1, ...): the graph's values that may be it, from the nodes' doc
    strings (`op scope`): the embedding's `hc_expand`, and a layer's residual after its experts, the `hc_post` of
    `layers.i.ffn_hc` or, fused into the next seam, the `mhc_post_pre` of `layers.{i+1}.attn_hc`; each a value
    consumed outside its op. The shape picks among them at run time."""
    scope_of, users = {}, {}
    for nd in model.graph.node:
        for o in nd.output:
            scope_of[o] = nd.doc_string
        for i in nd.input:
            users.setdefault(i, set()).add(nd.doc_string)

    def out_of(*docs):
        return [o for o, d in scope_of.items() if d in docs and any(u != d for u in users.get(o, ()))]

    out = [out_of("hc_expand embed")]
    i = 0
    while True:
        c = out_of(f"hc_post layers.{i}.ffn_hc", f"mhc_post_pre layers.{i + 1}.attn_hc")
        if not c:
            return out
        out.append(c)
        i += 1


def _replica(be) -> tuple[int, int]:
    """(this rank's data-parallel replica, the replicas): (0, 1) without data parallelism."""
    ranks = getattr(be, "ranks", None)
    if ranks is None or ranks.layout.dp == 1:
        return 0, 1
    return ranks.layout.replica(ranks.rank), ranks.layout.dp


def _any_rank(sess, mine: bool, able: bool = True) -> bool:
    """Whether any rank of a partitioned artifact wants the layer statistics and every rank can run them (`mine`
    alone for one process): every rank must agree before a step that runs collectives (a rank whose golden run
    failed is not able: its collectives may be broken)."""
    ranks = getattr(sess.backend, "ranks", None)
    if ranks is None:
        return mine and able
    import torch

    flag = torch.tensor([1.0 if mine else 0.0, 0.0 if able else 1.0], dtype=torch.float64)
    ranks._do("the self-check's layer statistics", ranks.dist.all_reduce, flag)
    return bool(flag[0].item() > 0 and flag[1].item() == 0)


def _done(sess, res: SelfCheckResult) -> SelfCheckResult:
    """Across the ranks of a partitioned artifact: every rank's verdict, rank 0 holding the worst one (the
    failing rank with the lowest number, else the largest error)."""
    ranks = getattr(sess.backend, "ranks", None)
    if ranks is None:
        return res
    import torch

    mine = torch.tensor([0.0 if res.passed else 1.0, min(res.max_error, 1e30), -1 if res.first_step is None
                         else res.first_step, -1 if res.first_lane is None else res.first_lane,
                         -2 if res.first_layer is None else res.first_layer], dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(ranks.world)]
    ranks._do("the self-check's gather", ranks.dist.all_gather, parts, mine)
    failed = [k for k, p in enumerate(parts) if p[0] > 0]
    worst = failed[0] if failed else int(np.argmax([float(p[1]) for p in parts]))
    p = parts[worst]
    if worst == ranks.rank:
        return SelfCheckResult(**{**_fields(res), "first_rank": worst if failed else None})
    step, lane, layer = int(p[2]), int(p[3]), int(p[4])
    return SelfCheckResult(**{**_fields(res), "passed": not failed, "max_error": float(p[1]),
                              "reason": res.reason or f"rank {worst} departs from the golden",
                              "first_step": None if step < 0 else step, "first_lane": None if lane < 0 else lane,
                              "first_layer": None if layer < -1 else layer, "first_rank": worst if failed else None})


def _fields(res: SelfCheckResult) -> dict:
    return {k: getattr(res, k) for k in res.__dataclass_fields__}
