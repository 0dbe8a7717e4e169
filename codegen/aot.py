"""Ahead-of-time compilation of KernelCalls for gfx950 (MI355X) and sm_90a (H200) on a CPU-only host.

    compile_calls(calls, targets, out_dir, jobs) -> report rows

For each (call, target): `triton.compile(ASTSource(...), target=GPUTarget(...))` in a spawned worker
process (the parent may run kernels under TRITON_INTERPRET=1, whose `@triton.jit` objects cannot be
compiled; workers import the kernel modules with the interpreter off). Results are cached under
`$V4COMPILE_CACHE` (default ~/.cache/v4compile)/aot/<key>/ where key hashes the kernel module's source,
the specialisation (constexprs, pointer types, alignment, warps, stages), the target and the Triton
version: what the binary depends on, not the launch (name, grid, the operands bound), so calls differing only
there compile once, each with its own sidecar (`call_sidecar`: the entry's binary part and its launch's); an
unchanged rerun only copies files. The cache is not trusted: each entry records the sha256 of
its files (`digest.json`, written last, in a temporary directory renamed into place) and is used only if
they match; an entry that does not (a flipped byte, a truncated or missing file) is removed and compiled
again, and the artifact receives exactly the bytes that were checked.

Written per kernel into `out_dir/<target>/`: the binary (`<name>.hsaco` / `<name>.cubin`) and
`<name>.json`, the sidecar with all a launcher needs that the binary does not hold (symbol, parameter
list with Triton's two trailing scratch pointers, dynamic shared memory, warps, grid, specialisation).
Every file is a pure function of its inputs (sorted JSON, no times or paths), so output is
byte-reproducible. Report rows: name, target, regs, spills, shared_bytes, mma_instructions, occupancy,
and the roofline model's flops, bytes and modeled_us (`roofline.modeled_time`; target figures: `v4compile/targets.py`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import io
import json
import logging
import queue
import sys
import threading
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..targets import TARGETS, cache_root
from ..threads import usable_cores
from .kernels.call import KernelCall
from .kernels.flags import CALLS_PARAM, PDL_PARAM, declares_calls, declares_pdl, uses_calls, uses_pdl
from .roofline import bandwidth_time, hbm_bytes, launch_kind, modeled_time

log = logging.getLogger(__name__)


# Bump when what a cache entry holds (binary, sidecar, stats) changes (5: PDL; 6: keyed on the binary's inputs
# alone, the entry's sidecar the binary's part of it).
AOT_FORMAT = 6
# What a binary depends on: a job's launch (pointers bound, grid, scratch carved, name) does not, so calls that
# differ only there (one binary for the hash-routed and the learned layers' MoE, `moe_router.py`) compile once.
BINARY_INPUTS = ("module", "fn", "target", "signature", "constexprs", "aligned", "num_warps", "num_stages")


# ---- job description (plain data, sent to workers) -------------------------------------------------------

def _ce_encode(v: Any) -> Any:
    import triton.language as tl
    if isinstance(v, tl.dtype):
        return {"tl_dtype": v.name}
    if isinstance(v, tl.constexpr):
        return _ce_encode(v.value)
    if isinstance(v, (list, tuple)):
        return [_ce_encode(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"constexpr value {v!r} cannot be recorded")


def _ce_decode(v: Any) -> Any:
    import triton.language as tl
    if isinstance(v, dict) and "tl_dtype" in v:
        return getattr(tl, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8e4nv": "float8e4nv",
                            "fp8e5": "float8e5", "u8": "uint8", "i8": "int8", "i32": "int32", "i64": "int64",
                            "i1": "int1"}.get(v["tl_dtype"], v["tl_dtype"]))
    if isinstance(v, list):
        return tuple(_ce_decode(x) for x in v)
    return v


@functools.lru_cache(maxsize=None)
def _module_source(module: str) -> str:
    """The kernel's module source plus every module of its package (kernels call @triton.jit helpers from
    sibling modules, e.g. moe uses gemm.mma_step; hashing the package keeps the cache from going stale)."""
    mod = importlib.import_module(module)
    parts = [inspect.getsource(mod)]
    pkg = Path(mod.__file__).parent
    for f in sorted(pkg.glob("*.py")):
        parts.append(f"{f.name}\n{f.read_text()}")
    return "\n".join(parts)


def job_of(call: KernelCall, target: str) -> dict:
    fn = call.fn
    py = getattr(fn, "fn", fn)
    module, qual = py.__module__, py.__qualname__
    sig = call.signature()
    num_warps, num_stages, constexprs = call.for_target(target)
    if declares_pdl(fn):  # the kernel's launches overlap on a target with PDL (kernels/pdl.py)
        constexprs[PDL_PARAM] = uses_pdl(fn, target)
    if declares_calls(fn):  # noinline calls where the target takes them (kernels/flags.py)
        constexprs[CALLS_PARAM] = uses_calls(target)
    job = {
        "name": call.name, "module": module, "fn": qual, "target": target, "signature": sig,
        "constexprs": {k: _ce_encode(v) for k, v in sorted(constexprs.items())},
        "aligned": [a for a, t in sig.items() if t.startswith("*") and a not in call.unaligned],
        "num_warps": num_warps, "num_stages": num_stages,
        "pointers": [list(p) for p in call.pointers], "grid": list(call.grid),
        "scratch_bytes": dict(sorted(call.scratch_bytes.items())),
    }
    import triton
    blob = json.dumps({k: job[k] for k in BINARY_INPUTS}, sort_keys=True)
    src = _module_source(module)
    job["key"] = hashlib.sha256(f"{AOT_FORMAT}\n{triton.__version__}\n{blob}\n{src}".encode()).hexdigest()[:32]
    return job


# ---- worker ---------------------------------------------------------------------------------------------

def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    # Our cache is the cache: a hit in Triton's own would skip ptxas and lose its register / spill log.
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    # Line info embeds the absolute paths of the kernel sources and of Triton's install in the binary: the
    # bytes would depend on where the checkout lies, and a cache warmed from another checkout would give an
    # artifact that a cold compile does not reproduce.
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    os.environ["TRITON_CACHE_DIR"] = str(cache_root() / "triton")  # scratch only (always compiling)


def _compile_job(job: dict, cache_dir: str) -> dict:
    """Compile one job into cache_dir/<key>/ (binary, sidecar, stats); returns the stats."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    spec = TARGETS[job["target"]]
    mod = importlib.import_module(job["module"])
    fn = getattr(mod, job["fn"])
    constexprs = {k: _ce_decode(v) for k, v in job["constexprs"].items()}
    names = list(job["signature"])
    if names != list(fn.arg_names):  # the sidecar's parameter order below is the compiled kernel's
        from ..errors import CodegenError
        raise CodegenError(f"the signature of {job['fn']} does not list its parameters in declared order",
                           where=job["name"], expected=", ".join(fn.arg_names), found=", ".join(names))
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in job["aligned"]}
    src = triton.compiler.ASTSource(fn=fn, signature=job["signature"], constexprs=constexprs, attrs=attrs)
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    ptxas_log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = spec.backend == "cuda"
    with contextlib.redirect_stdout(ptxas_log):
        c = triton.compile(src, target=GPUTarget(spec.backend, spec.arch, spec.warp_size),
                           options={"num_warps": job["num_warps"], "num_stages": job["num_stages"]})
    compile_s = time.perf_counter() - t0
    md = c.metadata
    binary = c.asm["hsaco"] if spec.backend == "hip" else c.asm["cubin"]
    stats = (_amd_stats(c.asm["amdgcn"], md.shared, job["num_warps"]) if spec.backend == "hip"
             else _nv_stats(binary, c.asm["ptx"], ptxas_log.getvalue(), md.shared, job["num_warps"]))
    cpu_s = _cpu_seconds() - cpu0  # compile + stats (ptxas, nvdisasm included): the job's whole CPU cost
    pdl = bool(constexprs.get(PDL_PARAM, False))
    stats["gdc_waits"] = len(re.findall(r"^\s*griddepcontrol\.wait", c.asm.get("ptx", ""), re.M))
    if pdl and not stats["gdc_waits"]:  # launched with the attribute, it would run before its inputs exist
        from ..errors import CodegenError
        raise CodegenError(f"{job['fn']} is to launch with PDL but its PTX holds no griddepcontrol.wait",
                           where=job["name"])
    # AMDGPU's implicit kernel arguments (hidden_*: a call, some library routines): HIP fills them itself at a
    # launch, behind the explicit parameters; recorded, since the fake HIP driver sizes parameters from the
    # kernarg segment and would refuse such a launch (kernels/flags.py: CALLS_PARAM).
    stats["hidden_args"] = len(set(re.findall(r"\.value_kind:\s+(hidden_\w+)", c.asm.get("amdgcn", ""))))
    sidecar = {  # the binary's part of a call's sidecar (`call_sidecar` adds the launch's)
        "symbol": md.name, "target": job["target"], "binary_sha256": hashlib.sha256(binary).hexdigest(),
        "shared_bytes": int(md.shared), "num_warps": int(md.num_warps), "warp_size": spec.warp_size,
        "num_stages": job["num_stages"], "constexprs": job["constexprs"], "aligned_16": job["aligned"],
        "kernel": f"{job['module']}.{job['fn']}", "triton_version": triton.__version__, "key": job["key"],
        "pdl": pdl,  # launch with programmatic stream serialization (kernels/pdl.py)
        "scratch": [{"name": n, "type": "*u8", "kind": "triton_scratch", "size_per_program": int(size),
                     "align": int(align)}
                    for n, size, align in (("global_scratch", md.global_scratch_size,
                                            getattr(md, "global_scratch_align", 1)),
                                           ("profile_scratch", md.profile_scratch_size,
                                            getattr(md, "profile_scratch_align", 1)))],
    }
    files = {"binary": binary,
             "sidecar.json": (json.dumps(sidecar, indent=1, sort_keys=True) + "\n").encode(),
             "stats.json": json.dumps({**stats, "compile_s": round(compile_s, 3), "cpu_s": round(cpu_s, 3)},
                                      sort_keys=True).encode()}
    out = Path(cache_dir) / job["key"]
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp-"))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / DIGEST).write_text(json.dumps({n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
                                             sort_keys=True))
        discard_entry(out)  # a damaged entry of the same key (the caller holds the key's lock)
        tmp.rename(out)
    except OSError:  # another process finished the same key first
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


