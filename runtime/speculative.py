"""Speculative decoding on a compiled artifact: the generation loop's verify step mode (`SpecStep`, which
`batcher.Batcher` runs instead of a decode step) around the `verify_b<B>` and the MTP block's `draft_b<B>` /
`draft_c<T>` functions (the compiled counterpart of `v4compile/model/speculative.py`, which states what each
kind of state does).

One step for the live sequences (each at length L, its last sampled token x_L not yet fed, k_b drafts
d_1..d_k_b, and for sampling the distributions q_j they were drawn from):

1. reserve the pool blocks of positions L .. L + k_b and save every row those positions can write after
   L (`PoolUndo`, positions L + 1 .. L + k_b);
2. run `verify_b<B>` (the smallest bucket that holds the sequences): lanes x_L, d_1 .. d_k_b at positions
   L .. L + k_b, the unused lanes (k_b < K, the artifact's `draft_tokens`) as padding (pos -1: they write
   nothing); every lane's logits and final hidden streams;
3. `speculation.accept`: a drafts survive, then one more token (greedy: the argmax; sampling: min(1, p/q)
   and the residual, in float32 with k + 1 uniforms from the request's generator, `speculation.sample_accept`);
   the rows of the rejected positions (> L + a) are restored, the sequence is a + 1 tokens longer;
4. draft (`CompiledDraft`): `draft_b<B>` on the kept lanes (the verify's streams, each lane with the token
   that follows it: the surviving drafts and the new token) writes the MTP layer's window ring for those
   positions and gives d'_1 from the last kept lane; for k > 1 the block runs again on its own output
   streams and the last draft, one position further each time, and those ring writes are undone.

Greedy on the cpu device, steps 2-4 are one call (`CompiledDraft.fused`: the `spec_b<B>_d<k>` graph of
`codegen/onnx_spec.py`: verify, the acceptance and all k drafts, the recursive ones unrolled with their ring
writes never stored): on a small model a call costs mostly its nodes and its overhead, and a separate draft
call is ~0.2-0.3 of a decode step. That step (`SpecStep._fused_step`) reads no logits: the graph's argmax ids
give the acceptance (the host's rule applied to them, checked against the graph's kept lanes), and instead of
step 1's saved rows the run's writes are held (`OrtBackend.run_held`) and stored but those of the rejected
positions (`rejected_rows`: the rows `PoolUndo` would restore).

On the C runtime (host, hip, cuda), steps 2-4 are one captured call, with step 1's saved rows (its buffers cannot
hold a run's writes). Greedy: the program's `spec_b<B>` drafting one, `spec_b<B>_d<k>` drafting k > 1
(`passes/spec_steps.py`: the k - 1 recursive drafts in the call, each fed by the `draft_next` op as the host feeds
a `draft_b<B>` call; their MTP ring rows, past the verify's positions too, saved before the call and restored
after it with the rejected ones), its acceptance checked against the host's rule on its logits, its drafts the
next step's.
With any sampling sequence: `spec_s<B>` (the first draft; the k - 1 recursive ones `draft_b<B>` calls, each
drawn on the host from the request's generator), whose `spec_sample` op (greedy or sampled per sequence) computes
`speculation.sample_accept`; its random numbers are drawn before the call from each request's generator
(`speculation.uniforms`, as the two-call path's `accept` draws them) and passed in (`sampling_inputs`) with each
draft's q and the temperatures. On the host device the op runs that very function, so the one call and the two
calls give the same ids and bytes; a GPU's kernel computes the same float32 formulas with its own exp and
chunked sums (equal to float32 rounding: an id can differ only where a uniform falls within that rounding of a
boundary, both exactly the target's distribution), so a sampled acceptance is taken from the call unchecked
(`scripts/gpu_check.py` checks a device's against the host's rule: `spec_check.py`).
The cpu device samples with verify then draft (the token after the last kept lane drawn on the host between
them): its one-call graph draws no random numbers (the k drafts in it are argmaxes).

`draft_tokens="auto"` (the default of `Session.generate` and `run`): k in 0..K chosen per step, 0 a plain
decode step (`spec_auto.py` states the rule); a greedy plain step is the generation loop's own
(`Batcher._decode`, handed over as `SpecStep.plain`), so it costs what a plain generation's step does.

During prefill (`CompiledDraft.prefill`, through the prefix cache), `draft_c<T>` runs the block over each
prompt chunk the same way (the last chunk's last lane, with the first sampled token, drafts d_1). A `draft(sequence index, ids so far, k) -> k ids`
callable replaces the MTP block as the draft source (tests: an oracle, an always-wrong one); its drafts are
deterministic, so for sampling their q is one-hot at the draft (accepted with probability p(d), the
residual then p without d: still exactly the target's distribution).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from v4compile.artifact import cpu_spec_name, draft_name, lane_variant, spec_name, verify_name
from v4compile.errors import InputError
from v4compile.speculation import Acceptance, accept, check_draft_tokens, sample, survivors, uniforms

from .spec_auto import AutoK
from .undo import PoolUndo, access, written_rows

AUTO = "auto"  # draft_tokens: k chosen per step (`spec_auto.py`)

Draft = Callable[[int, list[int], int], list[int]]  # (prompt index, prompt + ids so far, k) -> k draft ids


def verify_functions(session) -> list[tuple[int, str, int]]:
    """(batch, function name, lanes) of the artifact's verify functions on K's lanes, smallest batch first."""
    return sorted((f.batch, f.name, f.tokens) for f in session.backend.functions().values()
                  if f.kind == "verify" and not lane_variant(f.name))


def by_lanes(session, kind: str) -> dict[int, list[tuple[int, str]]]:
    """batch -> [(lanes, name)] of the artifact's `kind` ("verify" / "draft") functions of each decode bucket,
    fewest lanes first: K's, and on the cpu device those of fewer lanes (`Buckets.verify_drafts`)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for f in session.backend.functions().values():
        if f.kind == kind and (kind == "verify" or f.name.startswith("draft_b")):
            out.setdefault(f.batch, []).append((f.tokens, f.name))
    return {b: sorted(v) for b, v in out.items()}


