"""The KV compressor of CSA and HCA layers, as one static-shape step (`v4-reference.md` 5, 9).

State: a ring of the last S = c*m tokens' projections (`state_kv`) and gate logits with the position
bias already added (`state_gate`, fp32), slot `p % S`. HCA (c = 1) pools the m tokens of a window;
CSA (c = 2, overlapping) pools 2m slots: the previous window's first half-width ("A", columns
[0, dk)) and the current window's second half ("B", columns [dk, 2dk)).
"""

from __future__ import annotations

import math

import torch

from ..ir.registry import defop, require
from .attention import ring_lanes
from .numerics import fp8_round_ref, hadamard_fp4_round_ref
from .rope import rotate


def pooled_rows(kv, gate, state_kv, state_gate, pos, m: int, overlap: bool):
    """Rows closed by this chunk, before norm / RoPE.

    Returns (pooled [B, J, dk], window index w [B, J], closed mask [B, J]); J = T // m + 1 candidate
    windows per sequence, the windows that can close inside a T-token chunk.
    """
    B, T, CW = kv.shape
    c = 2 if overlap else 1
    dk = CW // c
    S = state_kv.shape[1]
    valid = pos >= 0
    start = pos[:, :1].clamp(min=0)  # [B, 1]
    n = valid.sum(1, keepdim=True)
    J = T // m + 1
    w = torch.div(start, m, rounding_mode="floor") + torch.arange(J, device=kv.device)  # [B, J]
    closed = (m * (w + 1) - 1 <= start + n - 1) & (n > 0)
    # Source positions of each pooling slot s and which half of the columns it reads.
    s = torch.arange(c * m, device=kv.device)
    if overlap:
        p = m * (w.unsqueeze(-1) - 1) + s  # A slots: previous window; B slots: this window
        half = (s >= m).long()
    else:
        p = m * w.unsqueeze(-1) + s
        half = torch.zeros_like(s)
    present = p >= 0  # the A slots of row 0 do not exist
    from_state = p < start.unsqueeze(-1)
    bi = torch.arange(B, device=kv.device).view(B, 1, 1)
    lane = (p - start.unsqueeze(-1)).clamp(0, T - 1)
    slot = torch.remainder(p, S)
    kv_src = torch.where(from_state.unsqueeze(-1), state_kv[bi, slot].to(kv.dtype), kv[bi, lane])
    g_src = torch.where(from_state.unsqueeze(-1), state_gate[bi, slot], gate[bi, lane])
    cols = (half * dk).view(1, 1, -1, 1) + torch.arange(dk, device=kv.device)  # [1, 1, c*m, dk]
    cols = cols.expand(B, J, -1, -1)
    v = torch.gather(kv_src, -1, cols)
    g = torch.gather(g_src, -1, cols).float()
    g = g.masked_fill(~present.unsqueeze(-1), float("-inf"))
    v = v.masked_fill(~present.unsqueeze(-1), 0)
    pooled = (v * torch.softmax(g, dim=2).to(v.dtype)).sum(dim=2)  # [B, J, dk]
    return pooled, w, closed


def closed_rows(kv, gate, ape, norm, state_kv, state_gate, pos, ratio: int, overlap: bool, eps: float, rope_dim: int,
                theta: float, yarn: tuple, round: str):
    """The finished rows of the windows this chunk closes: pooled, RMSNorm-ed, RoPE-d at `ratio * w`
    and (official numerics) rounded. Returns (rows [B, J, dk], w, closed, gate logits with the position
    bias, which is what the state ring stores)."""
    g = gate.float() + ape.float()[torch.remainder(pos.clamp(min=0), ratio)]
    pooled, w, closed = pooled_rows(kv, g, state_kv, state_gate, pos, ratio, overlap)
    h = pooled.float()
    h = (norm.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(kv.dtype)
    h = rotate(h, ratio * w, rope_dim, theta, yarn)
    if round == "fp8":
        h = fp8_round_ref(h, h.shape[-1] - rope_dim, math.gcd(64, h.shape[-1] - rope_dim))
    elif round == "fp4":
        h = hadamard_fp4_round_ref(h, 32)
    return h, w, closed, g


def update_ring(state_kv, state_gate, kv, gate, pos):
    """Write this chunk's tokens into ring slot `p % S` (only each sequence's last S positions)."""
    S = state_kv.shape[1]
    out_kv, out_g = state_kv.clone(), state_gate.clone()
    b, i = ring_lanes(pos, S).nonzero(as_tuple=True)
    out_kv[b, pos[b, i] % S] = kv[b, i].to(out_kv.dtype)
    out_g[b, pos[b, i] % S] = gate[b, i].to(out_g.dtype)
    return out_kv, out_g


@defop("compress(kv, gate, ape, norm, state_kv, state_gate, rows, pos) -> rows_out, state_kv_out, state_gate_out",
       attrs={"ratio": int, "overlap": bool, "eps": float, "rope_dim": int, "theta": float, "yarn": tuple,
              "round": (str, "none")}, tied={"rows_out": "rows", "state_kv_out": "state_kv", "state_gate_out": "state_gate"})
def compress(kv, gate, ape, norm, state_kv, state_gate, rows, pos, *, ratio, overlap, eps, rope_dim, theta, yarn,
             round):
    """Ingest a chunk: pool every window that closes in it (softmax over the window's slots, per
    channel), RMSNorm, RoPE at the window's first position `m * w`, optional official rounding
    (`fp8`: FP8 on the non-RoPE dims; `fp4`: Hadamard + FP4), store the row at index w; then push the
    chunk's tokens into the state ring. `kv` / `gate` are the raw projections of the chunk."""
    h, w, closed, g = closed_rows(kv, gate, ape, norm, state_kv, state_gate, pos, ratio, overlap, eps, rope_dim, theta,
                                  yarn, round)
    out = rows.clone()
    R = rows.shape[1]
    ok = closed & (w < R)
    b, j = ok.nonzero(as_tuple=True)
    out[b, w[b, j]] = h[b, j].to(out.dtype)
    skv, sg = update_ring(state_kv, state_gate, kv, g, pos)
    return out, skv, sg


@compress.infer
def _(kv, gate, ape, norm, state_kv, state_gate, rows, pos, *, ratio, overlap, **_):
    B, T, cw = kv.shape
    c = 2 if overlap else 1
    require(gate.shape == kv.shape, "compress gate must match kv", expected=list(kv.shape), found=list(gate.shape))
    require(tuple(ape.shape) == (ratio, cw), "compress position bias must be [ratio, c*dk]", expected=[ratio, cw],
            found=list(ape.shape))
    require(tuple(state_kv.shape) == (B, c * ratio, cw) and state_gate.shape == state_kv.shape,
            "compress state rings must be [B, c*ratio, c*dk]", expected=[B, c * ratio, cw], found=list(state_kv.shape))
    require(rows.shape[0] == B and rows.shape[2] == cw // c and norm.shape == (cw // c,),
            "compress rows [B, R, dk] / norm [dk]", found=(list(rows.shape), list(norm.shape)))
    return rows, state_kv, state_gate