# ---- the cache: entries verified before use --------------------------------------------------------------

DIGEST = "digest.json"
ENTRY_FILES = ("binary", "sidecar.json", "stats.json")


def call_sidecar(job: dict, binary: dict) -> bytes:
    """A call's sidecar: its binary's part (the cache entry's) and its launch's: name, parameters with the
    operands they bind (then Triton's two trailing scratch pointers), grid, scratch."""
    spec = TARGETS[job["target"]]
    roles = {p[0]: p for p in job["pointers"]}
    params = [{"name": p, "type": t, "kind": roles[p][1], "value": roles[p][2]}
              for p, t in job["signature"].items() if t != "constexpr"]
    side = {k: v for k, v in binary.items() if k != "scratch"}
    side.update(name=job["name"], binary=f"{job['name']}.{spec.binary_ext}", params=params + binary["scratch"],
                block=[binary["num_warps"] * spec.warp_size, 1, 1], grid=job["grid"],
                scratch_bytes=job["scratch_bytes"])
    return (json.dumps(side, indent=1, sort_keys=True) + "\n").encode()


def read_entry(d: Path) -> dict[str, bytes] | None:
    """A cache entry's files, if every one matches the sha256 recorded when it was written; else None."""
    try:
        digest = json.loads((d / DIGEST).read_text())
        files = {n: (d / n).read_bytes() for n in ENTRY_FILES}
    except (OSError, ValueError):
        return None
    if not isinstance(digest, dict) or any(digest.get(n) != hashlib.sha256(b).hexdigest() for n, b in files.items()):
        return None
    return files


