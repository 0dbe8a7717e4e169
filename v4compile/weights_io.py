"""Streaming the IR weights between a checkpoint, the artifact's shards and the runtime, at disk speed
and in memory that does not grow with the model.

Writing (`plan_weights`, `write_shards`):

* Every IR weight is a list of pieces, one per source tensor (a stack of experts, or a concatenation
  along the first axis, is the pieces' bytes one after the other, row-major). A piece whose stored
  bytes are exactly the IR's (`COPY`: FP8 / FP4 / E8M0 / BF16 / F32 / I64 stored as the IR takes it) is
  *copied*: read with `pread` from one descriptor per checkpoint file (a large file not in the page cache
  with O_DIRECT: `_Reader`),
  never decoded (the non-finite
  check of `Checkpoint.raw` is done on the bits). Any other piece is *converted* by the checkpoint's
  own reader (`harness._fetch`: BF16 norms to FP32, F32 scales to E8M0, dequantisation, ...).
* A shard is made block by block (`CHUNK_BYTES`, a few reused page-aligned buffers): a worker thread
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
* A checkpoint's weights are laid out in the order of their first source in the checkpoint (sequential
  reads); other sources in name order. Both are deterministic, so the shards are byte-reproducible.
* Each shard is flushed to disk (`fdatasync`, on a thread of its own; through the page cache, also started
  every `SYNC_BYTES`) before the artifact is renamed into place, and a progress line (bytes, rate, ETA) is
  logged every few seconds.

Reading (`MappedWeights`, from `Artifact.weights()`): each shard is mapped; `stream()` gives every
tensor as a zero-copy view (the cpu device keeps them as ONNX Runtime initializers), `chunks()` reads
each shard into a few reused buffers, in a region per hash lane read in turn (an upload to a device or to
the C runtime's host memory: no page faults, a few chunks of memory). Both hash each shard's segments on
hash threads as they go, when the load deferred that check (`load_artifact(defer_weights=True)`), so every
byte is read once, and check each tensor against its digest (the manifest's `sha256`, a tree digest: naming
it) and the shard against its digest.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError, IRError
from .ir.core import Module
from .shard_digest import EMPTY, Lanes, Tree, combine, segments, tree_digest
from .threads import usable_cores

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # a shard is written in blocks of this size, and read in chunks of it
WINDOW_BYTES = 64 << 20  # a writer's blocks in flight (being filled, written or hashed)
SYNC_BYTES = 256 << 20  # a shard written through the page cache starts flushing after this many more bytes
PROGRESS_S = 5.0  # seconds between progress lines
DIRECT_BYTES = 256 << 20  # shards from this size up are written and read around the page cache (O_DIRECT)
MAX_REGIONS = 4  # a shard is read in at most this many places at once (MappedWeights.chunks)
DIRECT_ALIGN = 4096  # O_DIRECT's unit of file offsets, lengths and buffer addresses (4Kn disks included)

# (IR dtype, stored safetensors dtype) pairs whose bytes are the same: such pieces are copied.
COPY = {("fp8e4m3", "F8_E4M3"), ("fp4x2", "I8"), ("fp4x2", "U8"), ("e8m0", "F8_E8M0"), ("e8m0", "U8"),
        ("bf16", "BF16"), ("fp32", "F32"), ("i64", "I64")}
ST_DTYPE = {"fp32": "F32", "bf16": "BF16", "i64": "I64", "i32": "I32", "fp8e4m3": "F8_E4M3", "e8m0": "F8_E8M0",
            "fp4x2": "I8"}


def default_workers() -> int:
    """Conversion / read threads: the cores this process may use, at most 8, at least 2 (one reads while
    another converts)."""
    return max(2, min(8, usable_cores()))


# ---- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """The bytes of one source tensor inside an IR weight: a file range to copy, or a conversion."""

    nbytes: int
    name: str  # the source tensor (canonical name)
    file: Path | None = None  # copy: the checkpoint file and absolute byte offset
    offset: int = 0
    bits: str | None = None  # copy: the non-finite check on the stored bits (fp8 / bf16 / fp32 / e8m0)
    convert: Callable[[], Any] | None = None  # convert: returns the piece as a torch tensor

    @property
    def copied(self) -> bool:
        return self.file is not None


@dataclass
class TensorPlan:
    name: str
    dtype: str  # IR dtype
    shape: tuple[int, ...]
    nbytes: int
    pieces: list[Piece]
    position: tuple = ()  # where its first source lies in the checkpoint (file index, offset)

    @property
    def path(self) -> str:
        kinds = {p.copied for p in self.pieces}
        return "copy" if kinds == {True} else "convert" if kinds == {False} else "mixed"


def _nonfinite_bits(stored: str, scale: bool) -> str | None:
    """Which bit test `Checkpoint.raw`'s non-finite check amounts to for a stored dtype."""
    if stored == "F8_E8M0" or (scale and stored == "U8"):
        return "e8m0"
    return {"F8_E4M3": "fp8", "BF16": "bf16", "F32": "fp32"}.get(stored)


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


