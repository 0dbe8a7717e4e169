"""The one model configuration, `V4Config`, and the named presets.

A config comes from either of the two layouts DeepSeek-V4 ships with:

* the official `inference/config.json` (`dim`, `n_layers`, `compress_ratios` with a trailing entry
  per MTP layer, `n_hash_layers`, `window_size`, `rope_factor`, ...);
* the HF `config.json` (`hidden_size`, `layer_types`, `compress_rates`, `mlp_layer_types`,
  `rope_parameters` / `rope_scaling`, ...), including the hub variant that keeps official names.

Both map onto the same frozen dataclass (field map: `v4-reference.md` sections 1 and 14). Every
field is validated once, here, so later stages may assume a consistent config.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .errors import show_value as _show

# Layer kinds, by the official compress ratio they come from.
SWA, CSA, HCA = "swa", "csa", "hca"
KINDS = (SWA, CSA, HCA)
HF_LAYER_TYPES = {
    "sliding_attention": SWA,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
HF_LAYER_TYPE_OF = {v: k for k, v in HF_LAYER_TYPES.items()}
WEIGHT_FORMATS = ("fp8", "bf16", "fp32")

# Bounds checked before anything is sized or enumerated from a config (V4-Pro is far inside each).
MAX_INT = 2 ** 53  # any integer field, before its own bound
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_LAYERS = 1024
MAX_MTP_LAYERS = 16
MAX_TENSORS = 1_000_000  # tensors in the checkpoint (V4-Pro: about 71 thousand)
LIMITS = {  # field -> largest accepted value
    "vocab_size": 1 << 24, "dim": 1 << 16, "n_layers": MAX_LAYERS, "n_heads": 1 << 12, "head_dim": 1 << 14,
    "rope_dim": 1 << 14, "q_lora_rank": 1 << 16, "o_groups": 1 << 12, "o_lora_rank": 1 << 16,
    "window": 1 << 24, "csa_ratio": 1 << 16, "hca_ratio": 1 << 16, "index_n_heads": 1 << 12,
    "index_head_dim": 1 << 14, "index_topk": 1 << 24, "n_experts": 1 << 14, "n_active_experts": 1 << 10,
    "n_shared_experts": 64, "moe_inter_dim": 1 << 17, "n_hash_layers": MAX_LAYERS, "hc_mult": 64,
    "hc_sinkhorn_iters": 10_000, "max_position": 1 << 26, "yarn_original_max_pos": 1 << 26,
    "n_mtp_layers": MAX_MTP_LAYERS, "quant_block": 1 << 12, "expert_scale_block": 1 << 12,
}
EXPERT_FORMATS = ("fp4", "fp8", "bf16", "fp32")
FLOAT_LIMITS = {  # field -> (exclusive lower, inclusive upper)
    "route_scale": (0.0, 1e6), "swiglu_limit": (0.0, 1e6), "rope_theta": (0.0, 1e12),
    "compress_rope_theta": (0.0, 1e12), "rms_eps": (0.0, 1.0), "hc_eps": (0.0, 1.0), "yarn_factor": (0.0, 1e6),
    "yarn_beta_fast": (0.0, 1e6), "yarn_beta_slow": (0.0, 1e6),
}

# Every key the parsers read, per layout: the default applied when the key is absent (then stated by
# `inspect`: `V4Config.defaults`), `Derived` (the parser works it out from other keys, as told), or REQUIRED.
# A key that is present must hold a value of its kind: `null` is refused, naming the key, unless the layout's
# upstream types the field optional (`HF_NULLABLE`), where it means absent. `_Getter` reads no key that is
# not in its table.
REQUIRED = object()


@dataclass(frozen=True)
class Derived:
    how: str


YARN = "yarn."  # the HF YaRN block's keys, wherever it sits (`rope_parameters[.compress]`, `rope_scaling`)
# The official `inference/config.json` (DeepSeek's `ModelArgs`: none of its fields is optional)
OFFICIAL_FIELDS: dict[str, Any] = {
    **dict.fromkeys(("n_layers", "compress_ratios", "vocab_size", "dim", "n_heads", "head_dim", "rope_head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
                     "index_topk", "n_routed_experts", "n_activated_experts", "moe_inter_dim", "route_scale",
                     "swiglu_limit"), REQUIRED),
    "n_mtp_layers": Derived("one per trailing `compress_ratios` entry"), "n_shared_experts": 1, "n_hash_layers": 0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "rope_factor": 16.0, "original_seq_len": 65536, "beta_fast": 32.0,
    "beta_slow": 1.0, "max_seq_len": 1048576, "score_func": "sqrtsoftplus", "dtype": "fp8", "expert_dtype": "fp4",
}
# The HF `config.json`: each default is the one `transformers`' DeepseekV4Config (5.23) documents (checked
# against it: tests/core/test_config_fields.py); the format keys follow its quantizer (no `quantization_config`:
# not quantised). Required although upstream has a default: the sizes (upstream's are V4-Flash's: silently
# another model) and, when the model has compressed layers, the YaRN block (without one upstream runs plain
# RoPE there, which is not V4's model) with its `factor` and `original_max_position_embeddings` (upstream
# requires both).
HF_FIELDS: dict[str, Any] = {
    **dict.fromkeys(("num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
                     YARN + "factor", YARN + "original_max_position_embeddings"), REQUIRED),
    "layer_types": Derived("from `compress_ratios`; one of the two is required"),
    "compress_ratios": Derived("from `layer_types`; one of the two is required"),
    "mlp_layer_types": Derived("`num_hash_layers` hash layers first"), "compress_rates": {},
    "compress_rates.compressed_sparse_attention": 4, "compress_rates.heavily_compressed_attention": 128,
    "compress_rate_csa": Derived("as `compress_rates`"), "compress_rate_hca": Derived("as `compress_rates`"),
    "num_hash_layers": 3, "n_hash_layers": Derived("as `num_hash_layers`"),
    "qk_rope_head_dim": Derived("`head_dim` x `partial_rotary_factor`"), "partial_rotary_factor": 0.125,
    "sliding_window": 128, "window_size": Derived("as `sliding_window`"), "n_shared_experts": 1,
    "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1, "scoring_func": "sqrtsoftplus",
    "rope_parameters": Derived("or `rope_scaling`: the YaRN block, required with compressed layers"),
    "rope_scaling": Derived("or `rope_parameters`"),
    YARN + "beta_fast": 32.0, YARN + "beta_slow": 1.0, YARN + "compress": Derived("upstream's nested form"),
    YARN + "rope_type": Derived("`type` (legacy), else YaRN"), YARN + "type": Derived("as `rope_type`"),
    "quantization_config": {}, "quantization_config.quant_method": Derived("absent: not FP8"),
    "quantization_config.fmt": Derived("absent: not FP8"),
    "quantization_config.expert_dtype": Derived("as `expert_dtype`"),
    "expert_dtype": Derived("fp4 if FP8-quantised, else bf16"),
}
# Keys upstream types optional (`X | None`) or reads only when not null (the legacy names it folds in)
HF_NULLABLE = frozenset({"layer_types", "compress_ratios", "mlp_layer_types", "compress_rates", "compress_rate_csa",
                         "compress_rate_hca", "num_hash_layers", "n_hash_layers", "qk_rope_head_dim",
                         "partial_rotary_factor", "rope_parameters", "rope_scaling", "quantization_config",
                         "expert_dtype"})


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4 hyper-parameters (names follow the official inference code where it has one)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    layer_kinds: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    n_active_experts: int
    n_shared_experts: int
    moe_inter_dim: int
    n_hash_layers: int
    route_scale: float
    swiglu_limit: float
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_pos: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position: int = 1048576
    n_mtp_layers: int = 1
    score_func: str = "sqrtsoftplus"
    # Storage formats of the released checkpoints (what `inspect` counts and `--quantized` writes).
    weight_format: str = "fp8"
    expert_format: str = "fp4"
    quant_block: int = 128
    expert_scale_block: int = 32
    name: str = field(default="custom", compare=False)
    # (config key, value) of each default the parser applied for a key the config left out (`inspect` says so)
    defaults: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    # ---- derived -------------------------------------------------------------------------------
    def kind(self, layer: int) -> str:
        """Layer kind of backbone layer `layer`, or of MTP layer `n_layers + j`."""
        if layer >= self.n_layers:
            return SWA
        return self.layer_kinds[layer]

    def ratio(self, layer: int) -> int:
        """Official compress ratio of a layer: 0 (SWA), `csa_ratio` or `hca_ratio`."""
        return {SWA: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[self.kind(layer)]

    def is_hash(self, layer: int) -> bool:
        return layer < min(self.n_hash_layers, self.n_layers)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    @property
    def compress_ratios(self) -> list[int]:
        """The official per-layer list, with the trailing MTP entries."""
        return [self.ratio(i) for i in range(self.n_layers)] + [0] * self.n_mtp_layers

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    def replace(self, **changes: Any) -> "V4Config":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> "V4Config":
        def need(cond: bool, what: str, expected: object = None, found: object = None) -> None:
            if not cond:
                raise ConfigError(what, where=f"config '{self.name}'", expected=expected, found=found)

        for f in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_dim", "q_lora_rank",
                  "o_groups", "o_lora_rank", "window", "csa_ratio", "hca_ratio", "index_n_heads",
                  "index_head_dim", "index_topk", "n_experts", "n_active_experts", "moe_inter_dim",
                  "hc_mult", "hc_sinkhorn_iters", "max_position", "quant_block", "expert_scale_block"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"`{f}` must be a positive integer",
                 found=v)
        for f in ("n_shared_experts", "n_hash_layers", "n_mtp_layers", "yarn_original_max_pos"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"`{f}` must be a non-negative integer",
                 found=v)
        for f, hi in LIMITS.items():
            need(getattr(self, f) <= hi, f"`{f}` is beyond what this tool handles", expected=f"<= {hi:,}",
                 found=f"{getattr(self, f):,}")
        for f in ("yarn_factor", "yarn_beta_fast", "yarn_beta_slow"):
            v = getattr(self, f)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                 f"`{f}` must be a finite number", found=v)
        need(isinstance(self.layer_kinds, tuple), "layer kinds must be a tuple", found=type(self.layer_kinds).__name__)
        need(len(self.layer_kinds) == self.n_layers, "layer kind list length must equal the layer count",
             expected=self.n_layers, found=len(self.layer_kinds))
        bad = sorted({k for k in self.layer_kinds if k not in KINDS})
        need(not bad, "unknown layer kind", expected=" / ".join(KINDS), found=bad)
        need(self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim,
             "`rope_dim` must be even and at most `head_dim`", found=(self.rope_dim, self.head_dim))
        need(self.rope_dim <= self.index_head_dim, "`rope_dim` must fit in `index_head_dim`",
             found=(self.rope_dim, self.index_head_dim))
        need(self.n_heads % self.o_groups == 0, "`n_heads` must be a multiple of `o_groups`",
             found=(self.n_heads, self.o_groups))
        need(self.n_active_experts <= self.n_experts, "top-k experts per token exceeds the expert count",
             expected=f"<= {self.n_experts}", found=self.n_active_experts)
        need(self.n_hash_layers <= self.n_layers, "`n_hash_layers` exceeds the layer count",
             expected=f"<= {self.n_layers}", found=self.n_hash_layers)
        need(self.score_func == "sqrtsoftplus", "only the sqrtsoftplus router is supported",
             found=self.score_func)
        need(self.csa_ratio >= 2 and self.hca_ratio >= 2, "compress ratios must be at least 2",
             found=(self.csa_ratio, self.hca_ratio))
        need(self.weight_format in WEIGHT_FORMATS, "unknown dense weight format", expected=WEIGHT_FORMATS,
             found=self.weight_format)
        need(self.expert_format in EXPERT_FORMATS, "unknown expert weight format", expected=EXPERT_FORMATS,
             found=self.expert_format)
        if self.expert_format == "fp4":
            need(self.dim % self.expert_scale_block == 0 and self.moe_inter_dim % self.expert_scale_block == 0,
                 "FP4 experts need `dim` and `moe_inter_dim` to be multiples of the 1x32 scale block",
                 found=(self.dim, self.moe_inter_dim))
        need(self.window < self.max_position, "`window` must be smaller than `max_position`",
             found=(self.window, self.max_position))
        need(self.yarn_factor >= 1, "`rope_factor` must be >= 1", found=self.yarn_factor)
        need(self.index_topk <= self.max_position, "`index_topk` must not exceed `max_position`",
             found=(self.index_topk, self.max_position))
        per_layer = 3 * self.n_experts + 3 * self.n_shared_experts + 60
        n_tensors = (self.n_layers + self.n_mtp_layers) * per_layer
        need(n_tensors <= MAX_TENSORS, "config describes too many tensors (layers x experts)",
             expected=f"<= {MAX_TENSORS:,}", found=f"about {n_tensors:,}")
        for f, (lo, hi) in FLOAT_LIMITS.items():
            v = getattr(self, f)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo < v <= hi,
                 f"`{f}` must be a number in ({lo:g}, {hi:g}]", found=v)
        return self

    # ---- official layout -----------------------------------------------------------------------
    def to_official(self) -> dict[str, Any]:
        return {
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "dim": self.dim, "moe_inter_dim": self.moe_inter_dim,
            "n_layers": self.n_layers, "n_hash_layers": self.n_hash_layers, "n_heads": self.n_heads,
            "n_routed_experts": self.n_experts, "n_shared_experts": self.n_shared_experts,
            "n_activated_experts": self.n_active_experts, "score_func": self.score_func,
            "route_scale": self.route_scale, "swiglu_limit": self.swiglu_limit,
            "q_lora_rank": self.q_lora_rank, "head_dim": self.head_dim, "rope_head_dim": self.rope_dim,
            "norm_eps": self.rms_eps, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "window_size": self.window, "compress_ratios": self.compress_ratios,
            "compress_rope_theta": self.compress_rope_theta, "rope_theta": self.rope_theta,
            "original_seq_len": self.yarn_original_max_pos, "rope_factor": self.yarn_factor,
            "beta_fast": self.yarn_beta_fast, "beta_slow": self.yarn_beta_slow,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "max_seq_len": self.max_position, "n_mtp_layers": self.n_mtp_layers,
            "dtype": self.weight_format, "expert_dtype": self.expert_format, "scale_fmt": "ue8m0",
        }

    @classmethod
    def from_official(cls, d: dict[str, Any], name: str = "custom") -> "V4Config":
        g = _Getter(d, name, OFFICIAL_FIELDS)
        n_layers = g.int("n_layers", hi=MAX_LAYERS)
        ratios = g.list("compress_ratios", int, max_len=MAX_LAYERS + MAX_MTP_LAYERS)
        n_mtp = g.int("n_mtp_layers", default=max(len(ratios) - n_layers, 0), hi=MAX_MTP_LAYERS)
        if len(ratios) not in (n_layers, n_layers + n_mtp):
            raise ConfigError("`compress_ratios` length must be n_layers (+ one entry per MTP layer)",
                              where=f"config '{name}'", expected=f"{n_layers} or {n_layers + n_mtp}",
                              found=len(ratios))
        kinds, csa, hca = _kinds_from_ratios(ratios[:n_layers], name)
        return cls(
            vocab_size=g.int("vocab_size"), dim=g.int("dim"), n_layers=n_layers, n_heads=g.int("n_heads"),
            head_dim=g.int("head_dim"), rope_dim=g.int("rope_head_dim"), q_lora_rank=g.int("q_lora_rank"),
            o_groups=g.int("o_groups"), o_lora_rank=g.int("o_lora_rank"), window=g.int("window_size"),
            layer_kinds=kinds, csa_ratio=csa, hca_ratio=hca, index_n_heads=g.int("index_n_heads"),
            index_head_dim=g.int("index_head_dim"), index_topk=g.int("index_topk"),
            n_experts=g.int("n_routed_experts"), n_active_experts=g.int("n_activated_experts"),
            n_shared_experts=g.int("n_shared_experts"), moe_inter_dim=g.int("moe_inter_dim"),
            n_hash_layers=g.int("n_hash_layers"), route_scale=g.num("route_scale"),
            swiglu_limit=g.num("swiglu_limit"), hc_mult=g.int("hc_mult"),
            hc_sinkhorn_iters=g.int("hc_sinkhorn_iters"), hc_eps=g.num("hc_eps"),
            rms_eps=g.num("norm_eps"), rope_theta=g.num("rope_theta"),
            compress_rope_theta=g.num("compress_rope_theta"), yarn_factor=g.num("rope_factor"),
            yarn_original_max_pos=g.int("original_seq_len"), yarn_beta_fast=g.num("beta_fast"),
            yarn_beta_slow=g.num("beta_slow"), max_position=g.int("max_seq_len"), n_mtp_layers=n_mtp,
            score_func=g.str("score_func"), weight_format=_fmt(g.str("dtype")),
            expert_format=_fmt(g.str("expert_dtype")), name=name, defaults=tuple(g.applied.items()),
        ).validate()

    # ---- HF layout -----------------------------------------------------------------------------
    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads, "num_key_value_heads": 1,
            "head_dim": self.head_dim, "qk_rope_head_dim": self.rope_dim, "q_lora_rank": self.q_lora_rank,
            "num_experts_per_tok": self.n_active_experts, "n_routed_experts": self.n_experts,
            "n_shared_experts": self.n_shared_experts, "scoring_func": self.score_func,
            "routed_scaling_factor": self.route_scale, "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "layer_types": [HF_LAYER_TYPE_OF[k] for k in self.layer_kinds],
            "compress_rates": {"compressed_sparse_attention": self.csa_ratio,
                               "heavily_compressed_attention": self.hca_ratio},
            "mlp_layer_types": ["hash_moe" if self.is_hash(i) else "moe" for i in range(self.n_layers)],
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "swiglu_limit": self.swiglu_limit, "sliding_window": self.window, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "num_nextn_predict_layers": self.n_mtp_layers, "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": False,
            "expert_dtype": self.expert_format,
            "rope_parameters": {"rope_type": "yarn", "factor": self.yarn_factor,
                                "original_max_position_embeddings": self.yarn_original_max_pos,
                                "beta_fast": self.yarn_beta_fast, "beta_slow": self.yarn_beta_slow},
        }
        if self.weight_format == "fp8":
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [self.quant_block, self.quant_block],
                                        "scale_fmt": "ue8m0", "expert_dtype": self.expert_format}
        return d

    @classmethod
    def from_hf(cls, d: dict[str, Any], name: str = "custom") -> "V4Config":
        g = _Getter(d, name, HF_FIELDS, HF_NULLABLE)
        n_layers = g.int("num_hidden_layers", hi=MAX_LAYERS)
        rates = g.obj("compress_rates")
        csa = g.int("compress_rate_csa") if g.has("compress_rate_csa") else rates.int("compressed_sparse_attention")
        hca = g.int("compress_rate_hca") if g.has("compress_rate_hca") else rates.int("heavily_compressed_attention")
        if g.has("layer_types"):
            types = g.list("layer_types", str, max_len=MAX_LAYERS)
            unknown = sorted({t for t in types if t not in HF_LAYER_TYPES})
            if unknown:
                raise ConfigError("unknown entry in `layer_types`", where=f"config '{name}'",
                                  expected=sorted(HF_LAYER_TYPES), found=unknown)
            kinds = tuple(HF_LAYER_TYPES[t] for t in types)
        elif g.has("compress_ratios"):
            ratios = g.list("compress_ratios", int, max_len=MAX_LAYERS + MAX_MTP_LAYERS)
            kinds, csa, hca = _kinds_from_ratios(ratios[:n_layers], name, csa, hca)
        else:
            raise ConfigError("config has neither `layer_types` nor `compress_ratios`", where=f"config '{name}'",
                              expected="one of them (HF's default schedule is wrong for synthetic configs)")
        if g.has("mlp_layer_types"):
            mlp = g.list("mlp_layer_types", str, max_len=MAX_LAYERS)
            bad = sorted({t for t in mlp if t not in ("hash_moe", "moe")})
            if bad:
                raise ConfigError("unknown entry in `mlp_layer_types`", where=f"config '{name}'",
                                  expected=["hash_moe", "moe"], found=bad)
            n_hash = sum(1 for t in mlp if t == "hash_moe")
            if list(mlp[:n_hash]) != ["hash_moe"] * n_hash:
                raise ConfigError("hash-routed layers must come first in `mlp_layer_types`",
                                  where=f"config '{name}'", found=mlp)
            if len(mlp) != n_layers:
                raise ConfigError("`mlp_layer_types` length must equal the layer count", where=f"config '{name}'",
                                  expected=n_layers, found=len(mlp))
        else:
            n_hash = g.int("n_hash_layers") if g.has("n_hash_layers") and not g.has("num_hash_layers") \
                else g.int("num_hash_layers")
        head_dim = g.int("head_dim")
        if g.has("qk_rope_head_dim"):
            rope_dim = g.int("qk_rope_head_dim")
        else:
            factor = g.num("partial_rotary_factor")
            if not 0 < factor <= 1:
                raise ConfigError("`partial_rotary_factor` must be in (0, 1]", where=f"config '{name}'", found=factor)
            rope_dim = int(round(head_dim * factor))
        yarn = _hf_yarn(g, any(k != SWA for k in kinds))
        quant = g.obj("quantization_config")
        method, fmt = quant.str("quant_method", default=""), quant.str("fmt", default="")
        is_fp8 = method == "fp8" or fmt == "e4m3"
        weight_format = "fp8" if is_fp8 else "bf16"
        expert_format = _fmt(quant.str("expert_dtype", default=g.str("expert_dtype",
                                                                     default="fp4" if is_fp8 else "bf16")))
        window = g.int("window_size") if g.has("window_size") and not g.has("sliding_window") \
            else g.int("sliding_window")
        return cls(
            vocab_size=g.int("vocab_size"), dim=g.int("hidden_size"), n_layers=n_layers,
            n_heads=g.int("num_attention_heads"), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=g.int("q_lora_rank"), o_groups=g.int("o_groups"), o_lora_rank=g.int("o_lora_rank"),
            window=window, layer_kinds=kinds, csa_ratio=csa, hca_ratio=hca, index_n_heads=g.int("index_n_heads"),
            index_head_dim=g.int("index_head_dim"), index_topk=g.int("index_topk"),
            n_experts=g.int("n_routed_experts"), n_active_experts=g.int("num_experts_per_tok"),
            n_shared_experts=g.int("n_shared_experts"), moe_inter_dim=g.int("moe_intermediate_size"),
            n_hash_layers=n_hash, route_scale=g.num("routed_scaling_factor"), swiglu_limit=g.num("swiglu_limit"),
            hc_mult=g.int("hc_mult"), hc_sinkhorn_iters=g.int("hc_sinkhorn_iters"), hc_eps=g.num("hc_eps"),
            rms_eps=g.num("rms_norm_eps"), rope_theta=g.num("rope_theta"),
            compress_rope_theta=g.num("compress_rope_theta"), **yarn,
            max_position=g.int("max_position_embeddings"), n_mtp_layers=g.int("num_nextn_predict_layers"),
            score_func=g.str("scoring_func"), weight_format=weight_format, expert_format=expert_format, name=name,
            defaults=tuple(g.applied.items()),
        ).validate()

    # ---- files ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "custom") -> "V4Config":
        """Either layout; the presence of `dim` / `n_layers` marks the official one."""
        if not isinstance(d, dict):
            raise ConfigError("config must be a JSON object", where=f"config '{name}'", found=type(d).__name__)
        mt = d.get("model_type", "deepseek_v4")
        if mt != "deepseek_v4":
            raise ConfigError("unsupported `model_type`", where=f"config '{name}'", expected="deepseek_v4",
                              found=mt)
        if "n_layers" in d or "dim" in d:
            return cls.from_official(d, name)
        return cls.from_hf(d, name)

    @classmethod
    def from_file(cls, path: str | Path) -> "V4Config":
        from .files import read_text
        from .safetensors_io import loads_strict

        text = read_text(path, ConfigError, "config", limit=MAX_CONFIG_BYTES)
        return cls.from_dict(loads_strict(text, str(path), "config", ConfigError), name=str(path))

    @classmethod
    def from_dir(cls, path: str | Path) -> "V4Config":
        """A checkpoint directory: `config.json`, or `inference/config.json` of the official release
        (neither may lead out of the directory through a symlink)."""
        from .files import inside

        path = Path(path)
        for rel in ("config.json", "inference/config.json"):
            cand = path / rel
            if cand.exists() or cand.is_symlink():
                return cls.from_file(inside(path, rel, ConfigError, str(cand)))
        raise ConfigError("no config.json in checkpoint directory", where=str(path),
                          expected="config.json or inference/config.json")

    def to_json(self) -> str:
        return json.dumps(self.to_official(), indent=2) + "\n"


# ---- helpers -----------------------------------------------------------------------------------

class _Getter:
    """Typed access to a raw JSON object, with errors that name the config and the key. The one schema of
    both layouts: integers are JSON integers (or integral floats), never booleans; numbers are finite;
    `null` is refused except where the layout makes it mean absent (`nullable`); every integer is bounded
    (`MAX_INT`) before anything is sized from it. Every key read is one of `fields` (its default, `Derived`
    or REQUIRED: see OFFICIAL_FIELDS); the defaults applied are recorded in `applied` (key -> value)."""

    def __init__(self, d: dict[str, Any], name: str, fields: dict[str, Any], nullable: frozenset = frozenset(),
                 prefix: str = "", scope: str | None = None, applied: dict[str, Any] | None = None):
        self.d, self.name, self.fields, self.nullable, self.prefix = d, name, fields, nullable, prefix
        self.scope = prefix if scope is None else scope  # the keys' prefix in `fields`
        self.applied = {} if applied is None else applied

    def _err(self, what: str, **kw: Any) -> ConfigError:
        return ConfigError(what, where=f"config '{self.name}'", **kw)

    def _table(self, key: str) -> Any:
        try:
            return self.fields[self.scope + key]
        except KeyError:
            raise AssertionError(f"config key `{self.scope}{key}` is read but not in its layout's table") from None

    def has(self, key: str) -> bool:
        """Present with a value (`null` where it means absent: no; `null` elsewhere: refused)."""
        return self._present(key) is not None

    def _present(self, key: str) -> Any:
        """The key's value, None if absent (or `null` where that means absent)."""
        table = self._table(key)
        v = self.d.get(key)
        if v is None and key in self.d and self.scope + key not in self.nullable:
            left_out = "" if table is REQUIRED else \
                f", or the field left out: {table.how if isinstance(table, Derived) else f'default {_show(table)}'}"
            raise self._err(f"`{self.prefix}{key}` is null", expected=f"a value{left_out}")
        return v

    def _get(self, key: str, default: Any) -> Any:
        v = self._present(key)
        if v is not None:
            return v
        table = self._table(key)
        if default is REQUIRED:
            if table is REQUIRED:
                raise self._err(f"missing required field `{self.prefix}{key}`")
            assert not isinstance(table, Derived), f"`{self.scope}{key}` is derived: its reader gives the value"
            default = table
        if not isinstance(table, Derived):
            self.applied[self.prefix + key] = default
        return default

    def int(self, key: str, default: Any = REQUIRED, hi: int = None) -> int:
        v = self._get(key, default)
        return _as_int(v, f"{self.prefix}{key}", self._err, hi)

    def num(self, key: str, default: Any = REQUIRED) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._err(f"`{self.prefix}{key}` must be a finite number", found=_show(v))
        return float(v)

    def str(self, key: str, default: Any = REQUIRED) -> str:
        v = self._get(key, default)
        if not isinstance(v, str):
            raise self._err(f"`{self.prefix}{key}` must be a string", found=_show(v))
        return v

    def list(self, key: str, elem: type, max_len: int) -> list:
        v = self._get(key, REQUIRED)
        if not isinstance(v, list):
            raise self._err(f"`{self.prefix}{key}` must be a list", found=_show(v))
        if len(v) > max_len:
            raise self._err(f"`{self.prefix}{key}` is too long", expected=f"<= {max_len} entries", found=len(v))
        if elem is int:
            return [_as_int(x, f"{self.prefix}{key}[{i}]", self._err) for i, x in enumerate(v)]
        bad = next((x for x in v if not isinstance(x, elem)), None)
        if bad is not None:
            raise self._err(f"`{self.prefix}{key}` entries must be {_JSON_NAME.get(elem, elem.__name__)}",
                            found=_show(bad))
        return v

    def obj(self, key: str, scope: str | None = None) -> "_Getter":
        """A nested object (absent, or `null` where that means absent: an empty one). `scope`: its keys'
        prefix in the table (default: the object's own path)."""
        v = self._present(key)
        v = {} if v is None else v
        if not isinstance(v, dict):
            raise self._err(f"`{self.prefix}{key}` must be an object", found=_show(v))
        path = f"{self.prefix}{key}."
        return _Getter(v, self.name, self.fields, self.nullable, path, path if scope is None else scope, self.applied)


