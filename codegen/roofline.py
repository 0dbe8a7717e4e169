"""The modeled time of one step of a program on a GPU target, against its roofline.

    step_model(prog, kernels, function, target, rows=None) -> dict

Two byte counts per step:
* `ideal_bytes`: what the step has to move at least: the registry's cost rule of every launch
  (`OpDef.cost_of`: weights read once, only the active experts' weights, only the pool rows a launch
  reads or writes, activations once).
* `kernel_bytes`: what our kernels are modeled to move to and from HBM (`hbm_bytes` of each call: its
  `bytes_moved`, re-reads, scratch round trips and split-K partials included, less the re-reads the target's
  last-level cache serves); `traffic_bytes` is the same before the cache (every `bytes_moved`).
Times (microseconds): every kernel call costs max(its bytes at HBM bandwidth, its FLOPs at the MMA peak)
plus the per-launch latency of its launch kind: "graph" (a node of the replayed graph) or "graph_pdl" (a
node launched with programmatic dependent launch: kernels that wait in `kernels/pdl.py`, on a target with
PDL). The figures and their published sources are the target's (`v4compile/targets.py`, one home).
`modeled_us` is the sum, split into `bandwidth_us` (calls bound by bytes), `compute_us` (calls bound by
FLOPs) and `launch_latency_us`; `roofline_us` is the step's own roofline: the larger of `ideal_bytes` at
HBM bandwidth and the registry's FLOPs at the MMA peak (decode is always the former).
`time_ratio = modeled_us / roofline_us` is what further fusion has to drive toward 1; `bytes_ratio =
kernel_bytes / ideal_bytes` has the goal <= 1.01 (`BYTES_GOAL`; tests hold it <= `BYTES_BOUND`). `by_layer` gives per decoder layer
(from each launch's location, `layers.<i>.`) its kernel calls, modeled time and bytes; the report groups
them by layer kind.
`by_family` gives per kernel family its calls, kernel bytes and ideal bytes (largest excess first): where
the bytes above ideal come from (`render_excess`).
With `rows` (the AOT report rows of these kernels) the step also says how many of its kernels spill and
whether every GEMM-like kernel uses matrix instructions.
"""

from __future__ import annotations

import re
from typing import Any

from ..ir.registry import get_op
from ..program.core import Program
from ..targets import TARGETS
from .kernels.flags import uses_pdl

BYTES_GOAL = 1.01  # the decode step's goal (issue 21), printed met or not
BYTES_BOUND = 1.05  # what the tests hold every program to until the goal is met: a regression fails them
# Kernel families whose FLOP-counting kernels multiply matrices: their binaries must hold MMA instructions
# (an fp32 artifact on sm_90a has none: no fp32 MMA there, and tf32 would change the numerics).
MMA_FAMILIES = ("gemm", "grouped_gemm", "out_proj", "moe", "moe_router", "sparse_attention", "indexer",
                "attn_front")


LAUNCH_KINDS = ("graph", "graph_pdl")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def launch_kind(pdl: bool) -> str:
    return "graph_pdl" if pdl else "graph"


def peak_flops(target: str, mma_dtype: str) -> float:
    t = TARGETS[target]
    return t.fp8_flops_s if mma_dtype in ("fp8", "fp4") else t.bf16_flops_s


def modeled_time(flops: int, bytes_moved: int, target: str, mma_dtype: str = "bf16", kind: str = "graph") -> float:
    """Seconds for one launch: max(bytes / HBM, flops / MMA peak) + the latency of its launch kind."""
    t = TARGETS[target]
    return max(bytes_moved / t.hbm_bytes_s, flops / peak_flops(target, mma_dtype)) + t.launch_latency(kind)


def bandwidth_time(bytes_moved: int, target: str) -> float:
    """The pure-bandwidth roofline of the same bytes (no launch latency, no compute)."""
    return bytes_moved / TARGETS[target].hbm_bytes_s


# A launch's re-reads (`KernelCall.reread_bytes`: rows read by every head block, x read by every K split, partials
# read back by the reducing program) hit the last-level cache when everything the launch touches (its footprint:
# bytes_moved less those re-reads) fits in this share of it: then, even under plain LRU, nothing the launch
# touched is evicted before the launch ends, whatever order its programs run in. The half is the margin for
# Hopper's two L2 partitions (a line may be held in both) and for the neighbouring launches' lines (PDL overlap).
CACHE_SHARE = 0.5


