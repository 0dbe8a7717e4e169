"""Rollback of the paged KV pool for speculative decoding: the compiled counterpart of the reference's undo
log (`v4compile/model/speculative.py`, which says what each kind of state does).

A verify step writes positions L .. L + k of a sequence; before it, `PoolUndo` saves every row those
positions can write, and `restore(keep)` puts back the rows of the rejected positions (>= keep). Rows, in
the pool's geometry (`v4compile/pool.py`), for position q of the sequence in slot s with blocks `blocks`:

* the window ring of every layer (with a compiled MTP block, its ring too: layer `n_layers`): main row
  `n_rows - (s + 1) * slot_rows + layer * window + q % window`;
* a compressed row when q closes window w = q // m of a CSA / HCA layer: main row
  `blocks[w // per_block] * envelope + offset + w % per_block` (per_block = block_tokens / m), and the
  CSA indexer's key row at the same place in the index planes;
* the compressor rings `state.layers.<l>.<key>` `[n_slots, S, c * d]`: row `s * S + q % S` of the buffer
  seen as `[n_slots * S, c * d]` (m = S / c; c = 2 for CSA, whose indexer rings are the same shape rule).

Every plane of a family (FP8 values, scales, RoPE; FP4 packed, scales) has one row per row index, so a
row is saved and restored across all of them: the FP8 / FP4 bytes come back exactly. Works on the cpu
backend's host arrays and on the C runtime's buffers (host device and GPUs: row-sized reads and writes).
"""

from __future__ import annotations

import numpy as np

from v4compile.model.cache import state_input_name
from v4compile.pool import PoolGeometry

_STATE_KEYS = ("state_kv", "state_gate", "index_state_kv", "index_state_gate")


class _Arrays:
    """The cpu backend's pool and state (numpy arrays it owns), as 2-D row spaces."""

    def __init__(self, backend):
        self.state = backend.state
        self.geometry = geometry_of(backend.art.manifest)
        self._views: dict[str, np.ndarray] = {}

    def names(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.state[name].shape

    def get_all(self, name: str) -> np.ndarray:
        return self.state[name]

    def _rows(self, name: str) -> np.ndarray:
        """The buffer as a 2-D view, made once (the backend updates its arrays in place, never replaces them)."""
        v = self._views.get(name)
        if v is None:
            a = self.state[name]
            v = self._views[name] = a.reshape(-1, a.shape[-1])
        return v

    def get(self, name: str, row: int) -> np.ndarray:
        return self._rows(name)[row].copy()

    def put(self, name: str, row: int, value: np.ndarray) -> None:
        self._rows(name)[row] = value

    def get_rows(self, name: str, row: int, n: int) -> np.ndarray:
        """Rows row .. row + n - 1 (a copy): a slot's rings, a pool block (the prefix cache)."""
        return self._rows(name)[row:row + n].copy()

    def put_rows(self, name: str, row: int, value: np.ndarray) -> None:
        self._rows(name)[row:row + len(value)] = value


class _Buffers:
    """The C runtime's pool and state buffers (any device), read and written a row at a time."""

    def __init__(self, backend):
        self.rt = backend.rt
        fn = next(iter(backend.program.functions.values()))
        self.fname = fn.name
        self.types = {b.name: b.type for b in fn.buffers if b.type is not None}
        self.geometry = PoolGeometry.from_attrs(backend.program.attrs)  # a GPU program's own pool (FP8 / FP4)

    def names(self) -> set[str]:
        return set(self.types)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.types[name].shape)

    def _where(self, name: str, row: int) -> tuple[int, int, int]:
        t = self.types[name]
        rb = t.nbytes // int(np.prod(t.shape[:-1]))
        return self.rt.sched.buffer_index(self.fname, name), row * rb, rb

    def get_all(self, name: str):
        return self.rt.read(self.rt.sched.buffer_index(self.fname, name)).numpy()

    def get(self, name: str, row: int):
        i, off, n = self._where(name, row)
        return self.rt.read(i, off, n)

    def put(self, name: str, row: int, value) -> None:
        i, off, _ = self._where(name, row)
        self.rt.write(i, value, off)

    def get_rows(self, name: str, row: int, n: int) -> np.ndarray:
        """Rows row .. row + n - 1 as raw bytes (one read: a slot's rings, a pool block)."""
        i, off, rb = self._where(name, row)
        return self.rt.read(i, off, n * rb).numpy()

    def put_rows(self, name: str, row: int, value) -> None:
        i, off, _ = self._where(name, row)
        self.rt.write(i, value, off)


