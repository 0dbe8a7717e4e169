"""Prefix cache on a multi-turn chat: prefill tokens, time to first token and hit rate, cache on vs off.

    python bench/bench_prefix.py [--configs tiny-doc,mid] [--turns 8] [--conversations 4] [--system 1024]
                                 [--user 48] [--answer 16] [--threads N] [--json OUT]

Per config (examples/tiny-doc's checkpoint; `mid`: bench_cpu's random ~0.5 B-parameter V4), cpu device,
one artifact (prefill chunk = the cache's piece, lcm of the ratios; decode batch = the conversations) and
two sessions on it, prefix cache on and off. Each of the conversations starts with the same system prompt
(seeded random ids), then per turn a fresh user message; its prompt is the system prompt, every earlier
turn's message and answer, and the new message; the answer is `--answer` greedy tokens. A turn's requests
(one per conversation) go to the generation loop together. Side by side, turn by turn: the same turn runs
with the cache off, then on; the answers must be identical (else the run stops). Printed per turn: prefill
tokens computed (prompt tokens minus those taken from the cache), mean time to first token, the cache's
hit rate; then turns 2..N summed: prefill tokens cut by, TTFT speed-up. Not a test: run it once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from v4compile import frontend  # noqa: E402
from v4compile.artifact import Buckets  # noqa: E402
from v4compile.cli.driver import compile_artifact  # noqa: E402
from v4compile.trace import TraceOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build(name: str, out: Path, capacity: int, batch: int) -> Path:
    opts = TraceOptions(numerics="hf", dtype="fp32", capacity=capacity)
    if name == "tiny-doc":
        fe = frontend.load(str(ROOT / "examples" / "tiny-doc"), None, None, opts)
    else:
        import bench_cpu
        from v4compile.init_random import random_source
        from v4compile.weights import spec_table
        from v4compile.weights_convert import DenseSource

        cfg = bench_cpu.mid_config()
        src, specs = random_source(cfg, 0), spec_table(cfg)
        fe = frontend.Frontend(cfg, "random", DenseSource(frontend._LazyDense(lambda n: src(specs[n]))), None, 0,
                               opts)
    ratios = sorted({fe.cfg.ratio(i) for i in range(fe.cfg.n_layers) if fe.cfg.ratio(i)})
    import math

    g = math.lcm(*ratios)
    return compile_artifact(fe, out, Buckets(decode=(batch,), prefill=(g,)))


def turn(sess, prompts: list[list[int]], answer: int):
    from v4compile.runtime.batcher import Batcher, Request

    loop = Batcher(sess, raise_errors=True)
    t0 = time.perf_counter()
    reqs = [loop.submit(Request(p, answer)) for p in prompts]
    loop.run_until_idle()
    ttft = [r.first_token_at - t0 for r in reqs]
    return [r.ids for r in reqs], sum(len(p) - r.cached_tokens for p, r in zip(prompts, reqs)), ttft


def bench(name: str, args) -> dict:
    import v4compile

    rng = np.random.default_rng(0)
    capacity = args.system + args.turns * (args.user + args.answer) + 64
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        art = build(name, Path(tmp) / name, capacity, args.conversations)
        print(f"{name}: compiled in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        on = v4compile.load(art, device="cpu", threads=args.threads)
        off = v4compile.load(art, device="cpu", threads=args.threads, prefix_cache=False)
        vocab = on.vocab
        system = rng.integers(0, vocab, args.system).tolist()
        hist = [list(system) for _ in range(args.conversations)]
        rows = []
        for k in range(args.turns):
            msgs = [rng.integers(0, vocab, args.user).tolist() for _ in range(args.conversations)]
            prompts = [h + m for h, m in zip(hist, msgs)]
            ids_off, pf_off, tt_off = turn(off, prompts, args.answer)
            ids_on, pf_on, tt_on = turn(on, prompts, args.answer)
            if ids_on != ids_off:
                raise SystemExit(f"{name} turn {k + 1}: the answers differ with the cache on and off")
            st = on.prefix_cache_stats()
            rows.append({"turn": k + 1, "prompt_tokens": sum(map(len, prompts)), "prefill_off": pf_off,
                         "prefill_on": pf_on, "ttft_off_s": float(np.mean(tt_off)), "ttft_on_s": float(np.mean(tt_on)),
                         "hit_rate": st["hit_rate"], "token_hit_rate": st["token_hit_rate"]})
            r = rows[-1]
            print(f"{name} turn {k + 1}: prompt {r['prompt_tokens']} tokens, prefill off {pf_off} on {pf_on}; "
                  f"TTFT off {r['ttft_off_s']:.3f} s on {r['ttft_on_s']:.3f} s; hit rate {st['hit_rate']:.2f}",
                  file=sys.stderr)
            hist = [p + a for p, a in zip(prompts, ids_on)]
        st = on.prefix_cache_stats()
        on.close()
        off.close()
    later = rows[1:]
    pf_off, pf_on = sum(r["prefill_off"] for r in later), sum(r["prefill_on"] for r in later)
    tt_off, tt_on = sum(r["ttft_off_s"] for r in later), sum(r["ttft_on_s"] for r in later)
    return {"config": name, "turns": rows, "cache": st, "identical": True,
            "later_prefill_cut": 1 - pf_on / pf_off if pf_off else 0.0,
            "later_ttft_speedup": tt_off / tt_on if tt_on else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny-doc,mid")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=48, help="tokens of each user message")
    ap.add_argument("--answer", type=int, default=16, help="tokens of each answer")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    out = []
    for name in args.configs.split(","):
        r = bench(name, args)
        out.append(r)
        print(f"{name}: turns 2-{args.turns}: prefill tokens cut by {100 * r['later_prefill_cut']:.1f} %, "
              f"TTFT {r['later_ttft_speedup']:.2f}x faster, hit rate {r['cache']['hit_rate']:.2f} (token hit rate "
              f"{r['cache']['token_hit_rate']:.2f}), outputs identical on / off; snapshot bytes "
              f"{r['cache']['snapshot_bytes']}, cached blocks {r['cache']['cached_blocks']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
