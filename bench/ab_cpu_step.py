"""Paired A/B of the cpu device's decode step: two compiled artifacts (e.g. before / after a change to the
ONNX lowerings), the same prompt, their decode steps timed in interleaved rounds.

    python bench/ab_cpu_step.py compile OUT [--config tiny]       # bench_cpu's artifact, this checkout's code
    python bench/ab_cpu_step.py run A B [--rounds 15] [--steps 32] [--batch 1] [--clock cpu] [--nodes]

`compile` builds bench_cpu.py's artifact (fp32, hf numerics, seeded weights; decode b1 / b8, prefill 64).
`run` loads both (one thread each), checks that they emit the same greedy tokens, then alternates rounds
(the order flipping each round: a burst of load falls on both): each round prefills the same 64-token
prompt and times `--steps` decode steps. It prints each side's median and minimum us per step (on a
shared machine the minimum is the least disturbed), the median of the per-round ratios B / A and their
spread, and (`--nodes`) each side's exported node count. The session loaded second ran ~2 % slower in A/A
runs on a shared 2-core machine (A A: ratio 1.021): run `A B` and `B A`, take the geometric mean. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = 64


def compile_one(out: str, config: str) -> None:
    import bench_cpu
    from v4compile.artifact import Buckets
    from v4compile.driver import compile_artifact

    cfg = bench_cpu.big_tiny() if config == "tiny" else bench_cpu.mid_config()
    compile_artifact(bench_cpu._frontend(cfg, 512), Path(out), Buckets(decode=(1, 8), prefill=(PROMPT,)))
    print("compiled", out, flush=True)


def node_count(art: str, batch: int) -> int:
    import onnx

    return len(onnx.load(str(Path(art) / f"onnx/decode_b{batch}.onnx"), load_external_data=False).graph.node)


def run(a: str, b: str, rounds: int, steps: int, batch: int, clock, nodes: bool) -> None:
    from v4compile.runtime import load

    sessions = []  # A then B (also two sessions when A and B are the same artifact: an A/A check)
    for name in (a, b):
        s = load(name, "cpu", threads=1)
        s.warmup(PROMPT, batch)
        sessions.append(s)
    prompts = [np.random.default_rng(i).integers(0, sessions[0].vocab, PROMPT).tolist() for i in range(batch)]

    def one(s) -> tuple[float, list]:
        seqs, lg = s.prefill(prompts)
        toks = [int(x) for x in lg.argmax(-1)]
        out = [toks]
        toks = [int(x) for x in s.decode(seqs, toks).argmax(-1)]  # first decode step untimed
        t = clock()
        for _ in range(steps):
            toks = [int(x) for x in s.decode(seqs, toks).argmax(-1)]
            out.append(toks)
        dt = (clock() - t) / steps
        for q in seqs:
            s.release(q)
        return dt * 1e6, out

    ta, tb, ratio = [], [], []
    for r in range(rounds):
        got = {i: one(sessions[i]) for i in ((0, 1) if r % 2 == 0 else (1, 0))}
        if got[0][1] != got[1][1]:
            print("the two artifacts' greedy tokens differ", flush=True)
        ta.append(got[0][0])
        tb.append(got[1][0])
        ratio.append(got[1][0] / got[0][0])
    q = statistics.quantiles(ratio, n=4) if len(ratio) >= 2 else [ratio[0]] * 3
    print(f"A {a}: median {statistics.median(ta):.1f} us/step, min {min(ta):.1f}" +
          (f", {node_count(a, batch)} nodes" if nodes else ""))
    print(f"B {b}: median {statistics.median(tb):.1f} us/step, min {min(tb):.1f}" +
          (f", {node_count(b, batch)} nodes" if nodes else ""))
    print(f"B / A per round: median {statistics.median(ratio):.3f} (quartiles {q[0]:.3f} .. {q[2]:.3f}, "
          f"{rounds} rounds of {steps} decode b{batch} steps)", flush=True)


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
    args = ap.parse_args()
    if args.cmd == "compile":
        compile_one(args.out, args.config)
    else:
        import torch

        torch.set_num_threads(1)
        run(args.a, args.b, args.rounds, args.steps, args.batch,
            time.process_time if args.clock == "cpu" else time.perf_counter, args.nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
