"""The lightning indexer's scores and the top-k selection (`v4-reference.md` section 6)."""

from __future__ import annotations

import torch

from ..ir.registry import defop, require
from ..ir.types import TensorType


@defop("indexer_scores(q, weights, keys, pos) -> scores", attrs={"ratio": int, "q_scale": float, "w_scale": float})
def indexer_scores(q, weights, keys, pos, *, ratio, q_scale, w_scale):
    """`I[t, w] = sum_h (weights[t, h] * w_scale) * ReLU(q[t, h] . keys[w]) * q_scale` in fp32, and -inf
    for rows the query may not see yet (w >= floor((t + 1) / ratio))."""
    s = torch.einsum("bthd,brd->bthr", q.float(), keys.float())
    s = torch.relu(s) * q_scale
    s = (s * (weights.float() * w_scale).unsqueeze(-1)).sum(dim=2)  # [B, T, R]
    limit = torch.div(pos + 1, ratio, rounding_mode="floor").unsqueeze(-1)
    w = torch.arange(keys.shape[1], device=q.device).view(1, 1, -1)
    return s.masked_fill((w >= limit) | (pos.unsqueeze(-1) < 0), float("-inf"))


@indexer_scores.infer
def _(q, weights, keys, pos, **_):
    require(keys.shape[0] == q.shape[0] and keys.shape[2] == q.shape[3], "indexer keys must be [B, R, di]",
            expected=f"[{q.shape[0]}, R, {q.shape[3]}]", found=list(keys.shape))
    require(tuple(weights.shape) == tuple(q.shape[:3]), "indexer head weights must be [B, T, Hi]",
            expected=list(q.shape[:3]), found=list(weights.shape))
    return TensorType((q.shape[0], q.shape[1], keys.shape[1]), "fp32")


@defop("topk(scores) -> indices", attrs={"k": int})
def topk(scores, *, k):
    """Indices of the k largest scores per row; -1 where the chosen score is -inf (not selectable)."""
    vals, idx = scores.topk(k, dim=-1)
    return torch.where(torch.isinf(vals) & (vals < 0), torch.full_like(idx, -1), idx)


@topk.infer
def _(scores, *, k):
    require(0 < k <= scores.shape[-1], "topk k must be in 1..R", expected=f"<= {scores.shape[-1]}", found=k)
    return TensorType((*scores.shape[:-1], k), "i64")
