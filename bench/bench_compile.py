"""Compile time of a whole artifact, ahead-of-time kernels for gfx950 and sm_90a included, cold and warm cache.
A measurement, not a test (issue 9's goal for V4-Pro shape-only on a 2-core machine: <= 60 s cold, <= 10 s warm).

    python bench/bench_compile.py                       # V4-Pro, --weights none, both GPU targets
    python bench/bench_compile.py --preset tiny --jobs 2

Each run is `v4compile compile ... -o DIR --time-passes` in a fresh process: the cold run gets an empty kernel
cache (a temporary V4COMPILE_CACHE), the warm run the same cache again. Printed per run: wall time, the
stages of `--time-passes` (trace, passes, report, write output) and the AOT line (kernels compiled / cached).
"""

from __future__ import annotations

import argparse
import os
import re
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
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "V4COMPILE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"compile failed ({r.returncode}):\n{r.stderr[-3000:]}")
    stages = {}
    if "// ----- timing" in r.stderr:
        for secs, name in re.findall(r"^\s+([\d.]+) s\s+[\d.]+%\s+(.+)$", r.stderr[r.stderr.index("// ----- timing"):],
                                     re.M):
            stages[name.strip()] = float(secs)
    aot = re.search(r"aot: (\d+) kernels x targets, (\d+) compiled in ([\d.]+) s, (\d+) cached", r.stderr)
    return {"wall": wall, "stages": stages,
            "aot": aot.groups() if aot else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-pro")
    p.add_argument("--weights", default="none")
    p.add_argument("--target", default="gfx950,sm_90a")
    p.add_argument("--jobs", type=int, default=None)
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
            print(f"{name}: {r['wall']:.1f} s wall; {aot_s}")
            big = sorted(((v, k) for k, v in r["stages"].items() if k != "total"), reverse=True)[:6]
            print("    " + ", ".join(f"{k} {v:.1f} s" for v, k in big))
        n = sum(1 for _ in (tmp / "out" / "kernels").rglob("*.json")) if (tmp / "out" / "kernels").exists() else 0
        print(f"{a.preset}: {n} kernel sidecars; cold {res['cold']['wall']:.1f} s (goal <= 60), "
              f"warm {res['warm']['wall']:.1f} s (goal <= 10); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
