"""Interleaved (GPT-J) partial RoPE on the trailing channels, with optional YaRN (`v4-reference.md` 4.3)."""

from __future__ import annotations

import math

import torch

from ..ir.registry import defop, require


def inv_freq(dim: int, theta: float, yarn: tuple) -> torch.Tensor:
    """One frequency per rotated pair. `yarn` is `(factor, original_max_pos, beta_fast, beta_slow)` or ()."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1.0 / pos_freqs
    if not yarn:
        return extra
    factor, orig, beta_fast, beta_slow = yarn

    def corr(n_rot: float) -> float:
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + extra * keep


def rotate(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float, yarn: tuple,
           inverse: bool = False) -> torch.Tensor:
    """Rotate the last `dim` channels of x by angle `pos * f_i` (pairs of adjacent channels).

    `positions` has the leading shape of x (its first `positions.ndim` axes); cos/sin are computed in
    fp32 and cast to x's dtype before the rotation, as HF does.
    """
    freqs = positions.float().unsqueeze(-1) * inv_freq(dim, theta, yarn).to(x.device)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    if inverse:
        sin = -sin
    extra = x.ndim - positions.ndim - 1
    cos = cos.repeat_interleave(2, dim=-1).reshape(*cos.shape[:-1], *([1] * extra), dim)
    sin = sin.repeat_interleave(2, dim=-1).reshape(*sin.shape[:-1], *([1] * extra), dim)
    nope, r = x[..., :-dim], x[..., -dim:]
    rot_half = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    out = (r.float() * cos + rot_half.float() * sin).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


@defop("rope(x, pos) -> y", attrs={"dim": int, "theta": float, "yarn": tuple, "inverse": (bool, False)})
def rope(x, pos, *, dim, theta, yarn, inverse):
    """RoPE at each token's position on the last `dim` channels; `inverse` rotates back (the output
    of attention, whose values carry their own rotation)."""
    return rotate(x, pos, dim, theta, yarn, inverse)


@rope.infer
def _(x, pos, *, dim, theta, yarn, inverse):
    require(dim % 2 == 0 and dim <= x.shape[-1], "rope dim must be even and fit the last axis", found=dim)
    require(tuple(pos.shape) == tuple(x.shape[:pos.rank]), "rope positions must match the leading axes",
            expected=list(x.shape[:pos.rank]), found=list(pos.shape))
    require(len(yarn) in (0, 4), "yarn must be () or (factor, original_max_pos, beta_fast, beta_slow)", found=yarn)
    return x
