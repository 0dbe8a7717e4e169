"""One core's weight-streaming rate, and what it allows a bandwidth-bound decode step (issue 22).

    python bench/bench_stream.py [--gib 1] [--repeats 5] [--step-mb 526.3 --hf-ms 110]

A decode step at batch 1 reads every weight it uses once and does ~2 flops a weight: its time is the
bytes over the rate one core streams them at. This measures that rate, over buffers far larger than the
last-level cache, four ways (best of `--repeats`, one thread, this process's CPU time: a shared machine's
other processes take turns on the core but still share the memory bus, so the best figure is the one to quote):
* `c_sum`: a C loop summing fp32 (64 independent accumulators: 4 AVX-512 chains, -O3 -march=native), the
  hardware's read rate;
* `numpy_gemv`: one row times a [N, 1024] fp32 matrix (`np.dot`, the BLAS numpy links);
* `torch_gemv`: the same in torch (what HF eager's linears call at batch 1);
* `ort_gemm_m1`: ONNX Runtime Gemm nodes, one row by 200 distinct [512, 1024] weights (transB, as the cpu
  target lowers a linear), the kernel our decode step spends its time in.
With `--step-mb` (a step's weight bytes: bench_cpu.py's mid decode b1 reads 526.3 MB) and `--hf-ms` (HF
eager's step time), it prints the step time each rate allows and the ratio to HF that bounds.
Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

C_SUM = r"""
#include <stdlib.h>
#include <stdio.h>
#include <time.h>
int main(int argc, char **argv) {
    size_t n = strtoull(argv[1], 0, 10); int reps = atoi(argv[2]);
    float *a = aligned_alloc(64, n * sizeof(float));
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 7);
    double best = 1e30; float keep = 0;
    for (int r = 0; r < reps; r++) {
        struct timespec t0, t1; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
        float s[64] = {0};
        for (size_t i = 0; i < n; i += 64)
            for (int j = 0; j < 64; j++) s[j] += a[i + j];
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
        double dt = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
        if (dt < best) best = dt;
        for (int j = 0; j < 64; j++) keep += s[j];
    }
    printf("%.6f %g\n", best, keep);
    free(a);
    return 0;
}
"""


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def c_sum(nbytes: int, repeats: int) -> float | None:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    with tempfile.TemporaryDirectory(prefix="bench_stream_") as d:
        src, exe = Path(d) / "s.c", Path(d) / "s"
        src.write_text(C_SUM)
        subprocess.run([cc, "-O3", "-march=native", "-o", str(exe), str(src)], check=True)
        out = subprocess.run([str(exe), str(nbytes // 4), str(repeats)], check=True, capture_output=True, text=True)
    return nbytes / float(out.stdout.split()[0])


def gemv_rates(nbytes: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    w = np.random.default_rng(0).standard_normal((nbytes // 4096, 1024), dtype=np.float32)
    x = np.ones((1, w.shape[0]), np.float32)
    wt, xt = torch.from_numpy(w), torch.from_numpy(x)
    return {"numpy_gemv": w.nbytes / best_of(lambda: np.dot(x, w), repeats),
            "torch_gemv": w.nbytes / best_of(lambda: xt @ wt, repeats)}


def ort_gemm_m1(repeats: int, n: int = 200) -> float:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((512, 1024), dtype=np.float32), f"w{i}") for i in range(n)]
    nodes = [helper.make_node("Gemm", ["x", f"w{i}"], [f"y{i}"], transB=1) for i in range(n)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 512]) for i in range(n)],
                              inits)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = {"x": np.ones((1, 1024), np.float32)}
    s.run(None, x)
    return n * 512 * 1024 * 4 / best_of(lambda: s.run(None, x), repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size (default 1 GiB: >> the last-level cache)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-mb", type=float, help="a decode step's weight bytes, MB")
    ap.add_argument("--hf-ms", type=float, help="HF eager's time for that step, ms")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    rates = {"c_sum": c_sum(nbytes, args.repeats), **gemv_rates(nbytes, args.repeats),
             "ort_gemm_m1": ort_gemm_m1(args.repeats)}
    for k, v in rates.items():
        print(f"{k:12s} {'(no C compiler)' if v is None else f'{v / 1e9:6.2f} GB/s'}", flush=True)
    if args.step_mb:
        print(f"a step of {args.step_mb:.1f} MB:")
        for k, v in rates.items():
            if v is None:
                continue
            ms = args.step_mb * 1e6 / v * 1e3
            hf = f"  HF / that = {args.hf_ms / ms:.2f}x" if args.hf_ms else ""
            print(f"  at {k:12s} {ms:6.1f} ms{hf}")
        if args.hf_ms:
            print(f"  HF eager itself streams {args.step_mb * 1e6 / (args.hf_ms * 1e-3) / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
