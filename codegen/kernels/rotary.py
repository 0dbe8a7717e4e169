"""The inverse interleaved RoPE of a tile, shared by `inv_rope_quant` (a kernel of its own) and the GEMM
loader of `rope_out_proj` (wo_a rotating each K tile as it loads it).

Frequencies are the reference's `inv_freq` values, computed on the host in fp32 and baked in as constants
(FREQS), so angles match the reference bit for bit; cos / sin are rounded to the tile's dtype before the
rotation and the products summed in the reference's order (`ops/rope.rotate`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def inverse_rope(x, partner, c, pos, D: tl.constexpr, DIM: tl.constexpr, FREQS: tl.constexpr,
                 SIGN: tl.constexpr, DT: tl.constexpr):
    """x rotated back, in DT: x and partner (the value at channel c ^ 1) in fp32, c the channel within its
    head (broadcastable to x; the last DIM of D channels rotate), pos the token position (broadcastable)."""
    rc = c - (D - DIM)
    is_rope = rc >= 0
    pair = tl.where(is_rope, rc // 2, 0)
    fr = tl.zeros(pair.shape, dtype=tl.float32)
    for i in tl.static_range(DIM // 2):
        fr = tl.where(pair == i, FREQS[i], fr)
    ang = pos * fr
    cs = tl.cos(ang).to(DT).to(tl.float32)
    sn = SIGN * tl.sin(ang).to(DT).to(tl.float32)
    rot = tl.where((c & 1) == 0, -partner, partner)
    return tl.where(is_rope, x * cs + rot * sn, x).to(DT)


def rope_constants(attrs: dict) -> dict:
    """The constexprs of `inverse_rope` but D (the head dim) from an op's rope attributes."""
    from ...ops.rope import inv_freq

    freqs = tuple(float(v) for v in inv_freq(attrs["dim"], attrs["theta"], tuple(attrs["yarn"])).tolist())
    return dict(DIM=attrs["dim"], FREQS=freqs, SIGN=-1.0)
