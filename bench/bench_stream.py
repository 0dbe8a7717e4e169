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
With `--step-mb` (a step's weight bytes) and `--hf-ms` (HF eager's step time), it prints the step time each
rate allows and the ratio to HF that bounds. `--config mid` (bench_cpu.py's configs) compiles that config and
counts the weight bytes its decode b1 and 64-token prefill graphs read (`step_bytes`: an embedding's one row a
token, each routed expert's matrices once, at most min(E, tokens x k) experts of a stack; HF eager reads the
same: its expert loop visits the chosen experts only) and uses decode b1's as `--step-mb`.
Not a test: a measurement.

Measured (2026-12-02, the shared 2-core Xeon with AVX-512, load 9-16 from other processes; best of 7): c_sum
12.1 GB/s, numpy_gemv 10.4, torch_gemv 12.7, ort_gemm_m1 11.9. `--config mid`: decode b1 reads 525.7 MB (324.4
dense, of which the LM head 131.1; 201.3 for 4 of 32 experts x 8 layers), the 64-token prefill 1,935 MB (1,610.6
of experts: 256 routed pairs choose all 32). So mid's decode step takes >= 44.2 ms on one core at ONNX Runtime's
1-row Gemm rate (>= 41.4 at the best rate measured, torch's); HF eager took 106-113 ms in quieter runs (4.7-5.0
GB/s), 124 ms in a run at load 15: 3x needs <= 35-41 ms, below what the bytes allow (2.4-2.6x at 106-113 ms,
2.8x at 124); we take 62.5 ms (8.4 GB/s). Prefill: the experts alone take >= 134 ms at 12 GB/s (ONNX Runtime's
Gemm on the 4-29 rows an expert gets streams ~7-9 GB/s: ~190 ms), the dense projections ~6.2 GFLOP (~56 ms at
the ~110 GFLOP/s of a 64-row Gemm here), the head 11 ms: >= ~200 ms before attention, against HF's 425-560 ms.
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


def step_weights(art_path, fname: str) -> tuple[dict, list[tuple[str, str, list[int], str | None]]]:
    """The artifact's cpu function `fname` (its spec) and each weight input its graph reads: (name, kind, shape,
    stack), kind `expert` (a per-expert view, `codegen/onnx_weights` derived entries with an index; stack: the
    stacked weight it views), `gathered` (only Gathered: an embedding), `matrix` (a 2-D operand of a GEMM) or
    `other`."""
    import onnx

    from v4compile.artifact import load_artifact

    spec = load_artifact(art_path).target("cpu")["functions"][fname]
    g = onnx.load(str(Path(art_path) / spec["file"]), load_external_data=False).graph
    shape = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in g.input}
    consumers: dict[str, set] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, set()).add(n.op_type)
    derived = spec.get("derived", {})
    out = []
    for name in sorted(set(spec["weights"]) | set(derived)):
        if name not in consumers:
            continue
        if name in derived and derived[name]["index"] is not None:
            out.append((name, "expert", shape[name], derived[name]["of"]))
        elif consumers[name] == {"Gather"}:
            out.append((name, "gathered", shape[name], None))
        elif consumers[name] & {"Gemm", "MatMul", "FusedMatMul"} and len(shape[name]) == 2:
            out.append((name, "matrix", shape[name], None))
        else:
            out.append((name, "other", shape[name], None))
    return spec, out


