"""Specialise every launch of a preset's final IR that a given set of kernel families covers, AOT-compile
the distinct specialisations for gfx950 / sm_90a, and print the static report per kernel and a summary per
family (regs, spills, MMA count, compile time). A measurement, not a test.

    python bench/bench_aot_kernels.py --preset v4-pro --dtype bf16 --decode-batch 4 --funcs decode -j 2

The kernel calls, and the value layouts they are specialised for, come from the program
(`build_program` then `program_kernels`): the same calls the runtime launches.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections import defaultdict

from v4compile.codegen import aot
from v4compile.codegen.program_kernels import program_kernels
from v4compile.program.build import build_program

MINE = ("gemm", "grouped_gemm", "inv_rope_quant", "moe", "moe_router", "router", "embed", "rms_norm", "elementwise", "last_token")


def calls_of(module, funcs, families):
    """The distinct kernel specialisations of `funcs` whose family is in `families`, in launch order, as the
    program specialises them (its value layouts), and how many launches of other families were left out."""
    prog = build_program(module)
    kernels = program_kernels(prog)
    out, seen, skipped = [], set(), defaultdict(int)
    for fname in funcs:
        for launch, calls in zip(prog.functions[fname].launches, kernels.calls[fname]):
            if launch.kernel not in families or launch.kernel in kernels.missing:
                skipped[launch.kernel] += 1
                continue
            for c in calls:
                if c.name not in seen:
                    seen.add(c.name)
                    out.append((launch.kernel, c))
    return out, dict(skipped)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--numerics", default="hf", choices=("hf", "official"))
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--funcs", default="decode")
    p.add_argument("--families", default=",".join(MINE))
    p.add_argument("--targets", default="gfx950,sm_90a")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--json", help="write the report rows here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from v4compile import frontend
    from v4compile.passes import PassManager, PipelineOptions
    from v4compile.trace import TraceOptions
    t0 = time.perf_counter()
    fe = frontend.load(None, a.preset, "none", TraceOptions(batch=a.batch, chunk=a.chunk, decode_batch=a.decode_batch,
                                                            capacity=256, numerics=a.numerics, dtype=a.dtype))
    from v4compile.cli.pipeline import pipeline_of
    module = PassManager(pipeline_of(argparse.Namespace(passes=None)), PipelineOptions()).run(fe.module).module
    t1 = time.perf_counter()
    calls, skipped = calls_of(module, a.funcs.split(","), set(a.families.split(",")))
    print(f"trace+passes {t1 - t0:.1f} s; {len(calls)} distinct specialisations; not covered here: {skipped}")
    with tempfile.TemporaryDirectory() as d:
        t2 = time.perf_counter()
        rows = aot.compile_calls([c for _, c in calls], a.targets.split(","), d, a.jobs)
        t3 = time.perf_counter()
    fam = {c.name: f for f, c in calls}
    print(f"AOT {t3 - t2:.1f} s wall for {len(rows)} kernel x target ({sum(r['cached'] for r in rows)} cached)")
    print(f"{'kernel':58s} {'target':7s} {'regs':>4s} {'spill':>5s} {'mma':>4s} {'smem':>6s} {'occ':>3s} "
          f"{'model_us':>8s} {'bw_us':>7s} {'comp_s':>6s}")
    for r in rows:
        print(f"{r['name'][:58]:58s} {r['target']:7s} {r['regs']:4d} {r['spills']:5d} {r['mma_instructions']:4d} "
              f"{r['shared_bytes']:6d} {r['occupancy']:3d} {r['modeled_us']:8.2f} {r['bandwidth_us']:7.2f} "
              f"{(r['compile_s'] or 0):6.2f}")
    summ = defaultdict(lambda: defaultdict(list))
    for r in rows:
        summ[(fam[r["name"]], r["target"])]["rows"].append(r)
    print("\nper family and target: kernels, max regs, total spills, min MMA count (GEMM-like), compile s")
    for (f, t), v in sorted(summ.items()):
        rs = v["rows"]
        print(f"  {f:15s} {t:7s} n={len(rs):3d} max_regs={max(r['regs'] for r in rs):4d} "
              f"spills={sum(r['spills'] for r in rs):5d} mma_min={min(r['mma_instructions'] for r in rs):4d} "
              f"compile_s={sum((r['compile_s'] or 0) for r in rs):6.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
