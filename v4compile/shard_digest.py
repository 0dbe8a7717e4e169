"""The digest of a weights shard and of each of its tensors, as the manifest records them, and the threads
that compute them.

A *segment* (a tensor's bytes, or any other run of a shard, see below) is digested as `HASH`
("sha256-tree-8MiB"): cut into pieces of `PIECE_BYTES` (8 MiB; the last one shorter, none for no bytes),

    tree(segment) = sha256(TREE_TAG || sha256(piece 0) || sha256(piece 1) || ...)     (32-byte digests)

so the pieces of one large tensor are hashed on several threads at once (one sha256 stream runs on one core,
~1.2 GB/s here, slower than a fast disk: a 268 MB tensor hashed whole kept one core busy while the other
waited). The manifest's `weights.tensors.<name>.sha256` is a tensor's tree digest (hex), and its `weights.hash`
names the scheme. The piece size is part of the format, not of any reader's or writer's buffer size.

A shard is cut into segments: its header (the 8-byte length and the JSON, padding included), then each
non-empty tensor, and any bytes between or after the tensors, in file order; together they cover every byte
of the file once. The shard's digest is

    sha256(TAG || tree(segment 0) || tree(segment 1) || ...)      (32-byte digests, file order)

so a tensor's digest is one of its inputs. The writer hashes every byte once (the tensors as it writes them,
plus the small header) instead of twice (tensor and whole file), and a reader hashes the pieces on several
threads at once (`Lanes`: hashlib releases the GIL for large buffers). Any changed byte changes its piece's
sha256, so its segment's digest and the shard's (sha256's collision resistance); the segments are fixed by the
header, which is itself a segment, and the pieces by the segments.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

HASH = "sha256-tree-8MiB"  # the manifest's name for the scheme (`weights.hash`)
PIECE_BYTES = 8 << 20
TREE_TAG = b"v4compile sha256-tree-8MiB\n"
TAG = b"v4compile weights shard, sha256 of its segments\n"


class Tree:
    """A segment's digest (`tree`), its bytes given in order (`Lanes.submit`), each piece's sha256 on a lane."""

    def __init__(self, lane=None):
        self.lane = lane  # the lane of all its pieces, or None: each piece on the next lane in turn
        self.pieces: list[Any] = []  # each piece's sha256 object
        self.piece_lane: Any = None  # the lane of the last piece
        self.pos = 0  # bytes given so far

    def digest(self) -> bytes:
        h = hashlib.sha256(TREE_TAG)
        for p in self.pieces:
            h.update(p.digest())
        return h.digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


def tree_digest(data) -> Tree:
    """The tree digest of bytes at hand (a header; tests), on this thread."""
    t, mv = Tree(), memoryview(data).cast("B")
    for lo in range(0, len(mv), PIECE_BYTES):
        t.pieces.append(hashlib.sha256(mv[lo:lo + PIECE_BYTES]))
    t.pos = len(mv)
    return t


EMPTY = Tree().hexdigest()  # the digest of a tensor with no bytes (not a segment)


def segments(data_start: int, tensors: dict[str, Any], size: int) -> list[tuple[int, int, str | None]]:
    """(begin, end, tensor name or None) covering [0, size) of a shard file in order: the header, each
    non-empty tensor (`TensorInfo`s, offsets relative to `data_start`), the bytes outside them (None)."""
    out: list[tuple[int, int, str | None]] = [(0, data_start, None)]
    pos = data_start
    for b, e, n in sorted((data_start + i.begin, data_start + i.end, n) for n, i in tensors.items() if i.end > i.begin):
        if b > pos:
            out.append((pos, b, None))
        out.append((b, e, n))
        pos = e
    if size > pos:
        out.append((pos, size, None))
    return out


def combine(digests: Iterable[bytes]) -> str:
    """The shard's digest from its segments' tree digests, in file order."""
    h = hashlib.sha256(TAG)
    for d in digests:
        h.update(d)
    return h.hexdigest()


class Lanes:
    """Tree digests (`Tree`) of many byte streams at once. Each piece's updates run in order on one thread
    (its lane); pieces are dealt to lanes in turn (or all of a stream's to the lane it was given), so the
    pieces of one tensor, and different tensors, are hashed in parallel. `backlog` bounds the bytes submitted
    and not yet hashed (the caller's buffers stay alive until then): `submit` waits for the oldest updates
    beyond it."""

    def __init__(self, lanes: int, backlog: int):
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix=f"sha-{i}") for i in range(max(1, lanes))]
        self.turn, self.backlog = 0, backlog
        self.pending: deque[tuple[Future, int]] = deque()
        self.held = 0

    def stream(self, lane: int | None = None) -> tuple[Tree, ThreadPoolExecutor | None]:
        """A new stream: (its digest, its lane): with `lane`, every piece on lane `lane` (modulo); else each
        piece on the next lane in turn."""
        pool = None if lane is None else self.pools[lane % len(self.pools)]
        return Tree(pool), pool

    def submit(self, stream: tuple[Tree, Any], data, done: Callable[[], None] | None = None) -> Future:
        """Hash `data` (the stream's next bytes, kept alive until hashed) into `stream`; the future is done
        (and `done()` runs) once all of it has been hashed."""
        tree = stream[0]
        mv = memoryview(data).cast("B")
        n = len(mv)
        while self.pending and self.held + n > self.backlog:
            f, k = self.pending.popleft()
            f.result()
            self.held -= k
        futs, at = [], 0
        while at < n:
            if tree.pos % PIECE_BYTES == 0:  # a new piece starts here
                tree.pieces.append(hashlib.sha256())
                lane = tree.lane
                if lane is None:
                    lane, self.turn = self.pools[self.turn % len(self.pools)], self.turn + 1
                tree.piece_lane = lane
            k = min(n - at, PIECE_BYTES - tree.pos % PIECE_BYTES)
            futs.append(tree.piece_lane.submit(tree.pieces[-1].update, mv[at:at + k]))
            at, tree.pos = at + k, tree.pos + k
        fut = futs[0] if len(futs) == 1 else _all(futs) if futs else _done()
        if done is not None:
            fut.add_done_callback(lambda _: done())
        self.pending.append((fut, n))
        self.held += n
        return fut

    def prune(self) -> None:
        """Forget the oldest updates that are done (a long-lived `Lanes` whose backlog is bounded elsewhere)."""
        while self.pending and self.pending[0][0].done():
            self.held -= self.pending.popleft()[1]

    def drain(self) -> None:
        for f, _ in self.pending:
            f.result()
        self.pending.clear()
        self.held = 0

    def close(self) -> None:
        """Stop: updates not started are dropped (their `done` still runs), running ones finish."""
        for p in self.pools:
            p.shutdown(wait=True, cancel_futures=True)


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


def _all(futs: list[Future]) -> Future:
    """A future done once all of `futs` are: cancelled if one was, failed with the first failure."""
    out: Future = Future()
    left = [len(futs)]
    lock = threading.Lock()

    def one(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        if any(f.cancelled() for f in futs):
            out.cancel()
            return
        err = next((f.exception() for f in futs if f.exception() is not None), None)
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(None)
    for f in futs:
        f.add_done_callback(one)
    return out
