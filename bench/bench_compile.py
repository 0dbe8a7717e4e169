"""Compile time of a whole artifact, ahead-of-time kernels for gfx950 and sm_90a included, cold and warm cache.
A measurement, not a test (issue 9's goal for V4-Pro shape-only on a 2-core machine: <= 60 s cold, <= 10 s warm).

    python bench/bench_compile.py                       # V4-Pro, --weights none, both GPU targets
    python bench/bench_compile.py --preset tiny --jobs 2

Each run is `v4compile compile ... -o DIR --time-passes` in a fresh process: the cold run gets an empty kernel
cache (a temporary V4COMPILE_CACHE), the warm run the same cache again. Printed per run: wall time, the
stages of `--time-passes` (trace, passes, report, write output) and the AOT line (kernels compiled / cached);
after the cold run, the per-kernel table per target (from the cache's stats), slowest first: compile seconds
(wall, in the worker), CPU seconds of the whole job (ptxas and nvdisasm included), regs, spills, MMA count,
and their sum per target (less noisy than wall time on a shared machine: it does not depend on how the jobs
packed onto the workers). Then the same CPU by kernel family: its specialisations and the constexprs in which
they differ.

Issue 40's figures (V4-Pro shape-only, both targets, empty cache, 2 cores):
- main 2dc4511 on 2 idle cores (the coordinator's run): 2 min 7.6 s wall, 236 CPU s; `aot: 96 kernels x targets, 96
  compiled in 118.5 s` (so ~9 s of trace, passes and writing, single-threaded, before and after the workers).
- the same sources profiled on 2 loaded cores (load 5-10, so wall time meant nothing: 576 s): 272.5 CPU s in all
  processes, 255.9 of them in the 96 compile jobs (sm_90a 155.5, gfx950 100.4: ptxas and nvdisasm make a sm_90a
  kernel ~1.5x a gfx950 one), ~17 outside them (trace, passes, writing, the workers' imports: ~3 s each). By
  family: moe_fused 98.0 (4 specialisations: the first MoE layer's (seam after only, hash-routed) 18.8, the
  hash-routed and the learned layers' with both seams 27.8 and 35.7, the last layer's (no seam) 15.8), mhc 32.0
  (8: four seam kinds x decode / prefill rows), pair_norm 22.8 (4), qkv_norm_rope 19.6 (4), compress 14.2 (4),
  attn_out_proj 11.9, out_proj 11.0, router 9.0 (2: hash 3.1, learned 5.9), the other 12 families 18.9.
- h-cold2: the router's launch is one binary for both routings (tid2eid / ids / bias always bound, an absent one
  a null pointer; `router.route_rows` picks the routing at run time): router 2 -> 1 specialisation, -3.1 CPU s.
  The same in the one-launch MoE (moe_fused: hash-routed and learned layers with both seams one binary, -27.8
  CPU s) compiles and interprets right but takes a third routing pointer, and gfx950's binary then spills one
  SGPR (106; the kernel sat at 105 with two): not done, as no specialisation may spill. Measured (empty cache,
  loaded cores, load 3-15): 47 specialisations x 2 targets, 0 spills, 274.7 CPU s in all processes, 260.0 in the
  jobs (sm_90a 153.7, gfx950 106.3; router 5.8): the 3 s won are below the noise of a loaded machine.
The 60 s goal (issue 40) on 2 idle cores needs <= ~115 CPU s in all: about half of today's. Where the rest is:
moe_fused's seam variants (the first / last layer's differ from the others only in which seams run, i.e. in
program counts a binary could take at run time: ~35 CPU s, needs the AOT cache keyed on the binary alone, as
the grid and the bound operands are not part of it, and one scratch carve for all variants), a pointer freed in
moe_fused for the routing merge above (~28), mhc's hc_pre_norm as mhc_post_pre without the post pass (~9), and
nvdisasm's ~0.7 CPU s per sm_90a kernel with matrix instructions (~20 in all; the count could come from the PTX).
h-cold3 (measured on 2 shared cores, load 5-10: CPU seconds, not wall, compare): one binary for the hash-routed and
the learned layers' one-launch MoE (the routing table one pointer, tid2eid or the bias as bytes, so no third
pointer and no SGPR spill; the token ids pick the routing at run time) with the AOT cache keyed on what a binary
depends on (calls differing in their launch only, name, grid, operands bound, compile once): moe_fused 4 -> 3
binaries, 83.9 -> 61.1 CPU s in its jobs; sm_90a's MMA count read from the cubin's code instead of nvdisasm (the
same counts on all 41 V4-Pro sm_90a cubins; nvdisasm cost 0.63 CPU s a kernel, ~16 s over the 25 with matrix
instructions). Back to back on the same shared 2 cores (load 3.3-3.6; wall is not the idle figure): base (371751e)
213.7 s wall, 227.5 CPU s in all processes, 212.0 in the jobs (gfx950 90.4, sm_90a 121.6; moe_fused 85.1), 94 compiled;
h-cold3 201.0 s wall, 167.9 CPU s, 154.6 in the jobs (gfx950 63.7, sm_90a 90.8; moe_fused 48.7), 92 compiled and
2 served by the binary they share, 0 spills; warm 11.3 -> 9.4 s. Again, quieter (load 1-3): h-cold3 98.7 s wall,
166.4 CPU s (152.4 in the jobs; `aot: 94 kernels x targets, 92 compiled in 90.0 s, 2 cached`), then base 176.8 s
wall, 191.2 CPU s (177.8; 94 compiled in 168.4 s) while the load rose to 3.3. The 60 s goal still wants about
50 CPU s less (and the seams' merge above).
Where the rest goes (a Triton pass profile, `MLIR_ENABLE_TIMING=1`, of 72 of the 94 jobs): 70% of a job is
MLIR passes, and their largest single cost is TritonGPUCoalesce (14% of all; up to 9 s of moe_fused's 18 s on
gfx950): for every tensor load / store it takes the transitive slice of the function (`multiRootGetSlice`,
superlinear in the kernel's size), so the one-launch MoE pays it per memory op; a kernel split into smaller
functions would pay less (noinline phases, as sm_90a's router phase), but that changes the code. The seam
variants of moe_fused (first / last layer: the seams run or not) are the next binaries to merge: the AOT key
now allows it (the grid is no part of it); what remains is the seam counts NA / NH as run-time values and the
first layer's x as an operand without a pointer more (gfx950 at 105 SGPRs).
h-cold4: the seam's loops over the streams (`mhc_rows`, `_post_chunk`: n = 4, nested, n^2 + 2n loads and stores
unrolled) and the combine's KSEL loop as run-time loops (the same arithmetic in order), and `hc_pre_norm` launching
`mhc_post_pre`'s binary with y null (its post pass skipped at run time; `mhc.py`). Coalesce's cost grows with (loads +
stores) x (ops in the function)^2, and the one-launch MoE holds one or two seams: with both, 2587 -> 1785 TTIR ops
and 188 -> 99 loads / stores. The changed families' jobs compiled back to back, main's sources then the branch's,
alternating, same load (`triton.compile` per job in one process, CPU s): moe_fused 58.8 -> 36.7 (gfx950 24.0 ->
14.0, sm_90a 34.8 -> 22.7), mhc 20.7 -> 8.6 (16 -> 12 binaries): 79.4 -> 45.3. The whole compile on the shared
machine (load 3-7, not comparable run to run: the unchanged families moved by +15 CPU s between the two runs): main
178.5 CPU s, 164.2 in the 92 jobs; h-cold4 176.6, 161.2 in 88 jobs (2 + 4 calls served by binaries they share).
The routing's KSEL loops stay unrolled: run-time, the sm_90a router kernel at 64 rows spilled 8 bytes at 8 warps.
Where a job's CPU goes (the Triton stages of one job, sm_90a out_proj: frontend 0.13, ttgir 0.49, llir 2.18 of which
LLVM O3 1.26, ptx 0.7, ptxas 1.69 s; gfx950 has no ptxas and an LLVM AMDGPU backend of ~0.6 s): past the MoE, the
kernels are ~500-1150 TTIR ops with few loads, Coalesce a few % (compress_pair 20-40 %: two compressors' RoPE
frequency where-chains, 32 selects each), so the rest of the 60 s goal is fewer jobs, not smaller ones: the row
counts (decode 8 / prefill 64) are constexprs of every family (a run-time M needs scalar kernel arguments, which
the launch ABI does not have: pointers only), and the moe_fused seam variants as one binary (NA / NH from the grid,
x and the seam buffers one layout for all three) remain.
After the merges (main with h-cold4 and h-tpbytes; the coordinator's run, 2 quiet cores, load 1.2-1.7): 90.6 s wall,
170.0 CPU s (154.1 in 88 jobs, 6 calls shared; 15.9 outside them), warm 9.0 s; by family moe_fused 43.0, pair_norm
24.1, qkv_norm_rope 16.2, compress 13.3, mhc 8.9.
Main 291470a on 2 idle cores (the coordinator's run, `nice -n 5`): 63.5 s wall, 118.2 CPU s in all processes, 106
in 88 jobs; moe_fused 28.4 in 3 specialisations x 2 targets (both seams: gfx950 4.48, sm_90a 7.72; the first MoE
layer's, seam after only: 3.41, 6.37; the last layer's, no seam: 2.17, 4.28).
h-seams: the first MoE layer's one-launch MoE (`moe_mhc_post_pre`) launches the middle layers' (`mhc_moe_mhc`)
binary: the seam before stands in with the seam after's weights and attributes, its weights null, and its
programs copy the layer's x / streams / post / comb where the seam would write them (`moe_router._as_both_seams`,
bit for bit; ~1.1 MB more traffic in that one launch at decode 8). Run-time NA / NH were the first plan: the grid
cannot say them on gfx950 (`tl.num_programs` reads AMDGPU's hidden kernel arguments), null pointers can, but the
MoE then chooses its x and the seam after its streams / post / comb among two pointers each, and holding those
made gfx950's binary spill 4-5 SGPRs (106); the copy keeps them in the first phase: 0 spills (gfx950 150 VGPRs,
106 SGPRs; sm_90a 184 regs), also in the `--decode-batch 8 --max-context 4096`, `--tp 8 --ep 8` and `--dp 8 --ep 8`
compiles. moe_fused 3 -> 2 binaries per target, 88 -> 86 jobs. Measured on the shared 2 cores (load 5-15, so CPU
seconds, not wall, compare): the moe_fused jobs alone, main's then the branch's sources, alternating, one process
each (`aot.compile_calls`, jobs 1): 43.0 / 37.2 -> 32.0 / 25.8 CPU s (the merged binary costs what main's
both-seams one did: 20.8 / 15.9 against 18.6 / 16.9); the whole cold compile (`bench_compile.py`, alternating):
main 157.0 / 145.6 CPU s in all (142.7 / 132.3 in 88 jobs; moe_fused 43.2 / 36.6), the branch 133.4 / 149.8
(120.8 / 135.2 in 86 jobs; moe_fused 25.1 / 32.4): ~11 CPU s less, ~5.5 s of wall on 2 idle cores, so about
58 s against 63.5. Left: the last layer's (`moe_router_experts_shared`, no seam on either side) binary, 6.5 CPU s:
the same stand-in needs the seams' stream count and mHC attributes, which that op does not carry (its x is an
unfused `mhc_post_pre`'s output; its output goes to `mhc_post_head`).
h-coldmisc, the serial parts of a cold compile (a timeline: when each feeder thread sent a job and got its reply; cProfile
of the main process on a warm cache): before the first job, the imports (~2 s), trace (0.8), passes (0.7) with change
detection (1.7: every op's key, twice a pass), then the GPU codegen building the program a second time (0.4), its kernel
calls and the PDL check; after the last reply, the workers' exit (interpreter teardown of torch, Triton, LLVM: 1.1-1.5 s
a worker at load 7) and the step models. The queue's tail is no loss: both workers' last replies came within 4 ms of
each other (the last jobs take ~0.4 s), so `longest_first`'s static estimate stays. Changed: the worker leaves with
os._exit (0.05 s); it imports no torch (the families load it where they run kernels: start-up 1.9 -> 0.4 CPU s a
worker); change detection keys each op once per pipeline run (load 9: 4.7 -> 0.32 s); the program is built once.
The twins are no twins: qkv_norm_rope's pairs are the layers with and without the indexer's query, and besides DI / HI /
QI_FP4 / HS (a null QI pointer could skip it at run time) the q input's row stride differs (Q_S 73728 vs 65536: the
indexer's query rows ride in the same rows), a constexpr while a launch passes pointers only; pair_norm's and
compress's four are different GEMM pairs and compressors (N1 1024 / 2624; m128 hca / m4 csa fp8 / fp4) at two row
counts, mhc's six three modes at two row counts.
This bench, the base (291470a) and h-coldmisc alternately on the shared 2 cores (the jobs' CPU moves with the load,
the CPU outside them much less), the closest pair (load 5.6 / 5.7): base cold 103.8 s wall, 102.9 CPU s (92.1 in the 88
jobs, 10.7 outside), warm 6.6 s, 6.3 CPU s; h-coldmisc cold 99.3 s wall, 98.2 CPU s (92.6 in the jobs, 5.7 outside),
warm 5.1 s, 4.9 CPU s. The other pair (load 6.9 / 4.6): outside the jobs 12.8 -> 6.1 CPU s, warm 7.4 -> 4.8 CPU s.
About 5 CPU s less outside the jobs, some serial (change detection, the second program), some the workers' start-up
and exit (in parallel, two at a time).
Quieter, main (1bbad5f, h-seams merged: 86 jobs) and h-coldmisc (on 58fffbc; 1bbad5f changes a test), alternating,
load 1.8-1.9: main cold 48.2 / 47.7 s wall, 89.7 / 88.4 CPU s (10.4 / 10.7 outside the jobs), warm 5.8 / 7.0 s;
h-coldmisc cold 44.1 / 46.1 s wall, 83.0 / 86.6 CPU s (5.7 / 6.1 outside the jobs), warm 5.1 / 4.6 s.
Issue 40's measurement, the merged main (d3ebb5a) on 2 idle cores of an AVX-512 EPYC (load 1.2-1.8), three runs:
cold 43.1 / 44.7 / 47.0 s wall (median 44.7; goal <= 60), 81.3 / 83.8 / 88.3 CPU s, 5.6-6.3 outside the jobs; warm
4.7 / 5.4 / 4.7 s; then the day's start (291470a) on the same machine, same minute: 51.5 s, 95.8 CPU s, warm 6.6 s.
(The day's very first run of 291470a there, on a freshly booted machine: 63.5 s, 118 CPU s. On the slower machine
of a day earlier 291470a took 90.6 s, 170 CPU s: what a run costs moves with the machine by more than any change.)
`--json FILE` records every figure printed (wall, CPU in all processes and in the jobs, per target, per family,
the stages, the AOT line) for a closing note to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(args, out: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "v4compile", "compile", "--preset", args.preset, "-o", str(out), "--force",
           "--time-passes", "--target", args.target, "--threads", "1"]
    if args.weights:
        cmd += ["--weights", args.weights]
    if args.jobs:
        cmd += ["--jobs", str(args.jobs)]
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "V4COMPILE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the compile and every process it waited for (workers, ptxas, nvdisasm): unlike wall
    # time, barely moved by other load on a shared machine.
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if r.returncode:
        sys.exit(f"compile failed ({r.returncode}):\n{r.stderr[-3000:]}")
    stages = {}
    if "// ----- timing" in r.stderr:
        for secs, name in re.findall(r"^\s+([\d.]+) s\s+[\d.]+%\s+(.+)$", r.stderr[r.stderr.index("// ----- timing"):],
                                     re.M):
            stages[name.strip()] = float(secs)
    aot = re.search(r"aot: (\d+) kernels x targets, (\d+) compiled in ([\d.]+) s, (\d+) cached", r.stderr)
    return {"wall": wall, "cpu": cpu, "stages": stages,
            "aot": aot.groups() if aot else None}


def entries(cache: Path, out: Path) -> list[tuple[dict, dict]]:
    """(sidecar, stats) of every binary compiled: a cache entry is a binary, named by the artifact's sidecars
    that use it (the first, by name, where several calls share one binary)."""
    side_of: dict[str, dict] = {}
    for f in sorted((out / "kernels").glob("*/*.json")):
        side = json.loads(f.read_text())
        side_of.setdefault(side["key"], side)
    return [(side_of[d.name], json.loads((d / "stats.json").read_text())) for d in sorted((cache / "aot").glob("*/"))
            if (d / "stats.json").exists() and d.name in side_of]


def kernel_table(cache: Path, out: Path, top: int) -> str:
    """Per kernel: compile seconds, regs, spills, MMA count on each target, from the cache entries."""
    per: dict[str, dict[str, dict]] = {}
    for side, st in entries(cache, out):
        per.setdefault(side["name"], {})[side["target"]] = st
    targets = sorted({t for v in per.values() for t in v})
    lines = [f"{'kernel':56s} " + " ".join(f"{t:>6s} {'cpu':>5s} {'regs':>4s} {'spill':>5s} {'mma':>4s}" for t in targets)]

    def cell(st):
        return (f"{st['compile_s']:6.2f} {st.get('cpu_s', float('nan')):5.2f} {st['regs']:4d} {st['spills']:5d} "
                f"{st['mma_instructions']:4d}" if st
                else f"{'-':>6s} {'':5s} {'':4s} {'':5s} {'':4s}")
    order = sorted(per, key=lambda n: -max(s["compile_s"] for s in per[n].values()))
    for n in order[:top]:
        lines.append(f"{n[:56]:56s} " + " ".join(cell(per[n].get(t)) for t in targets))
    lines += family_table(cache, out)
    for key, what in (("compile_s", "compile seconds (wall, in the worker)"), ("cpu_s", "CPU seconds (with stats)")):
        sums = {t: sum(v[t].get(key, 0.0) for v in per.values() if t in v) for t in targets}
        lines.append(f"{len(per)} kernels; sum of {what}: "
                     + ", ".join(f"{t} {v:.1f} s" for t, v in sums.items()) + f", total {sum(sums.values()):.1f} s")
    return "\n".join(lines)


def job_figures(cache: Path, out: Path) -> dict:
    """The compile jobs' CPU seconds (from the cache's stats) in all, per target and per kernel family."""
    by_target: dict[str, float] = {}
    by_family: dict[str, float] = {}
    n = 0
    for side, st in entries(cache, out):
        cpu = st.get("cpu_s", 0.0)
        by_target[side["target"]] = by_target.get(side["target"], 0.0) + cpu
        fam = side["kernel"].rsplit(".", 1)[-1]
        by_family[fam] = by_family.get(fam, 0.0) + cpu
        n += 1
    r2 = lambda d: {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return {"jobs": n, "jobs_cpu": round(sum(by_target.values()), 2), "by_target": r2(by_target),
            "by_family": r2(by_family)}


def family_table(cache: Path, out: Path) -> list[str]:
    """Where the CPU goes by kernel family (a @triton.jit kernel): CPU seconds per target, its specialisations,
    and the constexprs in which they differ (a family's specialisations that differ only in values a kernel
    could take at run time are compile time to win back; issue 40)."""
    fams: dict[str, dict] = {}
    for side, st in entries(cache, out):
        f = fams.setdefault(side["kernel"].rsplit(".", 1)[-1], {"cpu": {}, "specs": {}})
        f["cpu"][side["target"]] = f["cpu"].get(side["target"], 0.0) + st.get("cpu_s", 0.0)
        f["specs"][side["name"]] = side["constexprs"]
    total = sum(sum(f["cpu"].values()) for f in fams.values()) or 1.0
    lines = [f"{'family':28s} {'CPU s':>7s} {'share':>5s} {'specs':>5s}  per target; constexprs that differ"]
    for name, f in sorted(fams.items(), key=lambda kv: -sum(kv[1]["cpu"].values())):
        ces = list(f["specs"].values())
        differ = sorted(k for k in set().union(*ces) if len({json.dumps(c.get(k), sort_keys=True) for c in ces}) > 1)
        cpu = sum(f["cpu"].values())
        lines.append(f"{name[:28]:28s} {cpu:7.1f} {cpu / total:5.0%} {len(ces):5d}  "
                     + ", ".join(f"{t} {v:.1f}" for t, v in sorted(f["cpu"].items()))
                     + (f"; {len(differ)} differ: {', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}"
                        if differ else ""))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-pro")
    p.add_argument("--weights", default="none")
    p.add_argument("--target", default="gfx950,sm_90a")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--top", type=int, default=1000, help="rows of the per-kernel table (slowest first)")
    p.add_argument("--json", type=Path, default=None, help="write the figures (cold and warm) to this file")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="v4bench-") as tmp:
        tmp = Path(tmp)
        res = {}
        for name in ("cold", "warm"):
            res[name] = run(a, tmp / "out", tmp / "cache")
            r = res[name]
            aot = r["aot"]
            aot_s = (f"{aot[1]} of {aot[0]} kernel x target compiled in {float(aot[2]):.1f} s, {aot[3]} cached"
                     if aot else "no AOT line")
            print(f"{name}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU (all processes); {aot_s}")
            big = sorted(((v, k) for k, v in r["stages"].items() if k != "total"), reverse=True)[:6]
            print("    " + ", ".join(f"{k} {v:.1f} s" for v, k in big))
            if name == "cold":
                print(kernel_table(tmp / "cache", tmp / "out", a.top))
                r.update(job_figures(tmp / "cache", tmp / "out"))
                # what the jobs' stats do not hold: trace, passes, writing, the workers' start-up
                r["outside_jobs_cpu"] = round(r["cpu"] - r["jobs_cpu"], 2)
                print(f"    CPU outside the compile jobs (trace, passes, writing, worker start-up): "
                      f"{r['outside_jobs_cpu']:.1f} s")
        n = sum(1 for _ in (tmp / "out" / "kernels").rglob("*.json")) if (tmp / "out" / "kernels").exists() else 0
        print(f"{a.preset}: {n} kernel sidecars; cold {res['cold']['wall']:.1f} s (goal <= 60), "
              f"warm {res['warm']['wall']:.1f} s (goal <= 10); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
        if a.json:
            a.json.write_text(json.dumps({"preset": a.preset, "target": a.target, "cpus": os.cpu_count(),
                                          "load": round(os.getloadavg()[0], 1),
                                          **{k: {**v, "wall": round(v["wall"], 2), "cpu": round(v["cpu"], 2)}
                                             for k, v in res.items()}}, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
