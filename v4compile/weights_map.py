"""Load time: an artifact's weight shards (written at compile time by `weights_write`), mapped and read.
Nothing here knows the checkpoint, the tracer or the reference model: the runtime loads only this.

`MappedWeights`, from `Artifact.weights()`: each shard is mapped; `stream()` gives every tensor as a
zero-copy view (the cpu device keeps them as ONNX Runtime initializers), `chunks()` reads each shard into a
few reused buffers, in a region per hash lane read in turn (an upload to a device or to the C runtime's
host memory: no page faults, a few chunks of memory). Both hash each shard's segments on hash threads as
they go, when the load deferred that check (`load_artifact(defer_weights=True)`), so every byte is read
once, and check each tensor against its digest (the manifest's `sha256`, a tree digest: naming it) and the
shard against its digest.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# open_direct and default_workers are looked up when used (as in weights_write).
from . import weights_disk as disk
from .errors import CheckpointError
from .shard_digest import EMPTY, Lanes, combine, segments
from .weights_disk import DIRECT_ALIGN, ST_DTYPE, Progress

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # a shard is read in chunks of this size
MAX_REGIONS = 4  # a shard is read in at most this many places at once (MappedWeights.chunks)


def _regions(units: list, sizes: list[int], k: int) -> list[list]:
    """`units` (segments, in file order, of `sizes` bytes) cut into at most `k` runs of about equal bytes: each
    run ends at the first bound at or past its share (a segment larger than a share stays whole)."""
    total, done = sum(sizes), 0
    out: list[list] = [[]]
    for n, (u, size) in enumerate(zip(units, sizes)):
        out[-1].append(u)
        done += size
        if len(out) < k and done >= total * len(out) / k and n < len(units) - 1:
            out.append([])
    return out


def _region_chunks(run: list[tuple[int, int, str | None]], shard: list[int], size: int, align: int
                   ) -> list[tuple[int, int, int, int]]:
    """(shard, read from, first byte used, end) of each chunk of one region (its segments `run`, each in
    shard `shard[n]`), front to back: a chunk stays in one shard, starts its read at a multiple of `align`
    (O_DIRECT's unit) and spans at most `size` bytes."""
    out: list[tuple[int, int, int, int]] = []
    n = 0
    while n < len(run):
        m = n  # the segments of this shard that follow each other in the run
        while m + 1 < len(run) and shard[m + 1] == shard[n] and run[m + 1][0] == run[m][1]:
            m += 1
        pos, end = run[n][0], run[m][1]
        while pos < end:
            r0 = pos - pos % align
            hi = min(end, r0 + size)
            out.append((shard[n], r0, pos, hi))
            pos = hi
        n = m + 1
    return out


def _interleave(per_region: list[list[tuple]]) -> list[tuple]:
    """(region, *chunk): each next chunk from the region with the fewest bytes taken so far (ties: the first),
    so every lane has about as much to hash as the others (a chunk is (..., first byte used, end))."""
    heads, taken, out = [0] * len(per_region), [0] * len(per_region), []
    while True:
        live = [r for r, c in enumerate(per_region) if heads[r] < len(c)]
        if not live:
            return out
        r = min(live, key=lambda r: (taken[r], r))
        c = per_region[r][heads[r]]
        heads[r] += 1
        taken[r] += c[-1] - c[-2]
        out.append((r, *c))


class MappedWeights(Mapping):
    """An artifact's weights, mapped: name -> a torch view of its shard's mapping (no copy). `stream()` and
    `chunks()` visit them shard by shard (`stream()` in file order, `chunks()` each tensor's pieces in
    order); when `expected` gives the shards' digests (`shard_digest`), they hash every segment of each
    shard on `lanes` threads as they go and check each tensor's sha256 (the manifest's) and the shard's
    digest, so a verified load reads every byte once; `release(name)` drops a tensor's pages from the
    process once it has been copied elsewhere (they stay in the page cache)."""

    def __init__(self, root: Path, tensors: dict[str, dict[str, Any]], error: type,
                 expected: dict[str, str] | None = None, path_of=None, lanes: int | None = None):
        # `path_of(rel)`: the shard's path, checked by the caller (an artifact confines it to itself)
        self.root, self.error, self.expected = Path(root), error, expected
        self.path_of = path_of if path_of is not None else (lambda rel: self.root / rel)
        self.lanes = lanes or disk.default_workers()
        self.shard_of: dict[str, str] = {n: t["shard"] for n, t in tensors.items()}
        self.sha256: dict[str, str | None] = {n: t.get("sha256") for n, t in tensors.items()}
        self.shards: dict[str, MappedShard] = {}
        for rel in sorted(set(self.shard_of.values())):
            sh = map_shard(self.path_of(rel), error)
            self.shards[rel] = sh
            for n, t in tensors.items():
                if t["shard"] != rel:
                    continue
                i = sh.tensors.get(n)
                if i is None or ST_DTYPE.get(t["dtype"]) != i.dtype or list(t["shape"]) != list(i.shape):
                    raise error("weights shard does not hold the tensor the manifest names", where=f"{rel}: '{n}'",
                                expected=f"{t['dtype']} {t['shape']}",
                                found="absent" if i is None else f"{i.dtype} {list(i.shape)}")
        self.nbytes = sum(sh.mm.size() for sh in self.shards.values())
        self._hashed: dict[str, Future] = {}  # tensor -> its last hash update, while streaming

    def __getitem__(self, name: str):
        return self.shards[self.shard_of[name]].tensor(name)

    def __iter__(self):
        return iter(self.shard_of)

    def __len__(self) -> int:
        return len(self.shard_of)

    def _mine(self, rel: str, sh: MappedShard) -> list[tuple[int, int, str]]:
        """(begin, end, name) in the file of the tensors the manifest places in this shard, in file order."""
        return sorted((sh.data_start + i.begin, sh.data_start + i.end, n) for n, i in sh.tensors.items()
                      if self.shard_of.get(n) == rel)

    def stream(self) -> Iterator[tuple[str, Any]]:
        """(name, tensor) in file order; with `expected`, each shard's segments are hashed on other threads
        while its tensors are used here, and a tensor or shard whose bytes do not match raises `error`
        naming it once the shard's last tensor has been visited (before the load returns)."""
        t0, done = time.perf_counter(), 0
        prog = Progress(self.nbytes, "weights read", log)
        lanes = Lanes(self.lanes, 1 << 62) if self.expected is not None else None  # mapped: no buffers to bound
        try:
            for rel, sh in self.shards.items():
                hashed = []
                if lanes is not None:
                    mv = memoryview(sh.mm)
                    for lo, hi, n in segments(sh.data_start, sh.tensors, len(mv)):
                        st = lanes.stream()
                        fut = lanes.submit(st, mv[lo:hi])
                        hashed.append((n, st[0]))
                        if n is not None:
                            self._hashed[n] = fut
                    del mv
                for lo, hi, n in self._mine(rel, sh):
                    prog.add(hi - lo)
                    yield n, sh.tensor(n)
                done += sh.mm.size()
                if lanes is not None:
                    lanes.drain()
                    self._hashed.clear()
                    self._check_shard(rel, sh, hashed)
        finally:
            if lanes is not None:
                lanes.close()
        self._log_read(done, t0)

    def chunks(self, size: int = CHUNK_BYTES, nbufs: int | None = None) -> Iterator[tuple[str, int, bytearray, int, int]]:
        """(tensor, offset in the tensor, buffer, start in the buffer, byte count) for every weight, read with
        `pread` (a large shard with O_DIRECT: `weights_disk.open_direct`) into `nbufs` reused buffers (default
        three per region and one): no mapping, no page faults (a fifth of the CPU of touching the mapping),
        memory of `nbufs` chunks. The host side of an upload: use each piece before asking for the next.

        The shards' segments, in file order, are cut at their bounds into a few regions of about equal bytes
        (`_regions`, one per hash lane, at most `MAX_REGIONS`; a region may span shards, a shard regions),
        each read front to back, their chunks taken in turn (`_interleave`) and read ahead on as many threads
        (the disk sees a queue of reads, not one at a time). A region's segments (every piece of their tree
        digests) are hashed on its own lane while the others' are hashed on theirs (one sha256 stream runs on
        one core, ~1.1-1.4 GB/s here, below a fast disk), so the lanes hash at their combined speed, each a
        region front to back. Each tensor's pieces still come in order, each shard is checked once its last chunk
        has been used, and the order of every piece is fixed by the shards, the chunk size and the lanes
        (nothing depends on timing)."""
        from bisect import bisect_right

        from .files import open_regular

        t0 = time.perf_counter()
        prog = Progress(self.nbytes, "weights read", log)
        nreg = max(1, min(self.lanes, MAX_REGIONS))
        bufs = [mmap.mmap(-1, size) for _ in range(max(2, nbufs or 3 * nreg + 1))]  # page-aligned (O_DIRECT)
        # reads in flight: one per region; the other buffers are the caller's and those being hashed
        ahead = max(1, min(nreg, len(bufs) - 1 - nreg))
        hashing: list[list[Future]] = [[] for _ in bufs]  # each buffer's hash updates, done before it is refilled
        lanes = Lanes(nreg, 1 << 62) if self.expected is not None else None  # bounded by the buffers
        readers = ThreadPoolExecutor(min(nreg, ahead), thread_name_prefix="weights-read")
        shards = list(self.shards.items())
        segs = [segments(sh.data_start, sh.tensors, sh.mm.size()) for _, sh in shards]
        starts = [[g[0] for g in sg] for sg in segs]
        spans = [[t for t in self._mine(rel, sh) if t[1] > t[0]] for rel, sh in shards]
        streams: list[list[tuple | None]] = [[None] * len(sg) for sg in segs]
        hashed: list[list[Future]] = [[] for _ in shards]  # each shard's hash updates, done before its check
        align = DIRECT_ALIGN if size % DIRECT_ALIGN == 0 else 1  # reads start at whole units (O_DIRECT or not)
        units = [(i, g) for i, sg in enumerate(segs) for g in range(len(sg))]
        order = _interleave([_region_chunks([segs[i][g] for i, g in run], [i for i, _ in run], size, align)
                             for run in _regions(units, [segs[i][g][1] - segs[i][g][0] for i, g in units], nreg)])
        left = [0] * len(shards)  # chunks of each shard not yet used
        for c in order:
            left[c[1]] += 1
        fds: dict[int, tuple[int, int | None]] = {}  # shard -> (descriptor, O_DIRECT descriptor or None), while read
        reads: dict[int, Future] = {}

        def start(k: int) -> None:  # read chunk k once its buffer's hashing is done
            b = k % len(bufs)
            for f in hashing[b]:
                f.result()
            hashing[b].clear()
            _, i, r0, _, hi = order[k]
            if i not in fds:
                path = self.path_of(shards[i][0])
                fd = open_regular(path, self.error, "weights shard")
                fds[i] = fd, None  # (closed below whatever happens next)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                fds[i] = fd, disk.open_direct(path, fd, shards[i][1].mm.size(), size)
            reads[k] = readers.submit(self._read, *fds[i], bufs[b], r0, hi - r0, shards[i][0])

        try:
            for k in range(min(ahead, len(order))):
                start(k)
            for k, (r, i, r0, lo, hi) in enumerate(order):
                reads.pop(k).result()
                if k + ahead < len(order):
                    start(k + ahead)
                b = k % len(bufs)
                buf, view = bufs[b], memoryview(bufs[b])
                g = bisect_right(starts[i], lo) - 1
                while lanes is not None and g < len(segs[i]) and segs[i][g][0] < hi:  # this chunk's segments
                    slo, shi, name = segs[i][g]
                    if streams[i][g] is None:
                        streams[i][g] = lanes.stream(r)
                    fut = lanes.submit(streams[i][g], view[max(slo, lo) - r0:min(shi, hi) - r0])
                    hashing[b].append(fut)
                    hashed[i].append(fut)
                    if name is not None:
                        self._hashed[name] = fut
                    g += 1
                sp = spans[i]
                j = max(0, bisect_right(sp, (lo, float("inf"))) - 1)
                while j < len(sp) and sp[j][0] < hi:
                    slo, shi, name = sp[j]
                    if shi > lo:
                        a, e = max(slo, lo), min(shi, hi)
                        yield name, a - slo, buf, a - r0, e - a
                    j += 1
                prog.add(hi - lo)
                left[i] -= 1
                if left[i] == 0:  # the shard's last chunk: every read of it is done
                    for fd in fds.pop(i):
                        if fd is not None:
                            os.close(fd)
                    if lanes is not None:
                        for f in hashed[i]:
                            f.result()
                        hashed[i].clear()
                        rel, sh = shards[i]
                        self._check_shard(rel, sh, [(s[2], st[0]) for s, st in zip(segs[i], streams[i])])
                        for _, _, name in segs[i]:
                            self._hashed.pop(name, None)
        finally:
            for f in reads.values():  # nothing may still read into a buffer or from a descriptor
                f.exception()
            for pair in fds.values():
                for fd in pair:
                    if fd is not None:
                        os.close(fd)
            readers.shutdown(wait=True, cancel_futures=True)
            if lanes is not None:
                lanes.close()
        self._log_read(sum(sh.mm.size() for _, sh in shards), t0)

    def _read(self, fd: int, direct: int | None, buf, pos: int, n: int, rel: str) -> None:
        """Bytes [pos, pos + n) of a shard into the front of `buf`; with `direct`, in whole units (`pos` is
        one's start; the last unit may run past the end of the file)."""
        view, got = memoryview(buf), 0
        while got < n:
            if direct is not None and got % DIRECT_ALIGN == 0:
                r = os.preadv(direct, [view[got:-(-n // DIRECT_ALIGN) * DIRECT_ALIGN]], pos + got)
            else:
                r = os.preadv(fd, [view[got:n]], pos + got)
            if r <= 0:
                raise self.error("weights shard changed while it was read (shorter now)", where=str(self.root / rel))
            got = min(n, got + r)

    def _check_shard(self, rel: str, sh: MappedShard, hashed: list[tuple[str | None, Any]]) -> None:
        """Every tensor the manifest places here against its sha256 (naming it), then the whole shard (its
        header and any bytes outside the tensors too) against its digest."""
        got = {n: h.hexdigest() for n, h in hashed if n is not None}
        for _, _, n in self._mine(rel, sh):
            if got.get(n, EMPTY) != self.sha256[n]:
                raise self.error("tensor does not match its sha256 in the manifest (changed or damaged)",
                                 where=f"{self.root / rel}: '{n}'", expected=str(self.sha256[n])[:16] + "...")
        if combine(h.digest() for _, h in hashed) != self.expected.get(rel):
            raise self.error("file does not match its hash in the manifest (changed or damaged)",
                             where=str(self.root / rel), expected=str(self.expected.get(rel))[:16] + "...")

    def _log_read(self, done: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        log.info("weights: %.2f GB read in %.2f s (%.0f MB/s)%s", done / 1e9, dt, done / max(dt, 1e-9) / 1e6,
                 ", hashed" if self.expected is not None else "")

    def release(self, name: str) -> None:
        f = self._hashed.pop(name, None)
        if f is not None:
            f.result()  # its pages are hashed before they are dropped
        self.shards[self.shard_of[name]].release(name)

    def close(self) -> None:
        for sh in self.shards.values():
            sh.close()


def shard_file_digest(path: Path, error: type, lanes: int | None = None) -> str:
    """A shard file's digest (`shard_digest`), its segments hashed on `lanes` threads (a load that checks
    every file before using any)."""
    sh = map_shard(path, error)
    try:
        mv = memoryview(sh.mm)
        ls = Lanes(lanes or disk.default_workers(), 1 << 62)
        try:
            streams = []
            for lo, hi, _ in segments(sh.data_start, sh.tensors, len(mv)):
                streams.append(ls.stream())
                ls.submit(streams[-1], mv[lo:hi])
            ls.drain()
        finally:
            ls.close()
        del mv
        return combine(st[0].digest() for st in streams)
    finally:
        sh.close()


@dataclass
class MappedShard:
    """One weights shard mapped read-only; tensors are views of the mapping (no copy)."""

    path: Path
    mm: mmap.mmap
    data_start: int
    tensors: dict[str, Any]  # name -> TensorInfo

    def bytes_of(self, name: str) -> memoryview:
        i = self.tensors[name]
        return memoryview(self.mm)[self.data_start + i.begin: self.data_start + i.end]

    def tensor(self, name: str):
        """The tensor as a torch view of the mapping (read-only memory: do not write to it)."""
        import warnings

        import torch

        from .safetensors_io import DTYPES

        i = self.tensors[name]
        if i.end == i.begin:
            return torch.empty(i.shape, dtype=DTYPES[i.dtype])
        with warnings.catch_warnings():  # torch warns that the buffer is not writable; it is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.bytes_of(name), dtype=torch.uint8)
        return flat.view(DTYPES[i.dtype]).reshape(i.shape)

    def release(self, name: str) -> None:
        """Drop this tensor's pages from the process (they stay in the page cache): RSS stays bounded
        while a large artifact is streamed somewhere else."""
        i = self.tensors[name]
        lo = (self.data_start + i.begin) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = self.data_start + i.end
        if hi > lo and hasattr(self.mm, "madvise"):
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view is still alive: the mapping goes when the last view does
            pass


def map_shard(path: Path, error: type) -> MappedShard:
    from .files import open_regular
    from .safetensors_io import read_header

    fd = open_regular(path, error, "weights shard")
    try:
        try:
            data_start, infos, _ = read_header(fd, str(path))
        except CheckpointError as e:
            raise error(e.what, where=e.where, expected=e.expected, found=e.found) from None
        mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)  # read_header: at least 8 bytes
    finally:
        os.close(fd)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_SEQUENTIAL)
    return MappedShard(path, mm, data_start, infos)
