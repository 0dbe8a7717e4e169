"""The digest of a weights shard, as the manifest's `files` records it, and the threads that compute it.

A shard is cut into *segments*: its header (the 8-byte length and the JSON, padding included), then each
non-empty tensor, and any bytes between or after the tensors, in file order; together they cover every byte
of the file once. The shard's digest is

    sha256(TAG || sha256(segment 0) || sha256(segment 1) || ...)      (32-byte digests, file order)

so a tensor's sha256 (the manifest's `weights.tensors.<name>.sha256`) is one of its inputs. The writer hashes
every byte once (the tensors as it writes them, plus the small header) instead of twice (tensor and whole
file), and a reader hashes the segments on several threads at once (`Lanes`: hashlib releases the GIL for
large buffers), where one whole-file sha256 is one thread's speed. Any changed byte changes its segment's
sha256 and so the shard's digest (sha256's collision resistance); the segments are fixed by the header, which
is itself a segment.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

TAG = b"v4compile weights shard, sha256 of its segments\n"
EMPTY = hashlib.sha256().hexdigest()  # the sha256 of a tensor with no bytes (not a segment)


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
    """The shard's digest from its segments' sha256 digests, in file order."""
    h = hashlib.sha256(TAG)
    for d in digests:
        h.update(d)
    return h.hexdigest()


class Lanes:
    """sha256 of many byte streams at once. Each stream's updates run in order on one thread (its lane);
    streams are dealt to lanes in turn, so different tensors are hashed in parallel. `backlog` bounds the
    bytes submitted and not yet hashed (the caller's buffers stay alive until then): `submit` waits for the
    oldest updates beyond it."""

    def __init__(self, lanes: int, backlog: int):
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix=f"sha-{i}") for i in range(max(1, lanes))]
        self.turn, self.backlog = 0, backlog
        self.pending: deque[tuple[Future, int]] = deque()
        self.held = 0

    def stream(self, lane: int | None = None) -> tuple[Any, ThreadPoolExecutor]:
        """A new stream: (its sha256 object, its lane): the next lane in turn, or lane `lane` (modulo)."""
        if lane is None:
            lane, self.turn = self.turn, self.turn + 1
        return hashlib.sha256(), self.pools[lane % len(self.pools)]

    def submit(self, stream: tuple[Any, ThreadPoolExecutor], data, done: Callable[[], None] | None = None) -> Future:
        """Hash `data` (kept alive until hashed) into `stream`; `done()` runs once it has been hashed."""
        h, lane = stream
        n = memoryview(data).nbytes
        while self.pending and self.held + n > self.backlog:
            f, k = self.pending.popleft()
            f.result()
            self.held -= k
        fut = lane.submit(h.update, data)
        if done is not None:
            fut.add_done_callback(lambda _: done())
        self.pending.append((fut, n))
        self.held += n
        return fut

    def drain(self) -> None:
        for f, _ in self.pending:
            f.result()
        self.pending.clear()
        self.held = 0

    def close(self) -> None:
        """Stop: updates not started are dropped (their `done` still runs), running ones finish."""
        for p in self.pools:
            p.shutdown(wait=True, cancel_futures=True)