def plan_weights(module: Module, source) -> list[TensorPlan]:
    """Every IR weight as pieces to copy or convert, in the order they will be written."""
    from .checkpoint import Checkpoint
    from .trace import expand_sources

    ck = source if isinstance(source, Checkpoint) else None
    file_index = {f: i for i, f in enumerate(sorted({e.file for e in ck.entries.values()}))} if ck else {}
    plans = []
    for w in module.weights.values():
        t = w.type
        names = expand_sources(w.sources)
        stacked = len(w.sources) == 1 and "{0.." in w.sources[0]
        row = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0  # bytes per index of the first axis
        pieces, position = [], ()
        for n in names:
            e = ck.entries.get(n) if ck is not None else None
            if stacked:
                want = t.shape[1:]
            elif len(names) == 1:
                want = t.shape
            else:  # one part of a concatenation along the first axis
                want = (_rows_of(source, n), *t.shape[1:])
            if e is not None:
                f, off, nbytes = ck.stored_range(n)
                position = position or (file_index[f], off)
                if (t.dtype, e.dtype) in COPY and e.shape == tuple(want):
                    bits = None if ck.allow_nonfinite else _nonfinite_bits(e.dtype, n.endswith(".scale"))
                    pieces.append(Piece(nbytes, n, f, off, bits))
                    continue
            # Converted by the source's own reader; the result's shape is checked when it is produced.
            nbytes = row if stacked else t.nbytes if len(names) == 1 else want[0] * row
            pieces.append(Piece(nbytes, n, convert=_converter(source, n, t.dtype, tuple(want), w.name)))
        if sum(p.nbytes for p in pieces) != t.nbytes:
            raise IRError(f"weight @{w.name}: source tensors do not give its IR type", expected=str(t),
                          found=f"{sum(p.nbytes for p in pieces)} bytes from {len(pieces)} source tensors")
        plans.append(TensorPlan(w.name, t.dtype, tuple(t.shape), t.nbytes, pieces, position))
    plans.sort(key=lambda p: (0, p.position, p.name) if p.position else (1, (), p.name))
    return plans


def _converter(source, name: str, dtype: str, shape: tuple[int, ...], weight: str):
    def run():
        from .harness import _fetch

        v = _fetch(source, name, dtype).contiguous()
        if tuple(v.shape) != shape:
            raise IRError(f"weight @{weight}: source tensors do not give its IR type",
                          expected=f"{dtype} {list(shape)} from '{name}'", found=f"{v.dtype} {list(v.shape)}")
        return v
    return run


def _rows_of(source, name: str) -> int:
    """Rows of a source tensor, from its header (a checkpoint) or its value (an in-memory source)."""
    e = getattr(source, "entries", {}).get(name)
    if e is not None:
        return e.shape[0]
    tensors = getattr(source, "tensors", None)
    try:
        return int(tensors[name].shape[0])
    except (TypeError, KeyError, IndexError):
        return 0  # no such tensor: its conversion names the problem


# ---- writing -------------------------------------------------------------------------------------

def shard_groups(plans: list[TensorPlan], shard_bytes: int) -> list[list[TensorPlan]]:
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if groups[-1] and size + p.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.nbytes
    return groups


def shard_header(group: list[TensorPlan]) -> bytes:
    """The safetensors header (length prefix included) of one shard, its tensors in `group` order."""
    from .safetensors_io import header_bytes

    return header_bytes([(p.name, ST_DTYPE[p.dtype], p.shape, p.nbytes) for p in group],
                        {"format": "v4compile-ir-weights"}, sort_keys=True)