# A launch whose programs' order bounds how far a re-read comes after its byte's last touch declares that bound
# (`KernelCall.reuse_bytes`, the re-read's LRU stack distance in bytes: Mattson, Gecsei, Slutz and Traiger,
# "Evaluation techniques for storage hierarchies", IBM Systems Journal 9(2), 1970: a fully associative LRU cache
# of C bytes hits exactly the references whose stack distance is below C). The bound is taken with the programs
# one after another in the order they start; on the GPU many run at once, but in the steady state of a
# bandwidth-bound phase of like programs one program's bytes arrive per program started (Little's law), so the
# bytes between two events of programs n apart are still ~n programs' bytes. The same CACHE_SHARE margin holds.


def hbm_bytes(call, target: str) -> int:
    """The HBM bytes of one kernel call on `target`: its footprint when that fits `CACHE_SHARE` of the target's
    last-level cache (the re-reads are hits), else every byte it moves; phase by phase for a launch whose
    phases each wait for every program of the one before (`KernelCall.phases`: no phase's loads overlap
    another's in time, so a phase's re-reads compete with its own footprint only). Where a phase declares its
    re-reads' reuse distance (`KernelCall.reuse_bytes`), that distance stands for the footprint when smaller."""
    cache = CACHE_SHARE * TARGETS[target].llc_bytes
    parts = call.phases or ((call.bytes_moved, call.reread_bytes),)
    reuse = tuple(call.reuse_bytes) + (None,) * (len(parts) - len(call.reuse_bytes))
    return sum(moved - reread if min(moved - reread, far if far is not None else moved) <= cache else moved
               for (moved, reread), far in zip(parts, reuse))


def _cost(l):
    return get_op(l.op).cost_of([a.type if a is not None else None for _, a in l.operands],
                                [a.type for _, a in l.results], l.attrs)


def ideal_bytes(prog: Program, function: str) -> int:
    """Registry cost of every launch of `function`; a weight buffer read by several launches counts once."""
    f = prog.functions[function]
    total, seen = 0, set()
    for l in f.launches:
        c = _cost(l)
        total += c.bytes_read + c.bytes_written
        for _, a in l.operands:  # a weight shared between launches (none today) would be read once
            if a is not None and f.buffer(a.buffer).kind == "weight":
                if a.buffer in seen:
                    total -= a.type.nbytes
                seen.add(a.buffer)
    return total


def layer_of(loc: str) -> int | None:
    """The decoder layer a launch belongs to, from its location (`layers.<i>.`); None outside the layers."""
    m = _LAYER.search(loc or "")
    return int(m.group(1)) if m else None


