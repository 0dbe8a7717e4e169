"""The GPU check of the C runtime (issue 10; speculation: issue 43), for a machine with an H200 or H100 (device
cuda) or an MI355X (hip); `--device host` is its dry run on the CPU (the same program, the kernels interpreted).

    python scripts/gpu_check.py [--device cuda] [--configs tiny,mid] [--compare tiny] [--steps 8] [--reps 50]
                                [--draft-tokens 2] [--spec-rounds 16] [--json OUT]

For each config (tiny; `mid`: the ~0.5 B random V4 of bench/bench_cpu.py; both with the MTP block), random weights
(seed 0):
1. compile the artifact with the device's GPU target (its program: decode bucket 4, prefill chunk 64; with
   `--draft-tokens` K = 2 (the default; 0: none of the speculative parts) also verify_b4, the MTP block's draft_b4
   and draft_c64, and the one-call steps spec_b4, spec_s4, spec_b4_d2; the kernels compiled ahead of time into
   kernels/<sm_90a|gfx950>/; with its golden) and load it on the device, then run the deployment self-check first
   (`run --self-check`: the golden through the captured decode graphs, its lines on stderr, `self_check` in the
   JSON; exit 1 if it fails);
2. generate `--steps` greedy tokens for a ragged batch of 3 prompts (40, 23, 70 tokens: chunked prefill)
   and compare the ids with `ReferenceModel.generate` (exit 1 on any difference);
3. speculation (`speculative` in the JSON; exit 1 if any part fails):
   a. greedy `--speculative mtp` generation of the same prompts with K drafts a step: its ids against step 2's
      plain decoding on the device, the acceptance per draft position, and the calls: after the prefills and the
      first drafts, each step must be one graph replay of spec_b4_d2 (the recursive draft in the call), no other
      call (`graph_launches_per_step`, `one_call_per_step`);
   b. the sampled step: `--spec-rounds` calls of spec_s4 on the device from the prompts' pool (drafts right,
      wrong, drawn from a random q; seeded uniforms; a greedy row every second round), each call's kept lanes and
      ids against `speculation.sample_accept` on that call's own verify logits with the same uniforms and q:
      equal, or the first differing decision within float32 rounding of its boundary, told by its float64 margin
      against a stated tolerance (`runtime/spec_check.py`; anything else a fault);
   c. (after step 5's decode timing) spec_b4 and spec_b4_d2 timed as graph replays (the same inputs as the decode
      step, K more lanes each) against the decode step of the same bucket: the measured ratio beside the one
      report.json `spec_step` models for the device's target (measured against modeled; the model's figures are
      the target's: sm_90a's are the H200's);
4. (configs in `--compare`, default tiny) run one decode step of the batch-4 bucket launch by launch on the
   device and on the host device (the same kernels, interpreted) from the same bytes, and print the first
   launch whose results differ, with its op, family, kernels and parameter names (bit-exact for pool,
   state and integer values; float values within the kernel tests' tolerance; runtime/launch_check.py;
   exit 1 on a difference). The host side interprets every kernel: minutes for tiny;
5. time one decode step of the batch-4 bucket launch by launch and as a graph replay (inputs uploaded
   once, `--reps` runs, stream synchronised) and report the achieved bandwidth = bytes of the weights the
   step reads / step time, against the H200's 4.8 TB/s for cuda, whichever card (MI355X: 8 TB/s). The weight
   bytes count every expert: for MoE layers only the routed experts are read, so this overstates traffic (upper
   bound) for `mid`; KV-pool reads are not counted (small at these contexts).
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

from v4compile.targets import DEVICE_TARGET, TARGETS

ROOT = Path(__file__).resolve().parents[1]
# the device's HBM peak as its target's figure (host: a dry run of this script on CPU, no peak)
PEAK = {d: (TARGETS[t].hbm_bytes_s if d != "host" else float("nan")) for d, t in DEVICE_TARGET.items()}
B = 4  # the GPU program's decode bucket (and verify / speculative steps' batch)
K = 2  # drafts per speculative step (`--draft-tokens`, the artifact's K)


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


def spec_generation(sess, prompts, steps, plain, k):
    """1. Greedy speculative generation (`--speculative mtp`, k drafts a step) of `prompts`: its ids against plain
    decoding's, the acceptance, and the calls it made: after each prompt's prefill (`prefill_c<T>`, the MTP
    block's `draft_c<T>`) and the first drafts (`draft_b<B>`: the recursive one), every step one captured call of
    `spec_b<B>_d<k>` (`spec_b<B>` for k = 1) replayed as a graph: no verify, decode or other call."""
    from collections import Counter

    from v4compile.artifact import spec_name

    be = sess.backend
    calls: Counter = Counter()
    run = be.run_outputs
    before = be.rt.stats()
    be.run_outputs = lambda f, i: calls.update([f]) or run(f, i)
    try:
        t0 = time.perf_counter()
        ids = sess.generate(prompts, steps, speculative="mtp", draft_tokens=k)
        secs = time.perf_counter() - t0
    finally:
        del be.run_outputs
    after = be.rt.stats()
    acc = sess.last_acceptance
    step = spec_name(B, drafts=k)
    n = calls[step]
    replays, captures = after["replays"] - before["replays"], after["captures"] - before["captures"]
    other = {f: c for f, c in calls.items() if f != step and not f.startswith(("prefill_c", "draft_c", "draft_b"))}
    one_call = n > 0 and replays == n and captures <= 1 and not other
    return {"ids_match": ids == plain, "draft_tokens": k, "acceptance": [round(r, 3) for r in acc.rates()],
            "tokens_per_step": round(acc.tokens_per_step(), 3), "steps": n, "calls": dict(sorted(calls.items())),
            "graph_replays": replays, "captures": captures,
            "graph_launches_per_step": round(replays / n, 3) if n else None,
            "one_call_per_step": one_call, "seconds": round(secs, 2), **({} if ids == plain else {"got": ids})}


def sampled_step(sess, prompts, plain, rounds, seed=0):
    """2. The sampled one-call step `spec_s<B>` on the device from the prompts' prefilled pool, K drafts each:
    sequence 0's right (plain greedy's) drawn from a uniform q (kept unless its uniform is tiny), sequence 1's first
    wrong, q one-hot at each (rejected unless its uniform is below p(d): the token then drawn from p without it),
    sequence 2's drawn from a seeded random q (mostly rejected: drawn from the residual max(0, p - q)); the batch's
    last lane padding. `rounds` calls, each with fresh seeded uniforms and temperatures (0.8, 1.0, 0.6; every second
    round's sequence 2 greedy: the sampled step's greedy rows): its kept lanes and ids against
    `speculation.sample_accept` on the call's own verify logits (`runtime/spec_check.py`: equal, or a decision
    within float32 rounding of its boundary, told by its float64 margin)."""
    import numpy as np

    from v4compile.artifact import spec_name
    from v4compile.runtime.spec_check import sampled_differences

    T, V = K + 1, sess.vocab
    g = np.random.default_rng(seed)
    q = np.zeros((B, T, V), dtype=np.float32)
    q[0, 1:] = 1.0 / V
    drafts = [plain[0][1:T], [(plain[1][1] + 1) % V, *plain[1][2:T]]]
    q[1, 1:] = np.eye(V, dtype=np.float32)[drafts[1]]
    z = g.standard_normal((T - 1, V)) * 3
    q[2, 1:] = np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    drafts.append([int(g.choice(V, p=q[2, j].astype(np.float64) / q[2, j].sum())) for j in range(1, T)])
    seqs = [sess.open() for _ in prompts]
    try:
        ids, pos = np.zeros((B, T), dtype=np.int64), np.full((B, T), -1, dtype=np.int64)
        for b, (s, p) in enumerate(zip(seqs, prompts)):
            sess.extend(s, p)
            ids[b] = [plain[b][0], *drafts[b]]
            pos[b] = np.arange(s.length, s.length + T)
            sess.reserve(s, s.length + T - 1)
        table, slot = sess.table(seqs, B)
        fname, kept, diffs = spec_name(B, sampled=True), [], []
        for r in range(rounds):
            temp = np.array([0.8, 1.0, 0.0 if r % 2 else 0.6, 0.0], dtype=np.float32)
            u = g.random((B, T), dtype=np.float32)
            out = sess.backend.run_outputs(fname, {"ids": ids, "pos": pos, "block_table": table, "slot": slot,
                                                   "draft_probs": q, "uniforms": u, "temperature": temp})
            kept.append([int((out["spec.kept_pos"][b] >= 0).sum()) - 1 for b in range(len(prompts))])
            diffs += [{"round": r, **d} for d in sampled_differences(out["logits"], ids, pos, q, u, temp,
                                                                     out["spec.next_ids"], out["spec.kept_pos"])]
    finally:
        for s in seqs:
            sess.release(s)
    return {"function": fname, "rounds": rounds, "kept_drafts": kept, "differences": diffs,
            "passed": all(d["excused"] for d in diffs)}


def step_inputs(sess, T):
    """The timed steps' inputs in the batch-B bucket, T lanes a sequence: lane 0 at positions 100, 101, padding and
    7 (a step's lanes t at + t), each sequence's block table holding the pool blocks of its positions."""
    import numpy as np

    pos = np.where(np.array([[100], [101], [-1], [7]]) >= 0, np.array([[100], [101], [-1], [7]]) + np.arange(T), -1)
    table = np.full((B, int(sess.blocks_per_seq)), -1, np.int32)
    used = 0
    for b in range(B):
        if pos[b, 0] >= 0:
            n = int(pos[b].max()) // int(sess.block_tokens) + 1
            table[b, :n] = np.arange(used, used + n)
            used += n
    return {"ids": np.zeros((B, T), np.int64), "pos": pos.astype(np.int64), "block_table": table,
            "slot": np.array([0, 1, -1, 2], np.int32)}


def spec_timing(sess, art, device, decode_s, reps):
    """3. One speculative step per k = 1 .. K (`spec_b<B>`, `spec_b<B>_d<k>`) timed as a graph replay (`step_inputs`:
    uploaded once, `reps` runs, synchronised) against the decode step of the same bucket (`decode_s`, timed alike on
    the same positions): measured ratios beside the compile report's modeled ones (report.json `spec_step` for the
    device's target: a roofline model of the target's figures, not a measurement)."""
    from v4compile.artifact import spec_name

    report = json.loads((Path(art) / "report.json").read_text())
    target = DEVICE_TARGET[device]
    model = report["spec_step"][target][spec_name(B)]
    rows = []
    for k in range(1, K + 1):
        step = sess.backend.timed(spec_name(B, drafts=k), step_inputs(sess, K + 1), graph=True, reps=reps)
        rows.append({"function": spec_name(B, drafts=k), "draft_tokens": k, "step_us_graph": round(step * 1e6, 1),
                     "measured_ratio": round(step / decode_s, 3),
                     "modeled_ratio": round(model["steps_us"][k - 1] / model["decode_us"], 3),
                     "modeled_us": model["steps_us"][k - 1]})
    return {"target": target, "decode_us_graph": round(decode_s * 1e6, 1), "modeled_decode_us": model["decode_us"],
            "steps": rows, "note": "measured on the device against modeled (report.json spec_step, the target's "
                                   "roofline figures)"}


def check(name, cfg, device, steps, reps, work, compare, draft_tokens, spec_rounds):
    import numpy as np

    import v4compile
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_artifact

    t0 = time.perf_counter()
    fe = _bench()._frontend(cfg, 256)  # random weights (seed 0), hf numerics, fp32
    from v4compile.targets import DEVICE_TARGET

    if draft_tokens and not cfg.n_mtp_layers:
        raise SystemExit(f"error: config '{name}' has no MTP block: nothing drafts (--draft-tokens 0 skips it)")
    # GPU: decode_b4, prefill_c64; with K drafts also verify_b4, draft_b4, draft_c64, spec_b4, spec_s4, spec_b4_d<k>
    art = compile_artifact(fe, Path(work) / name, Buckets(decode=(1, B), prefill=(64,), draft_tokens=draft_tokens),
                           targets=("cpu", DEVICE_TARGET[device]), golden=True)
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
    spec = None
    if draft_tokens:  # before any step below writes the pool at made-up places (the prefix cache holds its blocks)
        spec = {"generation": spec_generation(sess, prompts, steps, got, draft_tokens)}
        gen = spec["generation"]
        print(f"{name}: speculative k={draft_tokens}: ids {'match' if gen['ids_match'] else 'DIFFER'}, acceptance "
              f"{gen['acceptance']}, {gen['tokens_per_step']} tokens/step, {gen['steps']} steps, "
              f"{gen['graph_launches_per_step']} graph launches/step, calls {gen['calls']}", file=sys.stderr)
        spec["sampled"] = sampled_step(sess, prompts, got, spec_rounds)
        sm = spec["sampled"]
        print(f"{name}: sampled step {sm['function']} x {sm['rounds']}: kept drafts {sm['kept_drafts']}, "
              f"{len(sm['differences'])} differences from the host rule "
              f"({sum(d['excused'] for d in sm['differences'])} within float32 rounding of a boundary)",
              file=sys.stderr)
    inputs = step_inputs(sess, 1)
    fname = f"decode_b{B}"
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
    if spec is not None:
        spec["timing"] = spec_timing(sess, art, device, graph, reps)
        spec["passed"] = spec["generation"]["ids_match"] and spec["generation"]["one_call_per_step"] and \
            spec["sampled"]["passed"]
        out["speculative"] = spec
        print(f"{name}: speculative step / decode step (graph replay, measured vs modeled): "
              + ", ".join(f"k={r['draft_tokens']} {r['measured_ratio']} vs {r['modeled_ratio']}"
                          for r in spec["timing"]["steps"]), file=sys.stderr)
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
    ap.add_argument("--draft-tokens", type=int, default=K, choices=(0, K),
                    help=f"compile with {K} drafts and check the speculative steps (0: neither)")
    ap.add_argument("--spec-rounds", type=int, default=16, help="calls of the sampled step compared with the host")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.draft_tokens and (args.steps <= K or args.spec_rounds < 1):
        # the sampled step's right drafts are plain decoding's tokens 2 .. K + 1
        ap.error(f"--draft-tokens {K} needs --steps > {K} and --spec-rounds >= 1")
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
                rows.append(check(name, cfg, args.device, args.steps, args.reps, work, name in compare,
                                  args.draft_tokens, args.spec_rounds))
            except V4Error as e:
                print(f"error: {name}: {e}", file=sys.stderr)
                return 2
            print(json.dumps(rows[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["self_check"]["passed"] and r["ids_match"] and r["first_difference"] is None
                    and r.get("speculative", {}).get("passed", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