_JSON_NAME = {str: "strings", int: "integers", float: "numbers", dict: "objects"}


def _as_int(v: Any, key: str, err, hi: int | None = None) -> int:
    ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v)
                                                               and v == int(v))
    if not ok:
        raise err(f"`{key}` must be an integer", found=_show(v))
    v = int(v)
    hi = MAX_INT if hi is None else hi
    if not -MAX_INT <= v <= hi:
        raise err(f"`{key}` is out of range", expected=f"|value| <= {hi}", found=v)
    return v


def _kinds_from_ratios(ratios: list, name: str, csa: int | None = None, hca: int | None = None):
    """Official ratios -> kinds. 4 is CSA and 128 HCA in the releases; the overlapping (CSA) ratio is the
    smaller non-zero one when a synthetic config uses other values."""
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ratios):
        raise ConfigError("`compress_ratios` entries must be non-negative integers", where=f"config '{name}'",
                          found=ratios)
    nonzero = sorted({r for r in ratios if r})
    if len(nonzero) > 2:
        raise ConfigError("at most two distinct non-zero compress ratios (CSA and HCA)", where=f"config '{name}'",
                          found=nonzero)
    c = csa if csa is not None else 4
    h = hca if hca is not None else 128
    if len(nonzero) == 2:
        c, h = nonzero
    elif len(nonzero) == 1:
        if nonzero[0] == c or (nonzero[0] != h and nonzero[0] <= 4):
            c = nonzero[0]
        else:
            h = nonzero[0]
    kinds = tuple(SWA if r == 0 else (CSA if r == c else HCA) for r in ratios)
    return kinds, c, h