def discard_entry(d: Path) -> None:
    """Remove a (damaged) entry: renamed aside first, so no reader sees it half-removed."""
    if not d.exists():
        return
    aside = d.with_name(f".bad-{d.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        d.rename(aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (ptxas, nvdisasm)."""
    import resource
    me, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + ch.ru_utime + ch.ru_stime


def _strip_comments(asm: str) -> list[str]:
    return [ln.split(";")[0].strip() for ln in asm.splitlines() if ln.split(";")[0].strip()]


def _amd_stats(amdgcn: str, shared: int, num_warps: int) -> dict:
    def meta(key: str) -> int:
        m = re.search(rf"^\s*\.{key}:\s*(\d+)", amdgcn, re.M)
        return int(m.group(1)) if m else 0
    code = _strip_comments(amdgcn)
    mma = sum(1 for ln in code if re.match(r"v_mfma\w*", ln))
    m = re.search(r";\s*Occupancy:\s*(\d+)", amdgcn)
    reg_occ = int(m.group(1)) if m else 0
    # The Occupancy comment counts registers only; dynamic LDS also limits waves per SIMD (160 KB per CU,
    # a workgroup of num_warps waves spreads over the CU's 4 SIMDs).
    lds_occ = (TARGETS["gfx950"].lds_bytes // shared) * num_warps // 4 if shared else reg_occ
    return {"regs": meta("vgpr_count"), "agprs": meta("agpr_count"), "sgprs": meta("sgpr_count"),
            "spills": meta("vgpr_spill_count") + meta("sgpr_spill_count"), "mma_instructions": mma,
            "occupancy": max(0, min(reg_occ, lds_occ)), "occupancy_unit": "waves/SIMD"}


def _nv_stats(cubin: bytes, ptx: str, ptxas_log: str, shared: int, num_warps: int) -> dict:
    m = re.search(r"Used (\d+) registers", ptxas_log)
    regs = int(m.group(1)) if m else 0
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))
    # The count is of the SASS (ptxas drops dead matrix instructions: the PTX of V4-Pro's one-launch MoE holds
    # 324, its cubin 276), read from the cubin's code itself; nvdisasm (~0.6 CPU s a kernel, ~15 s over V4-Pro's
    # sm_90a kernels) only where the cubin cannot be decoded. ptxas never turns scalar code into MMA, so a PTX
    # without a matrix instruction anywhere (predicated too) asks neither.
    has_mma = re.search(r"\b(?:wgmma\.mma_async|mma\.sync)", ptx) is not None
    if not has_mma:
        mma, source = 0, "ptx"
    elif (decoded := sass_mma_count(cubin)) is not None:
        mma, source = decoded, "sass"
    elif (sass := _nvdisasm(cubin)) is not None:
        mma = len(SASS_MMA.findall(sass))
        source = "sass"
    else:
        mma = len(re.findall(r"^\s*(?:wgmma\.mma_async|mma\.sync)", ptx, re.M))
        source = "ptx"
    # CTAs per SM from registers (64K per SM, allocated per warp in units of 256), smem (+1 KB reserve),
    # the 64-warp and 32-CTA limits.
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_smem = TARGETS["sm_90a"].lds_bytes // (shared + 1024)
    occ = max(0, min(by_regs, by_smem, 64 // num_warps, 32))
    return {"regs": regs, "spills": spills, "mma_instructions": mma, "mma_source": source, "occupancy": occ,
            "occupancy_unit": "CTAs/SM"}


# sm_90's matrix instructions by opcode, the low 9 bits of an instruction's first 64-bit word (every sm_90
# instruction is 128 bits; the next 3 bits say where operands come from, e.g. HGMMA with A in registers or in
# shared memory): HMMA 0x03c, IMMA 0x037 (mma.sync), HGMMA 0x1f0, IGMMA 0x1f1, QGMMA 0x1f3 (wgmma). Read off
# `nvdisasm -c -hex` of V4-Pro's kernels and of bf16 / fp16 / fp8 / int8 dots; no other opcode of those kernels
# shares these bits (tests/kernels/test_aot_schedule.py checks the count against nvdisasm where it is installed).
SM90_MMA_OPCODES = frozenset({0x03C, 0x037, 0x1F0, 0x1F1, 0x1F3})
SASS_MMA = re.compile(r"\b(?:HGMMA|QGMMA|IGMMA|HMMA|IMMA)\.")  # the same instructions in nvdisasm's text


def sass_mma_count(cubin: bytes) -> int | None:
    """Matrix instructions in the code sections (`.text.*`: the kernel and any function it calls) of an sm_90
    cubin, or None where it is no 64-bit little-endian ELF with whole 128-bit instructions."""
    try:
        if cubin[:6] != b"\x7fELF\x02\x01":
            return None
        shoff, = struct.unpack_from("<Q", cubin, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        names_at = heads[shstrndx][4]
        n = 0
        for name, _type, _flags, _addr, off, size in heads:
            end = cubin.index(b"\0", names_at + name)
            if not cubin[names_at + name:end].startswith(b".text."):
                continue
            if size % 16:
                return None
            n += sum(1 for (w,) in struct.iter_unpack("<Q8x", cubin[off:off + size]) if w & 0x1FF in SM90_MMA_OPCODES)
        return n
    except (struct.error, ValueError, IndexError):
        return None


def _nvdisasm(cubin: bytes) -> str | None:
    from triton import knobs
    try:
        tool = knobs.nvidia.nvdisasm.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            r = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=120)
        return r.stdout if r.returncode == 0 else None
    except Exception as e:  # noqa: BLE001  (a missing tool falls back to counting PTX)
        log.warning("nvdisasm failed (%s); counting MMA instructions in PTX", e)
        return None


@functools.lru_cache(maxsize=None)
def _source_size(module: str, qual: str) -> int:
    """Characters of a kernel's source and of the @triton.jit helpers it calls (transitively): a cheap static
    stand-in for its compile time (the big fused kernels are the long ones)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    seen: set[int] = set()

    def size(fn) -> int:
        py = getattr(fn, "fn", fn)
        if id(py) in seen:
            return 0
        seen.add(id(py))
        n = len(inspect.getsource(py))
        for name in py.__code__.co_names:
            g = py.__globals__.get(name)
            if isinstance(g, (JITFunction, InterpretedFunction)):  # the latter under TRITON_INTERPRET=1
                n += size(g)
        return n
    return size(getattr(importlib.import_module(module), qual))


def longest_first(jobs: list[dict]) -> list[dict]:
    """Jobs by estimated compile time, longest first, so the workers finish together (greedy LPT order)."""
    return sorted(jobs, key=lambda j: -_source_size(j["module"], j["fn"]) * TARGETS[j["target"]].aot_cost)


def _run_workers(jobs: list[dict], cache_dir: str, n: int) -> None:
    """n persistent worker processes (`python -m v4compile.codegen.aot --worker`), fed one job at a time
    over stdin (JSON lines) by one thread each, so slow kernels do not hold up a static partition."""
    q: queue.Queue = queue.Queue()
    for j in longest_first(jobs):
        q.put(j)
    errors: list[str] = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = [0]
    lock = threading.Lock()
    t0, last = [time.perf_counter()], [time.perf_counter()]

    def progress() -> None:  # a line at most every 10 s: a cold compile of a large model takes minutes
        with lock:
            done[0] += 1
            now = time.perf_counter()
            if now - last[0] >= 10 or done[0] == len(jobs):
                last[0] = now
                log.info("aot: %d of %d kernels compiled (%.0f s)", done[0], len(jobs), now - t0[0])

    def feed() -> None:
        p = subprocess.Popen([sys.executable, "-m", "v4compile.codegen.aot", "--worker", cache_dir], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while not errors:
                try:
                    j = q.get_nowait()
                except queue.Empty:
                    break
                p.stdin.write(json.dumps(j) + "\n")
                p.stdin.flush()
                line = p.stdout.readline()
                if not line:
                    errors.append(f"{j['name']} ({j['target']}): worker died: {p.stderr.read()[-4000:]}")
                    break
                r = json.loads(line)
                if "error" in r:
                    errors.append(f"{j['name']} ({j['target']}): {r['error']}")
                else:
                    progress()
        finally:
            with contextlib.suppress(Exception):
                p.stdin.close()
            p.wait()

    threads = [threading.Thread(target=feed, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        from ..errors import CodegenError

        raise CodegenError("ahead-of-time kernel compile failed: " + "; ".join(errors[:3]))


def _worker_main(cache_dir: str) -> None:
    _worker_init()
    import fcntl

    for line in sys.stdin:
        job = json.loads(line)
        try:
            # Two compiles sharing the cache (e.g. parallel test workers) wait for each other's result
            # instead of compiling the same kernel twice.
            with open(Path(cache_dir) / f".{job['key']}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if read_entry(Path(cache_dir) / job["key"]) is None:
                    with contextlib.redirect_stdout(sys.stderr):
                        _compile_job(job, cache_dir)
            out = {"ok": job["key"]}
        except Exception as e:  # noqa: BLE001  (reported to the parent with the kernel's name)
            out = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    # Every reply is flushed and every entry renamed into place: skip the interpreter's teardown of Triton's
    # and LLVM's state (1.1-1.5 s a worker on loaded cores, 0.04 s this way), which the parent waits for at
    # the end of every cold compile.
    sys.stderr.flush()
    os._exit(0)


# ---- driver ---------------------------------------------------------------------------------------------

def compile_calls(calls: list[KernelCall], targets: list[str] | tuple[str, ...], out_dir: str | os.PathLike,
                  jobs: int | None = None) -> list[dict]:
    """Compile every call for every target; write binaries + sidecars to out_dir/<target>/; return the
    static report rows (one per call and target, in call order then target order)."""
    from ..errors import InputError
    for t in targets:
        if t not in TARGETS:
            raise InputError("unknown target", where="--target", expected=", ".join(TARGETS), found=t)
    todo: list[tuple[KernelCall, dict]] = []
    seen: dict[tuple[str, str], dict] = {}
    for c in calls:
        for t in targets:
            j = job_of(c, t)
            if (c.name, t) in seen:  # (one name, one sidecar: the same binary bound the same way)
                if seen[(c.name, t)] != j:
                    raise ValueError(f"two different specialisations share the name {c.name}")
                continue
            seen[(c.name, t)] = j
            todo.append((c, j))
    cache = cache_root() / "aot"
    cache.mkdir(parents=True, exist_ok=True)
    missing = list({j["key"]: j for _, j in todo if read_entry(cache / j["key"]) is None}.values())
    damaged = [j["key"] for j in missing if (cache / j["key"]).exists()]
    if damaged:
        log.warning("aot: %d cache entries do not match their recorded hashes: compiling them again", len(damaged))
    fresh = {j["key"] for j in missing}
    t0 = time.perf_counter()
    if missing:
        _run_workers(missing, str(cache), max(1, min(jobs or usable_cores(), len(missing))))
    log.info("aot: %d kernels x targets, %d compiled in %.1f s, %d cached", len(todo), len(missing),
             time.perf_counter() - t0, len(todo) - len(missing))
    out = Path(out_dir)
    rows = []
    for c, j in todo:
        entry = read_entry(cache / j["key"])
        if entry is None:  # compiled just now, yet not intact: the cache directory is being damaged under us
            from ..errors import CodegenError

            raise CodegenError(f"the kernel cache entry of {c.name} ({j['target']}) does not verify after compiling",
                               where=str(cache / j["key"]))
        tdir = out / j["target"]
        tdir.mkdir(parents=True, exist_ok=True)
        sidecar = call_sidecar(j, json.loads(entry["sidecar.json"]))
        side = json.loads(sidecar)
        binary_name = f"{c.name}.{TARGETS[j['target']].binary_ext}"  # never a name read from the cache
        (tdir / binary_name).write_bytes(entry["binary"])  # the bytes that were checked, not a second read
        (tdir / f"{c.name}.json").write_bytes(sidecar)
        st = json.loads(entry["stats.json"])
        mma_dtype = getattr(c, "mma_dtype", "bf16")
        rows.append({
            "name": c.name, "target": j["target"], "regs": st["regs"], "spills": int(st["spills"]),
            "shared_bytes": side["shared_bytes"], "mma_instructions": st["mma_instructions"],
            "occupancy": st["occupancy"], "occupancy_unit": st["occupancy_unit"], "num_warps": side["num_warps"],
            "grid": side["grid"], "flops": c.flops, "bytes": hbm_bytes(c, j["target"]), "mma_dtype": mma_dtype,
            "modeled_us": round(modeled_time(c.flops, hbm_bytes(c, j["target"]), j["target"], mma_dtype,
                                             launch_kind(bool(side.get("pdl")))) * 1e6, 3),
            "pdl": bool(side.get("pdl")), "gdc_waits": int(st.get("gdc_waits", 0)),
            "hidden_args": int(st.get("hidden_args", 0)),
            "bandwidth_us": round(bandwidth_time(hbm_bytes(c, j["target"]), j["target"]) * 1e6, 3),
            "compile_s": st.get("compile_s"), "cached": j["key"] not in fresh,
            "path": f"{j['target']}/{binary_name}", "sidecar": f"{j['target']}/{c.name}.json",
        })
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2])
    else:
        sys.exit("usage: python -m v4compile.codegen.aot --worker CACHE_DIR")
