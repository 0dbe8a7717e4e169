"""Tiny decode b1 on the cpu device: node counts, ONNX Runtime's profile and a paired A/B of two artifacts.

    python bench/ab_attn_decode.py build OUT            # compile tiny as bench_cpu.py does (fp32, hf, cap 512)
    python bench/ab_attn_decode.py nodes ART            # decode_b1's nodes by IR op (and by ONNX op)
    python bench/ab_attn_decode.py profile ART          # ONNX Runtime's profile of decode b1, us/step by IR op
    python bench/ab_attn_decode.py ab ART_A ART_B [--rounds R] [--steps N]

`ab` loads both artifacts in this process (one ORT thread each), prefills the same 64-token prompt on both,
then alternates blocks of `--steps` greedy decode steps between them (the order flipping every round) with
this process's CPU clock, so load on a shared machine falls on both alike; it prints each one's median
ms/step, B/A and whether their logits stayed bit-identical (A/B of a codegen change: compile A before it
and B after it; the runtime that runs both is the current one). Not a test: a measuring tool.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = 64


def build(out: str) -> None:
    from bench_cpu import _frontend, big_tiny
    from v4compile.artifact import Buckets
    from v4compile.driver import compile_artifact

    compile_artifact(_frontend(big_tiny(), 512), Path(out), Buckets(decode=(1,), prefill=(PROMPT,)))
    print(out)


def nodes(art: str) -> None:
    import onnx

    g = onnx.load(str(Path(art) / "onnx/decode_b1.onnx"), load_external_data=False).graph
    by_ir = collections.Counter(n.doc_string.split(" ")[0] for n in g.node)
    by_op = collections.Counter(n.op_type for n in g.node)
    print(f"decode_b1: {len(g.node)} nodes")
    print("by IR op:", dict(by_ir.most_common()))
    print("by ONNX op:", dict(by_op.most_common()))


def _session(art: str, profile: str | None = None):
    from v4compile.artifact import load_artifact
    from v4compile.runtime.cpu_backend import OrtBackend
    from v4compile.runtime.session import Session

    a = load_artifact(art)
    be = OrtBackend(a, threads=1, profile=profile)
    return Session(a, be), be


def profile(art: str, steps: int = 16) -> None:
    import onnx

    d = tempfile.mkdtemp(prefix="ab_prof_")
    s, be = _session(art, d)
    seqs, lg = s.prefill([list(range(1, PROMPT + 1))])
    tok = [int(lg[0].argmax())]
    for _ in range(steps):
        tok = [int(s.decode(seqs, tok)[0].argmax())]
    files = be.end_profiling()
    f = next(x for x in files if "decode_b1" in os.path.basename(x))
    doc = {n.name: n.doc_string.split(" ")[0] for n in
           onnx.load(str(Path(art) / "onnx/decode_b1.onnx"), load_external_data=False).graph.node}
    by_type, by_ir, by_ir_type = collections.Counter(), collections.Counter(), collections.Counter()
    runs = 0
    for e in json.load(open(f)):
        if e.get("cat") == "Session" and e["name"] == "model_run":
            runs += 1
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            ir = doc.get(e["name"][: -len("_kernel_time")], "(fused by ORT)")
            by_type[e["args"]["op_name"]] += e["dur"]
            by_ir[ir] += e["dur"]
            by_ir_type[(ir, e["args"]["op_name"])] += e["dur"]
    runs = max(runs, 1)  # the decode_b1 session's runs: the decode steps
    print(f"profiled us/step {sum(by_type.values()) / runs:.0f} over {runs} runs")
    print("by ONNX op:", {k: round(v / runs) for k, v in by_type.most_common(16)})
    print("by IR op:", {k: round(v / runs) for k, v in by_ir.most_common(16)})
    print("by (IR op, ONNX op):", {f"{a}/{b}": round(v / runs) for (a, b), v in by_ir_type.most_common(40)})


def ab(art_a: str, art_b: str, rounds: int, steps: int) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 200, PROMPT).tolist()
    eng = {}
    for k, art in (("A", art_a), ("B", art_b)):
        s, _ = _session(art)
        s.warmup(PROMPT, 1)
        seqs, lg = s.prefill([prompt])
        eng[k] = [s, seqs, int(lg[0].argmax()), lg]
    same = bool(np.array_equal(eng["A"][3], eng["B"][3]))
    times = {"A": [], "B": []}
    for r in range(rounds):
        for k in ("AB" if r % 2 == 0 else "BA"):
            s, seqs, tok, _ = eng[k]
            if seqs[0].length + steps + 1 >= s.max_context:  # start over before the pool fills
                s.release(seqs[0])
                seqs, lg = s.prefill([prompt])
                tok = int(lg[0].argmax())
            t = time.process_time()
            for _ in range(steps):
                lg = s.decode(seqs, [tok])
                tok = int(lg[0].argmax())
            times[k].append(1e3 * (time.process_time() - t) / steps)
            eng[k][1:4] = [seqs, tok, lg]
        same = same and bool(np.array_equal(eng["A"][3], eng["B"][3]))
    ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"A {art_a}: median {ma:.4f} ms/step; B {art_b}: median {mb:.4f} ms/step; B/A = {mb / ma:.4f} "
          f"({rounds} rounds x {steps} steps, cpu clock, load {os.getloadavg()[0]:.2f}); "
          f"logits bit-identical: {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build").add_argument("out")
    sub.add_parser("nodes").add_argument("art")
    p = sub.add_parser("profile")
    p.add_argument("art")
    p = sub.add_parser("ab")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out)
    elif args.cmd == "nodes":
        nodes(args.art)
    elif args.cmd == "profile":
        profile(args.art)
    else:
        ab(args.a, args.b, args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