def _fmt(s: str) -> str:
    s = s.lower()
    return {"float8": "fp8", "e4m3": "fp8", "fp8_e4m3": "fp8", "bfloat16": "bf16", "float32": "fp32",
            "mxfp4": "fp4", "e2m1": "fp4"}.get(s, s)


def _hf_yarn(g: _Getter, needed: bool) -> dict[str, Any]:
    """The compressed layers' YaRN fields (V4Config's `yarn_*`) from their block: `rope_parameters.compress`
    (upstream's nested form), else `rope_parameters` when it says YaRN, else the legacy `rope_scaling`. A block
    without a type is YaRN (the hub's configs); another type is refused. No block: refused when the model has
    compressed layers (`needed`); otherwise nothing uses them (the dataclass's values stay)."""
    rp = g.obj("rope_parameters", scope=YARN)
    if rp.has("compress"):
        block = rp.obj("compress", scope=YARN)
    elif _rope_type(rp) == "yarn":
        block = rp
    else:
        block = g.obj("rope_scaling", scope=YARN)
    kind = _rope_type(block)
    if not block.d or kind == "default":
        if needed:
            raise ConfigError("missing required field `rope_parameters` (or `rope_scaling`): the YaRN parameters of "
                              "the compressed layers", where=f"config '{g.name}'")
        return {}
    if kind not in (None, "yarn"):
        raise ConfigError(f"`{block.prefix}rope_type` must be yarn (the compressed layers' RoPE)",
                          where=f"config '{g.name}'", found=_show(kind))
    return dict(yarn_factor=block.num("factor"), yarn_original_max_pos=block.int("original_max_position_embeddings"),
                yarn_beta_fast=block.num("beta_fast"), yarn_beta_slow=block.num("beta_slow"))


