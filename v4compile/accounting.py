"""Parameter, disk and KV-cache accounting (`v4compile inspect`).

Reproduces seed `v4-pro-architecture.txt` section 4 from a config (or from a checkpoint's headers):
logical parameters (an FP4 byte counts as two parameters, scales are not parameters), parameters
activated per token, bytes on disk with scales, tensor count, and the KV pool geometry per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

from .config import CSA, HCA, V4Config
from .weights import CATEGORIES, TensorSpec, weight_specs

GIB, MIB = float(1 << 30), float(1 << 20)



def main_row_bytes(cfg: V4Config) -> dict[str, int]:
    """Bytes of one main-pool row (seed figure 4): BF16 is one plane of head_dim x 2 B (1024 for V4);
    FP8 is a NoPE plane of head_dim B (448 e4m3 + tile scales + pad = 512) plus a BF16 RoPE plane
    of rope_dim x 2 B (128)."""
    return {"bf16": 2 * cfg.head_dim, "fp8": cfg.head_dim + 2 * cfg.rope_dim}


def index_row_bytes(cfg: V4Config) -> dict[str, int]:
    """Bytes of one indexer-key row: FP4 packs two values a byte plus one E8M0 byte per 32 values
    (68 for V4); FP8 is one byte a value plus an fp32 scale (132)."""
    di = cfg.index_head_dim
    return {"fp4": di // 2 + di // 32, "fp8": di + 4}


def block_tokens(cfg: V4Config) -> int:
    """Tokens per pool block (envelope): 2 x lcm of the compress ratios (256 for the releases)."""
    return 2 * math.lcm(cfg.csa_ratio, cfg.hca_ratio)


def envelope_rows(cfg: V4Config) -> dict[str, int]:
    bt = block_tokens(cfg)
    return {CSA: cfg.count(CSA) * bt // cfg.csa_ratio, HCA: cfg.count(HCA) * bt // cfg.hca_ratio}


def kv_bytes_per_token(cfg: V4Config) -> dict[str, float]:
    """Compressed-history bytes per token of context, by pool format (main pool + index plane)."""
    bt = block_tokens(cfg)
    env = envelope_rows(cfg)
    main_rows = (env[CSA] + env[HCA]) / bt
    index_rows = env[CSA] / bt
    main = {k: main_rows * v for k, v in main_row_bytes(cfg).items()}
    index = {k: index_rows * v for k, v in index_row_bytes(cfg).items()}
    out = {"bf16": main["bf16"], "fp8": main["fp8"], "index_fp4": index["fp4"], "index_fp8": index["fp8"]}
    for m in ("bf16", "fp8"):
        for i in ("fp4", "fp8"):
            out[f"{m}+{i}"] = main[m] + index[i]
    return out


def state_bytes_per_request(cfg: V4Config) -> dict[str, int]:
    """FP32 compressor state (kv + score rings) per request, by ring."""
    d, di = cfg.head_dim, cfg.index_head_dim
    csa_main = 2 * (2 * cfg.csa_ratio) * (2 * d) * 4
    csa_index = 2 * (2 * cfg.csa_ratio) * (2 * di) * 4
    hca = 2 * cfg.hca_ratio * d * 4
    return {"csa_main": cfg.count(CSA) * csa_main, "csa_index": cfg.count(CSA) * csa_index,
            "hca": cfg.count(HCA) * hca}


@dataclass
class Accounting:
    logical_params: int
    activated_params: int
    activated_parts: dict[str, int]
    disk_bytes: int
    n_tensors: int
    categories: dict[str, dict[str, float]]
    kv_bytes_per_token: dict[str, float]
    window_rows_per_request: int
    window_bytes_per_request: dict[str, int]
    state_bytes_per_request: dict[str, int]
    block_tokens: int
    envelope_rows: dict[str, int]

    def to_json(self) -> dict:
        return {
            "logical_params": self.logical_params,
            "activated_params": self.activated_params,
            "activated_parts": self.activated_parts,
            "disk_bytes": self.disk_bytes,
            "disk_gib": self.disk_bytes / GIB,
            "n_tensors": self.n_tensors,
            "categories": self.categories,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_gib_at_1m_tokens": {k: v * 1e6 / GIB for k, v in self.kv_bytes_per_token.items()},
            "window_rows_per_request": self.window_rows_per_request,
            "window_bytes_per_request": self.window_bytes_per_request,
            "state_bytes_per_request": self.state_bytes_per_request,
            "block_tokens": self.block_tokens,
            "envelope_rows": self.envelope_rows,
        }


def _scale_bytes(s: TensorSpec, cfg: V4Config) -> int:
    shape = s.scale_shape(cfg.quant_block, cfg.expert_scale_block)
    return math.prod(shape) if shape else 0


def account(cfg: V4Config, specs: list[TensorSpec] | None = None) -> Accounting:
    """Accounting for `cfg` in its declared storage formats (or for `specs` read from a checkpoint)."""
    specs = weight_specs(cfg) if specs is None else specs
    cats = {c: {"params": 0, "disk_bytes": 0} for c in CATEGORIES}
    n_tensors = 0
    disk = 0
    for s in specs:
        nbytes = s.data_bytes + _scale_bytes(s, cfg)
        n_tensors += 2 if s.scale_name else 1
        disk += nbytes
        cats[s.category]["params"] += s.numel
        cats[s.category]["disk_bytes"] += nbytes
    logical = sum(c["params"] for c in cats.values())

    # Activated per token: the backbone (no MTP), 6 of the routed experts, the whole attention path
    # (incl. compressors and indexer), shared experts, embed + head + final norm, gates, mHC.
    # Hash tables are lookups, not multiply-adds, and are not counted.
    per_expert = 3 * cfg.dim * cfg.moe_inter_dim
    parts = {
        "routed_experts": cfg.n_layers * cfg.n_active_experts * per_expert,
        "attention": cats["attention"]["params"] + cats["compressor"]["params"] + cats["indexer"]["params"],
        "shared_experts": cats["shared_experts"]["params"],
        "embed_head": cats["embed_head"]["params"],
        "gate": cats["gate"]["params"],
        "mhc": cats["mhc"]["params"],
        "norms": cats["norms"]["params"],
    }
    w = cfg.n_layers * cfg.window
    row = main_row_bytes(cfg)
    return Accounting(
        logical_params=logical,
        activated_params=sum(parts.values()),
        activated_parts=parts,
        disk_bytes=disk,
        n_tensors=n_tensors,
        categories={k: v for k, v in cats.items()},
        kv_bytes_per_token=kv_bytes_per_token(cfg),
        window_rows_per_request=w,
        window_bytes_per_request={"fp8": w * row["fp8"], "bf16": w * row["bf16"]},
        state_bytes_per_request=state_bytes_per_request(cfg),
        block_tokens=block_tokens(cfg),
        envelope_rows=envelope_rows(cfg),
    )


def _r2(x: float) -> str:
    """Two decimals, halves rounded up as the seed's tables do (7.625 -> 7.63)."""
    return str(Decimal(repr(x)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def _unit(total: float) -> tuple[str, float]:
    """One unit for a whole table, picked from its total (the seed prints everything in B)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if total >= scale:
            return unit, scale
    return "", 1.0


def render(cfg: V4Config, a: Accounting) -> str:
    """The text table of `v4compile inspect`."""
    unit, scale = _unit(a.logical_params)

    def _b(n: float) -> str:
        return f"{_r2(n / scale)} {unit}"

    lines = [f"DeepSeek-V4 accounting: {cfg.name}",
             f"  layers {cfg.n_layers} ({cfg.count(HCA)} HCA, {cfg.count(CSA)} CSA, "
             f"{cfg.n_layers - cfg.count(HCA) - cfg.count(CSA)} SWA) + {cfg.n_mtp_layers} MTP, dim {cfg.dim}, "
             f"{cfg.n_experts} experts / {cfg.n_active_experts} per token",
             *(["  defaults (left out of the config): " + ", ".join(f"{k} = {v}" for k, v in cfg.defaults)]
               if cfg.defaults else []),
             "",
             f"  logical parameters      {_b(a.logical_params)}   (FP4 byte = 2 params, scales not counted)",
             f"  activated per token     {_b(a.activated_params)}"]
    for k, v in a.activated_parts.items():
        lines.append(f"    {k:<22}{_b(v)}")
    lines += [f"  disk (with scales)      {_r2(a.disk_bytes / GIB)} GiB",
              f"  tensors                 {a.n_tensors:,}",
              "",
              f"  {'category':<18}{'params':>12}{'share':>9}{'disk':>12}"]
    for k, v in a.categories.items():
        if v["params"] == 0:
            continue
        lines.append(f"  {k:<18}{_b(v['params']):>12}{_r2(100 * v['params'] / a.logical_params):>8}%"
                     f"{_r2(v['disk_bytes'] / GIB):>9} GiB")
    kv = a.kv_bytes_per_token
    lines += ["",
              f"  KV pool: {a.block_tokens}-token blocks, envelope {sum(a.envelope_rows.values())} rows "
              f"({a.envelope_rows[CSA]} CSA + {a.envelope_rows[HCA]} HCA)",
              f"    bytes per token: BF16 main {kv['bf16']:.0f}, FP8 main {kv['fp8']:.0f}, "
              f"index FP4 {kv['index_fp4']:.0f} / FP8 {kv['index_fp8']:.0f}",
              f"    recipe default (FP8 + FP4 index) {kv['fp8+fp4']:.0f} B/token, "
              f"{_r2(kv['fp8+fp4'] * 1e6 / GIB)} GiB at 1 M (10^6) tokens",
              f"    sliding window per request: {a.window_rows_per_request} rows = "
              f"{_r2(a.window_bytes_per_request['fp8'] / MIB)} MiB FP8 / "
              f"{_r2(a.window_bytes_per_request['bf16'] / MIB)} MiB BF16",
              f"    compressor state per request: {sum(a.state_bytes_per_request.values()) / MIB:.1f} MiB "
              f"(HCA {a.state_bytes_per_request['hca'] / MIB:.1f} MiB)"]
    return "\n".join(lines) + "\n"
