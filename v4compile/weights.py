"""Every tensor of a DeepSeek-V4 checkpoint, declared once from the config.

Names are the official ones (`v4-reference.md` 14.1), which are the project's canonical names; other
layouts are mapped onto them by `names.py`. A `TensorSpec` knows its logical shape, the format the
released checkpoint stores it in, and its accounting category. The checkpoint loader validates
against this table, the writer and `init-random` produce it, `inspect` counts it and the tracer types
the IR's weight parameters from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import CSA, HCA, V4Config

# Storage formats: how a tensor's values are kept on disk.
#   fp4: e2m1 packed two per int8 byte along the last dim, with a 1x32 E8M0 scale grid;
#   fp8: e4m3 with a 128x128 E8M0 scale grid; bf16 / fp32 / i64: plain.
FORMAT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "fp4": 0.5, "i64": 8}
SAFETENSORS_DTYPE = {"fp32": "F32", "bf16": "BF16", "fp8": "F8_E4M3", "fp4": "I8", "i64": "I64"}

# Accounting categories, in the order of the seed's table.
CATEGORIES = ("routed_experts", "mtp", "attention", "shared_experts", "embed_head", "compressor", "indexer",
              "gate", "mhc", "hash", "norms")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # logical (unpacked) shape
    fmt: str  # storage format in the released checkpoint layout
    category: str
    quantizable: bool = False  # a GEMM weight that the release stores as fp8 / fp4
    activated: bool = True  # touched by every token (routed experts: only 6 of them)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.fmt == "fp4":
            return (*self.shape[:-1], self.shape[-1] // 2)
        return self.shape

    @property
    def scale_name(self) -> str | None:
        """Name of the scale tensor in the declared format (None when the format has none)."""
        return self.scale_key if self.fmt in ("fp8", "fp4") else None

    @property
    def scale_key(self) -> str:
        """Name a scale tensor for this weight has, whatever format it is stored in."""
        return self.name[: -len(".weight")] + ".scale"

    def scale_shape(self, block: int = 128, fp4_block: int = 32) -> tuple[int, ...] | None:
        if self.fmt == "fp8":
            return (math.ceil(self.shape[0] / block), math.ceil(self.shape[1] / block))
        if self.fmt == "fp4":
            return (self.shape[0], self.shape[1] // fp4_block)
        return None

    @property
    def data_bytes(self) -> int:
        return int(self.numel * FORMAT_BYTES[self.fmt])

    def with_format(self, fmt: str) -> "TensorSpec":
        return TensorSpec(self.name, self.shape, fmt, self.category, self.quantizable, self.activated)


def _layer_specs(cfg: V4Config, prefix: str, layer: int, kind: str, hash_routed: bool, mtp: bool) -> list[TensorSpec]:
    D, H, d = cfg.dim, cfg.n_heads, cfg.head_dim
    wf, ef = cfg.weight_format, cfg.expert_format
    cat = (lambda c: "mtp") if mtp else (lambda c: c)
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], fmt: str, category: str, quantizable: bool = False,
            activated: bool = True) -> None:
        out.append(TensorSpec(f"{prefix}{name}", shape, fmt, cat(category), quantizable, activated))

    hc = (2 + cfg.hc_mult) * cfg.hc_mult
    for site in ("attn", "ffn"):
        add(f"hc_{site}_fn", (hc, cfg.hc_mult * D), "fp32", "mhc")
        add(f"hc_{site}_base", (hc,), "fp32", "mhc")
        add(f"hc_{site}_scale", (3,), "fp32", "mhc")
    add("attn_norm.weight", (D,), "bf16", "norms")
    add("ffn_norm.weight", (D,), "bf16", "norms")
    # Attention (common part).
    add("attn.wq_a.weight", (cfg.q_lora_rank, D), wf, "attention", True)
    add("attn.q_norm.weight", (cfg.q_lora_rank,), "bf16", "attention")
    add("attn.wq_b.weight", (H * d, cfg.q_lora_rank), wf, "attention", True)
    add("attn.wkv.weight", (d, D), wf, "attention", True)
    add("attn.kv_norm.weight", (d,), "bf16", "attention")
    add("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups), wf, "attention", True)
    add("attn.wo_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), wf, "attention", True)
    add("attn.attn_sink", (H,), "fp32", "attention")
    # Compressors and the indexer.
    if kind in (CSA, HCA):
        c = 2 if kind == CSA else 1
        m = cfg.csa_ratio if kind == CSA else cfg.hca_ratio
        add("attn.compressor.wkv.weight", (c * d, D), "bf16", "compressor")
        add("attn.compressor.wgate.weight", (c * d, D), "bf16", "compressor")
        add("attn.compressor.ape", (m, c * d), "fp32", "compressor")
        add("attn.compressor.norm.weight", (d,), "bf16", "compressor")
    if kind == CSA:
        di, m = cfg.index_head_dim, cfg.csa_ratio
        add("attn.indexer.wq_b.weight", (cfg.index_n_heads * di, cfg.q_lora_rank), wf, "indexer", True)
        add("attn.indexer.weights_proj.weight", (cfg.index_n_heads, D), "bf16", "indexer")
        add("attn.indexer.compressor.wkv.weight", (2 * di, D), "bf16", "indexer")
        add("attn.indexer.compressor.wgate.weight", (2 * di, D), "bf16", "indexer")
        add("attn.indexer.compressor.ape", (m, 2 * di), "fp32", "indexer")
        add("attn.indexer.compressor.norm.weight", (di,), "bf16", "indexer")
    # MoE.
    add("ffn.gate.weight", (cfg.n_experts, D), "bf16", "gate")
    if hash_routed:
        add("ffn.gate.tid2eid", (cfg.vocab_size, cfg.n_active_experts), "i64", "hash")
    else:
        add("ffn.gate.bias", (cfg.n_experts,), "fp32", "gate")
    I = cfg.moe_inter_dim
    for e in range(cfg.n_experts):
        for w, shape in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
            add(f"ffn.experts.{e}.{w}.weight", shape, ef, "routed_experts", True, activated=False)
    for j in range(cfg.n_shared_experts):
        sp = "ffn.shared_experts." if cfg.n_shared_experts == 1 else f"ffn.shared_experts.{j}."
        add(f"{sp}w1.weight", (I, D), wf, "shared_experts", True)
        add(f"{sp}w2.weight", (D, I), wf, "shared_experts", True)
        add(f"{sp}w3.weight", (I, D), wf, "shared_experts", True)
    return out


def weight_specs(cfg: V4Config, include_mtp: bool = True) -> list[TensorSpec]:
    """All tensors of the checkpoint in official order, MTP block last."""
    D = cfg.dim
    specs = [
        TensorSpec("embed.weight", (cfg.vocab_size, D), "bf16", "embed_head"),
        TensorSpec("head.weight", (cfg.vocab_size, D), "bf16", "embed_head"),
        TensorSpec("norm.weight", (D,), "bf16", "embed_head"),
        TensorSpec("hc_head_fn", (cfg.hc_mult, cfg.hc_mult * D), "fp32", "mhc"),
        TensorSpec("hc_head_base", (cfg.hc_mult,), "fp32", "mhc"),
        TensorSpec("hc_head_scale", (1,), "fp32", "mhc"),
    ]
    for layer in range(cfg.n_layers):
        specs += _layer_specs(cfg, f"layers.{layer}.", layer, cfg.kind(layer), cfg.is_hash(layer), mtp=False)
    if include_mtp:
        for j in range(cfg.n_mtp_layers):
            p = f"mtp.{j}."
            specs += _layer_specs(cfg, p, cfg.n_layers + j, cfg.kind(cfg.n_layers + j), False, mtp=True)
            specs += [
                TensorSpec(p + "e_proj.weight", (D, D), cfg.weight_format, "mtp", True),
                TensorSpec(p + "h_proj.weight", (D, D), cfg.weight_format, "mtp", True),
                TensorSpec(p + "enorm.weight", (D,), "bf16", "mtp"),
                TensorSpec(p + "hnorm.weight", (D,), "bf16", "mtp"),
                TensorSpec(p + "norm.weight", (D,), "bf16", "mtp"),
                TensorSpec(p + "hc_head_fn", (cfg.hc_mult, cfg.hc_mult * D), "fp32", "mtp"),
                TensorSpec(p + "hc_head_base", (cfg.hc_mult,), "fp32", "mtp"),
                TensorSpec(p + "hc_head_scale", (1,), "fp32", "mtp"),
            ]
    return specs


def spec_table(cfg: V4Config, include_mtp: bool = True) -> dict[str, TensorSpec]:
    return {s.name: s for s in weight_specs(cfg, include_mtp)}
