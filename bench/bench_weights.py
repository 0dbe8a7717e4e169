"""Weights at disk speed: `compile -o` writing and `v4compile.load` reading an artifact's weights, against the
disk's own speed, and the peak memory of both at two checkpoint sizes. A measurement, not a test (issue 25's
goals: writing >= 70 % of the disk's write speed, reading >= 70 % of its read speed, peak RSS the same
within 15 % at both sizes and below 2x the largest tensor plus the process's baseline).

    python bench/bench_weights.py                         # V4-Flash dims: 2 and 6 layers, 4 experts, 8k vocab
    python bench/bench_weights.py --size issue            # 1 and 3 layers (1.6 GB), 10 experts, 32k vocab
    python bench/bench_weights.py --workdir /tmp/bw --keep  # reuse the checkpoints of an earlier run
    python bench/bench_weights.py --checkpoints /dev/shm/bw  # the checkpoints off the artifact's disk

Steps, each in a fresh process:
1. two quantised checkpoints with `v4compile init-random --config ... --quantized` (V4-Flash dims, fewer layers,
   experts and vocabulary); kept in --workdir and reused when present;
2. the disk, three times (the median): 512 MiB written in 16 MiB blocks then `fdatasync` (as `dd
   conv=fdatasync`), then read back after its pages are dropped from the page cache (`posix_fadvise
   DONTNEED`, this file only: no root, no global cache drop on a shared machine); that read is listed, but the read speed the load is held against is the
   artifact's own shards read as `dd bs=16M` after their pages are dropped, next to the loads (before and
   after them in turn; the median): a virtual disk reads a file just written from its host's cache, faster
   than one written minutes before; and the disk's *copy* speed: the checkpoint's files read and written into
   a new file in 8 MiB blocks, both around the page cache (as `dd iflag=direct oflag=direct bs=8M`, then
   `fdatasync`), on one thread and on two (one block's read beside another's write), three times each, the
   larger median: the most a compile can write when its checkpoint is read from the same disk (this virtual
   disk has one bandwidth for reads and writes together: it copies at about half its write speed, and no
   faster on two threads). `--checkpoints DIR` keeps the checkpoints elsewhere (`/dev/shm`: the disk then
   only writes, as for a checkpoint on its own drive);
3. `v4compile compile CKPT -o DIR --target sm_90a`, twice: with the checkpoint in the page cache (read through it
   once before: a checkpoint just downloaded or compiled before; the writer reads a cached file through the
   cache) and with its pages dropped (read from the disk: the table's main figure, and the RSS figures). The
   weight rate is the writer's own line (bytes written,
   hashed and `fdatasync`ed per second of the weights stage; shards of 256 MiB and more go out with O_DIRECT,
   which the line counts); its CPU seconds per GB (every thread); peak RSS of the weights stage above the RSS
   when it started, and of the whole process. `--kernels placeholder` (default) replaces the ahead-of-time kernel
   compiler with placeholder binaries (as tests/runtime/test_artifact_targets.py does): kernels take minutes per new
   shape on a shared 2-core machine and do not touch the weights; `--kernels real` runs it;
4. load, after the shards are dropped from the page cache, hashed against the manifest as read (`--loads`
   times: the median is the table's, every run is listed) and not; the weights' rate is timed from the
   weights' first read (the manifest and the other files' checks before it are listed as the fixed cost):
   `stream` is the host side of a GPU load (`MappedWeights.chunks`: the shards read in a region per hash
   lane, into a few reused chunk buffers, the pieces a driver copy would take; the copy itself is not made
   here); `host` is `v4compile.load(DIR, device="host")`, whose C runtime keeps the weights in host memory
   (its RSS is the weights plus a constant, by design).

On a shared machine the rates follow what the other processes do, the CPU seconds per GB much less: the report
gives both, and the rate the CPU seconds allow on this process's cores when they are idle (next to one core's
sha256 speed; a large tensor's 8 MiB pieces are hashed on every core). `bench/profile_writer.py` times the
writer's stages on each thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIZES = {  # name -> [(label, layers, experts, vocab)]
    "small": [("A", 2, 4, 8192), ("B", 6, 4, 8192)],
    # init-random writes at most 2 B parameters (cli.MAX_RANDOM_PARAMS): the 1.6 GB checkpoint (A, 3 layers,
    # 1.86 B) is the largest it makes, so the smaller one (S, 1 layer) gives the pair its factor (~1.8x).
    "issue": [("S", 1, 10, 32768), ("A", 3, 10, 32768)],
}

COMPILE = r'''
import json, os, resource, sys
from v4compile.cli import driver

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

stats = {}
real = driver.write_weights
def measured(*a, **kw):
    stats["peak_before"] = status("VmHWM")
    stats["rss_before"] = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again from here
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    out = real(*a, **kw)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    stats["cpu_weights"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)  # every thread
    stats["peak_weights"] = status("VmHWM")
    return out
driver.write_weights = measured
if os.environ.get("BENCH_PLACEHOLDER_KERNELS"):  # the kernels are not this bench's subject
    from v4compile.codegen import aot
    sys.path.insert(0, os.environ["BENCH_TESTS_DIR"])
    from fake_aot import placeholder_compile_calls
    aot.compile_calls = placeholder_compile_calls()
from v4compile.cli import main
rc = main(sys.argv[1:])
stats["peak_process"] = max(stats.get("peak_before", 0), status("VmHWM"))
print("BENCH " + json.dumps(stats), file=sys.stderr)
sys.exit(rc)
'''

LOAD = r'''
import json, os, resource, sys, time
import numpy as np

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

mode, path, verify = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
import torch
from v4compile.artifact import load_artifact
import v4compile.runtime  # noqa: F401  (imports settle before the baseline)
stats = {"rss_before": status("VmRSS")}
open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
r0 = resource.getrusage(resource.RUSAGE_SELF)
if mode == "stream":
    art = load_artifact(path, verify=verify, defer_weights=True)  # the manifest and the files other than weights
    t1 = time.perf_counter()
    w = art.weights()
    n = 0
    for name, off, buf, start, k in w.chunks():  # what a GPU upload hands the driver, chunk by chunk
        n += k
    w.close()
    stats["weights_s"] = time.perf_counter() - t1
else:
    from v4compile.runtime import load
    s = load(path, device="host", verify=verify)
    stats["weights_s"] = s.backend.weights_s
stats["load_s"] = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
stats["cpu"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
stats["peak"] = status("VmHWM")
print("BENCH " + json.dumps(stats), file=sys.stderr)
'''


def evict(paths) -> None:
    """Drop these files' pages from the page cache (so the next read comes from the disk)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cache(paths, block: int = 16 << 20) -> None:
    """Bring these files into the page cache (read them through it once)."""
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(block):
                pass


