"""Attention over the sliding window and compressed rows, with the sink (`v4-reference.md` 4.4-4.6, 7-9).

Static-shape formulation. A chunk holds T lanes per sequence; lane i of sequence b has absolute
position `pos[b, i]` (-1 for padding; valid lanes come first and are consecutive, starting at the
sequence's current length). The window ring holds the raw kv rows of earlier tokens at slot
`p % W`; the compressed rows of a layer live at their window index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.registry import defop, require
from ..ir.types import TensorType
from .basic import dequant_weight


def ring_positions(pos: torch.Tensor, slots: int) -> torch.Tensor:
    """Position held by each ring slot before this chunk: the latest p < start with p = slot (mod
    slots), or a negative number if none. `start` is the first lane's position."""
    start = pos[:, :1].clamp(min=0)
    j = torch.arange(slots, device=pos.device)
    return start - 1 - torch.remainder(start - 1 - j, slots)


def ring_lanes(pos: torch.Tensor, slots: int) -> torch.Tensor:
    """Lanes whose token a ring of `slots` entries keeps after this chunk: each sequence's last `slots`
    positions (so no slot is written twice)."""
    valid = pos >= 0
    last = pos[:, :1].clamp(min=0) + valid.sum(1, keepdim=True) - 1
    return valid & (pos > last - slots)


@defop("attention(q, kv, window_kv, pos, sink, rows?, selected?) -> out",
       attrs={"window": int, "ratio": int, "scale": float},
       variants={"window": (), "compressed": ("rows",), "indexed": ("rows", "selected")})
def attention(q, kv, window_kv, pos, sink, rows, selected, *, window, ratio, scale):
    """One softmax over the visible keys of each query, the sink in the denominator only.

    Keys (= values): window ring rows and this chunk's kv rows at positions in (t - window, t]; plus,
    when `rows` is given, compressed rows w < floor((t + 1) / ratio) — all of them (HCA) or only
    those listed in `selected` (CSA, -1 = none). Scores are formed in the activation dtype and the
    softmax in fp32, as HF does.
    """
    B, T, H, d = q.shape
    W = window_kv.shape[1]
    keys = torch.cat([window_kv, kv], dim=1)  # [B, W + T, d]
    kpos = torch.cat([ring_positions(pos, W), pos], dim=1)  # [B, W + T]
    t = pos.unsqueeze(-1)  # [B, T, 1]
    kp = kpos.unsqueeze(1)  # [B, 1, W + T]
    visible = (kp >= 0) & (kp <= t) & (kp > t - window) & (t >= 0)  # [B, T, W + T]
    if rows is not None:
        R = rows.shape[1]
        limit = torch.div(pos + 1, ratio, rounding_mode="floor").unsqueeze(-1)  # [B, T, 1]
        w = torch.arange(R, device=q.device).view(1, 1, -1)
        vis_rows = (w < limit) & (t >= 0)  # HCA: every complete window
        if selected is not None:  # CSA: only the indexer's picks
            hit = torch.zeros(B, T, R + 1, dtype=torch.bool, device=q.device)
            hit.scatter_(-1, torch.where(selected >= 0, selected, R), True)
            vis_rows = vis_rows & hit[..., :R]
        keys = torch.cat([keys, rows], dim=1)
        visible = torch.cat([visible, vis_rows], dim=-1)
    return attend(q, keys, visible, sink, scale)