def step_model(prog: Program, kernels, function: str, target: str, rows: list[dict] | None = None) -> dict[str, Any]:
    """`kernels`: the program's `ProgramKernels` (codegen.program_kernels)."""
    spec = TARGETS[target]
    fam: dict[str, str] = {}
    calls = []
    ideal_flop_s = 0.0
    by_layer: dict[Any, dict[str, float]] = {}
    by_family: dict[str, dict[str, int]] = {}  # where the kernel bytes exceed the ideal (no weight dedup here)
    split = {"bandwidth": 0.0, "compute": 0.0, "launch": 0.0}
    kinds = {k: 0 for k in LAUNCH_KINDS if k == "graph" or spec.pdl}
    for l, per in zip(prog.functions[function].launches, kernels.calls[function]):
        live = [c for c in per if 0 not in c.grid]
        mma = next((c.mma_dtype for c in live if c.flops), "bf16")
        cost = _cost(l)
        ideal_flop_s += cost.flops / peak_flops(target, mma)
        layer = layer_of(l.loc)
        row = by_layer.setdefault("other" if layer is None else layer,
                                  {"calls": 0, "modeled_s": 0.0, "bytes": 0, "ideal": 0})
        row["ideal"] += cost.bytes_read + cost.bytes_written
        fx = by_family.setdefault(l.kernel, {"calls": 0, "kernel_bytes": 0, "ideal_bytes": 0,
                                                    "traffic_bytes": 0})
        fx["calls"] += len(live)
        fx["kernel_bytes"] += sum(hbm_bytes(k, target) for k in live)
        fx["traffic_bytes"] += sum(k.bytes_moved for k in live)
        fx["ideal_bytes"] += cost.bytes_read + cost.bytes_written
        for c in live:
            calls.append(c)
            fam[c.name] = l.kernel
            kind = launch_kind(uses_pdl(c.fn, target))
            kinds[kind] += 1
            hb = hbm_bytes(c, target)
            bw, fl = hb / spec.hbm_bytes_s, c.flops / peak_flops(target, c.mma_dtype)
            split["bandwidth" if bw >= fl else "compute"] += max(bw, fl)
            split["launch"] += spec.launch_latency(kind)
            row["calls"] += 1
            row["modeled_s"] += max(bw, fl) + spec.launch_latency(kind)
            row["bytes"] += hb
    modeled = sum(split.values())
    kbytes = sum(hbm_bytes(c, target) for c in calls)
    ideal = ideal_bytes(prog, function)
    roof = max(ideal / spec.hbm_bytes_s, ideal_flop_s)
    out: dict[str, Any] = {
        "function": function, "target": target, "launches": len(prog.functions[function].launches),
        "kernel_calls": len(calls), "kernels": len({c.name for c in calls}), "kernel_bytes": kbytes, "ideal_bytes": ideal,
        "traffic_bytes": sum(c.bytes_moved for c in calls),
        "bytes_ratio": round(kbytes / max(ideal, 1), 4), "bytes_goal": BYTES_GOAL,
        "modeled_us": round(modeled * 1e6, 2), "roofline_us": round(roof * 1e6, 2),
        "roofline_bound": "compute" if ideal_flop_s > ideal / spec.hbm_bytes_s else "bandwidth",
        "bandwidth_us": round(split["bandwidth"] * 1e6, 2), "compute_us": round(split["compute"] * 1e6, 2),
        "launch_latency_us": round(split["launch"] * 1e6, 2),
        "calls_by_launch_kind": kinds,
        "launch_latency_s": {k: spec.launch_latency(k) for k in kinds},
        "hbm_bytes_s": spec.hbm_bytes_s, "launch_s": spec.launch_s, "llc_bytes": spec.llc_bytes,
        "by_layer": {str(k): {"calls": v["calls"], "modeled_us": round(v["modeled_s"] * 1e6, 2),
                              "kernel_bytes": v["bytes"], "ideal_bytes": v["ideal"]} for k, v in by_layer.items()},
        "by_family": dict(sorted(by_family.items(), key=lambda kv: kv[1]["ideal_bytes"] - kv[1]["kernel_bytes"])),
    }
    out["time_ratio"] = round(out["modeled_us"] / max(out["roofline_us"], 1e-9), 3)
    if rows is not None:
        by = {r["name"]: r for r in rows if r["target"] == target}
        names = {c.name for c in calls}
        out["kernels_spilling"] = sorted(n for n in names if by[n]["spills"])
        gemm_like = {c.name for c in calls if fam[c.name] in MMA_FAMILIES and c.flops}
        out["mma_missing"] = sorted(n for n in gemm_like if not by[n]["mma_instructions"])
    return out


def add_collectives(m: dict[str, Any], collectives_us: float, oneshot: dict[str, Any] | None = None) -> None:
    """Fold a partitioned step's collective time (the parallel model, `codegen/parallel_model.py`) into a
    step model: the fourth part of its split, added to `modeled_us`. `oneshot` (the parallel model's): the same
    step with the all-reduces as one-shot kernel calls, as `m["oneshot"]` (its launches and collectives)."""
    m["collectives_us"] = round(collectives_us, 2)
    m["modeled_us"] = round(m["bandwidth_us"] + m["compute_us"] + m["launch_latency_us"] + collectives_us, 2)
    m["time_ratio"] = round(m["modeled_us"] / max(m["roofline_us"], 1e-9), 3)
    if oneshot:
        us = m["bandwidth_us"] + m["compute_us"] + m["launch_latency_us"] + oneshot["launch_latency_us"] \
            + oneshot["collectives_us"]
        m["oneshot"] = {"modeled_us": round(us, 2), "time_ratio": round(us / max(m["roofline_us"], 1e-9), 3),
                        "kernel_calls": m["kernel_calls"] + oneshot["all_reduces"]}


def by_layer_kind(m: dict[str, Any], kind_of) -> dict[str, dict[str, Any]]:
    """A step model's `by_layer` grouped by layer kind (`kind_of(layer) -> str`, e.g. `V4Config.kind`): layers,
    kernel calls per layer, modeled microseconds per layer, kernel bytes per layer and their ratio to the
    ideal bytes; launches outside the layers as "other" (totals)."""
    acc: dict[str, dict[str, float]] = {}
    for layer, v in m["by_layer"].items():
        k = "other" if layer == "other" else kind_of(int(layer))
        a = acc.setdefault(k, {"layers": 0, "calls": 0, "modeled_us": 0.0, "kernel_bytes": 0, "ideal_bytes": 0})
        a["layers"] += 1
        for f in ("calls", "modeled_us", "kernel_bytes", "ideal_bytes"):
            a[f] += v[f]
    return {k: {"layers": a["layers"], "calls_per_layer": round(a["calls"] / a["layers"], 2),
                "modeled_us_per_layer": round(a["modeled_us"] / a["layers"], 2),
                "kernel_bytes_per_layer": int(a["kernel_bytes"] / a["layers"]),
                "bytes_ratio": round(a["kernel_bytes"] / max(a["ideal_bytes"], 1), 4)} for k, a in acc.items()}


