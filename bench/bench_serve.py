"""How much of the batching `serve` keeps: 8 concurrent streaming clients against `v4compile serve` (cpu
device) vs the same 8 greedy requests given to one `Session.generate` call, in one run.

    python bench/bench_serve.py [--artifact DIR] [--max-tokens 64] [--threads 1] [--json out.json]

Without --artifact, examples/tiny-doc is compiled (cpu target) into a temporary directory. Prints both
aggregate tokens/s and their ratio (the goal: >= 0.8). One server subprocess, always killed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import openai

    import v4compile
    from v4compile.cli import main as cli

    tmp = tempfile.TemporaryDirectory()
    art = args.artifact
    if art is None:
        art = Path(tmp.name) / "tiny-doc"
        assert cli(["-q", "compile", str(ROOT / "examples" / "tiny-doc"), "-o", str(art), "--target", "cpu"]) == 0

    # one generate call with the 8 requests (the chat prompts the server builds)
    sess = v4compile.load(art, device="cpu", threads=args.threads)
    tok = sess.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": n}])) for n in NAMES]
    sess.warmup(max(map(len, prompts)), len(prompts))
    t0 = time.perf_counter()
    out = sess.generate(prompts, args.max_tokens, stop_ids=sorted(tok.eos_ids))
    gen_s = time.perf_counter() - t0
    gen_tokens = sum(map(len, out))
    sess.close()

    p, url = start_server(art, args.threads, Path(tmp.name) / "serve.log")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)
        counts = [0] * len(NAMES)

        def client(i: int) -> None:
            for ch in c.chat.completions.create(model="m", messages=[{"role": "user", "content": NAMES[i]}],
                                                max_tokens=args.max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
                if ch.usage is not None:
                    counts[i] = ch.usage.completion_tokens

        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)  # warm
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(NAMES))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        serve_s = time.perf_counter() - t0
    finally:
        p.kill()
        p.wait(timeout=30)
    serve_tokens = sum(counts)
    r = {"requests": len(NAMES), "max_tokens": args.max_tokens, "threads": args.threads,
         "generate_tokens": gen_tokens, "generate_s": round(gen_s, 3), "generate_tokens_per_s": round(gen_tokens / gen_s, 1),
         "serve_tokens": serve_tokens, "serve_s": round(serve_s, 3), "serve_tokens_per_s": round(serve_tokens / serve_s, 1)}
    r["ratio"] = round(r["serve_tokens_per_s"] / r["generate_tokens_per_s"], 3)
    print(f"generate: {gen_tokens} tokens in {gen_s:.2f} s ({r['generate_tokens_per_s']} tokens/s); serve, "
          f"8 concurrent clients: {serve_tokens} tokens in {serve_s:.2f} s ({r['serve_tokens_per_s']} tokens/s); "
          f"ratio {r['ratio']:.2f} (goal >= 0.8)")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
