"""The modeled time of one step of a program on a GPU target, against the pure-bandwidth roofline.

    step_model(prog, kernels, function, target, rows=None) -> dict

Two byte counts per step:
* `ideal_bytes`: what the step has to move at least: the registry's cost rule of every launch
  (`OpDef.cost_of`: weights read once, only the active experts' weights, only the pool rows a launch
  reads or writes, activations once).
* `kernel_bytes`: what our kernels are modeled to move (`KernelCall.bytes_moved`: re-reads, scratch round
  trips and split-K partials included).
Times (microseconds): `modeled_us` sums every kernel call's `modeled_time` (bandwidth or MMA
bound, plus the target's stated per-launch latency under graph replay); `roofline_us` is `ideal_bytes`
at the target's HBM bandwidth. `time_ratio = modeled_us / roofline_us` is what further fusion has to
drive toward 1; `bytes_ratio = kernel_bytes / ideal_bytes` has the goal <= 1.05 (`BYTES_GOAL`).
With `rows` (the AOT report rows of these kernels) the step also says how many of its kernels spill and
whether every GEMM-like kernel uses matrix instructions.
"""

from __future__ import annotations

from typing import Any

from ..ir.registry import get_op
from ..program.core import Program
from ..targets import TARGETS

BYTES_GOAL = 1.05
# Kernel families whose FLOP-counting kernels multiply matrices: their binaries must hold MMA instructions
# (an fp32 artifact on sm_90a has none: no fp32 MMA there, and tf32 would change the numerics).
MMA_FAMILIES = ("gemm", "grouped_gemm", "moe", "sparse_attention", "indexer")


def modeled_time(flops: int, bytes_moved: int, target: str, mma_dtype: str = "bf16") -> float:
    """Seconds for one launch: max(bytes / HBM, flops / MMA peak) + the graph-replay launch latency."""
    t = TARGETS[target]
    peak = t.fp8_flops_s if mma_dtype in ("fp8", "fp4") else t.bf16_flops_s
    return max(bytes_moved / t.hbm_bytes_s, flops / peak) + t.launch_s


def bandwidth_time(bytes_moved: int, target: str) -> float:
    """The pure-bandwidth roofline of the same bytes (no launch latency, no compute)."""
    return bytes_moved / TARGETS[target].hbm_bytes_s


def ideal_bytes(prog: Program, function: str) -> int:
    """Registry cost of every launch of `function`; a weight buffer read by several launches counts once."""
    f = prog.functions[function]
    total, seen = 0, set()
    for l in f.launches:
        c = get_op(l.op).cost_of([a.type if a is not None else None for _, a in l.operands],
                                 [a.type for _, a in l.results], l.attrs)
        total += c.bytes_read + c.bytes_written
        for _, a in l.operands:  # a weight shared between launches (none today) would be read once
            if a is not None and f.buffer(a.buffer).kind == "weight":
                if a.buffer in seen:
                    total -= a.type.nbytes
                seen.add(a.buffer)
    return total


def step_model(prog: Program, kernels, function: str, target: str, rows: list[dict] | None = None) -> dict[str, Any]:
    """`kernels`: the program's `ProgramKernels` (codegen.program_kernels)."""
    spec = TARGETS[target]
    fam: dict[str, str] = {}
    calls = []
    for l, per in zip(prog.functions[function].launches, kernels.calls[function]):
        for c in per:
            if 0 not in c.grid:
                calls.append(c)
                fam[c.name] = l.kernel
    modeled = sum(modeled_time(c.flops, c.bytes_moved, target, c.mma_dtype) for c in calls)
    kbytes = sum(c.bytes_moved for c in calls)
    ideal = ideal_bytes(prog, function)
    out: dict[str, Any] = {
        "function": function, "target": target, "launches": len(prog.functions[function].launches),
        "kernel_calls": len(calls), "kernels": len({c.name for c in calls}), "kernel_bytes": kbytes, "ideal_bytes": ideal,
        "bytes_ratio": round(kbytes / max(ideal, 1), 4), "bytes_goal": BYTES_GOAL,
        "modeled_us": round(modeled * 1e6, 2), "roofline_us": round(ideal / spec.hbm_bytes_s * 1e6, 2),
        "launch_latency_us": round(len(calls) * spec.launch_s * 1e6, 2),
        "hbm_bytes_s": spec.hbm_bytes_s, "launch_s": spec.launch_s,
    }
    out["time_ratio"] = round(out["modeled_us"] / max(out["roofline_us"], 1e-9), 3)
    if rows is not None:
        by = {r["name"]: r for r in rows if r["target"] == target}
        names = {c.name for c in calls}
        out["kernels_spilling"] = sorted(n for n in names if by[n]["spills"])
        gemm_like = {c.name for c in calls if fam[c.name] in MMA_FAMILIES and c.flops}
        out["mma_missing"] = sorted(n for n in gemm_like if not by[n]["mma_instructions"])
    return out


def render_step(m: dict[str, Any]) -> str:
    goal = "ok" if m["bytes_ratio"] <= m["bytes_goal"] else "MISSED"
    s = (f"    {m['target']} @{m['function']}: modeled {m['modeled_us']:.1f} us vs bandwidth roofline "
         f"{m['roofline_us']:.1f} us ({m['time_ratio']:.2f}x; {m['kernel_calls']} calls of {m['kernels']} kernels x "
         f"{m['launch_s'] * 1e6:.0f} us latency = {m['launch_latency_us']:.0f} us); HBM bytes {m['kernel_bytes']:,} "
         f"vs ideal {m['ideal_bytes']:,} ({m['bytes_ratio']:.3f}x, goal <= {m['bytes_goal']}: {goal})")
    if "kernels_spilling" in m:
        s += (f"\n      static report: {len(m['kernels_spilling'])} of {m['kernels']} kernels spill"
              f"{' (' + ', '.join(m['kernels_spilling'][:4]) + ')' if m['kernels_spilling'] else ''}; "
              f"GEMM-like kernels without matrix instructions: {len(m['mma_missing'])}"
              f"{' (' + ', '.join(m['mma_missing'][:4]) + ')' if m['mma_missing'] else ''}")
    return s
