"""What the writer of an artifact's weight shards (`weights_write`, compile time) and their reader
(`weights_map`, load time) share: the shards' dtype names, when a file is read or written around the page
cache (O_DIRECT) and the page-cache probe that decides it, progress lines and thread counts.
"""

from __future__ import annotations

import logging
import mmap
import os
import time

from .threads import usable_cores

PROGRESS_S = 5.0  # seconds between progress lines
DIRECT_BYTES = 256 << 20  # files from this size up are written and read around the page cache (O_DIRECT)
DIRECT_ALIGN = 4096  # O_DIRECT's unit of file offsets, lengths and buffer addresses (4Kn disks included)

# The safetensors dtype a shard stores each IR dtype as.
ST_DTYPE = {"fp32": "F32", "bf16": "BF16", "i64": "I64", "i32": "I32", "fp8e4m3": "F8_E4M3", "e8m0": "F8_E8M0",
            "fp4x2": "I8"}


def default_workers() -> int:
    """Conversion / read threads: the cores this process may use, at most 8, at least 2 (one reads while
    another converts)."""
    return max(2, min(8, usable_cores()))



class Progress:
    """A progress line (bytes, rate, ETA) on `log` every PROGRESS_S seconds."""

    def __init__(self, total: int, what: str, log: logging.Logger):
        self.total, self.what, self.done, self.log = total, what, 0, log
        self.t0 = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= PROGRESS_S and self.done < self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            self.log.info("%s: %.2f of %.2f GB (%d%%), %.0f MB/s, ETA %.0f s", self.what, self.done / 1e9,
                          self.total / 1e9, 100 * self.done // max(self.total, 1), rate / 1e6,
                          (self.total - self.done) / max(rate, 1))


def page_cached(fd: int, nbytes: int) -> bool:
    """Whether most of the file's pages are in the page cache now (`mincore` of a mapping, which reads
    nothing): a checkpoint just downloaded or read, an artifact just written. False where it cannot tell."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return False
    addr = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return False
    try:
        vec = ctypes.create_string_buffer(-(-nbytes // mmap.PAGESIZE))
        if libc.mincore(addr, nbytes, vec) != 0:
            return False
        raw = vec.raw  # a byte a page, bit 0 set when resident (the other bits are reserved, zero)
        return 2 * (len(raw) - raw.count(0)) >= len(raw)
    finally:
        libc.munmap(addr, nbytes)


def open_direct(path, fd: int, nbytes: int, chunk: int) -> int | None:
    """A second descriptor of a large shard (or checkpoint file: `weights_write._Reader`), opened with
    O_DIRECT: the disk writes straight into the chunk buffers, without the page cache's copy and bookkeeping
    (a fifth of the kernel's CPU per byte here), and a file larger than memory does not push everything else
    out of the cache. None for a small file (read again soon: the cache helps), for a file mostly in the page cache
    already (`page_cached`: O_DIRECT would read it from the disk again, and where reads and writes share the
    disk, as on this virtual disk, take its bandwidth from the artifact's writes: a cached checkpoint
    compiled at 620-826 MB/s with O_DIRECT, 1,109-1,198 through the cache: `bench/profile_writer.py`),
    where the file system refuses O_DIRECT, or for a chunk size not in whole units; `fd` (the same file,
    checked) then serves every read."""
    if nbytes < DIRECT_BYTES or chunk % DIRECT_ALIGN or not hasattr(os, "O_DIRECT") or page_cached(fd, nbytes):
        return None
    try:
        d = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if os.path.samestat(os.fstat(d), os.fstat(fd)):
        return d
    os.close(d)  # replaced since it was checked: read only the checked descriptor
    return None
