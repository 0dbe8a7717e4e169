"""The reference speculative decoder: the MTP block drafts, the main model verifies (the oracle for the
compiled paths).

One step for each live sequence at length L (tokens 0..L-1 in the cache; x_L sampled, not yet fed):

1. **verify**: the main model on `1 + k` lanes, x_L and the drafts d_1..d_k at positions L..L+k
   (`model_step` on a `[B, 1 + k]` chunk, every lane's logits);
2. **accept** (`v4compile.speculation.accept`): a drafts survive and one more token follows them;
3. **rollback**: every state entry written for a rejected position (> L + a) gets back the value it had
   before the step (an undo log taken before the verify; `speculation.clobbered` names the entries);
4. **draft**: the MTP block on the accepted lanes (streams of lanes 0..a with the ids that follow them)
   gives d'_1; for k > 1 the block is applied again to its own output streams and the last draft, one
   position further each time, and those speculative MTP cache writes are undone the same way.

What each kind of state does (per layer; rejected positions are `q > L + a`):

* window ring (`win`, slot `q % W`): the verify writes slots of positions L+1..L+k, overwriting the rows of
  positions q - W, which later queries still read: restored from the undo log.
* compressor rings (`state_kv`, `state_gate`, the indexer's `index_state_*`, slot `q % S`): same as the
  window (a later window's pooling reads the overwritten slot): restored.
* compressed rows (`rows`, the indexer's `index_rows`, the FP8 / FP4 pool rows once lowered): a rejected
  position that closes window w writes row w, which no accepted query can see (rows are read causally)
  and which the true token would rewrite; restored anyway, so the state is byte for byte the state of
  the same chunks with the rejected lanes as padding.
* the MTP block's own window ring: written for accepted positions only by step 4; the recursive drafts'
  writes are undone after drafting.

So after a step every state entry is either what it was before the step or what a kept position wrote
(`tests/core/test_speculative.py` checks each restore byte for byte): no trace of a rejected draft. The
kept lanes' values are those of the same chunk with the rejected lanes as padding (pos = -1), bit for bit
when nothing was rejected, else to the last bits (the MoE groups a chunk's lanes per expert, so the GEMM
shapes a lane meets depend on where the other lanes were routed). The undo log needs
every ring to have more than k slots (`speculation.check_draft_tokens`). The compiled pool's counterpart
(the same entries as physical rows of the paged pool, FP8 / FP4 planes included) is `runtime/undo.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError
from ..speculation import Acceptance, accept, check_draft_tokens, clobbered, sample
from .cache import Cache

DraftHook = Callable[[int, int, int], int]  # (sequence, position of the drafted token, MTP's draft) -> draft


class UndoLog:
    """The entries of `caches` (per layer dicts, `layers` their layer numbers) that positions
    `first[b] .. last[b]` of sequence b write, saved before they are written."""

    def __init__(self, cfg, layers: Sequence[int], caches: Sequence[dict], spans: dict[int, tuple[int, int]]):
        self.saved = []
        for layer, c in zip(layers, caches):
            ratio = cfg.ratio(layer) if layer < cfg.n_layers else 0
            for key, t in c.items():
                for b, (first, last) in spans.items():
                    for q in range(first, last + 1):
                        i = clobbered(key, t.shape[1], ratio, q)
                        if i is not None:
                            self.saved.append((c, key, b, q, i, t[b, i].clone()))

    def restore(self, keep: dict[int, int]) -> None:
        """Put back every entry written for a position >= keep[b] (the step replaced the tensors: write into
        the dict's current ones)."""
        for c, key, b, q, i, v in self.saved:
            if q >= keep.get(b, 0):
                c[key][b, i] = v


@dataclass
class SpecResult:
    ids: list[list[int]]
    acceptance: Acceptance
    cache: Cache
    chunks: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # what the state saw


def _rings(cfg, cache: Cache) -> int:
    return min(t.shape[1] for c in cache.layers + cache.mtp for k, t in c.items() if k not in ("rows", "index_rows"))


@torch.no_grad()
def speculative_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_tokens: int,
                         temperature: float = 0.0, seed: int | None = None, draft: DraftHook | None = None
                         ) -> SpecResult:
    """New ids for each prompt (all decoded together, each at its own length). Greedy ids equal
    `model.generate`'s; with temperature > 0 they are distributed as plain sampling's. `draft` replaces the
    MTP's drafts (tests: an oracle draft, an always-wrong one). `chunks` records the lanes each step kept
    (main and MTP ids / positions, rejected lanes as pos -1): replaying them must give the same state."""
    if not model.has_mtp or model.cfg.n_mtp_layers < 1:
        raise InputError("this checkpoint has no MTP weights", expected="an MTP block for speculative decoding")
    cfg = model.cfg
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise InputError("empty prompt", expected="at least one token per sequence")
    B, k, n = len(prompts), draft_tokens, [len(p) for p in prompts]
    rng = np.random.default_rng(seed)
    cache = model.new_cache(B, max(n) + max_new_tokens + k + 1)
    k = check_draft_tokens(k, _rings(cfg, cache))
    stats = Acceptance(k)
    chunks: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return SpecResult(out, stats, cache, chunks)

    def pick(logits: torch.Tensor) -> tuple[int, np.ndarray | None]:
        if temperature == 0:
            return int(logits.argmax()), None
        return sample(logits.numpy(), temperature, rng)

    # prefill (one chunk) and the MTP over the prompt: its last lane drafts the token after the first one
    T = max(n)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : n[b]] = torch.tensor(p)
        pos[b, : n[b]] = torch.arange(n[b])
    logits, streams = model.step(ids, pos, cache, last_only=True)
    chunks.append(("main", ids, pos))
    L, last = list(n), []
    for b in range(B):
        tok, _ = pick(logits[b].float())
        last.append(tok)
        out[b].append(tok)
    nxt = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        nxt[b, : n[b]] = torch.tensor(p[1:] + [last[b]])
    live = [b for b in range(B) if len(out[b]) < max_new_tokens]
    drafts, dprobs = _draft(model, streams, nxt, pos, cache, L, live, k, pick, draft, chunks)

    while live:
        ids = torch.zeros(B, 1 + k, dtype=torch.long)
        pos = torch.full((B, 1 + k), -1, dtype=torch.long)
        for b in live:
            ids[b] = torch.tensor([last[b]] + drafts[b])
            pos[b] = torch.arange(L[b], L[b] + 1 + k)
        undo = UndoLog(cfg, range(cfg.n_layers), cache.layers, {b: (L[b] + 1, L[b] + k) for b in live})
        logits, streams = model.step(ids, pos, cache)
        kept, mids = pos.clone(), torch.zeros(B, 1 + k, dtype=torch.long)
        for b in live:
            a, tok = accept(drafts[b], logits[b].float().numpy(), dprobs[b], rng, temperature)
            new = (drafts[b][:a] + [tok])[: max_new_tokens - len(out[b])]
            stats.add(a, len(new))
            out[b] += new
            kept[b, a + 1:] = -1
            mids[b, : a + 1] = torch.tensor(drafts[b][:a] + [tok])
            L[b] += a + 1
            last[b] = tok
        undo.restore({b: L[b] for b in live})
        chunks.append(("main", ids, kept))
        live = [b for b in live if len(out[b]) < max_new_tokens]
        mpos = kept.clone()
        mpos[[b for b in range(B) if b not in live]] = -1  # finished sequences need no more drafts
        drafts, dprobs = _draft(model, streams, mids, mpos, cache, L, live, k, pick, draft, chunks)
    return SpecResult(out, stats, cache, chunks)