class Picker:
    """The token chosen from logits `[V]`: the argmax (temperature 0), or drawn from softmax(logits / t) with
    one uniform from `rng` (`speculation.sample`; also returned: the distribution, a draft's q)."""

    def __init__(self, temperature: float, rng: np.random.Generator):
        self.temperature, self.rng = temperature, rng

    def __call__(self, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        if self.temperature == 0:
            return int(np.argmax(logits)), None
        return sample(logits, self.temperature, self.rng)


def mtp_draft(session) -> None:
    """Check that the artifact carries the compiled MTP block (`speculative="mtp"` without a `draft` source):
    one clear error otherwise (no MTP weights, or compiled without --draft-tokens)."""
    fns = session.backend.functions()
    if not any(f.kind == "draft" for f in fns.values()):
        if not any(f.kind == "verify" for f in fns.values()):
            raise InputError("the artifact has no verify functions: it cannot decode speculatively",
                             where=str(session.art.path), expected="an artifact compiled with --draft-tokens")
        raise InputError("the artifact has no MTP weights: it cannot draft for --speculative mtp",
                         where=str(session.art.path), expected="an artifact carrying the MTP block")


class CompiledDraft:
    """The artifact's MTP block as the draft source: `draft_c<T>` after each prefill chunk, `draft_b<B>` after
    each verify step and for the recursive drafts (their MTP window-ring writes undone), but where a one-call
    step drafts in the call (`fused`)."""

    def __init__(self, session):
        mtp_draft(session)
        self.s = session
        fns = session.backend.functions().values()
        # K's lanes (`in_call`), and every bucket's lane counts (a step's own: `lanes`)
        self.batch_fns = sorted((f.batch, f.name, f.tokens) for f in fns
                                if f.name.startswith("draft_b") and not lane_variant(f.name))
        self.K = self.batch_fns[0][2] - 1 if self.batch_fns else 0  # the artifact's draft_tokens
        self.lanes = by_lanes(session, "draft")
        self.chunk_fns = {f.tokens: f.name for f in fns if f.name.startswith("draft_c")}
        # the MTP layer's window ring: the last of a slot's rings in the pool
        self.layer = int(session.art.manifest["pool"]["n_window_layers"]) - 1
        self.window = int(session.art.manifest["pool"]["window"])  # its positions (`whole_from`, `in_call`)
        self._fused: dict[tuple[int, int, int | None], str | None] = {}

    def fused(self, B: int, k: int = 1, lanes: int | None = None) -> str | None:
        """The one-call greedy step for bucket `B` drafting `k` tokens: on the cpu device `codegen/onnx_spec.py`'s
        (verify_b<B>, the acceptance and k unrolled copies of draft_b<B> in one ONNX graph, built when first asked
        for: `prepare`;
        with `lanes` = 1 + v < 1 + K the functions of those lanes, `verify_b<B>_d<v>` and `draft_b<B>_d<v>`);
        on the C runtime the program's `spec_b<B>` (k = 1) or `spec_b<B>_d<k>` (`passes/spec_steps.py`: the k - 1
        recursive drafts in the call too; a program compiled before it: `spec_b<B>`, the recursive drafts
        `draft_b<B>` calls); or None (a partitioned artifact, an artifact compiled before `spec_b<B>`: a verify
        call, then draft calls)."""
        key = (B, k, lanes)
        if key not in self._fused:
            self._fused[key] = self._fuse(B, k, lanes)
        return self._fused[key]

    def prepare(self, B: int, ks, lanes) -> None:
        """Make now, with their ONNX Runtime sessions, the cpu device's one-call graphs that bucket `B`'s steps may
        ask for: drafting each k of `ks` after a verify on each lane count of `lanes` (a step verifies what the
        last one drafted: fewer near a request's end, other counts after `auto` changed k). Made at first use
        instead, each would stall the step that first asks for it (~0.15-0.2 s a graph on tiny-doc, seconds on a
        larger graph), in the middle of a generation. For the cpu device's backend only (`SpecStep._held`)."""
        self.s.backend.prepare([n for k in ks for T in lanes if (n := self.fused(B, k, T))])

    def sampled(self, B: int) -> str | None:
        """The one-call step for bucket `B` with any sampled sequence: on the C runtime the program's `spec_s<B>`
        (`passes/spec_steps.py`: the `spec_sample` acceptance, greedy or sampled per sequence, and the first
        draft); elsewhere None (verify, the host's acceptance, then draft calls)."""
        return self._program_step(spec_name(B, sampled=True))

    def in_call(self, k: int) -> bool:
        """Whether the C runtime's one-call step may make k drafts in the call: the rows it restores after the
        call (positions L + 1 .. L + d + k - 1, d <= K the drafts it verifies) then share no ring row with a kept
        position (>= L): K + k - 1 < the window (V4's 128, tiny's 16; K <= `MAX_DRAFT_TOKENS` = 7)."""
        return self.K + k - 1 < self.window

    def _program_step(self, name: str) -> str | None:
        """`name` where the backend is the C runtime in one process and its program has that function."""
        backend = self.s.backend
        if getattr(backend, "program", None) is None or getattr(backend, "ranks", None) is not None:
            return None
        return name if name in backend.functions() else None

    def _fuse(self, B: int, k: int, lanes: int | None) -> str | None:
        backend = self.s.backend
        held = lanes - 1 if lanes is not None and lanes - 1 < self.K else None  # fewer lanes than K's: their functions
        vname, dname = verify_name(B, held), draft_name(B, held)
        if getattr(backend, "program", None) is not None:  # the C runtime: the program's own `spec_b<B>[_d<k>]`
            if held is not None:  # a program has K's lanes only
                return None
            return (self._program_step(spec_name(B, drafts=k)) if 1 < k and self.in_call(k)
                    else None) or self._program_step(spec_name(B))
        target = getattr(backend, "target", None)
        if (not hasattr(backend, "built") or target is None or vname not in target["functions"]
                or dname not in target["functions"]):
            return None
        v, d = target["functions"][vname], target["functions"][dname]
        if "segments" in v or "segments" in d:
            return None

        def build():
            from v4compile.codegen.onnx_spec import fuse_verify_draft

            from .artifact_checks import onnx_model

            model = fuse_verify_draft(onnx_model(backend.art, vname, v), onnx_model(backend.art, dname, d),
                                      v["batch"], v["tokens"], k, self.s.max_context - 1)
            return model, {"file": v["file"], "weights": sorted(set(v["weights"]) | set(d["weights"])),
                           "derived": {**v.get("derived", {}), **d.get("derived", {})},
                           "outputs": [o.name for o in model.graph.output]}
        return backend.built(cpu_spec_name(B, k, held), build)

    def _run(self, fname: str, hidden, ids, pos, seqs, B: int) -> dict[str, np.ndarray]:
        # data parallel: each replica's lanes on its ranks (`Session.run_lanes`)
        return self.s.run_lanes(fname, B, seqs, {"hidden": np.ascontiguousarray(hidden, dtype=np.float32),
                                                 "ids": ids, "pos": pos})

    def prefill(self, seq, prompt: list[int], pick: Picker) -> tuple[int, tuple]:
        """Chunked prefill of `prompt` into `seq` (as `Session.extend`, through the prefix cache), the MTP block
        over every chunk as soon as the token after it is known: the prompt's next token at once (so that a
        cached boundary's snapshot holds the block's ring at the boundary too), the last chunk's after the
        first token is `pick`ed. Returns that token and the sequence's entry for `drafts`."""
        pending = []

        def run(s, fname, inputs, n, rest):
            r = self.s.run_on(s.replica, fname, inputs)  # data parallel: the replica's own ranks
            chunk = (inputs["ids"].shape[1], r["streams"], rest[:n], s.length)
            if len(rest) > n:
                self._chunk(s, *chunk, rest[n])
            else:
                pending.append(chunk)
            return r["logits"][0]
        last = self.s.prefill_into(seq, list(prompt), run)
        tok, _ = pick(last)
        logits, out = self._chunk(seq, *pending[-1], tok)
        return tok, (seq, seq.length, logits[0], out[0, len(pending[-1][2]) - 1])

    def _chunk(self, seq, T: int, streams, part: list[int], start: int, nxt: int):
        """The MTP block over one prefill chunk: lane t (position start + t) with the token after it."""
        ids = np.zeros((1, T), dtype=np.int64)
        pos = np.full((1, T), -1, dtype=np.int64)
        ids[0, : len(part)] = part[1:] + [nxt]
        pos[0, : len(part)] = np.arange(start, start + len(part))
        r = self._run(self.chunk_fns[T], streams, ids, pos, [seq], 1)
        return r["logits"], r["streams"]

    def after_verify(self, B: int, streams, next_ids, kept, seqs) -> tuple[np.ndarray, np.ndarray]:
        """`draft_b<B>` over a verify step's kept lanes (pos -1 elsewhere; the draft function of the verify's
        lanes): the MTP logits of each sequence's last kept lane `[B, V]` and the block's output streams
        `[B, T, n, D]`."""
        fname = dict(self.lanes[B])[streams.shape[1]]
        r = self._run(fname, streams, next_ids, kept, seqs, B)
        return r["logits"], r["streams"]

    def drafts(self, entries: list[tuple], counts: list[int], picks: list[Picker]) -> list[tuple[list[int], list]]:
        """`counts[i]` drafts for each entry (sequence, its length L, the MTP logits `[V]` of its last kept lane
        and the block's output streams there `[n, D]`), picked by `picks[i]` (the request's own generator): the
        first from those logits, each next one from the block applied to its own streams and the last draft, at
        position L for the second draft, L + 1 for the third, ... (those MTP ring writes undone)."""
        toks: list[list[int]] = [[] for _ in entries]
        qs: list[list] = [[] for _ in entries]
        logits = [e[2] for e in entries]
        hs = [e[3] for e in entries]
        rounds = max(counts, default=0)
        if rounds == 0:
            return list(zip(toks, qs))
        B = next(f[0] for f in self.batch_fns if f[0] >= self.s.lanes([e[0] for e in entries]))
        T, fname = self.lanes[B][0]  # one live lane a sequence: the bucket's fewest lanes
        # this rank's pool holds its replica's sequences only (data parallel): their rows are the ones to undo
        spans = [(e[0].slot, list(e[0].blocks), e[1], e[1] + c - 2) for e, c in zip(entries, counts)
                 if c > 1 and e[0].replica == self.s.replica]
        undo = PoolUndo(self.s.backend, spans, window_layer=self.layer) if spans else None
        for j in range(rounds):
            for i, c in enumerate(counts):
                if j < c:
                    d, q = picks[i](logits[i])
                    toks[i].append(d)
                    qs[i].append(q)
            if j + 1 >= rounds:
                break
            n = max(B, len(entries))  # data parallel: more entries than one replica's batch (`run_lanes`)
            hidden = np.zeros((n, T, *hs[0].shape), dtype=np.float32)
            ids = np.zeros((n, T), dtype=np.int64)
            pos = np.full((n, T), -1, dtype=np.int64)
            for i, (e, c) in enumerate(zip(entries, counts)):
                if j + 1 < c:
                    hidden[i, 0], ids[i, 0], pos[i, 0] = hs[i], toks[i][-1], e[1] + j
            r = self._run(fname, hidden, ids, pos, [e[0] for e in entries], B)
            logits = list(r["logits"][: len(entries)])
            hs = list(r["streams"][: len(entries), 0])
        if undo is not None:
            undo.restore({})
        return list(zip(toks, qs))


@dataclass
class SpecState:
    """A request's state in the speculative step mode: its picker (its own generator), its MTP block entry
    after prefill (`CompiledDraft.prefill`), and its next drafts with the distributions they came from."""

    pick: Picker
    entry: tuple | None = None
    drafts: tuple[list[int], list] = ([], [])
    # the sequence length from which the MTP block's window ring holds every position of the window (a prefill
    # or a step without the block leaves holes in it, `SpecStep.skipped`): drafts made before it are worse than
    # the block's own and understate the acceptance, so "auto" does not observe their offers
    whole_from: int = 0


class SpecStep:
    """The generation loop's speculative step mode (`batcher.Batcher(spec=...)`): prefill with the MTP block
    over each chunk, then, for the live requests, one verify step instead of a decode step (the steps 1-4
    above). Drafts from the compiled MTP block, or from `draft(request index, prompt + ids so far, k)`. At
    most the largest verify bucket's batch of requests live at once; each accepts its own number of drafts."""

    def __init__(self, session, draft_tokens: int, draft: Draft | None = None):
        fns = verify_functions(session)
        if not fns:
            raise InputError("the artifact has no verify functions", where=str(session.art.path),
                             expected="an artifact compiled with --draft-tokens")
        self.s, self.fns, self.hook = session, fns, draft
        auto = isinstance(draft_tokens, str) and draft_tokens == AUTO
        self.k = check_draft_tokens(fns[0][2] - 1 if auto else draft_tokens, fns[0][2])
        if draft is not None and not callable(draft):
            raise InputError("draft must be a callable (prompt index, ids, k) -> k ids", found=type(draft).__name__)
        self.mtp = CompiledDraft(session) if draft is None else None
        self.stats = Acceptance(self.k)
        self.max_batch = fns[-1][0] * session.dp  # a verify bucket on each replica (data parallel)
        # "auto": k chosen per step (`spec_auto.py`); a `draft` source drafts the artifact's K every step
        self.auto = AutoK(self, self.k) if auto and self.mtp is not None else None
        self.k_now = self.k  # the drafts the next step is to verify (this step's choice with "auto")
        # the generation loop's own plain decode step (`Batcher._decode`, set by the loop): a greedy plain step
        # taken here costs what the loop's plain step costs (None: `_plain`'s own)
        self.plain: Callable[[], None] | None = None
        self._fns: dict[int, tuple[int, str, int]] = {}
        self._verify = by_lanes(session, "verify")
        self._of: dict[tuple[int, int], tuple[int, str]] = {}
        # the greedy one-call step's backend holds a run's writes (the cpu device, unpartitioned, one replica):
        # `_fused_step`, its inputs the function's own bound arrays (`_inputs`: fused name -> those arrays)
        self._held = (self.mtp is not None and session.dp == 1 and hasattr(session.backend, "run_held")
                      and getattr(session.backend, "ranks", None) is None)
        self._inputs: dict[str, dict[str, np.ndarray]] = {}
        self._ready: set[int] = set()  # buckets whose one-call graphs are made (`CompiledDraft.prepare`)

    @staticmethod
    def check(top_p: float) -> None:
        if top_p != 1:
            raise InputError("speculative decoding samples without top-p", expected="top_p 1", found=top_p)

    def _wanted(self, r) -> int:
        """Drafts worth making for request `r`: those beyond its last wanted token are wasted."""
        return min(self.k_now, r.max_new_tokens - len(r.ids) - 1)

    def prefill(self, r, batch: int = 1) -> int:
        """Prefill `r`'s prompt into its sequence (the MTP block over each chunk); its first token. `batch`:
        the sequences it is likely to step with ("auto": where the rule says plain decoding for that bucket,
        the MTP block is skipped, as plain steps skip it: its ring is only worth writing for drafts)."""
        r.spec = SpecState(Picker(r.temperature, r.rng))
        if self.mtp is None or (self.auto is not None and not self.auto.prefills_mtp(self._bucket_of(batch))):
            self.skipped(r, len(r.prompt) - 1)
            return r.spec.pick(self.s.extend(r.seq, r.prompt))[0]
        tok, r.spec.entry = self.mtp.prefill(r.seq, r.prompt, r.spec.pick)
        return tok

    def skipped(self, r, last: int) -> None:
        """Request `r`'s positions up to `last` were computed without the MTP block (its ring not written)."""
        if self.mtp is not None:
            r.spec.whole_from = last + 1 + self.mtp.window

    def _fn(self, lanes: int) -> tuple[int, str, int]:
        """The smallest verify bucket that holds `lanes` (found once per count: the loop asks every step)."""
        fn = self._fns.get(lanes)
        if fn is None:
            fn = self._fns[lanes] = next(f for f in self.fns if f[0] >= lanes)
        return fn

    def verify_of(self, B: int, held: int) -> tuple[int, str]:
        """(lanes, name) of bucket `B`'s verify function with the fewest lanes that hold `held` drafts a
        sequence (K's, or on the cpu device one of fewer lanes: a step costs its lanes there)."""
        got = self._of.get((B, held))
        if got is None:
            got = self._of[B, held] = next(x for x in self._verify[B] if x[0] > held)
        return got

    def _bucket_of(self, n: int) -> int:
        return next((f[0] for f in self.fns if f[0] >= n), self.fns[-1][0])

    def joined(self, reqs: list) -> None:
        """The first drafts of the requests just admitted (still live after their first token)."""
        if self.auto is not None:  # as many as the rule wants now (none while it says plain decoding)
            self.k_now = self.auto.first(self._bucket_of(len(reqs)))
            reqs = [r for r in reqs if r.spec.entry is not None]  # prefilled without the MTP block: no drafts
        if self.mtp is not None and reqs:
            ds = self.mtp.drafts([r.spec.entry for r in reqs], [self._wanted(r) for r in reqs],
                                 [r.spec.pick for r in reqs])
            for r, d in zip(reqs, ds):
                r.spec.drafts = d

    def _hooked(self, r) -> tuple[list[int], list]:
        kb = self._wanted(r)
        d = [int(x) for x in self.hook(r.index, r.prompt + r.ids, kb)] if kb else []
        if len(d) != kb or any(not 0 <= x < self.s.vocab for x in d):
            raise InputError("the draft source gave a wrong draft", where=f"prompt {r.index}",
                             expected=f"{kb} ids in 0..{self.s.vocab - 1}", found=d[:8])
        return d, [np.eye(1, self.s.vocab, x)[0] if r.temperature else None for x in d]

    def step(self, live: list, deliver: Callable[[object, list[int]], int]) -> None:
        """One verify step over the live requests: their new tokens go to `deliver(request, ids) -> how many
        it took` (it may end the request and release its sequence); those still live get their next drafts."""
        fn = self._fn(len(live) if self.s.dp == 1 else self.s.lanes([r.seq for r in live]))
        if self._held and fn[0] not in self._ready and all(r.temperature == 0 for r in live):
            self._ready.add(fn[0])  # the bucket's one-call graphs, before its first greedy step
            ks = range(1, self.k + 1) if self.auto is not None else (self.k,)
            self.mtp.prepare(fn[0], ks, sorted({self.verify_of(fn[0], h)[0] for h in range(max(ks) + 1)}))
        if self.auto is None:
            return self._step(live, deliver, fn)
        self.auto.prior(fn[0])  # measured first (a new bucket): untimed
        t0 = time.process_time()
        self._step(live, deliver, fn)
        self.auto.timed(fn[0], self._ran, time.process_time() - t0)

    def _step(self, live: list, deliver, fn: tuple[int, str, int]) -> None:
        s = self.s
        if self.mtp is None:
            for r in live:
                r.spec.drafts = self._hooked(r)
        B = fn[0]
        if self.auto is not None:
            self.k_now = self.auto.pick(B)
            # what the step is a sample of (`AutoK.timed`): a plain step, one drafting k, or (None) neither
            self._ran = self.k_now or None
            if self.k_now == 0 and not any(r.spec.drafts[0] for r in live):
                self._ran = 0
                return self._plain(live, deliver)
        T, fname = self.verify_of(B, max(len(r.spec.drafts[0]) for r in live))
        if self.k_now and self._held and all(r.temperature == 0 for r in live):
            fused = self.mtp.fused(B, self.k_now, T)
            if fused:
                return self._fused_step(live, deliver, fused, T)
        # data parallel: every replica's lanes (`run_lanes`), at least the bucket's
        rows_ids, rows_pos = self._lanes(live, T)
        for _ in range(B - len(live)):
            rows_ids.append([0] * T)
            rows_pos.append([-1] * T)
        ids, pos = np.array(rows_ids, dtype=np.int64), np.array(rows_pos, dtype=np.int64)
        seqs = [r.seq for r in live]
        greedy = all(r.temperature == 0 for r in live)
        fused = self.mtp.fused(B, self.k_now, T) if self.mtp is not None and greedy and self.k_now else None
        inputs = {"ids": ids, "pos": pos}
        sampled = self.mtp.sampled(B) if self.mtp is not None and not greedy and self.k_now else None
        if sampled:  # the uniforms drawn now, from each sequence's generator, as the host's `accept` draws them
            fused = sampled
            inputs.update(sampling_inputs(live, B, T, s.vocab))
        # this rank's pool (data parallel: its replica's sequences): the rows the drafts' positions may write
        undo = PoolUndo(s.backend, [(q.slot, list(q.blocks), q.length + 1, q.length + len(r.spec.drafts[0]))
                                    for r, q in zip(live, seqs) if q.replica == s.replica])
        # `spec_b<B>_d<k>`: the recursive drafts in the call (positions L' .. L' + k - 2, L' <= L + d + 1 the new
        # length) write MTP ring rows past the verify's positions too: saved now, restored with the verify's
        inner = self.k_now if fused and self.k_now > 1 and fused == spec_name(B, drafts=self.k_now) else 0
        ring = PoolUndo(s.backend, [(q.slot, list(q.blocks), q.length + len(r.spec.drafts[0]) + 1,
                                     q.length + len(r.spec.drafts[0]) + inner - 1)
                                    for r, q in zip(live, seqs) if q.replica == s.replica],
                        window_layer=self.mtp.layer) if inner else None
        res = s.run_lanes(fused or fname, B, seqs, inputs)
        logits = res["logits"]
        keep, news, kept_lane = {}, [], {}
        next_ids, kept = np.zeros_like(ids), pos.copy()
        for b, r in enumerate(live):
            (d, q), r.spec.drafts = r.spec.drafts, ([], [])
            if sampled and r.temperature:  # the step's own acceptance (its arithmetic is `accept`'s)
                a, tok = survivors(res["spec.next_ids"][b], res["spec.kept_pos"][b])
            else:
                a, tok = accept(d, logits[b, : 1 + len(d)], np.stack(q) if r.temperature and d else None, r.rng,
                                r.temperature)
            r.seq.length += a + 1
            if r.seq.replica == s.replica:
                keep[r.seq.slot] = r.seq.length
            next_ids[b, : a + 1] = d[:a] + [tok]
            kept[b, a + 1:] = -1
            kept_lane[b] = a
            if fused and ((res["spec.kept_pos"][b] != kept[b]).any()
                          or (res["spec.next_ids"][b, : a + 1] != next_ids[b, : a + 1]).any()):
                raise RuntimeError(f"{fused}'s in-graph acceptance disagrees with the host's")
            news.append((a, d[:a] + [tok], len(d)))
            if self.auto is not None:
                if r.seq.length - a - 1 >= r.spec.whole_from:
                    self.auto.observe(a, len(d))
                if not self.k_now:  # a verify without drafting: the block is not run on its lanes
                    self.skipped(r, r.seq.length - 1)
        undo.restore(keep)
        if ring is not None:
            ring.restore(keep)
        for r, (a, new, nd) in zip(live, news):
            self.stats.add(a, deliver(r, new), nd)
        if inner:  # the call drafted on every sequence (greedy: no q); those still live keep what they want
            made = np.stack([res[f"spec.draft{j}"][:, 0] for j in range(1, inner + 1)], axis=1).tolist()
            for b, r in enumerate(live):
                if not r.done:
                    n = self._wanted(r)
                    r.spec.drafts = (made[b][:n], [None] * n)
            return
        nxt = [b for b, r in enumerate(live) if not r.done]
        for b, r in enumerate(live):
            if r.done:
                kept[b] = -1  # a finished sequence needs no drafts
        if self.mtp is None or not any(self._wanted(live[b]) for b in nxt):
            return  # no draft wanted: the sequences' last verify lanes give their last tokens
        if fused:  # the graph drafted on every sequence's kept lanes already
            mlogits, mstreams = res["draft.logits"], res["draft.streams"]
        else:
            mlogits, mstreams = self.mtp.after_verify(B, res["streams"], next_ids, kept, seqs)
        reqs = [live[b] for b in nxt]
        entries = [(live[b].seq, live[b].seq.length, mlogits[b], mstreams[b, kept_lane[b]]) for b in nxt]
        for r, d in zip(reqs, self.mtp.drafts(entries, [self._wanted(r) for r in reqs], [r.spec.pick for r in reqs])):
            r.spec.drafts = d

    def _lanes(self, live: list, T: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each live sequence's T verify lanes as lists (its last id and drafts, their positions; padding ids 0 at
        position -1, which writes nothing), the pool reserved for the drafts' positions. Lists: one numpy write an
        array costs less than one a lane."""
        rows_ids, rows_pos = [], []
        for r in live:
            q, L, d = r.seq, r.seq.length, r.spec.drafts[0]
            self.s.reserve(q, L + len(d))
            pad = T - 1 - len(d)
            rows_ids.append([r.ids[-1], *d] + [0] * pad)
            rows_pos.append([*range(L, L + 1 + len(d))] + [-1] * pad)
        return rows_ids, rows_pos

    def _plain(self, live: list, deliver) -> None:
        """k = 0 ("auto"), no drafts held: a plain decode step (the MTP block's ring not written). Greedy, the
        generation loop's own (`plain`: the same ids, argmax either way); sampling draws as the verify step's
        picker does (the loop's sampler would draw other ids from the same generator)."""
        for r in live:
            self.skipped(r, r.seq.length)
        if self.plain is not None and all(r.temperature == 0 for r in live):
            self.plain()
            n = len(live)  # each sequence one step and one token (`Acceptance.add(0, 1, 0)` each)
            self.stats.steps += n
            self.stats.tokens += n
            return
        logits = self.s.decode([r.seq for r in live], [r.ids[-1] for r in live])
        for r, row in zip(live, logits):
            tok, _ = r.spec.pick(row)
            self.stats.add(0, deliver(r, [tok]), 0)

    def _fused_step(self, live: list, deliver, fused: str, T: int) -> None:
        """The greedy one-call step on a backend that can hold a run's writes (the cpu device): the graph's
        acceptance (checked against the host's rule on the graph's argmax ids: a few ints a sequence, no
        logits read), its writes stored but those of the rejected positions (no rows saved before the run,
        none restored after), and its in-graph drafts (`spec.drafts`) the next step's. Its inputs are written
        into the arrays the function's session has bound (`OrtBackend.step_inputs`): nothing is made or bound
        a step."""
        s = self.s
        x = self._inputs.get(fused)
        if x is None:
            x = self._inputs[fused] = s.backend.step_inputs(fused)
        # one write an array (as `_step`'s lists), padding lanes (pos -1: they write nothing) after
        rows_ids, rows_pos = self._lanes(live, T)
        B = len(x["ids"])
        x["ids"][...] = rows_ids + [[0] * T] * (B - len(live))
        x["pos"][...] = rows_pos + [[-1] * T] * (B - len(live))
        s.fill_table([r.seq for r in live], x["block_table"], x["slot"])
        res, store = s.backend.run_held(fused, x, views=True)  # read below, before any other run
        # read as lists, counted in Python: the first numpy arithmetic after a run finds numpy's code out of the
        # caches the run went through (`(kept_pos >= 0).sum(1)` there: 10-50 us a step against ~4 us warm;
        # tiny-doc k=1, a step ~0.9 ms)
        best_ids, drafts, kept = (res[n].tolist() for n in ("spec.next_ids", "spec.drafts", "spec.kept_pos"))
        rows = access(s.backend)
        skip: dict[str, set[int]] = {}
        news = []
        for b, r in enumerate(live):
            d, r.spec.drafts = r.spec.drafts[0], ([], [])
            best, a = best_ids[b], 0
            while a < len(d) and best[a] == d[a]:
                a += 1
            if sum(p >= 0 for p in kept[b]) != a + 1:
                raise RuntimeError(f"{fused}'s in-graph acceptance disagrees with the host's")
            q, L = r.seq, r.seq.length
            if self.auto is not None and L >= r.spec.whole_from:
                self.auto.observe(a, len(d))
            if a < len(d):
                rejected_rows(rows, q, L + a + 1, L + len(d), skip)  # not stored
            q.length += a + 1
            news.append((a, d[:a] + [best[a]], len(d)))
        store(skip)
        for r, (a, new, nd) in zip(live, news):
            self.stats.add(a, deliver(r, new), nd)
        for b, r in enumerate(live):
            if not r.done:
                n = self._wanted(r)
                r.spec.drafts = (drafts[b][:n], [None] * n)


def sampling_inputs(live: list, B: int, T: int, V: int) -> dict[str, np.ndarray]:
    """`spec_s<B>`'s own inputs for the live requests (padding after): each draft's q (lane j: draft j's), the
    step's uniforms (`speculation.uniforms`, drawn here from each sampling request's generator: 1 + its drafts),
    the temperatures (0: greedy)."""
    q = np.zeros((B, T, V), dtype=np.float32)
    u = np.zeros((B, T), dtype=np.float32)
    t = np.zeros(B, dtype=np.float32)
    for b, r in enumerate(live):
        if r.temperature:
            d, qs = r.spec.drafts
            if d:
                q[b, 1: 1 + len(d)] = np.stack(qs)
            u[b, : 1 + len(d)] = uniforms(r.rng, len(d))
            t[b] = r.temperature
    return {"draft_probs": q, "uniforms": u, "temperature": t}


def rejected_rows(rows, seq, first: int, last: int, into: dict[str, set[int]]) -> dict[str, set[int]]:
    """Add to `into` the rows (`undo.written_rows`, per buffer) that positions `first .. last` of `seq` write:
    those a held verify run (`OrtBackend.run_held`) does not store, where `PoolUndo` would restore them."""
    for x in range(first, last + 1):
        for name, row in written_rows(rows.geometry, rows, seq.slot, seq.blocks, x):
            into.setdefault(name, set()).add(row)
    return into


def speculative_generate(session, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_tokens: int,
                         draft: Draft | None = None, stop_ids: Sequence[int] = (), temperature: float = 0.0,
                         seed: int | None = None) -> tuple[list[list[int]], Acceptance]:
    """`session.generate(..., speculative="mtp")` (the generation loop's verify step) and its acceptance
    statistics: greedy ids identical to plain decoding's; with `temperature` > 0 distributed as plain
    sampling's (top-p 1), each prompt with its own generator as `generate` seeds them."""
    out = session.generate(prompts, max_new_tokens, temperature=temperature, seed=seed, stop_ids=stop_ids,
                           speculative="mtp", draft_tokens=draft_tokens, draft=draft)
    return out, session.last_acceptance
