"""Peak memory of the streaming golden against the in-memory one (issue 35 item 2).

    python bench/bench_golden_rss.py [--layers 12] [--dim 2048] [--experts 16] [--keep DIR]

Writes a seeded random checkpoint (fp32, official layout) of tiny's structure scaled up (hidden 2048, 12 layers,
16 routed experts of width 512, vocabulary 4096: about 0.7 B parameters, 2.8 GB) to a temporary directory (deleted
after), then makes its golden (hf, fp32, prefill chunk 16, two decode steps, one prompt candidate) twice, each in a
child process that prints its own peak RSS (`VmHWM` of /proc/self/status: `ru_maxrss` would start from the
forking parent's peak, which the checkpoint's writing raised): in memory (`fe.reference()`), then streaming
(`fe.reference(streaming=True)`). Both goldens are compared bit for bit.

The streaming golden's stated bound (`bound`): the child's RSS before the golden (interpreter, torch, the
checkpoint's header) + the weights held whole (embedding, head, final norms) + 2 x the largest decoder layer
(one resident, and one layer's tensors converted while its expert stack is built) + 256 MiB for the activations,
the cache and the allocator's slack at these sizes. The in-memory golden holds every layer and exceeds it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLACK = 256 << 20

CHILD = r"""
import json, sys, time, torch
import numpy as np
torch.set_num_threads(1)
from v4compile import frontend, golden
from v4compile.trace import TraceOptions
ckpt, streaming, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]


def hwm():  # this process's peak RSS since its exec (ru_maxrss would carry the forking parent's peak over)
    for ln in open("/proc/self/status"):
        if ln.startswith("VmHWM:"):
            return int(ln.split()[1]) * 1024


fe = frontend.load(ckpt, None, None, TraceOptions(numerics="hf", dtype="fp32", capacity=64))
base = hwm()
t0 = time.perf_counter()
model = fe.reference(streaming=streaming)
g = golden.make_golden(model, "hf", "fp32", (16,), 64, candidates=1, new_tokens=2)
secs = time.perf_counter() - t0
np.savez(out, **g.tensors)
w = model.weights
rest = sum(t.numel() * t.element_size() for t in w.rest.values()) if streaming else None
print(json.dumps({"base": base, "peak": hwm(),
                  "seconds": round(secs, 1), "rest": rest, "largest": getattr(w, "largest", None),
                  "layer_reads": getattr(w, "loads", None), "ids": g.facts["ids"]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--keep", help="write the checkpoint here and keep it")
    args = ap.parse_args()
    import dataclasses

    from v4compile.config import CSA, HCA, SWA, preset
    from v4compile.init_random import init_random

    tiny = preset("tiny")
    kinds = tuple((SWA, HCA, CSA, HCA, CSA)[min(i, 1) if i < 2 else 2 + i % 2] for i in range(args.layers))
    cfg = dataclasses.replace(tiny, vocab_size=4096, dim=args.dim, n_layers=args.layers, layer_kinds=kinds,
                              n_heads=16, head_dim=128, rope_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=256,
                              index_head_dim=64, n_experts=args.experts, moe_inter_dim=512, name="rss-bench").validate()
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="golden-rss-"))
    try:
        t0 = time.perf_counter()
        ck = init_random(tmp / "ckpt", cfg, seed=0, include_mtp=False, force=True)
        size = sum(p.stat().st_size for p in ck.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e9:.2f} GB, {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_experts} experts "
              f"(written in {time.perf_counter() - t0:.0f} s)")
        res = {}
        for name, flag in (("in-memory", "0"), ("streaming", "1")):
            r = subprocess.run([sys.executable, "-c", CHILD, str(ck), flag, str(tmp / f"{name}.npz")],
                               capture_output=True, text=True, timeout=1800, cwd=ROOT)
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            res[name] = json.loads(r.stdout.strip().splitlines()[-1])
        import numpy as np

        a, b = np.load(tmp / "in-memory.npz"), np.load(tmp / "streaming.npz")
        same = res["in-memory"]["ids"] == res["streaming"]["ids"] and all(np.array_equal(a[k], b[k]) for k in a.files)
        s = res["streaming"]
        bound = s["base"] + s["rest"] + 2 * s["largest"] + SLACK
        for name, r in res.items():
            print(f"{name:>10}: peak RSS {r['peak'] / 2**20:,.0f} MiB (before the golden {r['base'] / 2**20:,.0f} MiB), "
                  f"{r['seconds']} s" + (f", {r['layer_reads']} layer reads" if r["layer_reads"] else ""))
        print(f"stated bound: base {s['base'] / 2**20:,.0f} + whole {s['rest'] / 2**20:,.0f} + 2 x largest layer "
              f"{s['largest'] / 2**20:,.0f} + {SLACK >> 20} = {bound / 2**20:,.0f} MiB")
        ok = same and s["peak"] <= bound < res["in-memory"]["peak"]
        print(f"bit for bit: {same}; streaming under the bound: {s['peak'] <= bound}; in-memory over it: "
              f"{res['in-memory']['peak'] > bound}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
