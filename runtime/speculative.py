"""Speculative decoding on a compiled artifact: the session's loop around the `verify_b<B>` and the MTP
block's `draft_b<B>` / `draft_c<T>` functions (the compiled counterpart of `v4compile/model/speculative.py`,
which states what each kind of state does).

One step for the live sequences (each at length L, its last sampled token x_L not yet fed, k_b drafts
d_1..d_k_b, and for sampling the distributions q_j they were drawn from):

1. reserve the pool blocks of positions L .. L + k_b and save every row those positions can write after
   L (`PoolUndo`, positions L + 1 .. L + k_b);
2. run `verify_b<B>` (the smallest bucket that holds the sequences): lanes x_L, d_1 .. d_k_b at positions
   L .. L + k_b, the unused lanes (k_b < K, the artifact's `draft_tokens`) as padding (pos -1: they write
   nothing); every lane's logits and final hidden streams;
3. `speculation.accept`: a drafts survive, then one more token (greedy: the argmax; sampling: min(1, p/q)
   and the residual); the rows of the rejected positions (> L + a) are restored, the sequence is a + 1
   tokens longer;
4. draft (`CompiledDraft`): `draft_b<B>` on the kept lanes (the verify's streams, each lane with the token
   that follows it: the surviving drafts and the new token) writes the MTP layer's window ring for those
   positions and gives d'_1 from the last kept lane; for k > 1 the block runs again on its own output
   streams and the last draft, one position further each time, and those ring writes are undone.

Greedy on the cpu device, steps 2-4's verify and first draft are one call (`CompiledDraft.fused`: the
`spec_b<B>` graph of `codegen/onnx_spec.py`, the acceptance in the graph too, checked against step 3's each
step): on a small model a call costs mostly its nodes and its overhead, and a separate draft call is ~0.2 of a
decode step.

After prefill (`CompiledDraft.prefill`), `draft_c<T>` runs the block over each prompt chunk the same way
(its last lane, with the first sampled token, drafts d_1). A `draft(sequence index, ids so far, k) -> k ids`
callable replaces the MTP block as the draft source (tests: an oracle, an always-wrong one); its drafts are
deterministic, so for sampling their q is one-hot at the draft (accepted with probability p(d), the
residual then p without d: still exactly the target's distribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from v4compile.errors import InputError
from v4compile.speculation import Acceptance, accept, check_draft_tokens, draw, probs

from .undo import PoolUndo

Draft = Callable[[int, list[int], int], list[int]]  # (prompt index, prompt + ids so far, k) -> k draft ids


def verify_functions(session) -> list[tuple[int, str, int]]:
    """(batch, function name, lanes) of the artifact's verify functions, smallest batch first."""
    return sorted((f.batch, f.name, f.tokens) for f in session.backend.functions().values() if f.kind == "verify")


