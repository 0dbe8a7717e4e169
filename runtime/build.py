"""Build the C runtime (runtime/c) with the machine's C compiler, cached by source hash.

The library goes to `$V4COMPILE_CACHE/runtime/<hash>/libv4rt.so` (default `~/.cache/v4compile`); the hash
covers every source file, the compiler command and the flags, so an edit or another compiler rebuilds it.
Building is atomic (a temporary file renamed into place), so concurrent first uses are safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from v4compile.errors import DeviceError

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "c"
SOURCES = ("v4rt.c", "drv_host.c", "drv_gpu.c", "drv_hip.c", "drv_cuda.c")
CFLAGS = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared")
ASAN_FLAGS = ("-g", "-O1", "-fsanitize=address,undefined", "-fno-omit-frame-pointer")


def cache_dir() -> Path:
    return Path(os.environ.get("V4COMPILE_CACHE") or Path.home() / ".cache" / "v4compile")


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def compile_shared(sources: list[Path], out: Path, flags: tuple[str, ...] = CFLAGS, libs: tuple[str, ...] = ("-ldl",),
                   include: Path = SOURCE_DIR) -> None:
    cmd = compiler() + list(flags) + ["-I", str(include), "-o", str(out)] + [str(s) for s in sources] + list(libs)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DeviceError(f"cannot run the C compiler: {e}", where=" ".join(cmd[:1])) from None
    if r.returncode:
        raise DeviceError("the C runtime failed to compile", where=" ".join(cmd), found=(r.stderr or r.stdout)[-2000:])


def library(sanitize: bool = False) -> Path:
    """The path of the built runtime library (building it on first use)."""
    flags = CFLAGS + (ASAN_FLAGS if sanitize else ())
    h = hashlib.sha256()
    for name in sorted(p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    h.update(" ".join(compiler() + list(flags)).encode())
    d = cache_dir() / "runtime" / h.hexdigest()[:20]
    lib = d / ("libv4rt-asan.so" if sanitize else "libv4rt.so")
    if lib.is_file():
        return lib
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".so.tmp")
    os.close(fd)
    try:
        compile_shared([SOURCE_DIR / s for s in SOURCES], Path(tmp), flags)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the C runtime: %s", lib)
    return lib