def _rope_type(block: _Getter) -> str | None:
    kind = block.str("rope_type") if block.has("rope_type") else None
    legacy = block.str("type") if block.has("type") else None
    return kind or legacy


# ---- presets -----------------------------------------------------------------------------------

def _v4_pro() -> V4Config:
    ratios = [128, 128] + [4, 128] * 29 + [4]
    kinds, _, _ = _kinds_from_ratios(ratios, "v4-pro")
    return V4Config(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, head_dim=512, rope_dim=64, q_lora_rank=1536,
        o_groups=16, o_lora_rank=1024, window=128, layer_kinds=kinds, csa_ratio=4, hca_ratio=128,
        index_n_heads=64, index_head_dim=128, index_topk=1024, n_experts=384, n_active_experts=6,
        n_shared_experts=1, moe_inter_dim=3072, n_hash_layers=3, route_scale=2.5, swiglu_limit=10.0,
        name="v4-pro")


def _v4_flash() -> V4Config:
    ratios = [0, 0] + [4, 128] * 20 + [4]
    kinds, _, _ = _kinds_from_ratios(ratios, "v4-flash")
    return V4Config(
        vocab_size=129280, dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, window=128, layer_kinds=kinds, csa_ratio=4, hca_ratio=128,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_experts=256, n_active_experts=6,
        n_shared_experts=1, moe_inter_dim=2048, n_hash_layers=3, route_scale=1.5, swiglu_limit=10.0,
        name="v4-flash")


