"""Where the one-call speculative step's time goes on the cpu device: the fused verify + acceptance + MTP draft
graph (`spec_b1_d<k>`, `codegen/onnx_spec.py`) against `decode_b1`, and its parts run alone (`verify_b1`,
`draft_b1`), in one process on the same inputs.

    python bench/bench_spec_where.py ART [--runs 600] [--block 1] [--profile 200] [--k 1]

ART: an artifact compiled for the cpu target with `--draft-tokens k` and decode bucket 1 (bench_spec.py's:
`v4compile compile examples/tiny-doc -o ART --target cpu --decode-buckets 1 --prefill-buckets 16
--draft-tokens 1 --numerics hf --dtype fp32`). One greedy speculative generation through the fused step, one
through the two-call path (verify, then draft) and one plain generation record each graph's step inputs;
each graph is then warmed (20 runs) and run `--runs` times, the graphs interleaved (the order flipping each
round: a burst of load falls on all), timed two ways: `run_outputs` (the backend's call: binding, the run,
the row stores) and ONNX Runtime alone (`run_with_iobinding` on the bound session). Printed: each graph's
25th-percentile and median wall time, in decode steps of the same kind (on a shared machine the lower
quantile is the least disturbed).

`--profile N`: a second pass with ONNX Runtime's profiler on (a fresh load), N interleaved runs, the first
20 of each session left out (the first session created ran slowest: warm-up), aggregated per run by ONNX op
and by IR op (each node's `doc_string`; the fused graph's `draft/` nodes by the draft graph's, `spec/` by
the glue's own names). Read its times as node counts: on this example a node's kernel takes ~1 us and the
profiler adds ~5 us to each node's measured time and ~15 us around it (decode_b1: ~1.0 ms unprofiled, ~16 ms
of kernel time and ~36 ms a run profiled), so the profile cannot say which ops cost more than their count;
the unprofiled part-by-part times above can. Not a test.

Measured (examples/tiny-doc, k = 1, 2-core machine at load 3.7-4.2, ONNX Runtime alone, p25 / median in
decode steps, two runs of 600 / 800 rounds): the fused step 1.48-1.52, verify_b1 alone 1.22-1.29, draft_b1
alone 0.20-0.23, so the step's extra ~0.5 decode steps is verify's ~0.25 (its nodes +4.5 % after ORT's
optimisation: ~0.05; the rest spread over the attention side's nodes at 2 lanes: sparse_attention,
compress_paged, the window pool write, indexer_select, csr_window, no node standing out), the MTP draft's
~0.21 (242 nodes, half of them the two Sinkhorns) and the acceptance glue's ~0.02 (19 nodes). A chain of
LpNormalization nodes costs ~0.58 us a node at 1 or 2 lanes, Identity ~0.53: the per-node floor, not the
op, is the cost; no session option the fused graph misses (it takes the artifact's `SessionOptions`, as every
graph; ORT_ENABLE_EXTENDED, no memory pattern or no memory reuse leave the ratio as it is).

Since copy 1 of the draft reads on verify's lane arithmetic (`codegen/onnx_spec.py`, step 3): the fused step
1491 nodes after ORT's optimisation (was 1518; decode_b1 1209, verify_b1 1264, draft_b1 242). Re-measured
(load 4-12, ORT alone, thread CPU time, p25 in decode steps): verify_b1 1.15-1.38 (kernel time profiled only
+7 % over decode's, which the profiler's per-node cost makes a node count; see below for where the rest
goes), draft_b1 0.18-0.35, the fused step 1.35-1.50 (main's
1.35-1.66 in the same processes; this graph's time over main's, paired: 0.84-0.91 with main's session made
first, 1.02-1.06 with it made second, ~-4 % over both orders). Read ratios with care: a session made later in a process ran 5-10 % faster than the same kind of
graph made earlier, and this script makes `decode_b1` last (the plain generation runs after the speculative
ones), which favours decode.

Where verify's extra goes (issue 43; a 2-core AMD EPYC with AVX-512, ONNX Runtime 1.32). `--block 50 --runs
30` (each graph as the generation loop runs it, one run after another; medians, two processes, load 1-2):
verify_b1 1.16 / 1.16 decode, draft_b1 0.21 / 0.21, the fused step 1.39 / 1.39 (single interleaved runs
scatter far more: 1.11-1.58 for verify in this session). Instructions executed a run inside ONNX Runtime's
run, counted by valgrind's callgrind over 200 runs of one graph (a count, not a timing: no noise): decode_b1
5.83 M, verify_b1 6.71 M (1.15), the fused step 7.90 M (1.36): the time ratios within 0.03, so
verify's extra beyond its node count (+4.5 %) is work its kernels do, not stalls, allocation or the executor
(outside the nodes' kernels: 0.56 M / 0.59 M a run; node bookkeeping +15 k). verify's +0.89 M by kernel
(matched to op types by their calls a run): MatMul / FusedMatMul +243 k and Gemm +74 k (81 -> 82 and 16 -> 15
nodes, at 2 rows: MLAS's SGEMM kernel itself 213 k -> 407 k), the 380 Sinkhorn LpNormalizations +107 k (two
matrices each), RMSNormalization and elementwise ~+0.1 M: ~60 %, the second lane's arithmetic in nodes decode
has too, which no rewrite of the graph removes; the few-lane forms' extra nodes (Concat 24 -> 38 +101 k, Gather
38 -> 58 +56 k, Expand 1 -> 6 +21 k, Unsqueeze / Squeeze +32 k, against decode's 12 ScatterND -37 k): ~+0.17 M,
~20 %, ~0.03 decode steps. The draft part of the fused step (1.19 M, 0.20 decode) is a fifth of decode's
nodes, 76 of them its two Sinkhorns' LpNormalizations (+227 k). Its IO: 68 bytes of step inputs a step (bound a
step then; now written into arrays bound once, `cpu_backend._StepInputs`), the 73 KB of pool and state bound
once and never copied, 35 KB of outputs written into buffers bound once, the rows stored back in 11-15 us. ONNX Runtime's options (set on every session; blocks of 50 runs as `--block`, 20
rounds; verify / the fused step in decode steps, default 1.16 / 1.39): arena off 1.36 / 1.72, memory pattern off 1.23 / 1.71, memory reuse off
1.18 / 1.47, prepacking off 1.29 / 1.58, "extended" 1.20 / 1.41, "basic" 1.16 / 1.38: none lowers either.

Outside the run (callgrind, collected only inside one round of bench_spec.py's generations, 4 prompts x 64
tokens, k = 1: total instructions minus those inside ONNX Runtime's run, per step, the prefills' share included):
the one-call speculative step 389 k before its inputs were written into arrays bound once and the few-row
stores made one pass (`cpu_backend._StepInputs`, `_Writes`), 282 k after; the plain decode step 479 k -> 402 k;
the runs themselves unchanged (1137 M for the speculative round's 141 runs, 1517 M for the plain round's 256).
A speculative step's Python costs less than a decode step's: what the step costs beyond a decode step is its
call's. Within the runs, libc malloc / free take ~16 % of the instructions (~42 k frees a run in the
speculative round, ~22 k in the plain one): ONNX Runtime's own, unattributed (its library has no symbols).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT = [1, 2, 3, 4, 5]
WARM, SKIP = 20, 20


def captured(art: str, k: int, profile: str | None):
    """A loaded session and each graph's step inputs (its first call's) from three short generations."""
    import v4compile
    from v4compile.runtime import cpu_backend, speculative

    s = v4compile.load(art, device="cpu", threads=1)
    if profile:
        s.backend.profile = profile  # sessions are made at first use: every one of them profiled
    cap: dict[str, dict] = {}
    saved = [(cpu_backend.OrtBackend, n, getattr(cpu_backend.OrtBackend, n)) for n in ("run_outputs", "run_held")]
    fused = speculative.CompiledDraft.fused

    def rec(orig):
        def f(self, fname, inputs, *a, **kw):
            cap.setdefault(fname, {n: np.array(v) for n, v in inputs.items()})
            return orig(self, fname, inputs, *a, **kw)
        return f
    try:
        for cls, n, orig in saved:
            setattr(cls, n, rec(orig))
        speculative.speculative_generate(s, [PROMPT], 8, k)
        speculative.CompiledDraft.fused = lambda self, B, k=1, lanes=None: None  # the two-call path: verify, then draft
        speculative.speculative_generate(s, [PROMPT], 8, k)
        speculative.CompiledDraft.fused = fused
        s.generate([PROMPT], 8)
    finally:
        speculative.CompiledDraft.fused = fused
        for cls, n, orig in saved:
            setattr(cls, n, orig)
    names = [f for f in ("decode_b1", "verify_b1", "draft_b1", f"spec_b1_d{k}") if f in cap]
    return s, {f: cap[f] for f in names}


def timed(s, cap: dict, runs: int, block: int = 1) -> dict[str, list[float]]:
    """Each graph's times: `block` 1, one backend call then one ONNX Runtime run a round (wall time); `block` N
    > 1, N ONNX Runtime runs in a row a round, their mean per run in thread CPU time."""
    be, names = s.backend, list(cap)
    t: dict[str, list[float]] = collections.defaultdict(list)
    for f in names:
        for _ in range(WARM):
            be.run_outputs(f, cap[f])
    bound = {f: be._session(f, 0) for f in names}
    for r in range(runs):
        for f in (names if r % 2 else names[::-1]):
            if block > 1:
                sess, io = bound[f][0], bound[f][3]
                t0 = time.thread_time()
                for _ in range(block):
                    sess.run_with_iobinding(io)
                t["ort " + f].append((time.thread_time() - t0) / block)
                continue
            t0 = time.perf_counter()
            be.run_outputs(f, cap[f])
            t1 = time.perf_counter()
            bound[f][0].run_with_iobinding(bound[f][3])
            t[f].append(t1 - t0)
            t["ort " + f].append(time.perf_counter() - t1)
    return t


def q(x: list[float], p: float) -> float:
    return sorted(x)[int(p * (len(x) - 1))]


def report_times(t: dict[str, list[float]]) -> dict:
    out = {}
    for f, xs in t.items():
        ref = t["ort decode_b1" if f.startswith("ort ") else "decode_b1"]
        out[f] = {"p25_us": round(q(xs, 0.25) * 1e6), "median_us": round(statistics.median(xs) * 1e6),
                  "p25_decode": round(q(xs, 0.25) / q(ref, 0.25), 3),
                  "median_decode": round(statistics.median(xs) / statistics.median(ref), 3)}
        o = out[f]
        print(f"  {f:18s} p25 {o['p25_us']:6d} us ({o['p25_decode']:.3f} decode)   median {o['median_us']:6d} us "
              f"({o['median_decode']:.3f} decode)")
    return out


def doc_map(art: str, fname: str) -> dict[str, str]:
    import onnx

    g = onnx.load(str(Path(art) / "onnx" / f"{fname}.onnx"), load_external_data=False).graph
    return {n.name: n.doc_string.split(" ")[0] for n in g.node}


def family(art: str, docs: dict, fname: str, node: str) -> str:
    """A profiled node's part and IR op: `verify` / `draft` / `spec` (the glue) / `decode`."""
    def of(f, n):
        if f not in docs:
            docs[f] = doc_map(art, f)
        return docs[f].get(n, "(made by ORT)")
    if fname.startswith("spec_"):
        if node.startswith("draft"):
            return "draft/" + of("draft_b1", node.split("/", 1)[1])
        if node.startswith("spec/"):
            return "spec/" + node.split("/")[1]
        return "verify/" + of("verify_b1", node)
    return fname.split("_")[0] + "/" + of(fname, node)


