"""How a batch of prompts becomes fixed-size chunks (shared by the reference model and the IR runner)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def prefill_chunks(prompts: Sequence[Sequence[int]], lengths: Sequence[int], chunk: int
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Yield `(ids [B, chunk], pos [B, chunk], n)` per step: each sequence's next piece in the first
    lanes (pos = its absolute positions), padding lanes with pos -1; `n[b]` tokens taken from b."""
    B = len(prompts)
    done = [0] * B
    longest = max(len(p) for p in prompts)
    for s in range(0, longest, chunk):
        ids = torch.zeros(B, chunk, dtype=torch.long)
        pos = torch.full((B, chunk), -1, dtype=torch.long)
        n = []
        for b, p in enumerate(prompts):
            piece = list(p[s: s + chunk])
            ids[b, : len(piece)] = torch.tensor(piece, dtype=torch.long)
            pos[b, : len(piece)] = torch.arange(len(piece)) + lengths[b] + done[b]
            done[b] += len(piece)
            n.append(len(piece))
        yield ids, pos, n
