"""Build the C runtime (runtime/c) with the machine's C compiler, cached by source hash.

The library goes to `$V4COMPILE_CACHE/runtime/<hash>/libv4rt.so` (default `~/.cache/v4compile`); the hash
covers every source file, the compiler command and the flags, so an edit or another compiler rebuilds it.
The cache is not trusted: the library's sha256 is recorded next to it (`libv4rt.so.sha256`) when it is
built and checked before every use, and a library that does not match (truncated, flipped, missing its
record) is rebuilt, never loaded (dlopen of a truncated library dies of SIGBUS). Building is atomic (a
temporary file renamed into place), so concurrent first uses are safe, and the compiler runs in its own
process group with its temporary files in a private directory of the cache, removed when the build ends,
is interrupted, or (after a kill) by the next build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from v4compile.errors import DeviceError
from v4compile.files import sha256_file
from v4compile.targets import cache_root

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "c"
SOURCES = ("v4rt.c", "drv_host.c", "drv_gpu.c", "drv_hip.c", "drv_cuda.c", "drv_nccl.c")
CFLAGS = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared")
ASAN_FLAGS = ("-g", "-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer")


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def compile_shared(sources: list[Path], out: Path, flags: tuple[str, ...] = CFLAGS, libs: tuple[str, ...] = ("-ldl",),
                   include: Path = SOURCE_DIR) -> None:
    """Compile `sources` into `out` with the compiler's temporary files in a private directory next to `out`
    (removed whatever happens); on an interruption the compiler's whole process group is killed first."""
    cmd = compiler() + list(flags) + ["-I", str(include), "-o", str(out)] + [str(s) for s in sources] + list(libs)
    scratch = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=Path(out).parent))
    try:
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "TMPDIR": str(scratch)}, start_new_session=True)
        except OSError as e:
            raise DeviceError(f"cannot run the C compiler: {e}", where=" ".join(cmd[:1])) from None
        try:
            out_text, err_text = p.communicate(timeout=300)
        except BaseException as e:  # a timeout, Ctrl-C, SIGTERM: no compiler process outlives the build
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise DeviceError("the C compiler timed out", where=" ".join(cmd[:1])) from None
            raise
        if p.returncode:
            raise DeviceError("the C runtime failed to compile", where=" ".join(cmd), found=(err_text or out_text)[-2000:])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def verified(lib: Path) -> bool:
    """Whether a cached library matches the sha256 recorded when it was built."""
    record = lib.with_name(lib.name + ".sha256")
    try:
        return lib.is_file() and record.read_text().strip() == sha256_file(lib, DeviceError)
    except (OSError, UnicodeDecodeError, DeviceError):
        return False


def _remove_stale(d: Path) -> None:
    """Build directories and temporary files left by builds that were killed (their process is gone)."""
    for p in d.glob(".build-*"):
        try:
            pid = int(p.name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, IndexError, OSError):
            pass


def library(sanitize: bool = False) -> Path:
    """The path of the built runtime library (building it on first use, and again whenever the cached copy
    does not match its recorded hash)."""
    flags = CFLAGS + (ASAN_FLAGS if sanitize else ())
    h = hashlib.sha256()
    for name in sorted(p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    h.update(" ".join(compiler() + list(flags)).encode())
    d = cache_root() / "runtime" / h.hexdigest()[:20]
    lib = d / ("libv4rt-asan.so" if sanitize else "libv4rt.so")
    if verified(lib):
        return lib
    if lib.exists():
        log.warning("the cached C runtime %s does not match its recorded hash: rebuilding it", lib)
    d.mkdir(parents=True, exist_ok=True)
    _remove_stale(d)
    build = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=d))
    try:
        tmp = build / lib.name
        compile_shared([SOURCE_DIR / s for s in SOURCES], tmp, flags)
        (build / "sha256").write_text(sha256_file(tmp, DeviceError) + "\n")
        # The library first, then its record: a reader never finds a record naming a library not yet there.
        os.replace(tmp, lib)
        os.replace(build / "sha256", lib.with_name(lib.name + ".sha256"))
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log.info("built the C runtime: %s", lib)
    return lib
