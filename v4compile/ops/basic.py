"""Elementary ops: embedding, linear layers (any weight format), RMSNorm, SwiGLU, reshape, add."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import fp4_dequant, fp8_block_dequant
from ..ir.registry import defop
from ..ir.types import TensorType


def dequant_weight(w: torch.Tensor, scale: torch.Tensor | None, block: int, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D weight as `dtype`: fp8 e4m3 with a block x block E8M0 grid, packed fp4 with 1 x block
    scales, or a plain float tensor (scale None)."""
    if scale is None:
        return w.to(dtype)
    if w.dtype == torch.float8_e4m3fn:
        return fp8_block_dequant(w, scale, block).to(dtype)
    return fp4_dequant(w, scale, block).to(dtype)


def weight_in_features(w: TensorType) -> int:
    return w.shape[-1] * 2 if w.dtype == "fp4x2" else w.shape[-1]


@defop("embed(ids, table) -> x")
def embed(ids, table):
    """Row `ids[b, t]` of the embedding table."""
    return table[ids.clamp(min=0)]


@embed.infer
def _(ids, table):
    return TensorType((*ids.shape, table.shape[1]), table.dtype)


@defop("linear(x, w, scale?) -> y", attrs={"block": (int, 128)})
def linear(x, w, scale, *, block):
    """`y = x W^T` with W dequantised to the activation dtype (FP8 128x128 or FP4 1x32 when scaled)."""
    return F.linear(x, dequant_weight(w, scale, block, x.dtype))


@linear.infer
def _(x, w, scale, *, block):
    return TensorType((*x.shape[:-1], w.shape[0]), x.dtype)


@defop("rms_norm(x, weight?) -> y", attrs={"eps": float})
def rms_norm(x, weight, *, eps):
    """RMSNorm over the last axis in fp32; weighted: multiply by the (fp32) weight and cast back once;
    unweighted (the per-head q norm): rescale x by the rsqrt cast to x's dtype, as HF does."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


@rms_norm.infer
def _(x, weight, *, eps):
    return x


@defop("swiglu(gate, up) -> y", attrs={"limit": float})
def swiglu(gate, up, *, limit):
    """`silu(min(gate, L)) * clamp(up, -L, L)`: the clamped SwiGLU of every V4 expert."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@swiglu.infer
def _(gate, up, *, limit):
    return gate


@defop("reshape(x) -> y", attrs={"shape": tuple})
def reshape(x, *, shape):
    return x.reshape(shape)


@reshape.infer
def _(x, *, shape):
    return TensorType(tuple(int(s) for s in shape), x.dtype)


@defop("add(a, b) -> y")
def add(a, b):
    """Elementwise sum with broadcasting."""
    return a + b


@add.infer
def _(a, b):
    return TensorType(tuple(torch.broadcast_shapes(a.shape, b.shape)), a.dtype)


@defop("last_token(x, pos) -> y")
def last_token(x, pos):
    """`x[b, n_b - 1]`: the last valid lane of each sequence in a padded chunk (lane 0 if none)."""
    n = (pos >= 0).sum(1)
    idx = (n - 1).clamp(min=0)
    return x[torch.arange(x.shape[0]), idx]


@last_token.infer
def _(x, pos):
    return TensorType((x.shape[0], *x.shape[2:]), x.dtype)