def _tiny(kinds: tuple[str, ...], name: str) -> V4Config:
    """Small dims, same structure. HCA ratio 16 and window 16 so a ~100-token prompt closes several HCA
    windows and ~25 CSA windows (more than `index_topk` = 4, so the indexer really drops rows). Eight
    indexer heads keep exact ReLU-zero ties away (spec section 6). `swiglu_limit` 1.0 (not 10) so
    the clamp fires with unit-scale random activations."""
    return V4Config(
        vocab_size=512, dim=64, n_layers=len(kinds), n_heads=4, head_dim=32, rope_dim=16, q_lora_rank=48,
        o_groups=2, o_lora_rank=16, window=16, layer_kinds=kinds, csa_ratio=4, hca_ratio=16,
        index_n_heads=8, index_head_dim=32, index_topk=4, n_experts=8, n_active_experts=2,
        n_shared_experts=1, moe_inter_dim=32, n_hash_layers=2, route_scale=2.5, swiglu_limit=1.0,
        max_position=4096, yarn_original_max_pos=256, name=name)


PRESETS = {
    "v4-pro": _v4_pro,
    "v4-flash": _v4_flash,
    # The CLI default: every layer kind, hash + learned routing, MTP.
    "tiny": lambda: _tiny((SWA, HCA, CSA, HCA, CSA), "tiny"),
    # V4-Pro's layer pattern (HCA, HCA, then CSA/HCA alternating) at tiny size.
    "tiny-pro": lambda: _tiny((HCA, HCA, CSA, HCA, CSA), "tiny-pro"),
}


def preset(name: str) -> V4Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'", expected=" / ".join(sorted(PRESETS)))
    return PRESETS[name]().validate()