class Picker:
    """The token chosen from logits `[V]`: the argmax (temperature 0), or drawn from softmax(logits / t) with
    `rng` (also returned: the distribution, a draft's q)."""

    def __init__(self, temperature: float, rng: np.random.Generator):
        self.temperature, self.rng = temperature, rng

    def __call__(self, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        if self.temperature == 0:
            return int(np.argmax(logits)), None
        p = probs(logits, self.temperature)
        return draw(p, self.rng), p


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
    each verify step and for the recursive drafts (their MTP window-ring writes undone)."""

    def __init__(self, session, pick: Picker):
        mtp_draft(session)
        self.s, self.pick = session, pick
        fns = session.backend.functions().values()
        self.batch_fns = sorted((f.batch, f.name, f.tokens) for f in fns if f.name.startswith("draft_b"))
        self.chunk_fns = {f.tokens: f.name for f in fns if f.name.startswith("draft_c")}
        # the MTP layer's window ring: the last of a slot's rings in the pool
        self.layer = int(session.art.manifest["pool"]["n_window_layers"]) - 1
        self._fused: dict[int, str | None] = {}

    def fused(self, B: int) -> str | None:
        """The cpu device's one-call greedy step for bucket `B` (`codegen/onnx_spec.py`: verify_b<B>, the
        acceptance and draft_b<B> in one ONNX graph, built at first use), or None (the host device, or a
        partitioned artifact: a verify call, then a draft call)."""
        if B not in self._fused:
            self._fused[B] = self._fuse(B)
        return self._fused[B]

    def _fuse(self, B: int) -> str | None:
        backend = self.s.backend
        vname, dname = f"verify_b{B}", next((f for b, f, _ in self.batch_fns if b == B), None)
        target = getattr(backend, "target", None)
        if not hasattr(backend, "built") or target is None or dname is None:
            return None
        v, d = target["functions"][vname], target["functions"][dname]
        if "segments" in v or "segments" in d:
            return None

        def build():
            from v4compile.codegen.onnx_spec import fuse_verify_draft

            from .artifact_checks import onnx_model

            model = fuse_verify_draft(onnx_model(backend.art, vname, v), onnx_model(backend.art, dname, d),
                                      v["batch"], v["tokens"])
            return model, {"file": v["file"], "weights": sorted(set(v["weights"]) | set(d["weights"])),
                           "derived": {**v.get("derived", {}), **d.get("derived", {})},
                           "outputs": [o.name for o in model.graph.output]}
        return backend.built(f"spec_b{B}", build)

    def _run(self, fname: str, hidden, ids, pos, seqs, B: int) -> dict[str, np.ndarray]:
        table, slot = self.s._table(seqs, B)
        return self.s.backend.run_outputs(fname, {"hidden": np.ascontiguousarray(hidden, dtype=np.float32),
                                                  "ids": ids, "pos": pos, "block_table": table, "slot": slot})

    def prefill(self, seq, prompt: list[int]) -> tuple[int, tuple]:
        """Chunked prefill of `prompt` into `seq` (as `Session.extend`), the MTP block over every chunk once the
        token after it is known. Returns the first new token and the sequence's entry for `drafts`."""
        pending, ids, last = None, list(prompt), None
        while ids:
            fname, inputs, n = self.s.prefill_chunk(seq, ids)
            part, ids = ids[:n], ids[n:]
            r = self.s.backend.run_outputs(fname, inputs)
            if pending is not None:
                self._chunk(seq, *pending, part[0])
            pending = (inputs["ids"].shape[1], r["streams"], part, seq.length)
            seq.length += n
            last = r["logits"][0]
        tok, _ = self.pick(last)
        logits, out = self._chunk(seq, *pending, tok)
        return tok, (seq, seq.length, logits[0], out[0, len(pending[2]) - 1])

    def _chunk(self, seq, T: int, streams, part: list[int], start: int, nxt: int):
        """The MTP block over one prefill chunk: lane t (position start + t) with the token after it."""
        ids = np.zeros((1, T), dtype=np.int64)
        pos = np.full((1, T), -1, dtype=np.int64)
        ids[0, : len(part)] = part[1:] + [nxt]
        pos[0, : len(part)] = np.arange(start, start + len(part))
        r = self._run(self.chunk_fns[T], streams, ids, pos, [seq], 1)
        return r["logits"], r["streams"]

    def after_verify(self, B: int, streams, next_ids, kept, seqs) -> tuple[np.ndarray, np.ndarray]:
        """`draft_b<B>` over a verify step's kept lanes (pos -1 elsewhere): the MTP logits of each sequence's
        last kept lane `[B, V]` and the block's output streams `[B, T, n, D]`."""
        fname = next(f for b, f, _ in self.batch_fns if b == B)
        r = self._run(fname, streams, next_ids, kept, seqs, B)
        return r["logits"], r["streams"]

    def drafts(self, entries: list[tuple], counts: list[int]) -> list[tuple[list[int], list]]:
        """`counts[i]` drafts for each entry (sequence, its length L, the MTP logits `[V]` of its last kept lane
        and the block's output streams there `[n, D]`): the first from those logits, each next one from the
        block applied to its own streams and the last draft, at position L for the second draft, L + 1 for the
        third, ... (those MTP ring writes undone)."""
        toks: list[list[int]] = [[] for _ in entries]
        qs: list[list] = [[] for _ in entries]
        logits = [e[2] for e in entries]
        hs = [e[3] for e in entries]
        rounds = max(counts, default=0)
        if rounds == 0:
            return list(zip(toks, qs))
        B, fname, T = next(f for f in self.batch_fns if f[0] >= len(entries))
        spans = [(e[0].slot, list(e[0].blocks), e[1], e[1] + c - 2) for e, c in zip(entries, counts) if c > 1]
        undo = PoolUndo(self.s.backend, spans, window_layer=self.layer) if spans else None
        for j in range(rounds):
            for i, c in enumerate(counts):
                if j < c:
                    d, q = self.pick(logits[i])
                    toks[i].append(d)
                    qs[i].append(q)
            if j + 1 >= rounds:
                break
            hidden = np.zeros((B, T, *hs[0].shape), dtype=np.float32)
            ids = np.zeros((B, T), dtype=np.int64)
            pos = np.full((B, T), -1, dtype=np.int64)
            for i, (e, c) in enumerate(zip(entries, counts)):
                if j + 1 < c:
                    hidden[i, 0], ids[i, 0], pos[i, 0] = hs[i], toks[i][-1], e[1] + j
            r = self._run(fname, hidden, ids, pos, [e[0] for e in entries], B)
            logits = list(r["logits"][: len(entries)])
            hs = list(r["streams"][: len(entries), 0])
        if undo is not None:
            undo.restore({})
        return list(zip(toks, qs))