class _Progress:
    def __init__(self, total: int, what: str):
        self.total, self.what, self.done = total, what, 0
        self.t0 = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= PROGRESS_S and self.done < self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            log.info("%s: %.2f of %.2f GB (%d%%), %.0f MB/s, ETA %.0f s", self.what, self.done / 1e9, self.total / 1e9,
                     100 * self.done // max(self.total, 1), rate / 1e6, (self.total - self.done) / max(rate, 1))


class _Reader:
    """One read-only descriptor per checkpoint file, opened once. A large file (`DIRECT_BYTES` and up) not
    mostly in the page cache already (`_direct`) is read with O_DIRECT in whole units into a reused buffer per thread, the wanted bytes copied into the block being
    assembled: a checkpoint is read once, and the page cache's copy, readahead and eviction cost 2-4x the CPU
    of that copy here (0.44-0.79 against 0.15-0.20 CPU s per GB). A small file, or one whose file system refuses
    O_DIRECT, is read with `pread` straight into the block (the page cache's readahead serves the reads,
    which go through each file in order)."""

    def __init__(self, block: int = CHUNK_BYTES):
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
                self.fds[path] = fd, _direct(path, fd, os.fstat(fd).st_size, DIRECT_ALIGN)
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
    workers = workers or max(1, default_workers() // share)
    groups = shard_groups(plans, shard_bytes)
    total = sum(p.nbytes for p in plans)
    out = WrittenShards([], {}, {})
    t0 = time.perf_counter()
    w = _ShardWriter(source, workers, max(3, WINDOW_BYTES // share // CHUNK_BYTES), _Progress(total, rel), stop)
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
    """Shards made block by block (CHUNK_BYTES each, in `nbufs` reused page-aligned buffers), one stream of
    blocks over all the shards (a shard's last blocks are hashed, written and flushed while the next one's are
    read: no drain at a shard's end): each block is assembled and then written by a worker (`_fill`: reads,
    conversions and writes release the GIL), blocks in file order, half of the buffers being filled; a block's
    bytes go to the hash lanes as soon as it is assembled, while it is written (each 8 MiB piece of a tensor
    on the next lane: `shard_digest.Lanes`). A buffer is filled again once its write and hashes are done, so
    memory is the buffers, a read buffer per filling thread (`_Reader`) and the conversions in flight,
    whatever the checkpoint's size."""

    def __init__(self, source, workers: int, nbufs: int, prog: _Progress, stop: threading.Event | None):
        self.source, self.prog, self.stop = source, prog, stop
        self.direct = 0  # shards written with O_DIRECT
        self.block = CHUNK_BYTES
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
                sh.fd, sh.direct = _create(sh.path, sh.size >= DIRECT_BYTES and self.block % DIRECT_ALIGN == 0)
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


# ---- reading -------------------------------------------------------------------------------------

def _cached(fd: int, nbytes: int) -> bool:
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


def _direct(path, fd: int, nbytes: int, chunk: int) -> int | None:
    """A second descriptor of a large shard (or checkpoint file: `_Reader`), opened with O_DIRECT: the disk
    writes straight into the chunk buffers, without the page cache's copy and bookkeeping (a fifth of the
    kernel's CPU per byte here), and a file larger than memory does not push everything else out of the
    cache. None for a small file (read again soon: the cache helps), for a file mostly in the page cache
    already (`_cached`: O_DIRECT would read it from the disk again, and where reads and writes share the
    disk, as on this virtual disk, take its bandwidth from the artifact's writes: a cached checkpoint
    compiled at 620-826 MB/s with O_DIRECT, 1,109-1,198 through the cache: `bench/profile_writer.py`),
    where the file system refuses O_DIRECT, or for a chunk size not in whole units; `fd` (the same file,
    checked) then serves every read."""
    if nbytes < DIRECT_BYTES or chunk % DIRECT_ALIGN or not hasattr(os, "O_DIRECT") or _cached(fd, nbytes):
        return None
    try:
        d = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if os.path.samestat(os.fstat(d), os.fstat(fd)):
        return d
    os.close(d)  # replaced since it was checked: read only the checked descriptor
    return None


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
        self.lanes = lanes or default_workers()
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
        prog = _Progress(self.nbytes, "weights read")
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
        `pread` (a large shard with O_DIRECT: `_direct`) into `nbufs` reused buffers (default three per region
        and one): no mapping, no page faults (a fifth of the CPU of touching the mapping), memory of `nbufs`
        chunks. The host side of an upload: use each piece before asking for the next.

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
        prog = _Progress(self.nbytes, "weights read")
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
                fds[i] = fd, _direct(path, fd, shards[i][1].mm.size(), size)
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
        ls = Lanes(lanes or default_workers(), 1 << 62)
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
