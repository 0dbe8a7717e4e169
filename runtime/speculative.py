"""Speculative decoding on a compiled artifact: the session's loop around the `verify_b<B>` functions
(the compiled counterpart of `v4compile/model/speculative.py`, which states what each kind of state does).

One step for the live sequences (each at length L, its last sampled token x_L not yet fed, k_b drafts
d_1..d_k_b from the draft source):

1. reserve the pool blocks of positions L .. L + k_b and save every row those positions can write after
   L (`PoolUndo`, positions L + 1 .. L + k_b);
2. run `verify_b<B>` (the smallest bucket that holds the sequences): lanes x_L, d_1 .. d_k_b at positions
   L .. L + k_b, the unused lanes (k_b < K, the artifact's `draft_tokens`) as padding (pos -1: they write
   nothing); every lane's logits;
3. `speculation.accept` (greedy): a drafts survive, then one more token; the rows of the rejected
   positions (> L + a) are restored, the sequence is a + 1 tokens longer.

Greedy only: the drafts come from a `draft(sequence index, ids so far, k) -> k ids` callable (tests: an
oracle, an always-wrong one). The MTP block is not compiled into artifacts yet, so `speculative="mtp"`
is refused (no draft source in the artifact); see issue 19's closing note.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from v4compile.errors import InputError
from v4compile.speculation import Acceptance, accept, check_draft_tokens

from .undo import PoolUndo

Draft = Callable[[int, list[int], int], list[int]]  # (prompt index, prompt + ids so far, k) -> k draft ids


def verify_functions(session) -> list[tuple[int, str, int]]:
    """(batch, function name, lanes) of the artifact's verify functions, smallest batch first."""
    return sorted((f.batch, f.name, f.tokens) for f in session.backend.functions().values() if f.kind == "verify")


def speculative_generate(session, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_tokens: int,
                         draft: Draft, stop_ids: Sequence[int] = ()) -> tuple[list[list[int]], Acceptance]:
    """Greedy new ids for every prompt (identical to `session.generate`'s) and the acceptance statistics.
    Continuous batching: at most the largest verify bucket's batch of sequences live at once; a waiting
    prompt joins (its prefill) when a slot is free; each sequence accepts its own number of drafts."""
    fns = verify_functions(session)
    if not fns:
        raise InputError("the artifact has no verify functions", where=str(session.art.path),
                         expected="an artifact compiled with --draft-tokens")
    K = fns[0][2] - 1
    k = check_draft_tokens(draft_tokens, K + 1)
    if not callable(draft):
        raise InputError("draft must be a callable (prompt index, ids, k) -> k ids", found=type(draft).__name__)
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
    waiting, live = list(range(len(prompts))), []
    try:
        while waiting or live:
            while waiting and session.free_slots and len(live) < fns[-1][0]:
                i = waiting.pop(0)
                seqs[i] = session.open()
                tok = int(session.extend(seqs[i], prompts[i]).argmax())
                out[i].append(tok)
                if len(out[i]) < max_new_tokens and tok not in stops:
                    live.append(i)
                else:
                    session.release(seqs.pop(i))
            if not live:
                if waiting:  # no slot came free and none is live: another loop would never progress
                    raise InputError("no free sequence slot for the waiting prompts", found=f"{len(session.seqs)} open")
                continue
            B, fname, T = next(f for f in fns if f[0] >= len(live))
            ids = np.zeros((B, T), dtype=np.int64)
            pos = np.full((B, T), -1, dtype=np.int64)
            drafts, spans = {}, []
            for b, i in enumerate(live):
                s, L = seqs[i], seqs[i].length
                kb = min(k, max_new_tokens - len(out[i]) - 1)  # drafts beyond the last token wanted are wasted
                d = [int(x) for x in draft(i, prompts[i] + out[i], kb)] if kb else []
                if len(d) != kb or any(not 0 <= x < session.vocab for x in d):
                    raise InputError("the draft source gave a wrong draft", where=f"prompt {i}",
                                     expected=f"{kb} ids in 0..{session.vocab - 1}", found=d[:8])
                drafts[i] = d
                session._reserve(s, L + kb)
                ids[b, : 1 + kb] = [out[i][-1]] + d
                pos[b, : 1 + kb] = np.arange(L, L + 1 + kb)
                spans.append((s.slot, list(s.blocks), L + 1, L + kb))
            undo = PoolUndo(session.backend, spans)
            table, slot = session._table([seqs[i] for i in live], B)
            logits = session.backend.run(fname, {"ids": ids, "pos": pos, "block_table": table, "slot": slot})
            keep, nxt = {}, []
            for b, i in enumerate(live):
                d = drafts[i]
                a, tok = accept(d, logits[b, : 1 + len(d)], None, None, 0.0)
                new = (d[:a] + [tok])[: max_new_tokens - len(out[i])]
                if any(t in stops for t in new):
                    new = new[: next(j for j, t in enumerate(new) if t in stops) + 1]
                stats.add(a, len(new), len(d))
                out[i] += new
                seqs[i].length += a + 1
                keep[seqs[i].slot] = seqs[i].length
                if len(out[i]) < max_new_tokens and new[-1] not in stops:
                    nxt.append(i)
            undo.restore(keep)
            for i in live:
                if i not in nxt:
                    session.release(seqs.pop(i))
            live = nxt
    finally:
        for s in seqs.values():
            session.release(s)
    return out, stats


def mtp_draft(session) -> Draft:
    """The MTP block's drafts for `speculative="mtp"`. No artifact carries the MTP block yet (the pipeline
    compiles the main model only: `mtp.*` weights are not written), so every artifact is refused here in one
    line; the verify path above is what runs once a draft function exists."""
    tensors = session.art.manifest["weights"]["tensors"]
    if not any(n.startswith("mtp.") for n in tensors):
        raise InputError("the artifact has no MTP weights: it cannot draft for --speculative mtp",
                         where=str(session.art.path), expected="an artifact carrying the MTP block")
    raise InputError("the artifact's MTP weights have no compiled draft function", where=str(session.art.path))
