"""The report per layout: TP8/EP8 against DP8/EP8 on 8 GPUs of a target, modeled from the config alone.

    layout_table(cfg, targets, batch, calls_per_step) -> JSON;  render_layout_table(table) -> text

What each figure is and where it comes from (every row states it too):
* weights per rank: the checkpoint's tensors (`weights.spec_table`, stored formats + scales, the MTP block
  left out: no speculative decoding in the anchors), the routed experts split over EP; TP: `wq_b`, `wo_a`,
  `wo_b` and the sinks split over TP as `passes/partition.py` splits them, the rest replicated; DP: every
  non-expert weight replicated (each rank runs attention and the shared expert for its own sequences);
* KV + state per sequence at a context: `accounting.kv_bytes_per_token` (fp8 main pool + fp4 index, the
  lowered pool's formats) x context + the sliding windows and the compressor states of one request
  (`accounting.account`); TP replicates it on every rank (one KV head), DP holds each sequence on one rank;
* sequences that fit: (HBM - weights - WORKSPACE) / per-sequence bytes, per rank (DP: x 8 ranks);
* collectives per decode step at the per-rank batch b (bf16 activations, `dim` wide): TP8/EP8 two all-reduces
  per layer (wo_b's, the routed experts') of b tokens, a ring moving 2 (n-1)/n of them; DP8/EP8 one
  all-gather of the MoE input and one reduce-scatter of its output per layer over the 8 b tokens of the EP
  group, (n-1)/n of the gathered bytes each; each costs the link's latency + bytes / link bandwidth
  (`targets.TargetSpec.link`), except a compiled TP8/EP8 program's one-shot all-reduces (`oneshot`): the
  one-shot's measured fixed cost + (n-1) x bytes / link bandwidth, their launches among the program's calls
  (a compiled DP8/EP8 program's one-shot rows collectives alike, bytes a rank's part of the gathered value);
  the routed experts' folded into the MoE's launch (`passes/fuse_oneshot_producer.py`) exposed only past the
  shared expert's weights read meanwhile: max(0, time - those bytes / HBM bandwidth), modeled;
* modeled per-rank decode step = bandwidth (weights a step reads at the HBM roofline: every non-expert weight
  of the rank, and of its routed experts those the group's tokens pick, `1 - (1 - k/E)^tokens` each under
  uniform routing; KV reads left out as in `parallel_model`) + compute (2 x activated non-expert params x b +
  2 x expert params x the rank's share of the group's slots, at the fp8 MMA peak; it overlaps nothing, so it
  is an upper bound) + launches (the compiled program's kernel calls per step in its own layout's row, the
  other layout's the issue's bar of 7 a layer + 5, x `launch_s` of a graph node, PDL where the target has it)
  + collectives;
* modeled system output tokens/s at concurrency C (1k in / 1k out): C sequences decode one token per step;
  TP8/EP8 runs all C on every rank (b = C), DP8/EP8 ceil(C / 8) per rank; tokens/s = C / step. Decode steps
  only: the 1k-token prefill is not modeled (ATOM's measured figures include it, and its two micro-batches
  that hide the collectives). Modeled, not measured: printed beside ATOM's measurements from issue 34.
"""

from __future__ import annotations

import math
from typing import Any

from v4compile.accounting import kv_bytes_per_token, main_row_bytes, state_bytes_per_request
from v4compile.targets import TARGETS, oneshot_allreduce
from v4compile.weights import spec_table

WORLD = 8
# Memory a rank keeps apart from weights and KV: activations and the arena at the decode / prefill buckets,
# the collectives' buffers, the runtime and the driver's own (our assumption, stated in the output).
WORKSPACE_BYTES = 8e9
CONTEXTS = (4096, 65536, 1 << 20)
CONCURRENCY = (4, 256)
ACT_BYTES = 2  # bf16 activations through the collectives
TP_SPLIT = ("attn.wq_b.", "attn.wo_a.", "attn.wo_b.", "attn.attn_sink")
# ATOM on 8x MI355X, V4-Pro, FP8 KV, 1k in / 1k out, no MTP (issue 34): concurrency -> (ms per output token,
# system output tokens/s).
ATOM_MEASURED = {4: (19.66, 4 / 19.66e-3), 256: (57.55, 4290.0)}
LAYOUTS = ("TP8/EP8", "DP8/EP8")