def step_bytes(art_path, fname: str, k: int) -> dict[str, float]:
    """The weight bytes one run of `fname` reads: every weight input once, except an input only Gathered
    (an embedding: one row a token) and the per-expert views (a zero-row Gemm reads nothing, so
    min(E, tokens x k) experts of each stack)."""
    spec, weights = step_weights(art_path, fname)
    tokens = spec["batch"] * spec["tokens"]
    dense = rows = 0.0
    stacks: dict[str, list[int]] = {}
    for _, kind, shape, stack in weights:
        nbytes = 4 * int(np.prod(shape))
        if kind == "expert":
            stacks.setdefault(stack, []).append(nbytes)
        elif kind == "gathered":
            rows += min(tokens, shape[0]) * nbytes / shape[0]
        else:
            dense += nbytes
    experts = sum(min(len(b), tokens * k) * max(b) for b in stacks.values())
    return {"tokens": tokens, "dense_mb": dense / 1e6, "gathered_rows_mb": rows / 1e6,
            "experts_mb": experts / 1e6, "total_mb": (dense + rows + experts) / 1e6}


def gemm_peak(repeats: int, n: int = 1024) -> float:
    """One core's fp32 GEMM rate (flop/s): torch's [n, n] x [n, n], the best of `repeats` (a square GEMM is the
    most favourable shape: a floor computed with it is an upper bound on any engine's speed)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n ** 3 / best_of(lambda: a @ b, repeats)


def step_floor(art_path, fname: str, k: int, vocab: int, bw: float, flops: float) -> dict[str, float]:
    """A lower bound on one run of `fname` on one core: each weight's bytes over the best streaming rate `bw`
    or its GEMM flops over the best GEMM rate `flops`, whichever is larger, summed (ONNX Runtime runs one node
    after another on one thread; everything that is not a weight's GEMM (attention, norms, mHC) counted as
    free). A dense matrix multiplies every token's row, except the LM head (first dimension `vocab`): the last
    token of each sequence; a routed expert stack multiplies tokens x k rows in all and reads
    min(E, tokens x k) experts' matrices: exact at one token (k distinct experts); with more tokens the routing
    may pick fewer, and the figure is then not a bound. An embedding is one row a token, read only."""
    spec, weights = step_weights(art_path, fname)
    batch, tokens = spec["batch"], spec["batch"] * spec["tokens"]
    floor = 0.0
    stacks: dict[str, list[int]] = {}
    for _, kind, shape, stack in weights:
        numel = int(np.prod(shape))
        if kind == "expert":
            stacks.setdefault(stack, []).append(numel)
        elif kind == "gathered":
            floor += min(tokens, shape[0]) * 4 * numel / shape[0] / bw
        elif kind == "matrix":
            rows = batch if shape[0] == vocab else tokens
            floor += max(4 * numel / bw, 2 * rows * numel / flops)
        else:
            floor += 4 * numel / bw
    for b in stacks.values():
        floor += max(min(len(b), tokens * k) * 4 * max(b) / bw, 2 * tokens * k * max(b) / flops)
    return {"tokens": tokens, "floor_s": floor}


def config_bytes(name: str) -> dict[str, dict]:
    """Compile bench_cpu.py's `name` config (fp32, decode b1 and a 64-token prefill) and count its steps' bytes."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_cpu as bc
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_artifact

    cfg = bc.big_tiny() if name == "tiny" else bc.mid_config()
    with tempfile.TemporaryDirectory(prefix="bench_stream_") as d:
        art = compile_artifact(bc._frontend(cfg, 512), Path(d) / name, Buckets(decode=(1,), prefill=(bc.PROMPT,)))
        return {f: step_bytes(art, f, cfg.n_active_experts) for f in ("decode_b1", f"prefill_c{bc.PROMPT}")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size (default 1 GiB: >> the last-level cache)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-mb", type=float, help="a decode step's weight bytes, MB")
    ap.add_argument("--hf-ms", type=float, help="HF eager's time for that step, ms")
    ap.add_argument("--config", choices=("tiny", "mid"), help="count this bench_cpu.py config's step bytes")
    args = ap.parse_args()
    if args.config:
        for f, b in config_bytes(args.config).items():
            print(f"{args.config} {f}: " + ", ".join(f"{k} {v:.1f}" for k, v in b.items()), flush=True)
            if f == "decode_b1" and args.step_mb is None:
                args.step_mb = b["total_mb"]
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
