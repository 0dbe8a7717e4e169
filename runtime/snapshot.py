"""The prefix cache's copies (`prefix_cache.py`): a boundary snapshot of a slot's rings, its restore into
another slot, a pool block copied on write. One table, derived from the program's pool geometry and its
buffers' types (`copy_ranges`): a range is a buffer's rows at index k (a slot, or a pool block), `rows` rows
from `first + k * stride`:

* group SLOT: every main plane's window rings of the slot (`slot_rows` rows, counted from the top of the
  pool: a negative stride) and the overlapping (CSA) compressors' and indexers' state rings
  (`state.layers.<l>.*`, S rows at k * S); an HCA compressor's ring is left out (at a boundary it holds the
  window just closed, which nothing reads again: `prefix_cache.py`);
* group BLOCK: a pool block's envelope in every main plane and in every index plane.

On the C runtime (host, hip, cuda) the table is the runtime's copy table (`CRuntime.copy_table`, v4rt.h): the
C runtime issues each copy from it (a snapshot into one host array, its restore, a block into another), on
the device's stream in order with the kernels, and the host device checks every copy's bytes and order
(`copy_check.py`). On the cpu device the same ranges are numpy slices of the backend's arrays.

**Outside the captured decode graphs, on purpose.** A snapshot is taken only where a prefill chunk ends at a
piece boundary, and a restore or a block copy only when a new sequence's prompt hits: events of prefill, which
runs launch by launch, never of a decode step. Their slot and block are chosen at run time; a captured graph
replays fixed addresses, so inside one they would need a graph per (slot, block) or copy kernels reading the
slot from a step input, and every replayed decode step would carry them for the rare step that needs one.
Outside, they cost nothing when no boundary is passed, and being on the same stream they are ordered with
the prefill launches around them without a synchronisation (a save is read back to the host, which waits).
"""

from __future__ import annotations

import numpy as np

SLOT, BLOCK = 0, 1  # the copy table's groups


def copy_ranges(geo, names, shape) -> list[tuple[str, int, int, int, int]]:
    """(buffer, group, first row, stride in rows, rows) of the copy table, from the pool geometry `geo`
    (`v4compile.pool.PoolGeometry`), the pool / state buffer names and `shape(name)`."""
    main = [n for n, _, _ in geo.main_planes()]
    out = [(n, BLOCK, 0, geo.envelope_rows, geo.envelope_rows) for n in main]
    if geo.index_offset:
        out += [(n, BLOCK, 0, geo.index_envelope_rows, geo.index_envelope_rows) for n, _, _ in geo.index_planes()]
    out += [(n, SLOT, geo.n_rows - geo.slot_rows, -geo.slot_rows, geo.slot_rows) for n in main]
    csa = tuple(f"state.layers.{layer}." for layer, _ in geo.index_offset)
    for n in sorted(names):
        if n.startswith(csa):
            S = shape(n)[1]
            out.append((n, SLOT, 0, S, S))
    return out


class ArrayCopies:
    """The cpu device's copies: the same ranges as numpy slices of the backend's arrays (`undo._Arrays`)."""

    def __init__(self, store):
        self.store = store
        self.ranges = copy_ranges(store.geometry, store.names(), store.shape)
        self.nbytes_slot = sum(rows * store.get_rows(n, 0, 1).nbytes for n, g, _, _, rows in self.ranges if g == SLOT)

    def _at(self, group: int, k: int):
        for n, g, first, stride, rows in self.ranges:
            if g == group:
                yield n, first + k * stride, rows

    def save(self, slot: int, boundary: int) -> dict[str, np.ndarray]:
        return {n: self.store.get_rows(n, row, rows) for n, row, rows in self._at(SLOT, slot)}

    def restore(self, slot: int, snap: dict[str, np.ndarray], boundary: int) -> None:
        for n, row, _ in self._at(SLOT, slot):
            self.store.put_rows(n, row, snap[n])

    def copy_block(self, src: int, dst: int) -> None:
        for (n, row, rows), (_, to, _) in zip(self._at(BLOCK, src), self._at(BLOCK, dst)):
            self.store.put_rows(n, to, self.store.get_rows(n, row, rows))


class RuntimeCopies:
    """The C runtime's copies (host, hip, cuda): the table given to the runtime once, each copy issued by it."""

    def __init__(self, store):
        from .c_backend import COPY_DEVICE, COPY_RESTORE, COPY_SAVE

        self.kinds = (COPY_SAVE, COPY_RESTORE, COPY_DEVICE)
        self.rt = store.rt
        table, self.nbytes = [], {SLOT: 0, BLOCK: 0}
        for n, g, first, stride, rows in copy_ranges(store.geometry, store.names(), store.shape):
            i, _, rb = store._where(n, 0)
            table.append((i, g, first * rb, stride * rb, rows * rb))
            self.nbytes[g] += rows * rb
        self.rt.copy_table(table)
        self.nbytes_slot = self.nbytes[SLOT]

    def save(self, slot: int, boundary: int) -> dict[str, np.ndarray]:
        out = np.empty(self.nbytes[SLOT], dtype=np.uint8)
        self.rt.copy(self.kinds[0], SLOT, slot, host=out, what=("save", slot, boundary))
        return {"slot": out}

    def restore(self, slot: int, snap: dict[str, np.ndarray], boundary: int) -> None:
        self.rt.copy(self.kinds[1], SLOT, slot, host=snap["slot"], what=("restore", slot, boundary))

    def copy_block(self, src: int, dst: int) -> None:
        self.rt.copy(self.kinds[2], BLOCK, src, to=dst, what=("block", src, dst))


def copies(backend):
    """The backend's copies, made once per backend (the C runtime's table is given once)."""
    from .undo import access

    c = getattr(backend, "_copies", None)
    if c is None:
        store = access(backend)
        c = backend._copies = RuntimeCopies(store) if hasattr(backend, "rt") else ArrayCopies(store)
    return c