def _weights(cfg) -> dict[str, float]:
    """Bytes of the served model's tensors (stored formats + scales), by how the layouts split them."""
    from v4compile.accounting import _scale_bytes
    out = {"experts": 0.0, "tp_split": 0.0, "other": 0.0, "expert_params": 0.0, "dense_active_params": 0.0}
    for s in spec_table(cfg).values():
        if s.category == "mtp":
            continue
        b = s.data_bytes + _scale_bytes(s, cfg)
        if s.category == "routed_experts":
            out["experts"] += b
            out["expert_params"] += s.numel
        else:
            out["tp_split" if any(k in s.name for k in TP_SPLIT) else "other"] += b
            if s.category != "embed_head" or "head" in s.name:
                out["dense_active_params"] += s.numel
    return out


def _per_sequence(cfg, context: int) -> float:
    window = cfg.n_layers * cfg.window * main_row_bytes(cfg)["fp8"]  # as `accounting.account` counts it
    return kv_bytes_per_token(cfg)["fp8+fp4"] * context + window + sum(state_bytes_per_request(cfg).values())


def _collectives(cfg, layout: str, b: int) -> dict[str, Any]:
    n, tok_bytes = WORLD, cfg.dim * ACT_BYTES
    if layout == "TP8/EP8":
        count, each = 2 * cfg.n_layers, b * tok_bytes
        moved = 2 * (n - 1) / n * each
        what = f"{count} all-reduces of {each:,} bytes (wo_b's and the routed experts', per layer)"
    else:
        count, each = 2 * cfg.n_layers, n * b * tok_bytes
        moved = (n - 1) / n * each
        what = (f"{cfg.n_layers} all-gathers + {cfg.n_layers} reduce-scatters of {each:,} bytes gathered (the MoE "
                f"input and output of the group's {n * b} tokens, per layer)")
    return {"count": count, "bytes_each": each, "moved_per_rank_each": moved, "what": what}


def _calls(cfg, layout: str, calls_per_step: int | dict[str, int] | None) -> tuple[int, str]:
    """(kernel calls a step, their source): the compiled program's for its own layout (a dict names it; an int
    stands for both), else the issue's bar, 7 a layer + 5 outside them (a layout not compiled here)."""
    given = calls_per_step.get(layout) if isinstance(calls_per_step, dict) else calls_per_step
    if given is not None:
        return given, "the compiled program"
    return int(round(cfg.n_layers * 7 + 5)), "not compiled here: 7 a layer + 5, the bar"