def _draft(model, streams, next_ids, pos, cache: Cache, L: list[int], live: list[int], k: int, pick,
           hook: DraftHook | None, chunks) -> tuple[dict[int, list[int]], dict[int, list | None]]:
    """MTP over a chunk's accepted lanes (its cache keeps them), then k - 1 recursive drafts (undone)."""
    cfg = model.cfg
    drafts: dict[int, list[int]] = {b: [] for b in live}
    dprobs: dict[int, list | None] = {b: [] for b in live}
    if not live:
        return drafts, dprobs
    B = streams.shape[0]
    logits, out = model.mtp_step(streams, next_ids, pos, cache, last_only=True)
    chunks.append(("mtp", next_ids, pos))
    last = ((pos >= 0).sum(1) - 1).clamp(min=0)
    h = out[torch.arange(B), last].unsqueeze(1)
    undo = UndoLog(cfg, [cfg.n_layers], cache.mtp[:1], {b: (L[b], L[b] + k - 2) for b in live}) if k > 1 else None
    for j in range(k):
        tok = torch.zeros(B, 1, dtype=torch.long)
        for b in live:
            d, q = pick(logits[b].float())
            if hook is not None:
                d = hook(b, L[b] + j + 1, d)
            drafts[b].append(d)
            dprobs[b].append(q)
            tok[b, 0] = d
        if j + 1 < k:
            p = torch.full((B, 1), -1, dtype=torch.long)
            for b in live:
                p[b, 0] = L[b] + j
            logits, h = model.mtp_step(h, tok, p, cache, last_only=True)
    if undo is not None:
        undo.restore({})
    return drafts, {b: (None if v[0] is None else np.stack(v)) for b, v in dprobs.items()}