def profiled(art: str, k: int, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="spec_where_") as tmp:
        s, cap = captured(art, k, tmp)
        timed(s, cap, runs)
        files = {f: s.backend._sessions[s.backend._graphs[f][0][0]][0].end_profiling() for f in cap}
        docs: dict = {}
        res = {}
        for f, path in files.items():
            ev = json.load(open(path))
            starts = sorted(e["ts"] for e in ev if e.get("cat") == "Session" and e["name"] == "model_run")
            lo, n = starts[SKIP], len(starts) - SKIP
            by_op, by_ir, nodes = collections.Counter(), collections.Counter(), set()
            for e in ev:
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= lo:
                    node = e["name"][: -len("_kernel_time")]
                    by_op[e["args"]["op_name"]] += e["dur"] / n
                    by_ir[family(art, docs, f, node)] += e["dur"] / n
                    nodes.add(node)
            res[f] = {"kernel_us": round(sum(by_op.values())), "nodes": len(nodes), "by_onnx_op": by_op,
                      "by_ir_op": by_ir}
        s.close()
    return res


def print_profile(p: dict, k: int) -> None:
    dec, spec = p["decode_b1"], p.get(f"spec_b1_d{k}")
    for f, x in p.items():
        print(f"  {f:12s} {x['nodes']:5d} nodes after ORT's optimisation, kernel time {x['kernel_us']} us a run")
    if spec is None:
        return
    parts = collections.Counter()
    for key, v in spec["by_ir_op"].items():
        parts[key.split("/")[0]] += v
    print("  the fused step by part (profiled us a run): " + ", ".join(f"{a} {v:.0f}" for a, v in parts.items()))
    print("  by ONNX op, decode / fused step / difference (largest differences):")
    ops = set(dec["by_onnx_op"]) | set(spec["by_onnx_op"])
    for o in sorted(ops, key=lambda o: dec["by_onnx_op"].get(o, 0) - spec["by_onnx_op"].get(o, 0))[:15]:
        a, b = dec["by_onnx_op"].get(o, 0), spec["by_onnx_op"].get(o, 0)
        print(f"    {o:24s} {a:8.0f} {b:8.0f} {b - a:+8.0f}")
    print("  by IR op (the fused step's verify part against decode; its draft part; the glue):")
    ir = collections.Counter()
    for key, v in spec["by_ir_op"].items():
        part, op = key.split("/", 1)
        ir[key] += v - (dec["by_ir_op"].get("decode/" + op, 0) if part == "verify" else 0)
    for key in [x for x, v in sorted(ir.items(), key=lambda kv: -kv[1])][:20]:
        print(f"    {key:34s} {ir[key]:+8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art")
    ap.add_argument("--k", type=int, default=1, help="the artifact's --draft-tokens")
    ap.add_argument("--runs", type=int, default=600, help="interleaved unprofiled rounds of each graph")
    ap.add_argument("--block", type=int, default=1, help="ONNX Runtime runs of a graph in a row a round (thread "
                    "CPU time; 1: one backend call and one run a round, wall time)")
    ap.add_argument("--profile", type=int, default=0, help="also N profiled runs of each graph (0: none)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    s, cap = captured(a.art, a.k, None)
    print(f"unprofiled, {a.runs} interleaved rounds each " + ("(backend call, then ONNX Runtime alone):" if a.block == 1
          else f"({a.block} ONNX Runtime runs in a row a round, thread CPU time):"))
    out = {"times": report_times(timed(s, cap, a.runs, a.block))}
    s.close()
    if a.profile:
        print(f"profiled, {a.profile} interleaved runs each, the first {SKIP} left out:")
        p = profiled(a.art, a.k, a.profile)
        print_profile(p, a.k)
        out["profile"] = {f: {**x, "by_onnx_op": dict(x["by_onnx_op"]), "by_ir_op": dict(x["by_ir_op"])}
                          for f, x in p.items()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