def speculative_generate(session, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_tokens: int,
                         draft: Draft | None = None, stop_ids: Sequence[int] = (), temperature: float = 0.0,
                         seed: int | None = None) -> tuple[list[list[int]], Acceptance]:
    """New ids for every prompt and the acceptance statistics: greedy ids identical to `session.generate`'s;
    with `temperature` > 0 distributed as plain sampling's (top-p 1). Drafts from the compiled MTP block, or
    from `draft`. Continuous batching: at most the largest verify bucket's batch of sequences live at once;
    a waiting prompt joins (its prefill) when a slot is free; each sequence accepts its own number of drafts."""
    fns = verify_functions(session)
    if not fns:
        raise InputError("the artifact has no verify functions", where=str(session.art.path),
                         expected="an artifact compiled with --draft-tokens")
    K = fns[0][2] - 1
    k = check_draft_tokens(draft_tokens, K + 1)
    if draft is not None and not callable(draft):
        raise InputError("draft must be a callable (prompt index, ids, k) -> k ids", found=type(draft).__name__)
    rng = np.random.default_rng(seed)
    pick = Picker(temperature, rng)
    mtp = CompiledDraft(session, pick) if draft is None else None
    prompts = [session.check_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > session.max_context:
            raise InputError("prompt + max_new_tokens exceed the compiled maximum context", where=f"prompt {i}",
                             expected=f"<= {session.max_context} tokens", found=len(p) + max_new_tokens)
    stops = {int(t) for t in stop_ids}
    stats = Acceptance(k)
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out, stats
    seqs: dict[int, object] = {}  # prompt index -> its open sequence
    drafts: dict[int, tuple[list[int], list]] = {}  # prompt index -> its next drafts and their q

    def wanted(i: int) -> int:  # drafts beyond the last token wanted are wasted
        return min(k, max_new_tokens - len(out[i]) - 1)

    def hooked(i: int) -> tuple[list[int], list]:
        kb = wanted(i)
        d = [int(x) for x in draft(i, prompts[i] + out[i], kb)] if kb else []
        if len(d) != kb or any(not 0 <= x < session.vocab for x in d):
            raise InputError("the draft source gave a wrong draft", where=f"prompt {i}",
                             expected=f"{kb} ids in 0..{session.vocab - 1}", found=d[:8])
        return d, [np.eye(1, session.vocab, x)[0] if temperature else None for x in d]

    waiting, live = list(range(len(prompts))), []
    try:
        while waiting or live:
            joined = []
            while waiting and session.free_slots and len(live) + len(joined) < fns[-1][0]:
                i = waiting.pop(0)
                seqs[i] = session.open()
                if mtp is not None:
                    tok, entry = mtp.prefill(seqs[i], prompts[i])
                else:
                    tok, _ = pick(session.extend(seqs[i], prompts[i]))
                out[i].append(tok)
                if len(out[i]) < max_new_tokens and tok not in stops:
                    joined.append((i, entry if mtp is not None else None))
                else:
                    session.release(seqs.pop(i))
            if joined:
                if mtp is not None:
                    for (i, _), d in zip(joined, mtp.drafts([e for _, e in joined], [wanted(i) for i, _ in joined])):
                        drafts[i] = d
                live += [i for i, _ in joined]
            if not live:
                if waiting:  # no slot came free and none is live: another loop would never progress
                    raise InputError("no free sequence slot for the waiting prompts", found=f"{len(session.seqs)} open")
                continue
            if mtp is None:
                for i in live:
                    drafts[i] = hooked(i)
            B, fname, T = next(f for f in fns if f[0] >= len(live))
            ids = np.zeros((B, T), dtype=np.int64)
            pos = np.full((B, T), -1, dtype=np.int64)
            spans = []
            for b, i in enumerate(live):
                s, L, d = seqs[i], seqs[i].length, drafts[i][0]
                session._reserve(s, L + len(d))
                ids[b, : 1 + len(d)] = [out[i][-1]] + d
                pos[b, : 1 + len(d)] = np.arange(L, L + 1 + len(d))
                spans.append((s.slot, list(s.blocks), L + 1, L + len(d)))
            undo = PoolUndo(session.backend, spans)
            table, slot = session._table([seqs[i] for i in live], B)
            fused = mtp.fused(B) if mtp is not None and temperature == 0 else None
            res = session.backend.run_outputs(fused or fname, {"ids": ids, "pos": pos, "block_table": table,
                                                               "slot": slot})
            logits = res["logits"]
            keep, nxt, kept_lane = {}, [], {}
            next_ids, kept = np.zeros((B, T), dtype=np.int64), pos.copy()
            for b, i in enumerate(live):
                d, q = drafts.pop(i)
                a, tok = accept(d, logits[b, : 1 + len(d)], np.stack(q) if temperature and d else None, rng,
                                temperature)
                new = (d[:a] + [tok])[: max_new_tokens - len(out[i])]
                if any(t in stops for t in new):
                    new = new[: next(j for j, t in enumerate(new) if t in stops) + 1]
                stats.add(a, len(new), len(d))
                out[i] += new
                seqs[i].length += a + 1
                keep[seqs[i].slot] = seqs[i].length
                next_ids[b, : a + 1] = d[:a] + [tok]
                kept[b, a + 1:] = -1
                kept_lane[i] = a
                if fused and ((res["spec.kept_pos"][b] != kept[b]).any()
                              or (res["spec.next_ids"][b, : a + 1] != next_ids[b, : a + 1]).any()):
                    raise RuntimeError(f"{fused}'s in-graph acceptance disagrees with the host's")
                if len(out[i]) < max_new_tokens and new[-1] not in stops:
                    nxt.append(i)
                else:
                    kept[b] = -1  # a finished sequence needs no drafts
            undo.restore(keep)
            if mtp is not None and any(wanted(i) for i in nxt):
                if fused:  # the graph drafted on every sequence's kept lanes already
                    mlogits, mstreams = res["draft.logits"], res["draft.streams"]
                else:
                    mlogits, mstreams = mtp.after_verify(B, res["streams"], next_ids, kept, [seqs[i] for i in live])
                entries = [(seqs[i], seqs[i].length, mlogits[b], mstreams[b, kept_lane[i]])
                           for b, i in enumerate(live) if i in nxt]
                for i, d in zip(nxt, mtp.drafts(entries, [wanted(i) for i in nxt])):
                    drafts[i] = d
            elif mtp is not None:  # no draft wanted: the sequences' last verify lanes give their last tokens
                drafts.update({i: ([], []) for i in nxt})
            for i in live:
                if i not in nxt:
                    session.release(seqs.pop(i))
            live = nxt
    finally:
        for s in seqs.values():
            session.release(s)
    return out, stats
