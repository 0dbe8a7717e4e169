"""The cpu device's decode step: a paired A/B of two compiled artifacts (e.g. before / after a change to the
ONNX lowerings: the same prompt, their decode steps timed in interleaved rounds), node counts and ONNX
Runtime's profile of one.

    python bench/ab_cpu_step.py compile OUT [--config tiny]       # bench_cpu's artifact, this checkout's code
    python bench/ab_cpu_step.py run A B [--rounds 15] [--steps 32] [--batch 1] [--clock cpu] [--nodes]
    python bench/ab_cpu_step.py nodes ART [--batch 1]             # decode nodes by IR op and by ONNX op
    python bench/ab_cpu_step.py profile ART [--steps 16]          # ONNX Runtime's profile of decode b1, us a step

`compile` builds bench_cpu.py's artifact (fp32, hf numerics, seeded weights; decode b1 / b8, prefill 64).
`run` loads both (one thread each), checks that they emit the same greedy tokens (and says whether their
logits stayed bit-identical), then alternates rounds
(the order flipping each round: a burst of load falls on both): each round prefills the same 64-token
prompt and times `--steps` decode steps. It prints each side's median and minimum us per step (on a
shared machine the minimum is the least disturbed), the median of the per-round ratios B / A and their
spread, and (`--nodes`) each side's exported node count. The session loaded second ran ~2 % slower in A/A
runs on a shared 2-core machine (A A: ratio 1.021): run `A B` and `B A`, take the geometric mean. Not a test.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = 64


def compile_one(out: str, config: str) -> None:
    import bench_cpu
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_artifact

    cfg = bench_cpu.big_tiny() if config == "tiny" else bench_cpu.mid_config()
    compile_artifact(bench_cpu._frontend(cfg, 512), Path(out), Buckets(decode=(1, 8), prefill=(PROMPT,)))
    print("compiled", out, flush=True)


def node_count(art: str, batch: int) -> int:
    import onnx

    return len(onnx.load(str(Path(art) / f"onnx/decode_b{batch}.onnx"), load_external_data=False).graph.node)


def nodes(art: str, batch: int) -> None:
    import onnx

    g = onnx.load(str(Path(art) / f"onnx/decode_b{batch}.onnx"), load_external_data=False).graph
    print(f"decode_b{batch}: {len(g.node)} nodes")
    print("by IR op:", dict(collections.Counter(n.doc_string.split(" ")[0] for n in g.node).most_common()))
    print("by ONNX op:", dict(collections.Counter(n.op_type for n in g.node).most_common()))


def profile(art: str, steps: int) -> None:
    """ONNX Runtime's profiler over `steps` decode b1 steps (it slows every node: `run` times without it)."""
    import bench_cpu

    files = bench_cpu.ort_profile(art, 1, steps, tempfile.mkdtemp(prefix="ab_prof_"))
    p = bench_cpu.profile_breakdown(files, art, top=20, pairs=True)
    print(f"profiled us/step {p['profiled_us_per_step']} over {p['runs']} runs, {p['nodes']} nodes")
    for k in ("by_onnx_op", "by_ir_op", "by_ir_and_onnx_op"):
        print(k, p[k])


def run(a: str, b: str, rounds: int, steps: int, batch: int, clock, nodes: bool) -> None:
    from v4compile.runtime import load

    sessions = []  # A then B (also two sessions when A and B are the same artifact: an A/A check)
    for name in (a, b):
        s = load(name, "cpu", threads=1)
        s.warmup(PROMPT, batch)
        sessions.append(s)
    prompts = [np.random.default_rng(i).integers(0, sessions[0].vocab, PROMPT).tolist() for i in range(batch)]

    def one(s) -> tuple[float, list, np.ndarray]:
        seqs, lg = s.prefill(prompts)
        toks = [int(x) for x in lg.argmax(-1)]
        out = [toks]
        toks = [int(x) for x in s.decode(seqs, toks).argmax(-1)]  # first decode step untimed
        t = clock()
        for _ in range(steps):
            lg = s.decode(seqs, toks)
            toks = [int(x) for x in lg.argmax(-1)]
            out.append(toks)
        dt = (clock() - t) / steps
        for q in seqs:
            s.release(q)
        return dt * 1e6, out, lg

    ta, tb, ratio = [], [], []
    identical = True
    for r in range(rounds):
        got = {i: one(sessions[i]) for i in ((0, 1) if r % 2 == 0 else (1, 0))}
        if got[0][1] != got[1][1]:
            print("the two artifacts' greedy tokens differ", flush=True)
        identical = identical and bool(np.array_equal(got[0][2], got[1][2]))
        ta.append(got[0][0])
        tb.append(got[1][0])
        ratio.append(got[1][0] / got[0][0])
    q = statistics.quantiles(ratio, n=4) if len(ratio) >= 2 else [ratio[0]] * 3
    print(f"A {a}: median {statistics.median(ta):.1f} us/step, min {min(ta):.1f}" +
          (f", {node_count(a, batch)} nodes" if nodes else ""))
    print(f"B {b}: median {statistics.median(tb):.1f} us/step, min {min(tb):.1f}" +
          (f", {node_count(b, batch)} nodes" if nodes else ""))
    print(f"B / A per round: median {statistics.median(ratio):.3f} (quartiles {q[0]:.3f} .. {q[2]:.3f}, "
          f"{rounds} rounds of {steps} decode b{batch} steps, load {os.getloadavg()[0]:.2f}); last logits "
          f"bit-identical: {identical}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("out")
    c.add_argument("--config", choices=("tiny", "mid"), default="tiny")
    r = sub.add_parser("run")
    r.add_argument("a")
    r.add_argument("b")
    r.add_argument("--rounds", type=int, default=15)
    r.add_argument("--steps", type=int, default=32)
    r.add_argument("--batch", type=int, default=1, choices=(1, 8))
    r.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    r.add_argument("--nodes", action="store_true", help="also print each artifact's exported decode node count")
    n = sub.add_parser("nodes")
    n.add_argument("art")
    n.add_argument("--batch", type=int, default=1, choices=(1, 8))
    p = sub.add_parser("profile")
    p.add_argument("art")
    p.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    if args.cmd == "compile":
        compile_one(args.out, args.config)
    elif args.cmd == "nodes":
        nodes(args.art, args.batch)
    elif args.cmd == "profile":
        profile(args.art, args.steps)
    else:
        import torch

        torch.set_num_threads(1)
        run(args.a, args.b, args.rounds, args.steps, args.batch,
            time.process_time if args.clock == "cpu" else time.perf_counter, args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
