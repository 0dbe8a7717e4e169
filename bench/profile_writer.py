"""Where the weight writer's time goes: a per-stage, per-thread timeline of `compile -o`'s weights stage.

    python bench/profile_writer.py CKPT [--out DIR] [--cold] [--runs N]

Compiles CKPT once (placeholder kernels, as bench_weights does) and, when the compile reaches its weights,
writes them `--runs` times into `--out` (default: a directory beside the artifact; `/dev/shm/...` takes the
disk out of the picture) with every stage timed on its thread: `read` (pread from the checkpoint), `nan` (the
non-finite check on the stored bits), `convert`, `write` (pwrite into the shard), `hash` (a sha256 update on a
hash lane), `wait` (the writer's own thread waiting for a block or a buffer). For each run it prints the
rate, the process CPU seconds per GB, and per stage: wall and CPU seconds (`time.thread_time`), CPU s per GB,
and how many spans ran at once over the run (share of the wall time with k of them running: the read /
nan / convert / hash spans (a read's wait on the disk included), the hash spans alone (1: one lane hashing
while the other idles), the write spans (O_DIRECT writes wait on the disk)).
`--cold` drops the checkpoint's pages from the page cache before each run (as bench_weights does), so the
reads come from the disk. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

SPANS: list[tuple[str, int, float, float, float, int]] = []  # (stage, thread, t0, t1, cpu s, bytes)
LOCK = threading.Lock()


def span(stage: str, fn, nbytes=lambda *a, **k: 0):
    def timed(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            with LOCK:
                SPANS.append((stage, threading.get_ident(), t0, t1, c1 - c0, nbytes(*a, **k)))
    return timed


def instrument() -> None:
    from v4compile import shard_digest, weights_write

    weights_write._Reader.read_into = span("read", weights_write._Reader.read_into, lambda s, p, o, v: len(v))
    weights_write._check_bits = span("nan", weights_write._check_bits, lambda r, s, p, b, at, lo, hi: hi - lo)
    weights_write._Conversions.place = span("convert", weights_write._Conversions.place,
                                            lambda s, sp, lo, hi, d: hi - lo)

    class Os:  # weights_write's `os`, its pwrite timed
        def __getattr__(self, name):
            return getattr(os, name)
        pwrite = staticmethod(span("write", os.pwrite, lambda fd, b, pos: len(b)))
    weights_write.os = Os()

    class Hash:
        def __init__(self, h):
            self.h = h
            self.update = span("hash", h.update, lambda b: memoryview(b).nbytes)

        def __getattr__(self, name):
            return getattr(self.h, name)

    class Hashlib:  # shard_digest's `hashlib`, each sha256 object's updates timed
        def __getattr__(self, name):
            return getattr(hashlib, name)

        @staticmethod
        def sha256(*a):
            return Hash(hashlib.sha256(*a))
    shard_digest.hashlib = Hashlib()

    from concurrent.futures import Future
    result = Future.result

    def waited(self, timeout=None):
        if threading.current_thread() is threading.main_thread() and not self.done():
            return span("wait", result)(self, timeout)
        return result(self, timeout)
    Future.result = waited


def summary(t0: float, t1: float, nbytes: int, cpu: float) -> None:
    wall = t1 - t0
    gb = nbytes / 1e9
    print(f"  {gb:.2f} GB in {wall:.2f} s: {gb / wall * 1e3:.0f} MB/s; process CPU {cpu:.2f} s = {cpu / gb:.2f} s/GB "
          f"(the CPU allows {2 * gb / cpu * 1e3:.0f} MB/s on 2 idle cores)")
    per = defaultdict(lambda: [0.0, 0.0, 0, set()])
    for st, tid, a, b, c, n in SPANS:
        e = per[st]
        e[0] += b - a
        e[1] += c
        e[2] += n
        e[3].add(tid)
    print("  | stage | wall s | CPU s | CPU s/GB written | GB through it | threads |")
    for st in ("read", "nan", "convert", "write", "hash", "wait"):
        if st in per:
            w, c, n, tids = per[st]
            print(f"  | {st} | {w:.2f} | {c:.2f} | {c / gb:.2f} | {n / 1e9:.2f} | {len(tids)} |")
    # how many CPU stages run at once, over the run's wall time (a sweep over span starts and ends)
    for label, stages in (("cpu stages (read/nan/convert/hash)", {"read", "nan", "convert", "hash"}),
                          ("hash", {"hash"}), ("write", {"write"})):
        ev = sorted([(a, 1) for st, _, a, b, _, _ in SPANS if st in stages] +
                    [(b, -1) for st, _, a, b, _, _ in SPANS if st in stages])
        share, k, last = defaultdict(float), 0, t0
        for t, d in ev:
            share[min(k, 3)] += t - last
            k, last = k + d, t
        share[0] += t1 - last
        print(f"  busy at once, {label}: " + ", ".join(f"{k}{'+' if k == 3 else ''}: {100 * share[k] / wall:.0f} %"
                                                     for k in sorted(share)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from bench_weights import evict
    from fake_aot import placeholder_compile_calls

    from v4compile.cli import driver
    from v4compile.codegen import aot
    aot.compile_calls = placeholder_compile_calls()
    real = driver.write_weights
    instrument()

    def profiled(module, source, wdir, *a, **kw):
        base = Path(tempfile.mkdtemp(prefix="pw-", dir=args.out))
        try:
            for r in range(args.runs):
                if args.cold:
                    evict(sorted(args.ckpt.glob("*.safetensors")))
                d = base / f"run{r}"
                d.mkdir()
                SPANS.clear()
                u0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                real(module, source, d, *a, **kw)
                t1 = time.perf_counter()
                u1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu = u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime
                nbytes = sum(p.stat().st_size for p in d.glob("*.safetensors"))
                print(f"run {r} ({'cold' if args.cold else 'cached'} checkpoint, into {d}; load average "
                      f"{os.getloadavg()[0]:.1f}):")
                summary(t0, t1, nbytes, cpu)
                shutil.rmtree(d)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return real(module, source, wdir, *a, **kw)
    driver.write_weights = profiled

    from v4compile.cli import main as cli
    out = Path(tempfile.mkdtemp(prefix="pw-art-", dir=args.out))
    try:
        rc = cli(["-q", "compile", str(args.ckpt), "-o", str(out / "art"), "--target", "sm_90a", "--threads", "2"])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