def compile_once(ck: Path, out: Path, env: dict) -> tuple[float, dict, str]:
    """`compile CKPT -o OUT` in a fresh process: its weight rate (bytes/s), its bench line and its weights line."""
    r = subprocess.run([sys.executable, "-c", COMPILE, "compile", str(ck), "-o", str(out), "--force",
                        "--target", "sm_90a", "--threads", "2"], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"compile failed:\n{r.stderr[-3000:]}")
    wline = next(ln for ln in r.stderr.splitlines() if " GB in " in ln and "weights:" in ln)
    return float(wline.split("(")[1].split(" MB/s")[0]) * 1e6, bench_line(r.stderr), wline


def disk_speed(d: Path, nbytes: int = 512 << 20, block: int = 16 << 20) -> tuple[float, float]:
    p = d / "disk-speed.bin"
    buf = os.urandom(block)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    for _ in range(nbytes // block):
        os.write(fd, buf)
    os.fdatasync(fd)
    w = nbytes / (time.perf_counter() - t0)
    os.close(fd)
    r = read_speed([p], block)
    p.unlink()
    return w, r


def copy_speed(srcs, d: Path, threads: int = 1, block: int = 8 << 20) -> float:
    """Bytes per second of the files `srcs` copied into one new file in `d` in whole blocks (a file's tail is
    left out), each block read then written by one of `threads` threads (with 2, one block's read overlaps
    another's write), O_DIRECT on both sides where the file system takes it (tmpfs does not: a plain read
    there), then `fdatasync`: a compile's reads and writes without its CPU work."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    dst = d / "disk-copy.bin"
    evict(srcs)
    fds, jobs = [], []
    wfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for p in srcs:
            try:
                fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
            except OSError:
                fds.append(os.open(p, os.O_RDONLY))
            jobs += [(fds[-1], pos) for pos in range(0, os.fstat(fds[-1]).st_size - block + 1, block)]
        bufs = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned (O_DIRECT)

        def copy(i: int) -> None:
            fd, pos = jobs[i]
            buf = bufs[i % threads]
            if os.preadv(fd, [buf], pos) != block:
                raise OSError(f"short read from {srcs}")
            os.pwrite(wfd, buf, i * block)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:  # block i on thread i % threads: each buffer on one thread
            for k in range(0, len(jobs), threads):
                list(ex.map(copy, range(k, min(len(jobs), k + threads))))
        os.fdatasync(wfd)
        dt = time.perf_counter() - t0
    finally:
        for fd in fds + [wfd]:
            os.close(fd)
        dst.unlink()
    return len(jobs) * block / dt


def read_speed(paths, block: int = 16 << 20) -> float:
    """The disk's read speed on these very files: plain sequential reads through the page cache after their
    pages are dropped, as `dd if=F of=/dev/null bs=16M`. On a virtual disk the host's own cache makes a file
    just written (step 2's) read faster than one written minutes before, and the speed drifts by tens of
    percent between minutes, so the load is compared with this, taken next to it, on the same bytes."""
    evict(paths)
    n, t0 = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while k := len(os.read(fd, block)):
                n += k
        finally:
            os.close(fd)
    return n / (time.perf_counter() - t0)


def sha256_speed(nbytes: int = 256 << 20) -> float:
    """sha256's bytes per CPU second on one core (CPU time: the other processes on the machine count less)."""
    import hashlib

    buf = os.urandom(16 << 20)
    h, t0 = hashlib.sha256(), time.process_time()
    for _ in range(nbytes // len(buf)):
        h.update(buf)
    return nbytes / (time.process_time() - t0)


def bench_line(stderr: str) -> dict:
    for line in stderr.splitlines()[::-1]:
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    sys.exit(f"no BENCH line:\n{stderr[-3000:]}")


def checkpoint(work: Path, label: str, layers: int, experts: int, vocab: int, hash_layers: int) -> Path:
    from v4compile.config import preset

    ck = work / f"ck{label}"
    if (ck / "config.json").exists():
        return ck
    c = preset("v4-flash")
    cfg = c.replace(n_layers=layers, n_experts=experts, n_active_experts=min(6, experts), vocab_size=vocab,
                    n_hash_layers=hash_layers, layer_kinds=c.layer_kinds[:layers])
    cj = work / f"flash{label}.json"
    cj.write_text(cfg.to_json())
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "v4compile", "-q", "init-random", "--config", str(cj), "--quantized",
                    "-o", str(ck), "--force"], check=True)
    print(f"checkpoint {label}: {layers} layers, {experts} experts, vocab {vocab}: written in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return ck


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--workdir", default="/tmp/bench_weights")
    ap.add_argument("--checkpoints", default=None, help="where the checkpoints are made and kept (default: --workdir)")
    ap.add_argument("--kernels", choices=("placeholder", "real"), default="placeholder")
    ap.add_argument("--load", choices=("stream", "host"), default="stream")
    ap.add_argument("--loads", type=int, default=3, help="hashed loads per checkpoint (the median is reported)")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts (the checkpoints are always kept)")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    # V4-Flash's first 3 layers route by hash
    ckdir = Path(args.checkpoints or work)
    ckdir.mkdir(parents=True, exist_ok=True)
    cks = [(label, checkpoint(ckdir, label, *dims, min(3, dims[0]))) for label, *dims in SIZES[args.size]]
    rows = []
    for label, ck in cks:
        speeds = [disk_speed(work) for _ in range(3)]  # a virtual disk's speed drifts: the median of three
        wdisk, rdisk = sorted(speeds)[1]
        wdisk_runs = [w for w, _ in speeds]
        files = sorted(ck.glob("*.safetensors"))
        copies = {n: sorted(copy_speed(files, work, n) for _ in range(3)) for n in (1, 2)}  # the faster's median
        out = work / f"art{label}"
        placeholder = {"BENCH_PLACEHOLDER_KERNELS": "1", "BENCH_TESTS_DIR": str(Path(__file__).resolve().parents[1] / "tests")}
        env = {**os.environ, **(placeholder if args.kernels == "placeholder" else {})}
        # the checkpoint in the page cache (just downloaded, or compiled before): read through it
        cache(files)
        wrate_cached, _, wline_cached = compile_once(ck, out, env)
        evict(files)  # cold: read from the disk, which the artifact's writes share
        wrate, c, wline = compile_once(ck, out, env)
        m = json.loads((out / "manifest.json").read_text())
        shards = [out / s for s in m["weights"]["shards"]]
        nbytes = sum(p.stat().st_size for p in shards)
        import math
        largest = max(math.prod(t["shape"]) * (1 if t["dtype"] in ("fp8e4m3", "fp4x2", "e8m0") else
                                              2 if t["dtype"] == "bf16" else 4 if t["dtype"] == "fp32" else 8)
                      for t in m["weights"]["tensors"].values())
        loads, hashed, dd = {}, [], []
        for i, verify in enumerate(["1"] * args.loads + ["0"]):  # hashed against the manifest as read, and not
            if i % 2 == 0:  # the disk's speed on the same shards, before and after the loads in turn
                dd.append(read_speed(shards))
            evict(shards)
            r = subprocess.run([sys.executable, "-c", LOAD, args.load, str(out), verify], capture_output=True,
                               text=True)
            if r.returncode:
                sys.exit(f"load failed:\n{r.stderr[-3000:]}")
            loads[verify] = bench_line(r.stderr)
            if verify == "1":
                hashed.append(loads["1"])
            if i % 2 == 1:
                dd.append(read_speed(shards))
        ld = sorted(hashed, key=lambda x: x["weights_s"])[len(hashed) // 2]  # the median run
        rdisk_fresh, rdisk = rdisk, sorted(dd)[len(dd) // 2]
        rows.append({"label": label, "ckpt_gb": sum(p.stat().st_size for p in ck.glob("*.safetensors")) / 1e9,
                     "weights_gb": nbytes / 1e9, "largest_mb": largest / 1e6,
                     "disk_w": wdisk / 1e6, "disk_w_runs": [x / 1e6 for x in wdisk_runs],
                     "disk_copy": max(c[1] for c in copies.values()) / 1e6,
                     "disk_copy_runs": {n: [x / 1e6 for x in c]
                                        for n, c in copies.items()}, "disk_r": rdisk / 1e6, "disk_r_runs": [x / 1e6 for x in dd],
                     "disk_r_fresh": rdisk_fresh / 1e6, "write": wrate / 1e6, "write_cached": wrate_cached / 1e6,
                     "read": nbytes / ld["weights_s"] / 1e6, "read_nohash": nbytes / loads["0"]["weights_s"] / 1e6,
                     "read_runs": [nbytes / x["weights_s"] / 1e6 for x in hashed],
                     "fixed_s": ld["load_s"] - ld["weights_s"], "read_whole": nbytes / ld["load_s"] / 1e6,
                     "c_cpu_gb": c["cpu_weights"] / (nbytes / 1e9), "l_cpu_gb": ld["cpu"] / (nbytes / 1e9),
                     "l_cpu_gb_nohash": loads["0"]["cpu"] / (nbytes / 1e9),
                     "c_base": c["rss_before"] / 1e6, "c_peak": c["peak_weights"] / 1e6,
                     "c_proc": c["peak_process"] / 1e6, "l_base": ld["rss_before"] / 1e6, "l_peak": ld["peak"] / 1e6,
                     "line": wline.split("info: ")[-1], "line_cached": wline_cached.split("info: ")[-1]})
        print(json.dumps(rows[-1]), flush=True)
        if not args.keep:
            import shutil
            shutil.rmtree(out)
    report(rows, args.load, args.kernels)


def report(rows: list[dict], load: str, kernels: str) -> None:
    print(f"\nload: {load}; kernels: {kernels}; MB = 1e6 bytes; RSS in MB")
    print("| ckpt | ckpt GB | weights GB | largest MB | disk write | disk copy (ckpt -> disk) | compile write, ckpt "
          "on the disk (% disk write / % disk copy) | compile write, ckpt in the page cache (% disk write) | disk read "
          "| load read (% disk) | compile RSS base -> weights peak (+) | compile process peak | load RSS base -> peak (+) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in rows:
        print(f"| {w['label']} | {w['ckpt_gb']:.2f} | {w['weights_gb']:.2f} | {w['largest_mb']:.0f} | "
              f"{w['disk_w']:.0f} MB/s | {w['disk_copy']:.0f} MB/s | {w['write']:.0f} MB/s "
              f"({100 * w['write'] / w['disk_w']:.0f} % / {100 * w['write'] / w['disk_copy']:.0f} %) | "
              f"{w['write_cached']:.0f} MB/s ({100 * w['write_cached'] / w['disk_w']:.0f} %) | "
              f"{w['disk_r']:.0f} MB/s | {w['read']:.0f} MB/s ({100 * w['read'] / w['disk_r']:.0f} %) | "
              f"{w['c_base']:.0f} -> {w['c_peak']:.0f} (+{w['c_peak'] - w['c_base']:.0f}) | {w['c_proc']:.0f} | "
              f"{w['l_base']:.0f} -> {w['l_peak']:.0f} (+{w['l_peak'] - w['l_base']:.0f}) |")
    print("\n| ckpt | load read hashed, every run (% disk) | load fixed s (manifest, other files) / whole load "
          "(% disk) | load read, not hashed (% disk) | CPU s per GB: compile weights / load hashed / load not hashed |")
    print("|---|---|---|---|---|")
    for w in rows:
        runs = ", ".join(f"{r:.0f} ({100 * r / w['disk_r']:.0f} %)" for r in w["read_runs"])
        print(f"| {w['label']} | {runs} | {w['fixed_s']:.3f} s / {w['read_whole']:.0f} MB/s "
              f"({100 * w['read_whole'] / w['disk_r']:.0f} %) | "
              f"{w['read_nohash']:.0f} MB/s ({100 * w['read_nohash'] / w['disk_r']:.0f} %) | "
              f"{w['c_cpu_gb']:.2f} / {w['l_cpu_gb']:.2f} / {w['l_cpu_gb_nohash']:.2f} |")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: on a busy machine the CPU seconds, not "
          f"the rates, are what carries over)")
    for w in rows:
        print(f"{w['label']}: disk write = the median of " + ", ".join(f"{r:.0f}" for r in w["disk_w_runs"]) + " MB/s")
        print(f"{w['label']}: disk copy (the checkpoint's files, O_DIRECT both sides) = the larger median: "
              + "; ".join(f"{n} thread{'s' * (int(n) > 1)}: " + ", ".join(f"{r:.0f}" for r in runs)
                          for n, runs in w["disk_copy_runs"].items()) + " MB/s")
        print(f"{w['label']}: disk read = the shards read as dd bs=16M next to the loads, median of "
              + ", ".join(f"{r:.0f}" for r in w["disk_r_runs"]) + f" MB/s (a fresh 512 MiB file: {w['disk_r_fresh']:.0f} MB/s)")
        print(f"{w['label']}: {w['line']}")
        print(f"{w['label']}: checkpoint in the page cache: {w['line_cached']}")
    a, b = rows[0], rows[-1]
    print(f"\npeak RSS, larger / smaller checkpoint: compile weights {b['c_peak'] / a['c_peak']:.2f}, load "
          f"{b['l_peak'] / a['l_peak']:.2f} (goal: within 15 %); bound 2 x largest tensor + baseline: compile "
          + " / ".join(f"{w['c_peak']:.0f} <= {w['c_base'] + 2 * w['largest_mb']:.0f}" for w in rows) + ", load "
          + " / ".join(f"{w['l_peak']:.0f} <= {w['l_base'] + 2 * w['largest_mb']:.0f}" for w in rows))
    print("\nExtrapolation from the larger checkpoint (the weights taken as the checkpoint's size; memory does not "
          "grow with it). Cores to keep up with the disk = CPU s per GB x the disk's GB/s.")
    print("| model | size | compile: weights at the measured rate / at the disk's | load hashed: measured / disk's |")
    print("|---|---|---|---|")
    for name, size in (("V4-Pro", 805 * 2 ** 30), ("V4-Flash", 160e9)):
        print(f"| {name} | {size / 1e9:.0f} GB | {size / b['write'] / 6e7:.0f} min / {size / b['disk_w'] / 6e7:.0f} min | "
              f"{size / b['read'] / 6e7:.1f} min / {size / b['disk_r'] / 6e7:.1f} min |")
    print(f"cores to keep up with the disk: writing {b['c_cpu_gb'] * b['disk_w'] / 1e3:.1f}, loading hashed "
          f"{b['l_cpu_gb'] * b['disk_r'] / 1e3:.1f}")
    cores = len(os.sched_getaffinity(0))
    print(f"\nOn a shared machine the rates follow the other processes; the CPU s per GB do much less. The rates "
          f"they allow on {cores} idle cores (an upper bound; one core's sha256: "
          f"{sha256_speed() / 1e9:.2f} GB/s per CPU second here):")
    for w in rows:
        print(f"{w['label']}: compile {cores / w['c_cpu_gb']:.2f} GB/s ({100e3 * cores / w['c_cpu_gb'] / w['disk_w']:.0f} % "
              f"of the disk's write), load hashed {cores / w['l_cpu_gb']:.2f} GB/s "
              f"({100e3 * cores / w['l_cpu_gb'] / w['disk_r']:.0f} % of its read)")


if __name__ == "__main__":
    main()