def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [B, T, H, d] over keys = values [B, K, d] where visible [B, T, K]: scores in the activation dtype,
    one fp32 softmax with the sink in the denominator only. `sparse_attention`'s reference calls it on a
    key tensor laid out exactly as `attention` lays out its keys, so both reduce in the same order and
    round identically (a 1-ulp difference here becomes a whole FP8 step under official numerics)."""
    B, T, H, d = q.shape
    K = keys.shape[1]
    # Each (sequence, head) is its own [T, d] x [d, K] GEMM of a batched GEMM, not one GEMM over T * H
    # rows: a head's sums are then the same arithmetic whatever the number of heads beside it (a
    # tensor-parallel rank holds heads / tp of them), where torch picks its kernel, and so its order of
    # summation, by the whole shape and the instruction set (AVX2 differed at two heads against four).
    qh = q.permute(0, 2, 1, 3).reshape(B * H, T, d)
    kh = keys.unsqueeze(1).expand(B, H, K, d).reshape(B * H, K, d)
    scores = (torch.bmm(qh, kh.transpose(1, 2)).view(B, H, T, K).permute(0, 2, 1, 3) * scale).float()
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    logits = torch.cat([scores, sink.float().view(1, 1, H, 1).expand(B, T, H, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    ph = probs.permute(0, 2, 1, 3).reshape(B * H, T, K)
    return torch.bmm(ph, kh).view(B, H, T, d).permute(0, 2, 1, 3).contiguous()


@attention.infer
def _(q, kv, window_kv, pos, sink, rows, selected, *, window, ratio, scale):
    B, T, H, d = q.shape
    require(tuple(kv.shape) == (B, T, d), "attention kv must be [B, T, d]", expected=[B, T, d], found=list(kv.shape))
    require(window_kv.rank == 3 and window_kv.shape[0] == B and window_kv.shape[2] == d, "attention window ring",
            expected=f"[{B}, W, {d}]", found=list(window_kv.shape))
    require(tuple(sink.shape) == (H,), "attention sink must be [H]", expected=[H], found=list(sink.shape))
    require(tuple(pos.shape) == (B, T), "attention positions must be [B, T]", found=list(pos.shape))
    require(rows is None or (rows.shape[0] == B and rows.shape[2] == d), "attention rows must be [B, R, d]",
            found=None if rows is None else list(rows.shape))
    require(selected is None or (rows is not None and tuple(selected.shape[:2]) == (B, T)),
            "attention selection needs rows and must be [B, T, K]")
    return q


@defop("window_write(window_kv, kv, pos) -> window_out", tied={"window_out": "window_kv"})
def window_write(window_kv, kv, pos):
    """Store this chunk's kv rows in the ring at slot `p % W`; only the last W positions of each
    sequence are written, so no slot is written twice."""
    B, W, _ = window_kv.shape
    out = window_kv.clone()
    b, i = ring_lanes(pos, W).nonzero(as_tuple=True)
    out[b, pos[b, i] % W] = kv[b, i].to(out.dtype)
    return out


@window_write.infer
def _(window_kv, kv, pos):
    require(kv.shape[0] == window_kv.shape[0] and kv.shape[-1] == window_kv.shape[-1], "window_write kv rows",
            expected=f"[{window_kv.shape[0]}, T, {window_kv.shape[-1]}]", found=list(kv.shape))
    return window_kv


@defop("grouped_out_proj(o, w, scale?, o_scale?) -> z",
       attrs={"groups": int, "block": (int, 128), "act": (str, "native"), "acc": (str, "fp32"),
              "out_dtype": (str, "")}, kernel="grouped_gemm")
def grouped_out_proj(o, w, scale, o_scale, *, groups, block, act, acc, out_dtype):
    """`wo_a`: heads split into `groups` groups, each group's concatenated heads projected by its own
    block of rows of W (block diagonal, no mixing across groups). GEMM numerics as `linear`'s; with
    `act="fp8"` each group's K axis is quantised in 128-wide blocks. With `o_scale`, o arrives already
    quantised (e4m3, one scale per `K / o_scale.shape[-1]` values of the flattened heads, as
    `inv_rope_group_quant` makes it): the same values as quantising here, so the same result."""
    from .basic import torch_dtype
    from ..formats import act_qdq

    B, T = o.shape[:2]
    if o_scale is not None:
        x = (o.float().reshape(B, T, o_scale.shape[-1], -1) * o_scale.float().unsqueeze(-1)).reshape(B, T, groups, -1)
    elif act == "fp8":
        x = act_qdq(o.reshape(B, T, groups, -1))
    else:
        x = o.reshape(B, T, groups, -1)
        if out_dtype and torch_dtype(out_dtype) != o.dtype:
            x = x.float()  # another output dtype: run in fp32, as `linear` does
    out = torch_dtype(out_dtype) if out_dtype else o.dtype
    W = dequant_weight(w, scale, block, x.dtype)
    W = W.view(groups, -1, W.shape[-1])  # [G, R, Hd/G]
    x = x.reshape(B * T, groups, -1)  # [BT, G, Hd/G]
    # One contiguous 2-D GEMM per group, not one bmm over all groups: a group's sums are then the same
    # arithmetic whatever the number of groups (a tensor-parallel rank holds groups / tp of them), which
    # a batched GEMM does not promise (torch picks another kernel, and another order, for a batch of 1
    # on some instruction sets: AVX2 at two rows here).
    parts = [F.linear(x[:, g].contiguous(), W[g].contiguous()) for g in range(groups)]
    return torch.cat(parts, dim=-1).reshape(B, T, -1).to(out)


@grouped_out_proj.infer
def _(o, w, scale, o_scale, *, groups, block, act, acc, out_dtype):
    from .basic import check_gemm_attrs, check_weight, weight_in_features
    hd = o.numel // (o.shape[0] * o.shape[1])
    require(hd % groups == 0 and weight_in_features(w) == hd // groups and w.shape[0] % groups == 0,
            "grouped_out_proj weight must be [G * R, H * d / G]", expected=f"[G*R, {hd // groups}]",
            found=list(w.shape))
    check_weight(w, scale, block, "grouped_out_proj")
    check_gemm_attrs("grouped_out_proj", act, acc, out_dtype)
    if o_scale is not None:
        require(o.dtype == "fp8e4m3" and act == "fp8" and out_dtype in ("fp32", "bf16"),
                "a pre-quantised grouped_out_proj takes an fp8 input, act fp8 and an out_dtype",
                found=(o.dtype, act, out_dtype))
        return TensorType((o.shape[0], o.shape[1], w.shape[0]), out_dtype)
    require(o.dtype in ("fp32", "bf16"), "grouped_out_proj input must be fp32 or bf16 (or fp8 with o_scale)",
            found=o.dtype)
    return TensorType((o.shape[0], o.shape[1], w.shape[0]), out_dtype or o.dtype)
