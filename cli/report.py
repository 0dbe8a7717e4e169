"""The compile report: kernel launches per decode step (total, per layer kind), pass hits, the memory
arena and the KV bytes per token of the lowered pool."""

from __future__ import annotations

from collections import Counter

from ..accounting import kv_bytes_per_token
from ..runtime.prefix_cache import snapshot_bytes
from ..config import V4Config
from ..ir.core import Function, Module
from ..ir.registry import get_op
# ATOM's V4-Pro decode (anchor-atom.md, our estimates from its code paths).
ATOM_LAUNCHES = {"hca": (31, 34), "csa": (39, 42), "total": 2200}


def launches(fn: Function) -> list:
    """The ops that become kernel launches (the registry's `launch` trait: views are not)."""
    return [op for op in fn.ops if get_op(op.name).launch]


def launch_counts(cfg: V4Config, fn: Function) -> dict:
    per_layer: Counter = Counter()
    other = 0
    for op in launches(fn):
        layer = op.attrs.get("layer")  # MTP block j: layer n_layers + j
        if layer is None:
            other += 1
        else:
            per_layer[layer] += 1
    by_kind: dict[str, list[int]] = {}
    for i in range(cfg.n_layers):
        by_kind.setdefault(cfg.kind(i), []).append(per_layer.get(i, 0))
    return {
        "total": len(launches(fn)),
        "outside_layers": other,
        "per_layer": dict(per_layer),
        "by_kind": {k: {"layers": len(v), "mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                    for k, v in by_kind.items()},
        "mean_per_layer": sum(v for k, v in per_layer.items() if k < cfg.n_layers) / max(cfg.n_layers, 1),
        "ops": dict(Counter(op.name for op in launches(fn))),
    }


def _total_hits(hits: dict[str, int], func: str = "decode") -> dict[str, int]:
    """Hits of one function (`decode.seams` -> `seams`), or the plain ones for module-level counters."""
    out = {}
    for k, v in hits.items():
        f, _, name = k.partition(".")
        if not name:
            out[k] = v
        elif f == func:
            out[name] = v
    return out


def build_report(cfg: V4Config, traced: Module, result, targets: tuple[str, ...] = ()) -> dict:
    """`targets`: GPU targets whose modeled decode step (codegen/roofline.py) joins the report."""
    final = result.module
    dec = final.functions.get("decode")
    lowered = "pool.kv_bytes_per_token" in final.attrs
    rep = {
        "config": cfg.name,
        "numerics": final.attrs.get("numerics"),
        "dtype": final.attrs.get("dtype"),
        "pipeline": [r.spec for r in result.records],
        "pass_hits": {r.name: _total_hits(r.hits) for r in result.records},
        "launches_per_decode_step": len(launches(dec)) if dec else None,
        "launches_per_layer": launch_counts(cfg, dec)["by_kind"] if dec else None,
        "launches_per_layer_mean": launch_counts(cfg, dec)["mean_per_layer"] if dec else None,
        "launches_traced_per_decode_step": len(launches(traced.functions["decode"]))
        if "decode" in traced.functions else None,
        "arena_bytes": final.attrs.get("arena_bytes"),
        "arena_naive_bytes": final.attrs.get("arena_naive_bytes"),
        "arena_bytes_by_function": {n: f.attrs.get("arena_bytes") for n, f in final.functions.items()},
        "kv_bytes_per_token": final.attrs.get("pool.kv_bytes_per_token") if lowered else None,
        "kv_pool": {"main": final.attrs.get("pool.main_fmt"), "index": final.attrs.get("pool.index_fmt"),
                    "block_tokens": final.attrs.get("pool.block_tokens"),
                    "envelope_rows": final.attrs.get("pool.envelope_rows")} if lowered else None,
        "kv_bytes_per_token_accounting": kv_bytes_per_token(cfg),
        # the prefix cache's boundary snapshot (runtime/prefix_cache.py), from the config: bf16 window rows
        "prefix_cache_snapshot": snapshot_bytes(cfg, mtp_layers=cfg.n_mtp_layers),
        "seconds": {r.spec: round(r.seconds, 4) for r in result.records},
    }
    if dec:
        rep["decode_launches_detail"] = launch_counts(cfg, dec)
    if final.attrs.get("stage") == "program":
        from ..program.build import program_of

        prog = program_of(final)
        rep["program"] = program_summary(prog)
        if "decode" in rep["program"]:
            rep["launches_per_decode_step"] = rep["program"]["decode"]["launches"]
        gpu = [t for t in targets if t != "cpu"]
        if gpu and "decode" in prog.functions:
            from ..codegen.program_kernels import program_kernels
            from ..codegen.roofline import by_layer_kind, step_model

            pk = program_kernels(prog)
            if pk.complete:
                rep["decode_step"] = {t: step_model(prog, pk, "decode", t) for t in gpu}
                if "prefill" in prog.functions:
                    rep["prefill_step"] = {t: step_model(prog, pk, "prefill", t) for t in gpu}
                for m in [*rep["decode_step"].values(), *rep.get("prefill_step", {}).values()]:
                    m["by_layer_kind"] = by_layer_kind(m, cfg.kind)
    gpu = tuple(t for t in targets if t != "cpu")
    if gpu and cfg.n_mtp_layers:
        from ..codegen.spec_cost import REPORT_DRAFT_TOKENS, by_batch, verify_models

        rep["speculative_step"] = verify_models(cfg, REPORT_DRAFT_TOKENS, gpu)
        rep["speculative_by_batch"] = by_batch(cfg, max(REPORT_DRAFT_TOKENS), gpu)
    return rep


def program_summary(prog) -> dict:
    """Per function: launches, kernel families with counts, distinct specialisations, buffer bytes by kind,
    and the registry's cost rules summed (FLOPs, bytes read / written)."""
    from ..ir.registry import get_op

    out = {}
    for name, f in prog.functions.items():
        flops = read = written = 0
        for l in f.launches:
            opdef = get_op(l.op)
            operands = [a.type if a is not None else None for _, a in l.operands]
            c = opdef.cost_of(operands, [a.type for _, a in l.results], l.attrs)
            flops, read, written = flops + c.flops, read + c.bytes_read, written + c.bytes_written
        by_kind: Counter = Counter()
        for b in f.buffers:
            by_kind[b.kind] += b.nbytes
        out[name] = {"launches": len(f.launches),
                     "kernel_families": dict(sorted(Counter(l.kernel for l in f.launches).items())),
                     "specialisations": len({l.specialisation for l in f.launches}),
                     "buffer_bytes": dict(sorted(by_kind.items())),
                     "flops": flops, "bytes_read": read, "bytes_written": written}
    return out


def render_report(rep: dict) -> str:
    lines = [f"compile report: {rep['config']} (numerics {rep['numerics']}, {rep['dtype']})",
             f"  pipeline: {', '.join(rep['pipeline'])}"]
    if rep["launches_per_decode_step"] is not None:
        lines.append(f"  kernel launches per decode step: {rep['launches_per_decode_step']} "
                     f"(traced graph: {rep['launches_traced_per_decode_step']}; ATOM ~{ATOM_LAUNCHES['total']})")
        det = rep["decode_launches_detail"]
        # issue 21's goal counts kernel calls (a launch may make several), given per layer kind below
        lines.append(f"    mean per layer {det['mean_per_layer']:.2f} launches (goal: <= 6 kernel calls per layer, "
                     f"counted in the modeled step below), outside layers {det['outside_layers']}")
        for kind, v in rep["launches_per_layer"].items():
            atom = ATOM_LAUNCHES.get(kind)
            ref = f"; ATOM {atom[0]}-{atom[1]}" if atom else ""
            lines.append(f"    {kind}: {v['layers']} layers, {v['mean']:.2f} per layer (min {v['min']}, max {v['max']}{ref})")
    lines.append("  pass hits (decode):")
    for name, hits in rep["pass_hits"].items():
        shown = {k: v for k, v in hits.items() if v} or hits
        lines.append(f"    {name:<30} {', '.join(f'{k}={v}' for k, v in shown.items()) or '-'}")
    if rep["arena_bytes"] is not None:
        ratio = rep["arena_naive_bytes"] / max(rep["arena_bytes"], 1)
        lines.append(f"  arena: {rep['arena_bytes']:,} bytes (naive sum {rep['arena_naive_bytes']:,}; "
                     f"{ratio:.1f}x smaller); by function: "
                     + ", ".join(f"{k} {v:,}" for k, v in rep["arena_bytes_by_function"].items()))
    if rep["kv_bytes_per_token"] is not None:
        p = rep["kv_pool"]
        lines.append(f"  KV bytes per token of the lowered pool: {rep['kv_bytes_per_token']:.0f} "
                     f"({p['main']} main + {p['index']} index; {p['block_tokens']}-token blocks of "
                     f"{p['envelope_rows']} rows)")
    if rep.get("prefix_cache_snapshot"):
        c = rep["prefix_cache_snapshot"]
        lines.append(f"  prefix cache: a boundary snapshot {c['snapshot_bytes'] / 1e6:.2f} MB (window rings "
                     f"{c['window_bytes'] / 1e6:.2f} MB in bf16, compressor / indexer state rings "
                     f"{c['state_bytes'] / 1e6:.2f} MB), {c['per_block_bytes'] / 2**20:.2f} MiB per cached "
                     f"{c['block_tokens']}-token block (pieces of {c['granularity']} tokens)")
    for fname, p in (rep.get("program") or {}).items():
        lines.append(f"  program @{fname}: {p['launches']} launches, {p['specialisations']} launch signatures; "
                     + ", ".join(f"{k} x{v}" for k, v in p["kernel_families"].items()))
    if rep.get("decode_step"):
        from ..codegen.roofline import render_excess, render_layer_kinds, render_step

        lines.append("  modeled decode step (kernel bytes and FLOPs at the target's roofline + per-launch latency):")
        for m in rep["decode_step"].values():
            lines += [render_step(m), render_layer_kinds(m), render_excess(m)]
    if rep.get("prefill_step"):
        from ..codegen.roofline import render_layer_kinds, render_step

        lines.append("  modeled prefill chunk (the same model; roofline: the larger of ideal bytes at HBM and FLOPs "
                     "at the MMA peak):")
        for m in rep["prefill_step"].values():
            lines += [render_step(m), render_layer_kinds(m)]
    if rep.get("speculative_step"):
        from ..codegen.spec_cost import render

        lines.append("  modeled speculative verify step (MTP, traced graphs at the roofline, batch 1):")
        lines += [render(m) for ms in rep["speculative_step"].values() for m in ms]
    if rep.get("speculative_by_batch"):
        from ..codegen.spec_cost import render_by_batch

        lines += render_by_batch(rep["speculative_by_batch"], rep["config"])
    acc = rep["kv_bytes_per_token_accounting"]
    lines.append("  KV bytes per token, accounting: " + ", ".join(f"{k} {v:.0f}" for k, v in acc.items()))
    return "\n".join(lines) + "\n"
