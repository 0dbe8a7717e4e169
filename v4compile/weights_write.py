"""Compile time, second half of writing an artifact's weights: the planned tensors (`weights_plan`) streamed
into safetensors shards at disk speed, in memory that does not grow with the model, every byte hashed
as it is written (the shards are read at load time by `weights_map`).

* A copied piece is read with `pread` from one descriptor per checkpoint file (a large file not in the
  page cache with O_DIRECT: `_Reader`), never decoded; its non-finite check is done on the bits
  (`_bits_bad`). A converted piece is made once, by its conversion (`weights_plan.Piece.convert`).
* A shard is made block by block (`BLOCK_BYTES`, a few reused page-aligned buffers): a worker thread
  assembles a block (copied pieces `pread` into their place, converted ones placed from their
  conversion, made once) and writes it at its place in the file (`pwrite`; reads, writes and torch
  conversions release the GIL; a thread per block in flight, as most of its time is a wait on a disk); once
  assembled, its bytes are hashed on a few hash threads while it is written (`shard_digest.Lanes`: each
  8 MiB piece of a tensor's tree digest on the next lane, so one large tensor is hashed on every core). The
  blocks of all the shards are one stream: a shard's last blocks are written, hashed and flushed while the
  next one's are read (no drain at each shard's end). Every byte is
  copied once (disk to buffer; with O_DIRECT, from a unit-aligned buffer) and hashed once: a shard's digest
  is made of its tensors' digests and its header's (`shard_digest`). A large shard is written with O_DIRECT
  (whole blocks, cut to its size at the end): the page cache's copy and writeback cost more CPU than
  everything else together. Peak memory is the buffers, a read buffer per filling thread and the pieces
  being converted, whatever the checkpoint's size.
* Each shard is flushed to disk (`fdatasync`, on a thread of its own; through the page cache, also started
  every `SYNC_BYTES`) before the artifact is renamed into place, and a progress line (bytes, rate, ETA) is
  logged every few seconds.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# DIRECT_BYTES, open_direct and default_workers are looked up when used: what a test or bench sets in
# weights_disk reaches the writer and the reader alike.
from . import weights_disk as disk
from .errors import CheckpointError, IRError
from .shard_digest import Lanes, Tree, combine, tree_digest
from .weights_disk import DIRECT_ALIGN, ST_DTYPE, Progress
from .weights_plan import Piece, TensorPlan, shard_groups

log = logging.getLogger(__name__)

BLOCK_BYTES = 8 << 20  # a shard is written in blocks of this size
WINDOW_BYTES = 64 << 20  # a writer's blocks in flight (being filled, written or hashed)
SYNC_BYTES = 256 << 20  # a shard written through the page cache starts flushing after this many more bytes


_SCRATCH = threading.local()  # each thread's buffer for the masked magnitudes (`_bits_bad`)
SCRATCH_BYTES = 256 << 10  # fits a core's L2; no temporary of a block's size (its page faults cost ~40 %)
MAGNITUDE = {"bf16": (np.uint16, 0x7FFF, 0x7F80), "fp32": (np.uint32, 0x7FFFFFFF, 0x7F800000)}


def _bits_bad(buf, lo: int, hi: int, bits: str) -> bool:
    """True if the stored bytes buf[lo:hi] (whole elements) hold a NaN / Inf (E8M0: the NaN byte 0xFF). All
    exponent bits set is the largest value the magnitude bits can take, so one max over them decides (~7
    GB/s, in L2-sized pieces); a one-byte format's NaN bytes are found with `find` (memchr, no temporary:
    ~15 GB/s)."""
    if bits == "fp8":  # e4m3fn: NaN is S.1111.111 (0x7F, 0xFF), there is no Inf
        return buf.find(b"\x7f", lo, hi) >= 0 or buf.find(b"\xff", lo, hi) >= 0
    if bits == "e8m0":
        return buf.find(b"\xff", lo, hi) >= 0
    if bits not in MAGNITUDE:
        return False
    dtype, mask, inf = MAGNITUDE[bits]
    a = np.frombuffer(buf, dtype=dtype, count=(hi - lo) // np.dtype(dtype).itemsize, offset=lo)
    scratch = getattr(_SCRATCH, "buf", None)
    if scratch is None:
        scratch = _SCRATCH.buf = np.empty(SCRATCH_BYTES, np.uint8)
    step = SCRATCH_BYTES // a.itemsize
    for i in range(0, a.size, step):
        part = a[i:i + step]
        out = scratch[:part.nbytes].view(dtype)
        np.bitwise_and(part, mask, out=out)
        if int(out.max()) >= inf:
            return True
    return False


def shard_header(group: list[TensorPlan]) -> bytes:
    """The safetensors header (length prefix included) of one shard, its tensors in `group` order."""
    from .safetensors_io import header_bytes

    return header_bytes([(p.name, ST_DTYPE[p.dtype], p.shape, p.nbytes) for p in group],
                        {"format": "v4compile-ir-weights"}, sort_keys=True)


class _Reader:
    """One read-only descriptor per checkpoint file, opened once. A large file (`DIRECT_BYTES` and up) not
    mostly in the page cache already (`weights_disk.open_direct`) is read with O_DIRECT in whole units into
    a reused buffer per thread, the wanted bytes copied into the block being
    assembled: a checkpoint is read once, and the page cache's copy, readahead and eviction cost 2-4x the CPU
    of that copy here (0.44-0.79 against 0.15-0.20 CPU s per GB). A small file, or one whose file system refuses
    O_DIRECT, is read with `pread` straight into the block (the page cache's readahead serves the reads,
    which go through each file in order)."""

    def __init__(self, block: int = BLOCK_BYTES):
        self.fds: dict[Path, tuple[int, int | None]] = {}  # path -> (descriptor, O_DIRECT descriptor or None)
        self.lock = threading.Lock()
        self.size = -(-(block + 2 * DIRECT_ALIGN) // DIRECT_ALIGN) * DIRECT_ALIGN  # a block's bytes, in whole units
        self.bounce: dict[int, mmap.mmap] = {}  # thread -> its page-aligned buffer for O_DIRECT reads
        self.refused: list[int] = []  # O_DIRECT descriptors whose reads were refused

    def fd(self, path: Path) -> tuple[int, int | None]:
        with self.lock:
            if path not in self.fds:
                from .files import open_regular

                fd = open_regular(path, CheckpointError, "safetensors file")
                self.fds[path] = fd, None  # (closed by `close` whatever happens next)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self.fds[path] = fd, disk.open_direct(path, fd, os.fstat(fd).st_size, DIRECT_ALIGN)
            return self.fds[path]

    def read_into(self, path: Path, offset: int, view: memoryview) -> None:
        fd, direct = self.fd(path)
        if direct is None:
            self._read(path, fd, offset, view, None)
            return
        with self.lock:
            bounce = self.bounce.get(threading.get_ident())
            if bounce is None:
                bounce = self.bounce[threading.get_ident()] = mmap.mmap(-1, self.size)
        bv = memoryview(bounce)
        try:
            self._read(path, direct, offset, view, bv)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            with self.lock:  # a file system that opens with O_DIRECT but refuses its reads: the page cache
                if self.fds[path][1] == direct:  # (once, whichever thread was refused first)
                    self.fds[path] = fd, None
                    self.refused.append(direct)  # (closed with the others: another thread may be reading it)
            self._read(path, fd, offset, view, None)
        finally:
            bv.release()  # (the buffer can be closed)

    def _read(self, path: Path, fd: int, offset: int, view: memoryview, bv: memoryview | None) -> None:
        """Bytes [offset, offset + len(view)) into `view`; with `bv` (`fd` is O_DIRECT), through it."""
        got, n = 0, len(view)
        while got < n:
            pos = offset + got
            if bv is not None:  # whole units around the wanted bytes, then the wanted bytes
                skip = pos % DIRECT_ALIGN
                want = min(n - got, self.size - skip)
                r = os.preadv(fd, [bv[:-(-(skip + want) // DIRECT_ALIGN) * DIRECT_ALIGN]], pos - skip)
                k = min(want, r - skip)
                if k > 0:
                    view[got:got + k] = bv[skip:skip + k]
            else:
                k = os.preadv(fd, [view[got:]], pos)
            if k <= 0:
                raise CheckpointError("file changed since it was opened (tensor bytes run past its end)",
                                      where=str(path), expected=f"{offset + n} bytes at least", found=f"{offset + got}")
            got += k

    def close(self) -> None:
        for fd in [fd for pair in self.fds.values() for fd in pair if fd is not None] + self.refused:
            os.close(fd)
        self.fds.clear()
        self.refused.clear()
        for b in self.bounce.values():
            try:
                b.close()
            except BufferError:  # a view is still alive (an error's traceback): it goes with the last view
                pass
        self.bounce.clear()


@dataclass(eq=False)
class _Span:
    """A run of a shard's bytes with one origin: its header, or one piece of one tensor."""

    pos: int  # where it starts in the shard file
    n: int
    data: bytes | None = None  # the header's bytes
    tensor: TensorPlan | None = None
    piece: Piece | None = None
    key: tuple = ()  # (tensor, piece index): a conversion's identity


