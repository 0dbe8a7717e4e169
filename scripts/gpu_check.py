"""The GPU check of the C runtime (issue 10), for a machine with an H200 (device cuda) or an MI355X (hip).

    python scripts/gpu_check.py [--device cuda] [--configs tiny,mid] [--compare tiny] [--steps 8] [--reps 50]
                                [--json OUT]

For each config (tiny; `mid`: the ~0.5 B random V4 of bench/bench_cpu.py), random weights (seed 0):
1. compile the artifact with the device's GPU target (its program: decode bucket 4, prefill chunk 64; the
   kernels compiled ahead of time into kernels/<sm_90a|gfx950>/; with its golden) and load it on the device,
   then run the deployment self-check first (`run --self-check`: the golden through the captured decode
   graphs, its lines on stderr, `self_check` in the JSON; exit 1 if it fails);
2. generate `--steps` greedy tokens for a ragged batch of 3 prompts (40, 23, 70 tokens: chunked prefill)
   and compare the ids with `ReferenceModel.generate` (exit 1 on any difference);
3. (configs in `--compare`, default tiny) run one decode step of the batch-4 bucket launch by launch on the
   device and on the host device (the same kernels, interpreted) from the same bytes, and print the first
   launch whose results differ, with its op, family, kernels and parameter names (bit-exact for pool,
   state and integer values; float values within the kernel tests' tolerance; runtime/launch_check.py;
   exit 1 on a difference). The host side interprets every kernel: minutes for tiny;
4. time one decode step of the batch-4 bucket launch by launch and as a graph replay (inputs uploaded
   once, `--reps` runs, stream synchronised) and report the achieved bandwidth = bytes of the weights the
   step reads / step time, against the H200's 4.8 TB/s (MI355X: 8 TB/s). The weight bytes count every
   expert: for MoE layers only the routed experts are read, so this overstates traffic (upper bound) for
   `mid`; KV-pool reads are not counted (small at these contexts).
Exit status: 0 all checks passed, 1 a check failed, 2 the device or its kernels are unavailable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK = {"cuda": 4.8e12, "hip": 8.0e12, "host": float("nan")}  # host: a dry run of this script on CPU


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cpu", ROOT / "bench" / "bench_cpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def configs(names):
    bench = _bench()
    for n in names:
        if n not in ("tiny", "mid"):
            raise SystemExit(f"error: unknown config '{n}' (expected tiny, mid)")
        yield n, (bench.big_tiny() if n == "tiny" else bench.mid_config())


def compare_step(art, device, fname, inputs):
    """The first launch of one `fname` step whose results differ between the device and the host device."""
    from v4compile.artifact import load_artifact
    from v4compile.runtime.c_backend import CRuntime
    from v4compile.runtime.kernels import kernel_calls_for
    from v4compile.runtime.launch_check import first_difference, per_launch
    from v4compile.runtime.program_backend import artifact_binaries, artifact_program, artifact_weights

    a = load_artifact(art)
    prog, weights = artifact_program(a), artifact_weights(a)
    dev = CRuntime(prog, weights, device, kernel_calls=kernel_calls_for("auto", device),
                   binaries=artifact_binaries(a, device) if device != "host" else None, table=per_launch(fname))
    host = CRuntime(prog, weights, "host", kernel_calls=kernel_calls_for("auto", "host"), table=per_launch(fname))
    try:
        return first_difference(dev, host, fname, inputs)
    finally:
        dev.close()
        host.close()


def check(name, cfg, device, steps, reps, work, compare):
    import numpy as np

    import v4compile
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_artifact

    t0 = time.perf_counter()
    fe = _bench()._frontend(cfg, 256)  # random weights (seed 0), hf numerics, fp32
    from v4compile.targets import DEVICE_TARGET

    art = compile_artifact(fe, Path(work) / name, Buckets(decode=(1, 4), prefill=(64,)),
                           targets=("cpu", DEVICE_TARGET[device]), golden=True)  # GPU: decode_b4, prefill_c64
    compile_s = time.perf_counter() - t0
    sess = v4compile.load(art, device=device)
    # first the deployment self-check (`run --self-check`): the golden through the captured decode graphs
    sc = sess.self_check()
    print(f"{name}: " + "\n".join(sc.lines()), file=sys.stderr, flush=True)
    ref = fe.reference()
    g = np.random.default_rng(0)
    prompts = [g.integers(0, cfg.vocab_size, n).tolist() for n in (40, 23, 70)]
    got = sess.generate(prompts, steps)
    want = [ref.generate(p, steps) for p in prompts]
    be = sess.backend
    B = 4
    inputs = {"ids": np.zeros((B, 1), np.int64), "pos": np.array([[100], [101], [-1], [7]], np.int64),
              "block_table": np.full((B, int(sess.blocks_per_seq)), -1, np.int32), "slot": np.array([0, 1, -1, 2], np.int32)}
    inputs["block_table"][:, 0] = [0, 1, -1, 2]
    fname = "decode_b4"
    diff = None
    if compare:
        t1 = time.perf_counter()
        diff = compare_step(art, device, fname, inputs)
        print(f"{name}: launch-by-launch {device} vs host: "
              + ("every launch agrees" if diff is None else f"first difference: {json.dumps(diff)}")
              + f" ({time.perf_counter() - t1:.0f} s)", file=sys.stderr)
    eager = be.timed(fname, inputs, graph=False, reps=reps)
    graph = be.timed(fname, inputs, graph=True, reps=reps)
    f = be.program.functions[fname]
    wbytes = sum(b.nbytes for b in f.buffers if b.kind == "weight")
    out = {"config": name, "device": device, "compile_s": round(compile_s, 1),
           "self_check": {"passed": sc.passed, "max_error": sc.max_error, "tolerance": sc.tolerance,
                          "seconds": round(sc.seconds, 2), "first_step": sc.first_step, "first_lane": sc.first_lane},
           "ids_match": got == want,
           "launches_compared": compare, "first_difference": diff,
           "launches_per_step": len(f.launches), "step_us_launch_by_launch": round(eager * 1e6, 1),
           "step_us_graph": round(graph * 1e6, 1), "graph_speedup": round(eager / graph, 2),
           "weight_bytes_per_step": wbytes, "achieved_TBps_graph": round(wbytes / graph / 1e12, 3),
           "fraction_of_peak": round(wbytes / graph / PEAK[device], 3)}
    if got != want:
        out["got"], out["want"] = got, want
    sess.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "hip", "host"))
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--compare", default="tiny", help="configs whose decode step is compared launch by launch "
                                                       "with the host device ('' for none)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # The host side of the launch comparison interprets the kernels: the interpreter must be on before any
    # kernel module is imported. The device side launches the compiled binaries, never Triton's JIT, and the
    # ahead-of-time compile runs in workers that turn it off.
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    compare = set(filter(None, args.compare.split(",")))
    from v4compile.errors import V4Error

    rows = []
    with tempfile.TemporaryDirectory(prefix="v4-gpu-check-") as work:
        for name, cfg in configs(args.configs.split(",")):
            try:
                rows.append(check(name, cfg, args.device, args.steps, args.reps, work, name in compare))
            except V4Error as e:
                print(f"error: {name}: {e}", file=sys.stderr)
                return 2
            print(json.dumps(rows[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["self_check"]["passed"] and r["ids_match"] and r["first_difference"] is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
