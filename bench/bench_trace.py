"""Trace / verify / print+parse time of the full V4-Pro graph, shape-only (goal: trace <= 30 s on 2 cores).

    python bench/bench_trace.py [--preset v4-pro]
"""

from __future__ import annotations

import argparse
import time

from v4compile.config import preset
from v4compile.ir.text import parse_module, print_module
from v4compile.ir.verify import verify
from v4compile.trace import TraceOptions, trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v4-pro")
    args = ap.parse_args()
    cfg = preset(args.preset)
    opts = TraceOptions(batch=1, chunk=512, decode_batch=64, capacity=cfg.max_position, weights="released",
                        dtype="bf16")
    t0 = time.perf_counter()
    m = trace(cfg, opts)
    t1 = time.perf_counter()
    verify(m)
    t2 = time.perf_counter()
    text = print_module(m)
    t3 = time.perf_counter()
    parse_module(text)
    t4 = time.perf_counter()
    ops = {k: len(f.ops) for k, f in m.functions.items()}
    print(f"{cfg.name}: {ops} ops, {len(m.weights)} weights, {len(text) / 1e6:.2f} MB of IR text")
    print(f"  trace  {t1 - t0:7.3f} s   (goal 30 s: {30 / (t1 - t0):.0f}x headroom)")
    print(f"  verify {t2 - t1:7.3f} s")
    print(f"  print  {t3 - t2:7.3f} s")
    print(f"  parse  {t4 - t3:7.3f} s")


if __name__ == "__main__":
    main()
