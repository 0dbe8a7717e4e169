"""The compile report: kernel launches per decode step (total and per layer kind), pass hits, memory
arena and KV bytes per token."""

from __future__ import annotations

from collections import Counter

from .accounting import kv_bytes_per_token
from .config import V4Config
from .ir.core import Function, Module

# Ops that are views of their operand (no kernel launch).
VIEW_OPS = {"reshape", "split"}


def layer_of(loc: str) -> str | None:
    parts = loc.split(".")
    if len(parts) >= 2 and parts[0] in ("layers", "mtp") and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return None


def launches(fn: Function) -> list:
    return [op for op in fn.ops if op.name not in VIEW_OPS]


def launch_counts(cfg: V4Config, fn: Function) -> dict:
    per_layer: Counter = Counter()
    other = 0
    for op in launches(fn):
        layer = layer_of(op.loc)
        if layer is None:
            other += 1
        else:
            per_layer[layer] += 1
    by_kind: dict[str, list[int]] = {}
    for i in range(cfg.n_layers):
        by_kind.setdefault(cfg.kind(i), []).append(per_layer.get(f"layers.{i}", 0))
    return {
        "total": len(launches(fn)),
        "outside_layers": other,
        "per_layer": dict(per_layer),
        "by_kind": {k: {"layers": len(v), "mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                    for k, v in by_kind.items()},
        "mean_per_layer": sum(per_layer.values()) / max(cfg.n_layers, 1),
        "ops": dict(Counter(op.name for op in launches(fn))),
    }


def build_report(cfg: V4Config, traced: Module, result) -> dict:
    final = result.module
    dec = final.functions.get("decode")
    rep = {
        "config": cfg.name,
        "pipeline": [r.spec for r in result.records],
        "pass_hits": {r.name: r.hits for r in result.records},
        "launches_per_decode_step": len(launches(dec)) if dec else None,
        "launches_per_layer": launch_counts(cfg, dec)["by_kind"] if dec else None,
        "launches_traced_per_decode_step": len(launches(traced.functions["decode"])) if "decode" in traced.functions
        else None,
        "arena_bytes": final.attrs.get("arena_bytes"),
        "arena_naive_bytes": final.attrs.get("arena_naive_bytes"),
        "kv_bytes_per_token": final.attrs.get("kv_bytes_per_token", kv_bytes_per_token(cfg)),
        "seconds": {r.spec: round(r.seconds, 4) for r in result.records},
    }
    if dec:
        rep["decode_launches_detail"] = launch_counts(cfg, dec)
    return rep


def render_report(rep: dict) -> str:
    lines = [f"compile report: {rep['config']}", f"  pipeline: {', '.join(rep['pipeline'])}"]
    if rep["launches_per_decode_step"] is not None:
        lines.append(f"  kernel launches per decode step: {rep['launches_per_decode_step']} "
                     f"(traced: {rep['launches_traced_per_decode_step']})")
        det = rep["decode_launches_detail"]
        lines.append(f"    mean per layer {det['mean_per_layer']:.2f}, outside layers {det['outside_layers']}")
        for kind, v in rep["launches_per_layer"].items():
            lines.append(f"    {kind}: {v['layers']} layers, {v['mean']:.2f} per layer (min {v['min']}, max {v['max']})")
    lines.append("  pass hits:")
    for name, hits in rep["pass_hits"].items():
        shown = {k: v for k, v in hits.items() if v} or hits
        lines.append(f"    {name:<30} {', '.join(f'{k}={v}' for k, v in shown.items()) or '-'}")
    if rep["arena_bytes"] is not None:
        lines.append(f"  arena: {rep['arena_bytes']:,} bytes (naive sum {rep['arena_naive_bytes']:,})")
    kv = rep["kv_bytes_per_token"]
    if kv:
        lines.append("  KV bytes per token: " + ", ".join(f"{k} {v:.0f}" for k, v in kv.items()))
    return "\n".join(lines) + "\n"