def _layout(head: bytes, group: list[TensorPlan]) -> tuple[list[_Span], int]:
    """The shard's spans in file order, and its size."""
    spans, pos = [_Span(0, len(head), data=head)], len(head)
    for t in group:
        for i, p in enumerate(t.pieces):
            spans.append(_Span(pos, p.nbytes, tensor=t, piece=p, key=(t.name, i)))
            pos += p.nbytes
    return spans, pos


def _blocks(spans: list[_Span], size: int, block: int) -> Iterator[list[tuple[_Span, int, int]]]:
    """Each block's parts, in file order: (span, first byte, end) as file offsets, cut at the block's bounds.
    A span with no bytes is in the block its position falls in (its conversion still runs, and is checked)."""
    last = max(1, -(-size // block)) - 1
    j = 0
    for k in range(last + 1):
        lo, hi = k * block, min(size, (k + 1) * block)
        parts = []
        while j < len(spans) and (spans[j].pos < hi or k == last):
            s = spans[j]
            parts.append((s, max(s.pos, lo), min(s.pos + s.n, hi)))
            if s.pos + s.n > hi:  # it goes on in the next block
                break
            j += 1
        yield parts


ELEMENT = {"fp8": 1, "e8m0": 1, "bf16": 2, "fp32": 4}  # bytes per element of each bit test's dtype


def _check_bits(reader: _Reader, source, p: Piece, buf, at: int, lo: int, hi: int) -> None:
    """The non-finite check of the piece's bytes [lo, hi), which lie at buf[at:]: every element that starts
    there (one that a block's end cuts is read again whole, a few bytes), so each is checked once."""
    size = ELEMENT[p.bits]
    a, b = -(-lo // size) * size, hi // size * size
    bad = b > a and _bits_bad(buf, at + a - lo, at + b - lo, p.bits)
    if not bad and a <= b < hi:
        whole = bytearray(size)
        reader.read_into(p.file, p.offset + b, memoryview(whole))
        bad = _bits_bad(whole, 0, size, p.bits)
    if bad:
        source.raw(p.name)  # raises the checkpoint's own error, naming the file, tensor and first index
        raise CheckpointError("tensor holds non-finite values", where=f"{p.file}: '{p.name}'")


def _convert(t: TensorPlan, p: Piece):
    """A converted piece's bytes (a uint8 array), checked against the bytes the plan gives it."""
    v = p.convert()
    if v.numel() * v.element_size() != p.nbytes:
        raise IRError(f"weight @{t.name}: source tensors do not give its IR type",
                      expected=f"{p.nbytes} bytes from '{p.name}'", found=f"{v.dtype} {list(v.shape)}")
    import torch

    return v.reshape(-1).view(torch.uint8).numpy() if p.nbytes else b""


class _Conversions:
    """Each converted piece made once, by the first block that needs it (blocks start in file order, so that
    one never waits behind a later one), and dropped once its last byte is in a block."""

    def __init__(self):
        self.lock = threading.Lock()
        self.made: dict[tuple, list] = {}  # key -> [its lock, its bytes or None, bytes not yet placed]

    def place(self, s: _Span, lo: int, hi: int, dst: memoryview) -> None:
        with self.lock:
            e = self.made.setdefault(s.key, [threading.Lock(), None, s.n])
        with e[0]:
            if e[1] is None:
                e[1] = _convert(s.tensor, s.piece)
            dst[:] = e[1][lo:hi]
            e[2] -= hi - lo
            if e[2] <= 0:
                with self.lock:
                    self.made.pop(s.key, None)


def _fill(k: int, parts: list[tuple[_Span, int, int]], buf, size: int, fd: int, direct: bool,
          w: _ShardWriter, ready: Future | None = None) -> None:
    """Assemble block k of a shard (its bytes [k * block, ...)) in `buf`, copied pieces read straight into
    place, then (`ready` done: its bytes can be hashed while they are written) write it at its place (with
    O_DIRECT in whole units: the shard is cut to its size at the end)."""
    block = w.block
    view, base = memoryview(buf), k * block
    try:
        for s, a, e in parts:
            if w.stop is not None and w.stop.is_set():
                raise WriteStopped("stopped: another writer failed or was interrupted")
            dst, p = view[a - base:e - base], s.piece
            if s.data is not None:
                dst[:] = s.data[a:e]
            elif p.copied:
                w.reader.read_into(p.file, p.offset + a - s.pos, dst)
                if p.bits is not None and e > a:
                    _check_bits(w.reader, w.source, p, buf, a - base, a - s.pos, e - s.pos)
            else:
                w.conv.place(s, a - s.pos, e - s.pos, dst)
    except BaseException as e:
        if ready is not None:
            ready.set_exception(e)
        raise
    if ready is not None:
        ready.set_result(None)
    end = min(block, size - base)
    out, pos = view[:-(-end // DIRECT_ALIGN) * DIRECT_ALIGN if direct else end], base
    while len(out):
        n = os.pwrite(fd, out, pos)
        out, pos = out[n:], pos + n


def _create(path: Path, direct: bool) -> tuple[int, bool]:
    """A new shard's descriptor; with `direct`, O_DIRECT where the file system takes it: the blocks go from
    their buffers to the disk without the page cache's copy and dirty-page writeback (1.2-1.5 CPU s per GB
    here, more than all the rest of the writer), and a shard larger than memory does not push everything
    else out of the cache."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o666), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


class WriteStopped(Exception):
    """A writer running beside others stopped because one of them failed (its error is the one reported)."""


@dataclass
class WrittenShards:
    files: list[str]  # relative to the artifact
    file_digest: dict[str, str]  # relative path -> the shard's digest (`shard_digest`)
    tensors: dict[str, dict[str, Any]]  # name -> {shard, dtype, shape, sha256}
    copied: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    seconds: float = 0.0
    nbytes: int = 0


def write_shards(plans: list[TensorPlan], source, wdir: Path, shard_bytes: int, rel: str = "weights",
                 workers: int | None = None, share: int = 1, stop: threading.Event | None = None) -> WrittenShards:
    """Write the planned tensors into safetensors shards in `wdir`, hashing each tensor as it is written
    (on `workers` hash lanes; nothing is read back); a shard's digest is made of its tensors' and its
    header's (`shard_digest`). `share`: this writer is one of that many running at once (each rank's
    shards, `driver.write_rank_weights`): it takes that share of the window and the default workers, so
    together they need the memory of one; it stops (`WriteStopped`) once `stop` is set."""
    share = max(1, share)
    workers = workers or max(1, disk.default_workers() // share)
    groups = shard_groups(plans, shard_bytes)
    total = sum(p.nbytes for p in plans)
    out = WrittenShards([], {}, {})
    t0 = time.perf_counter()
    w = _ShardWriter(source, workers, max(3, WINDOW_BYTES // share // BLOCK_BYTES), Progress(total, rel, log), stop)
    names = [f"{rel}/weights-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    try:
        digests = w.write(groups, [wdir / Path(n).name for n in names], names, out.tensors)
    finally:
        w.close()
    out.files = names
    out.file_digest = dict(zip(names, digests))
    for p in plans:
        (out.copied if p.path == "copy" else out.converted).append(p.name)
    out.seconds, out.nbytes = time.perf_counter() - t0, total
    cb = sum(p.nbytes for p in plans if p.path == "copy")
    log.info("%s: %.2f GB in %.1f s (%.0f MB/s; %d tensors copied as stored, %.2f GB; %d converted, %.2f GB; "
             "%d of %d shards written with O_DIRECT)", rel, total / 1e9, out.seconds,
             total / max(out.seconds, 1e-9) / 1e6, len(out.copied), cb / 1e9, len(out.converted), (total - cb) / 1e9,
             w.direct, len(groups))
    return out


@dataclass(eq=False)
class _OpenShard:
    """A shard being written: its file, its layout and its tensors' hash streams."""

    group: list[TensorPlan]
    path: Path
    relname: str
    head: bytes
    size: int
    nblocks: int
    fd: int = -1
    direct: bool = False
    streams: dict[str, tuple] = field(default_factory=dict)  # tensor -> its hash stream (tensors with bytes)
    futures: list[Future] = field(default_factory=list)  # its blocks' writes and hash updates
    unsynced: int = 0
    sync: Future | None = None  # its flush in progress (through the page cache)
    done: Future | None = None  # cut, flushed, closed and digested (`_ShardWriter._finish`)
    digest: str = ""


class _ShardWriter:
    """Shards made block by block (BLOCK_BYTES each, in `nbufs` reused page-aligned buffers), one stream of
    blocks over all the shards (a shard's last blocks are hashed, written and flushed while the next one's are
    read: no drain at a shard's end): each block is assembled and then written by a worker (`_fill`: reads,
    conversions and writes release the GIL), blocks in file order, half of the buffers being filled; a block's
    bytes go to the hash lanes as soon as it is assembled, while it is written (each 8 MiB piece of a tensor
    on the next lane: `shard_digest.Lanes`). A buffer is filled again once its write and hashes are done, so
    memory is the buffers, a read buffer per filling thread (`_Reader`) and the conversions in flight,
    whatever the checkpoint's size."""

    def __init__(self, source, workers: int, nbufs: int, prog: Progress, stop: threading.Event | None):
        self.source, self.prog, self.stop = source, prog, stop
        self.direct = 0  # shards written with O_DIRECT
        self.block = BLOCK_BYTES
        self.bufs = [mmap.mmap(-1, self.block) for _ in range(nbufs)]  # page-aligned (O_DIRECT)
        self.busy: list[list[Future]] = [[] for _ in self.bufs]  # each buffer's write and hash updates
        self.ahead = max(1, nbufs // 2)  # blocks being filled; the other buffers' bytes are being hashed
        self.reader, self.conv = _Reader(self.block), _Conversions()
        # a thread per block being filled: most of a block's time is a wait on a disk (its read, its write),
        # so every block in flight has its own thread; `workers` threads hash
        self.pool = ThreadPoolExecutor(max(workers, self.ahead), thread_name_prefix="weights")
        self.lanes = Lanes(workers, 1 << 62)  # bounded by the buffers
        self.syncer = ThreadPoolExecutor(1, thread_name_prefix="fdatasync")

    def write(self, groups: list[list[TensorPlan]], paths: list[Path], relnames: list[str],
              tensors: dict[str, dict]) -> list[str]:
        """The shards, in order; their tensors' entries go into `tensors`; returns their digests."""
        shards: list[_OpenShard] = []  # those begun
        pending: deque[tuple[_OpenShard, int, list, int, Future]] = deque()  # blocks being filled, in order

        def hash_next() -> None:  # the oldest block, once assembled: its tensors' bytes to their lanes
            sh, k, parts, b, ready = pending.popleft()
            ready.result()
            view, base, n = memoryview(self.bufs[b]), k * self.block, 0
            for s, a, e in parts:
                if s.tensor is not None and e > a:
                    if s.tensor.name not in sh.streams:
                        sh.streams[s.tensor.name] = self.lanes.stream()
                    fut = self.lanes.submit(sh.streams[s.tensor.name], view[a - base:e - base])
                    self.busy[b].append(fut)
                    sh.futures.append(fut)
                    n += e - a
            self.prog.add(n)
            self.lanes.prune()
            sh.unsynced += n
            if not sh.direct and sh.unsynced >= SYNC_BYTES and (sh.sync is None or sh.sync.done()):
                sh.sync, sh.unsynced = self.syncer.submit(os.fdatasync, sh.fd), 0  # dirty pages go out as they come
            if k == sh.nblocks - 1:  # its last block: cut, flushed and closed once written and hashed
                sh.done = self.syncer.submit(self._finish, sh)

        try:
            seq = 0
            for group, path, relname in zip(groups, paths, relnames):
                head = shard_header(group)
                spans, size = _layout(head, group)
                sh = _OpenShard(group, path, relname, head, size, max(1, -(-size // self.block)))
                shards.append(sh)
                sh.fd, sh.direct = _create(sh.path, sh.size >= disk.DIRECT_BYTES and self.block % DIRECT_ALIGN == 0)
                self.direct += sh.direct
                for k, parts in enumerate(_blocks(spans, size, self.block)):
                    if self.stop is not None and self.stop.is_set():
                        raise WriteStopped(f"writing {sh.relname} stopped: another writer failed or was interrupted")
                    if len(pending) >= self.ahead:
                        hash_next()
                    b = seq % len(self.bufs)
                    seq += 1
                    for f in self.busy[b]:  # its last block is written and hashed before it is filled again
                        f.result()
                    self.busy[b].clear()
                    ready: Future = Future()
                    written = self.pool.submit(_fill, k, parts, self.bufs[b], sh.size, sh.fd, sh.direct, self, ready)
                    self.busy[b].append(written)
                    sh.futures.append(written)
                    pending.append((sh, k, parts, b, ready))
            while pending:
                hash_next()
            for sh in shards:
                sh.done.result()
        finally:
            for f in [f for sh in shards for f in sh.futures] + [sh.done for sh in shards if sh.done is not None]:
                f.exception()  # nothing may still write to a descriptor
            for sh in shards:
                if sh.sync is not None:
                    sh.sync.exception()
                if sh.fd >= 0:
                    os.close(sh.fd)
                    sh.fd = -1
        for sh in shards:  # in shard order, each in file order
            for t in sh.group:
                tensors[t.name] = {"shard": sh.relname, "dtype": t.dtype, "shape": list(t.shape),
                                   "sha256": sh.streams[t.name]}
        return [sh.digest for sh in shards]

    @staticmethod
    def _finish(sh: _OpenShard) -> None:
        """Once its blocks are written and hashed: cut to its size (O_DIRECT wrote whole units), flushed to
        the disk, closed (on the flushing thread: the next shard's blocks go on meanwhile), and its digests
        made (its hash objects and futures dropped: what stays per shard is a few strings)."""
        for f in sh.futures:
            f.result()
        if sh.direct:
            os.ftruncate(sh.fd, sh.size)
        if sh.sync is not None:
            sh.sync.result()
        os.fdatasync(sh.fd)
        os.close(sh.fd)
        sh.fd = -1
        digests, shas = [tree_digest(sh.head).digest()], {}
        for t in sh.group:  # file order; a tensor with no bytes is hashed too, but is no segment
            sha = sh.streams[t.name][0] if t.nbytes else Tree()
            if t.nbytes:
                digests.append(sha.digest())
            shas[t.name] = sha.hexdigest()
        sh.digest, sh.streams, sh.head = combine(digests), shas, b""  # (streams: now each tensor's sha256, hex)
        sh.futures.clear()
        log.debug("%s written (%d tensors)", sh.relname, len(sh.group))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.lanes.close()
        self.syncer.shutdown(wait=True)
        self.reader.close()