def render_layer_kinds(m: dict[str, Any]) -> str:
    return "      per layer kind: " + "; ".join(
        f"{k} ({v['layers']}{' layers' if k != 'other' else ''}): {v['calls_per_layer']:g} calls, "
        f"{v['modeled_us_per_layer']:.1f} us, {v['kernel_bytes_per_layer']:,} bytes ({v['bytes_ratio']:.3f}x ideal)"
        for k, v in m["by_layer_kind"].items())


def render_excess(m: dict[str, Any], top: int = 5) -> str:
    """The kernel families whose bytes exceed their launches' ideal the most (split partials written and read
    back, rows re-read per head block, scratch between launches), largest first."""
    rows = [(f, v["kernel_bytes"] - v["ideal_bytes"]) for f, v in m["by_family"].items()]
    return ("      bytes above ideal by kernel family: "
            + ", ".join(f"{f} {d / 1e6:+,.0f} MB" for f, d in rows[:top] if d > 0)
            + f" (all: {(m['kernel_bytes'] - m['ideal_bytes']) / 1e6:+,.0f} MB; before the last-level cache: "
            f"{(m['traffic_bytes'] - m['ideal_bytes']) / 1e6:+,.0f} MB, {m['traffic_bytes'] / max(m['ideal_bytes'], 1):.3f}x)")


def at_scale(m: dict[str, Any]) -> bool:
    """Whether the step's ideal bytes exceed the last-level cache: only then does it stream from HBM, which
    is what the bandwidth roofline and the bytes goal describe. A toy model's step (tiny-doc: ~1 MB against a
    256 MB cache) is launch latency and scratch traffic around weights that never leave the cache, so its
    ratios say nothing about the kernels (hundreds of x the roofline there is expected, not a failure)."""
    return m["ideal_bytes"] > m.get("llc_bytes", 0)


def render_step(m: dict[str, Any]) -> str:
    if at_scale(m):
        goal = "ok" if m["bytes_ratio"] <= m["bytes_goal"] else "MISSED"
    else:
        goal = (f"not a goal at this size: {m['ideal_bytes'] / 1e6:.2f} MB a step fits in the "
                f"{m['llc_bytes'] / 1e6:.0f} MB last-level cache and launch latency is "
                f"{100 * m['launch_latency_us'] / max(m['modeled_us'], 1e-9):.0f} % of the modeled time; the "
                "roofline and bytes ratios describe models whose step streams from HBM")
    bound = m.get("roofline_bound", "bandwidth")
    lat = ", ".join(f"{n} {k.replace('_', '+')} x {m['launch_latency_s'][k] * 1e6:.2f} us"
                    for k, n in m["calls_by_launch_kind"].items() if n)
    s = (f"    {m['target']} @{m['function']}: modeled {m['modeled_us']:.1f} us vs {bound} roofline "
         f"{m['roofline_us']:.1f} us ({m['time_ratio']:.2f}x; {m['kernel_calls']} calls of {m['kernels']} kernels, "
         f"launch latency {m['launch_latency_us']:.0f} us); HBM bytes {m['kernel_bytes']:,} "
         f"vs ideal {m['ideal_bytes']:,} ({m['bytes_ratio']:.3f}x, goal <= {m['bytes_goal']}: {goal})"
         f"\n      time split: bandwidth {m['bandwidth_us']:.1f} us + compute {m['compute_us']:.1f} us + launch "
         f"latency {m['launch_latency_us']:.1f} us ({lat})"
         + (f" + collectives {m['collectives_us']:.1f} us" if m.get("collectives_us") else ""))
    if "oneshot" in m:
        o = m["oneshot"]
        s += (f"\n      with its all-reduces one-shot over peer memory (modeled): {o['modeled_us']:.1f} us "
              f"({o['time_ratio']:.2f}x the roofline; {o['kernel_calls']} calls)")
    if "kernels_spilling" in m:
        s += (f"\n      static report: {len(m['kernels_spilling'])} of {m['kernels']} kernels spill"
              f"{' (' + ', '.join(m['kernels_spilling'][:4]) + ')' if m['kernels_spilling'] else ''}; "
              f"GEMM-like kernels without matrix instructions: {len(m['mma_missing'])}"
              f"{' (' + ', '.join(m['mma_missing'][:4]) + ')' if m['mma_missing'] else ''}")
    return s
