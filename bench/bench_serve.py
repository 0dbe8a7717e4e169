"""How much of the batching `serve` keeps: 8 concurrent streaming clients against `v4compile serve` (cpu
device) vs the same 8 greedy requests given to one `Session.generate` call, in one run.

    python bench/bench_serve.py [--artifact DIR] [--max-tokens 64] [--threads 1] [--repeat 5] [--json out.json]
                                [--loglikelihood]

Without --artifact, examples/tiny-doc is compiled (cpu target) into a temporary directory. Prints both
aggregate tokens/s (the medians of --repeat alternating rounds) and their ratio (the goal: >= 0.8). One
server subprocess, always killed. `--loglikelihood` also times an evaluation harness's loglikelihood requests:
8 concurrent completions of 300 prompt tokens each with `echo`, `logprobs` and `max_tokens` 0 (the example is
then compiled with a 512-token context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["json.dumps", "os.path.join", "re.compile", "textwrap.dedent", "heapq.heappush", "shutil.copy",
         "functools.partial", "random.choice"]


def start_server(art: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "v4compile", "serve", str(art), "--port", "0", "--device", "cpu",
                              "--threads", str(threads), "--model-name", "m"], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while True:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            return p, m.group(1)
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise SystemExit(f"serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)


async def clients(url: str, max_tokens: int) -> tuple[list[int], float]:
    """8 concurrent streaming chat clients (httpx, reading the events as they come: light enough that the
    clients do not take the server's CPU), after one warm-up request; their completion tokens and the wall
    time of all 8."""
    import httpx

    async def one(h, name: str) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": name}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        n = 0
        async with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
        return n

    async with httpx.AsyncClient(timeout=600) as h:
        await one(h, "x")
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(h, n) for n in NAMES))
        return list(counts), time.perf_counter() - t0


async def loglikelihood(url: str, prompts: list[list[int]]) -> float:
    """Wall time of one concurrent round of echo requests (max_tokens 0), each checked whole."""
    import httpx

    async def one(h, ids: list[int]) -> None:
        body = {"model": "m", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
        r = await h.post(url + "/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(ids), r.text

    async with httpx.AsyncClient(timeout=600) as h:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(h, ids) for ids in prompts))
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of each; the medians are compared")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--loglikelihood", action="store_true", help="also 8 concurrent 300-token echo requests")
    args = ap.parse_args()
    import v4compile
    from v4compile.cli import main as cli

    tmp = tempfile.TemporaryDirectory()
    art = args.artifact
    if art is None:
        art = Path(tmp.name) / "tiny-doc"
        context = ["--max-context", "512"] if args.loglikelihood else []
        assert cli(["-q", "compile", str(ROOT / "examples" / "tiny-doc"), "-o", str(art), "--target", "cpu",
                    *context]) == 0

    # one generate call with the 8 requests (the chat prompts the server builds), --repeat times; the server
    # runs meanwhile (idle between its rounds), so both measure on the same, possibly shared, machine
    p, url = start_server(art, args.threads, Path(tmp.name) / "serve.log")
    try:
        sess = v4compile.load(art, device="cpu", threads=args.threads)
        tok = sess.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": n}])) for n in NAMES]
        sess.warmup(max(map(len, prompts)), len(prompts))
        gens, serves = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = sess.generate(prompts, args.max_tokens, stop_ids=sorted(tok.eos_ids))
            gens.append((sum(map(len, out)), time.perf_counter() - t0))
            counts, dt = asyncio.run(clients(url, args.max_tokens))
            serves.append((sum(counts), dt))
        if args.loglikelihood:  # 8 choices of one question: a shared 290-token context and different endings
            text = (ROOT / "README.md").read_text()
            ctx = tok.encode(text)[:290]
            choices = [ctx + tok.encode(f" choice {i}: {n}")[:10] for i, n in enumerate(NAMES)]
            choices = [c + ctx[: 300 - len(c)] for c in choices]
            ll = sorted(asyncio.run(loglikelihood(url, choices)) for _ in range(args.repeat))[args.repeat // 2]
        sess.close()
    finally:
        p.kill()
        p.wait(timeout=30)
    (gen_tokens, gen_s), (serve_tokens, serve_s) = (sorted(x, key=lambda t: t[1])[len(x) // 2] for x in (gens, serves))
    r = {"requests": len(NAMES), "max_tokens": args.max_tokens, "threads": args.threads, "repeat": args.repeat,
         "generate_tokens": gen_tokens, "generate_s": round(gen_s, 3), "generate_tokens_per_s": round(gen_tokens / gen_s, 1),
         "serve_tokens": serve_tokens, "serve_s": round(serve_s, 3), "serve_tokens_per_s": round(serve_tokens / serve_s, 1)}
    r["ratio"] = round(r["serve_tokens_per_s"] / r["generate_tokens_per_s"], 3)
    if args.loglikelihood:
        r["loglikelihood_8x300_s"] = round(ll, 3)
    print(f"generate: {gen_tokens} tokens in {gen_s:.2f} s ({r['generate_tokens_per_s']} tokens/s); serve, "
          f"8 concurrent clients: {serve_tokens} tokens in {serve_s:.2f} s ({r['serve_tokens_per_s']} tokens/s); "
          f"ratio {r['ratio']:.2f} (goal >= 0.8)")
    if args.loglikelihood:
        print(f"loglikelihood: 8 concurrent echo requests of 300 tokens (max_tokens 0) in {ll:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