def step(cfg, w: dict, layout: str, target: str, b: int,
         calls_per_step: int | dict[str, int] | None, oneshot: bool = False, hidden_bytes: int = 0) -> dict[str, Any]:
    spec = TARGETS[target]
    E, k = cfg.n_experts, cfg.n_active_experts
    group_tokens = b if layout == "TP8/EP8" else WORLD * b
    dense = w["other"] + (w["tp_split"] / WORLD if layout == "TP8/EP8" else w["tp_split"])
    touched = 1 - (1 - k / E) ** group_tokens
    read = dense + w["experts"] / WORLD * touched
    bw_s = read / spec.hbm_bytes_s
    flops = 2 * w["dense_active_params"] * b + 2 * w["expert_params"] / E * k * group_tokens / WORLD
    compute_s = flops / spec.fp8_flops_s
    calls, calls_source = _calls(cfg, layout, calls_per_step)
    kind = "graph_pdl" if spec.pdl else "graph"
    launch_s = calls * spec.launch_latency(kind)
    c = _collectives(cfg, layout, b)
    coll_s = c["count"] * (spec.link.allreduce_latency_s + c["moved_per_rank_each"] / spec.link.bytes_s)
    if (oneshot and layout == "TP8/EP8" and calls_source == "the compiled program"
            and spec.link.oneshot_latency_s is not None and oneshot_allreduce(WORLD, c["bytes_each"])):
        # the compiled program's all-reduces are one-shot kernel calls (their launches among its calls, or phases
        # of their consumers')
        coll_s = c["count"] * spec.link.oneshot_s(WORLD, c["bytes_each"])
        c = {**c, "what": c["what"] + ", one-shot"}
    elif (oneshot and layout == "DP8/EP8" and calls_source == "the compiled program"
            and spec.link.oneshot_latency_s is not None and oneshot_allreduce(WORLD, c["bytes_each"] / WORLD)):
        # the compiled program's rows all-gathers / reduce-scatters are one-shot kernel calls: a rank pulls its
        # part (the gathered bytes over the world) from each peer
        coll_s = c["count"] * spec.link.oneshot_s(WORLD, c["bytes_each"] / WORLD)
        c = {**c, "what": c["what"] + ", one-shot"}
    if oneshot and hidden_bytes and layout == "TP8/EP8" and calls_source == "the compiled program":
        # the routed experts' all-reduces folded into the MoE's launch (`passes/fuse_oneshot_producer.py`): exposed
        # only past the shared expert's weights read while the peers arrive, max(0, time - bytes / HBM)
        each = coll_s / c["count"]
        coll_s = c["count"] / 2 * (each + max(0.0, each - hidden_bytes / spec.hbm_bytes_s))
        c = {**c, "what": c["what"] + f"; the routed experts' hidden behind the shared expert's "
                                      f"{hidden_bytes / 1e6:.0f} MB: modeled"}
    total = bw_s + compute_s + launch_s + coll_s
    return {"batch_per_rank": b, "bandwidth_us": bw_s * 1e6, "bytes_read": read, "compute_us": compute_s * 1e6,
            "flops": flops, "launch_us": launch_s * 1e6, "calls": calls,
            "calls_source": calls_source,
            "collectives_us": coll_s * 1e6, "collectives": c, "step_us": total * 1e6}


