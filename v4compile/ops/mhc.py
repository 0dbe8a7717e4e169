"""Manifold-constrained hyper-connections (`v4-reference.md` section 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.registry import defop, require
from ..ir.types import TensorType


@defop("hc_expand(x) -> streams", attrs={"n": int}, kernel="mhc")
def hc_expand(x, *, n):
    """`[B, T, D] -> [B, T, n, D]`: n identical copies of the embedding."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


@hc_expand.infer
def _(x, *, n):
    return TensorType((*x.shape[:-1], n, x.shape[-1]), x.dtype)


def _mix_inputs(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn.float())


@defop("hc_pre(streams, fn, base, scale) -> y, post, comb",
       attrs={"eps": float, "hc_eps": float, "iters": int}, kernel="mhc")
def hc_pre(streams, fn, base, scale, *, eps, hc_eps, iters):
    """Collapse the n streams into one sub-layer input and predict the post / comb weights.

    `pre = sigmoid + hc_eps`, `post = 2 sigmoid`, `comb` = row softmax + hc_eps, then Sinkhorn: one
    column normalisation, then `iters - 1` (row, column) pairs, eps in every denominator. All fp32.
    """
    n = streams.shape[-2]
    m = _mix_inputs(streams, fn, eps)
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[n:2 * n])
    comb = comb_w.view(*comb_w.shape[:-1], n, n) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    y = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
    return y, post, comb


@hc_pre.infer
def _(streams, fn, base, scale, *, eps, hc_eps, iters):
    *lead, n, d = streams.shape
    require(fn.shape == ((2 + n) * n, n * d), "hc_pre fn shape", expected=[(2 + n) * n, n * d], found=list(fn.shape))
    require(base.shape == ((2 + n) * n,) and scale.shape == (3,), "hc_pre base [24] / scale [3]",
            found=(list(base.shape), list(scale.shape)))
    return (TensorType((*lead, d), streams.dtype), TensorType((*lead, n), "fp32"),
            TensorType((*lead, n, n), "fp32"))


@defop("hc_post(y, streams, post, comb) -> streams_out", kernel="mhc")
def hc_post(y, streams, post, comb):
    """`X'_k = post_k * y + sum_j comb[j, k] X_j` (comb used transposed), in the streams' dtype."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


@hc_post.infer
def _(y, streams, post, comb):
    *lead, n, d = streams.shape
    require(tuple(y.shape) == (*lead, d), "hc_post sub-layer output shape", expected=[*lead, d], found=list(y.shape))
    require(tuple(post.shape) == (*lead, n) and tuple(comb.shape) == (*lead, n, n), "hc_post post / comb shapes",
            found=(list(post.shape), list(comb.shape)))
    return streams


@defop("hc_head(streams, fn, base, scale) -> y", attrs={"eps": float, "hc_eps": float}, kernel="mhc")
def hc_head(streams, fn, base, scale, *, eps, hc_eps):
    """Final collapse of the streams: `pre = sigmoid(m * scale + base) + hc_eps`, no Sinkhorn, no post."""
    m = _mix_inputs(streams, fn, eps)
    pre = torch.sigmoid(m * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


@hc_head.infer
def _(streams, fn, base, scale, *, eps, hc_eps):
    *lead, n, d = streams.shape
    require(fn.shape == (n, n * d), "hc_head fn shape", expected=[n, n * d], found=list(fn.shape))
    return TensorType((*lead, d), streams.dtype)
