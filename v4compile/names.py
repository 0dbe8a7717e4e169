"""Map every checkpoint naming onto the canonical (official) tensor names.

Three layouts occur in practice (`v4-reference.md` 14.4):

* official: `layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.17.w1.weight`, `*.scale`;
* HF parameters: `model.layers.3.self_attn.q_a_proj.weight`, stacked experts
  `model.layers.3.mlp.experts.gate_up_proj [E, 2I, D]`, `*.weight_scale_inv`;
* what HF `save_pretrained` writes: official names under a `model.` prefix, except `head.weight`,
  `model.embed_tokens.weight`, `model.hc_head.hc_fn`, and the attention `kv_norm` written as
  `attn.norm.weight`.

`canonical_sources` returns, for one stored tensor, the canonical names it provides and how to cut
each out of it (stacked HF experts provide many).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    """Which part of a stored tensor a canonical tensor is: `stored[index][:, rows]`."""

    index: int | None = None  # first-axis index into a stacked tensor
    rows: tuple[int, int] | None = None  # row range (after indexing)


_TOP = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# HF module path (inside a layer) -> official path. Longest prefixes first.
_LAYER = [
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.sinks", "attn.attn_sink"),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    # save_pretrained: the attention kv_norm comes back as `attn.norm`.
    ("attn.norm.", "attn.kv_norm."),
]

_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")


def _suffix(name: str) -> str:
    return name[: -len(".weight_scale_inv")] + ".scale" if name.endswith(".weight_scale_inv") else name


def canonical_sources(name: str, n_experts: int, inter_dim: int) -> list[tuple[str, Slice]]:
    """Canonical names provided by the stored tensor `name`, with the slice of it each one is."""
    n = _suffix(name)
    if n.startswith("mtp."):
        return [(n, Slice())]
    m = _LAYER_RE.match(n)
    if m is None:
        bare = n[len("model."):] if n.startswith("model.") else n
        return [(_TOP.get(bare, bare), Slice())]
    layer, rest = m.group(1), m.group(2)
    p = f"layers.{layer}."
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.scale"):
        tail = "weight" if rest.endswith("proj") else "scale"
        out = []
        for e in range(n_experts):
            out.append((f"{p}ffn.experts.{e}.w1.{tail}", Slice(e, None)))
            out.append((f"{p}ffn.experts.{e}.w3.{tail}", Slice(e, None)))
        return _split_gate_up(out, inter_dim)
    if rest in ("mlp.experts.down_proj", "mlp.experts.down_proj.scale"):
        tail = "weight" if rest.endswith("proj") else "scale"
        return [(f"{p}ffn.experts.{e}.w2.{tail}", Slice(e, None)) for e in range(n_experts)]
    for src, dst in _LAYER:
        if rest.startswith(src):
            return [(p + dst + rest[len(src):], Slice())]
    return [(p + rest, Slice())]


def _split_gate_up(pairs: list[tuple[str, Slice]], inter_dim: int) -> list[tuple[str, Slice]]:
    # gate_up_proj rows 0..I-1 are w1 (gate), I..2I-1 are w3 (up).
    out = []
    for cname, sl in pairs:
        rows = (0, inter_dim) if ".w1." in cname else (inter_dim, 2 * inter_dim)
        out.append((cname, Slice(sl.index, rows)))
    return out


def layout_of(names: list[str]) -> str:
    """Best guess of a checkpoint's naming, for messages: official, hf or hf-saved."""
    if any(".self_attn." in n or n.startswith("lm_head") for n in names):
        return "hf"
    if any(n.startswith("model.") for n in names):
        return "hf-saved"
    return "official"