def layout_table(cfg, targets: tuple[str, ...] = tuple(TARGETS), batch: int = 8,
                 calls_per_step: int | dict[str, int] | None = None, oneshot: bool = False,
                 hidden_bytes: int = 0) -> dict[str, Any]:
    """`oneshot`: the compiled program's collectives are one-shot kernel calls (`passes/oneshot_allreduce.py`: TP8/EP8's
    all-reduces, DP8/EP8's rows all-gathers and reduce-scatters; counted in its calls): its row's
    collectives then cost the one-shot's own time where the target has a measured
    figure (`parallel_model.collective_s`), not a ring's. `hidden_bytes`: its routed experts' all-reduces are folded
    into the MoE's launch (`passes/fuse_oneshot_producer.py`), each exposed only past that many bytes (the shared
    expert's weights) at the HBM roofline."""
    w = _weights(cfg)
    seq = {ctx: _per_sequence(cfg, ctx) for ctx in CONTEXTS}
    rows = []
    for t in targets:
        spec = TARGETS[t]
        for layout in LAYOUTS:
            per_rank = w["experts"] / WORLD + w["other"] + (w["tp_split"] / WORLD if layout == "TP8/EP8"
                                                             else w["tp_split"])
            free = spec.link.memory_bytes - per_rank - WORKSPACE_BYTES
            fits = {ctx: max(0, int(free // s)) * (1 if layout == "TP8/EP8" else WORLD) for ctx, s in seq.items()}
            tps = {}
            for conc in CONCURRENCY:
                b = conc if layout == "TP8/EP8" else math.ceil(conc / WORLD)
                st = step(cfg, w, layout, t, b, calls_per_step, oneshot, hidden_bytes)
                tps[conc] = {"step_us": st["step_us"], "tokens_s": conc / (st["step_us"] * 1e-6), "batch_per_rank": b}
            rows.append({"target": t, "device": spec.link.device, "layout": layout, "weights_per_rank": per_rank,
                         "kv_state_per_sequence": {ctx: seq[ctx] for ctx in CONTEXTS},
                         "kv_state_per_rank_at_batch": {ctx: seq[ctx] * batch for ctx in CONTEXTS},
                         "fits_sequences": fits,
                         "step": step(cfg, w, layout, t, batch, calls_per_step, oneshot, hidden_bytes),
                         "system": tps, "memory_bytes": spec.link.memory_bytes, "source": spec.link.source})
    return {"model": cfg.name if hasattr(cfg, "name") else "", "world": WORLD, "batch_per_rank": batch,
            "workspace_bytes": WORKSPACE_BYTES, "rows": rows, "atom_measured": ATOM_MEASURED,
            "modeled_from": "the config (shape-only), not a compiled DP module"}


def fits_ratio(table: dict, target: str, context: int) -> float:
    """DP8/EP8's sequences that fit over TP8/EP8's at a context, on a target."""
    r = {row["layout"]: row["fits_sequences"][context] for row in table["rows"] if row["target"] == target}
    return r["DP8/EP8"] / max(r["TP8/EP8"], 1)


def render_layout_table(t: dict) -> str:
    gb = 1e9
    lines = [f"  per layout, {t['world']} GPUs (modeled from {t['modeled_from']}; workspace "
             f"{t['workspace_bytes'] / gb:.0f} GB a rank assumed; KV fp8 + fp4 index):",
             "    device   layout   weights/rank  KV+state/seq 4k | 64k | 1M       sequences that fit 4k | 64k | 1M"]
    for r in t["rows"]:
        s = r["kv_state_per_sequence"]
        f = r["fits_sequences"]
        lines.append(f"    {r['device']:<8} {r['layout']:<8} {r['weights_per_rank'] / gb:8.1f} GB   "
                     + " | ".join(f"{s[c] / gb:.3f}" for c in CONTEXTS) + " GB    "
                     + " | ".join(f"{f[c]:,}" for c in CONTEXTS))
    lines.append(f"    modeled per-rank decode step at batch {t['batch_per_rank']} a rank (bandwidth: weights read at the "
                 "HBM roofline; compute: FLOPs at the fp8 peak; launches: calls x graph-node latency; collectives: "
                 "latency + bytes / link):")
    for r in t["rows"]:
        st = r["step"]
        c = st["collectives"]
        lines.append(f"    {r['device']:<8} {r['layout']:<8} {st['step_us']:7.1f} us = bandwidth {st['bandwidth_us']:.1f} "
                     f"({st['bytes_read'] / gb:.2f} GB) + compute {st['compute_us']:.1f} + launches {st['launch_us']:.1f} "
                     f"({st['calls']} calls, {st['calls_source']}) + collectives {st['collectives_us']:.1f} "
                     f"({c['what']})")
    lines.append("    system output tokens/s at 1k in / 1k out (modeled: decode steps only; measured: ATOM, 8x MI355X, "
                 "issue 34):")
    for r in t["rows"]:
        lines.append(f"    {r['device']:<8} {r['layout']:<8} " + "; ".join(
            f"concurrency {c}: modeled {v['tokens_s']:,.0f} tokens/s ({v['step_us'] / 1e3:.2f} ms a token)"
            for c, v in r["system"].items()))
    lines.append("    measured (ATOM, DP attention + EP, 8x MI355X): " + "; ".join(
        f"concurrency {c}: {tps:,.0f} tokens/s ({ms:.2f} ms a token)" for c, (ms, tps) in t["atom_measured"].items()))
    for tgt in dict.fromkeys(r["target"] for r in t["rows"]):
        dev = next(r["device"] for r in t["rows"] if r["target"] == tgt)
        lines.append(f"    DP8/EP8 fits {fits_ratio(t, tgt, 65536):.1f}x the concurrent sequences of TP8/EP8 at 64k "
                     f"on 8x {dev}")
    return "\n".join(lines) + "\n"