def access(backend):
    """The backend's pool and state as row spaces: made once per backend (the geometry is parsed once; a
    speculative step saves rows every step)."""
    store = getattr(backend, "_row_store", None)
    if store is None:
        store = backend._row_store = _Buffers(backend) if hasattr(backend, "rt") else _Arrays(backend)
    return store


def _layout(geo: PoolGeometry, store) -> tuple[list[str], list[str], list[tuple]]:
    """The part of `written_rows` that does not depend on the position: the main and index plane names and, per
    compressed layer, (envelope offset, ring slots S, ratio m, its state buffers, its indexer offset or None).
    Made once per store (again when the backend has made more state buffers)."""
    names = store.names()
    cached = getattr(store, "_layout", None)
    if cached is not None and cached[0] == len(names):
        return cached[1]
    main = [n for n, _, _ in geo.main_planes()]
    index = [n for n, _, _ in geo.index_planes()] if geo.index_offset else []
    csa = dict(geo.index_offset)
    layers = []
    for layer, off in geo.layer_offset:
        S = store.shape(state_input_name(layer, "state_kv"))[1]
        states = [n for n in (state_input_name(layer, key) for key in _STATE_KEYS) if n in names]
        layers.append((off, S, S // (2 if layer in csa else 1), states, csa.get(layer)))
    store._layout = (len(names), (main, index, layers))
    return main, index, layers


def written_rows(geo: PoolGeometry, store, slot: int, blocks: list[int], q: int,
                 window_layer: int | None = None) -> list[tuple[str, int]]:
    """(buffer, row) of everything decoding position q of the sequence in `slot` writes (`window_layer`:
    only that layer's window ring row, e.g. the MTP layer's, whose ring is the last one of a slot)."""
    main, index, layers = _layout(geo, store)
    base = geo.n_rows - (slot + 1) * geo.slot_rows + q % geo.window
    out = [(n, base + layer * geo.window) for layer in
           (range(geo.n_window_layers) if window_layer is None else (window_layer,)) for n in main]
    if window_layer is not None:
        return out
    for off, S, m, states, index_off in layers:
        out += [(n, slot * S + q % S) for n in states]
        if (q + 1) % m:
            continue
        w, per = q // m, geo.block_tokens // m
        if w // per >= len(blocks):
            continue
        b = blocks[w // per]
        out += [(n, b * geo.envelope_rows + off + w % per) for n in main]
        if index_off is not None:
            out += [(n, b * geo.index_envelope_rows + index_off + w % per) for n in index]
    return out


class PoolUndo:
    """Saved rows of the positions `first .. last` of some sequences (`spans`: slot, blocks, first, last)."""

    def __init__(self, backend, spans: list[tuple[int, list[int], int, int]], window_layer: int | None = None):
        self.store = access(backend)
        self.saved = []
        self.last: dict[int, int] = {}  # slot -> its last saved position
        for slot, blocks, first, last in spans:
            for q in range(first, last + 1):
                for name, row in written_rows(self.store.geometry, self.store, slot, blocks, q, window_layer):
                    self.saved.append((slot, q, name, row, self.store.get(name, row)))
            self.last[slot] = max(last, self.last.get(slot, last))

    def restore(self, keep: dict[int, int]) -> None:
        """Put back the rows written for positions >= keep[slot] (in reverse, so a row two positions share
        gets its oldest saved value)."""
        if all(keep.get(slot, 0) > last for slot, last in self.last.items()):
            return  # every saved position kept (every draft accepted)
        for slot, q, name, row, value in reversed(self.saved):
            if q >= keep.get(slot, 0):
                self.store.put(name, row, value)


def geometry_of(manifest: dict) -> PoolGeometry:
    """The pool geometry an artifact's manifest records (`pool`: the module's `pool.*` attributes)."""
    return PoolGeometry.from_attrs({f"pool.{k}": tuple(v) if isinstance(v, list) else v
                                    for k, v in manifest["pool"].items()})
