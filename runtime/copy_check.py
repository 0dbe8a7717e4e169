"""The host device's check of the prefix cache's copies (`snapshot.py`), as it checks every launch: each copy
the C runtime issues from its copy table comes back to the host callback before it is made (`CRuntime`,
function V4RT_COPY_CALL), and is refused (a DeviceError, the copy not made) unless

* **bytes**: its side in the runtime's buffers lies in the rows the program says that copy needs, and the
  copies of one `v4rt_copy` cover all of them. Those rows are derived here independently of the copy table:
  a snapshot of slot s at boundary P needs the rows the positions before P wrote that a later position reads
  in that slot (`undo.written_rows`, the rollback's own account of a position's writes: every window ring row
  and the overlapping compressors' and indexers' ring rows, HCA rings left out, `prefix_cache.py`); a block
  copy needs every compressed row the positions of a block write into it (every compressed layer, main and
  index planes). The direction is the kind's: a save reads the buffers and writes host memory, a restore the
  reverse, a block copy both sides in the buffers.
* **order**: a snapshot of slot s at boundary P is taken when the last step that wrote slot s ended exactly at
  position P - 1 (nothing after the boundary written yet: a snapshot taken one chunk late is refused); after a
  restore at P, the next step writing slot s starts at position P (the tail continues from the boundary, and
  the restore is not overwritten by anything else first).
Positions come from the steps' own inputs (`pos`, `slot`) as the runtime runs them (`ran`).
"""

from __future__ import annotations

import numpy as np

from v4compile.errors import DeviceError
from v4compile.pool import PoolGeometry

from .undo import written_rows


class _Types:
    """The pool / state buffers as `written_rows` reads them (names, shapes)."""

    def __init__(self, types: dict):
        self.types = types

    def names(self) -> set[str]:
        return set(self.types)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.types[name].shape)


def _intervals(rows: set[tuple[str, int]], row_bytes) -> dict[str, list[tuple[int, int]]]:
    """Rows as merged byte intervals per buffer."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name in sorted({n for n, _ in rows}):
        rb = row_bytes(name)
        iv = []
        for r in sorted(r for n, r in rows if n == name):
            if iv and iv[-1][1] == r * rb:
                iv[-1] = (iv[-1][0], (r + 1) * rb)
            else:
                iv.append((r * rb, (r + 1) * rb))
        out[name] = iv
    return out


class CopyCheck:
    def __init__(self, program):
        self.geo = PoolGeometry.from_attrs(program.attrs)
        fn = next(iter(program.functions.values()))
        self.types = {b.name: b.type for b in fn.buffers if b.kind in ("pool", "state") and b.type is not None}
        self.store = _Types(self.types)
        self.last: dict[int, int] = {}  # slot -> the last position the last step writing it wrote
        self.next: dict[int, int] = {}  # slot -> the position its next step must start at (after a restore)
        self.cur = None
        self._need: dict[tuple, dict] = {}  # what a copy needs, by (kind, slot or block): made once

    def _rb(self, name: str) -> int:
        t = self.types[name]
        return t.nbytes // int(np.prod(t.shape[:-1]))

    # ---- what each copy needs --------------------------------------------------------------------
    def slot_rows(self, slot: int, boundary: int) -> set[tuple[str, int]]:
        """Rows of slot `slot` a position after `boundary` may read that positions before it wrote: every row
        some position of the last ring period writes outside the pool blocks, the HCA rings left out."""
        geo = self.geo
        hca = {f"state.layers.{layer}." for layer, _ in geo.layer_offset} - {
            f"state.layers.{layer}." for layer, _ in geo.index_offset}
        period = max([geo.window] + [self.store.shape(n)[1] for n in self.types if n.startswith("state.")])
        out = set()
        for q in range(boundary - period, boundary):
            out |= {(n, r) for n, r in written_rows(geo, self.store, slot, [], q)
                    if not any(n.startswith(h) for h in hca)}
        return out

    def block_rows(self, block: int) -> set[tuple[str, int]]:
        """Every compressed row the positions of a pool block write into it."""
        geo, out = self.geo, set()
        for q in range(geo.block_tokens):
            out |= set(written_rows(geo, self.store, 0, [block], q)) - set(written_rows(geo, self.store, 0, [], q))
        return out

    # ---- the runtime's hooks ---------------------------------------------------------------------
    def begin(self, kind: int, group: int, index: int, to: int, what) -> None:
        if what is None:
            raise DeviceError("a copy of the copy table without its purpose (what: save / restore / block)")
        op, a, b = what
        if op == "save" and self.last.get(a) != b - 1:
            raise DeviceError(f"snapshot of slot {a} at boundary {b}: the slot's last step wrote up to "
                              f"position {self.last.get(a)}, not {b - 1} (taken out of order)")
        # a whole ring period before any boundary covers every ring row: the slot's need is the same at each
        key = ("slot", a) if op != "block" else ("block", a, b)
        need = self._need.get(key)
        if need is None:
            need = self._need[key] = ({"dev": _intervals(self.slot_rows(a, b), self._rb)} if op != "block" else
                                      {"src": _intervals(self.block_rows(a), self._rb),
                                       "dst": _intervals(self.block_rows(b), self._rb)})
        self.cur = (op, a, b, need, {k: {} for k in need})

    def copy(self, i: int, kind: int, dst, src, nbytes: int) -> None:
        """One copy (range `i` of the table): `dst` / `src` (buffer, offset) in the buffers, or None (host)."""
        if self.cur is None:
            raise DeviceError(f"copy {i} issued outside a checked copy")
        op, a, b, need, seen = self.cur
        sides = {"save": {"dev": src, "host": dst}, "restore": {"dev": dst, "host": src},
                 "block": {"src": src, "dst": dst}}[op]
        if "host" in sides and sides["host"] is not None:
            raise DeviceError(f"{op} of slot {a}: copy {i}'s host side lies in the runtime's buffers (wrong direction)")
        for side, place in sides.items():
            if side == "host":
                continue
            if place is None:
                raise DeviceError(f"{op} {a}: copy {i}'s {side} side is not in the runtime's buffers (wrong direction)")
            name, off = place
            if not any(s <= off and off + nbytes <= e for s, e in need[side].get(name, [])):
                raise DeviceError(f"{op} {a} (boundary / block {b}): copy {i} touches {name} bytes "
                                  f"[{off}, {off + nbytes}), not rows the program says it needs")
            seen[side].setdefault(name, []).append((off, off + nbytes))

    def end(self) -> None:
        op, a, b, need, seen = self.cur
        self.cur = None
        for side, want in need.items():
            got = {n: _merged(v) for n, v in seen[side].items()}
            if got != want:
                missing = sorted(set(want) - set(got)) or sorted(n for n in want if got.get(n) != want[n])
                raise DeviceError(f"{op} {a} (boundary / block {b}): its copies leave out rows it needs "
                                  f"(in {', '.join(missing[:3])})")
        if op == "restore":
            self.last[a] = b - 1
            self.next[a] = b

    def ran(self, inputs) -> None:
        """A step ran: the positions it wrote per slot (`pos` [B, T], `slot` [B]; padding: -1)."""
        if "pos" not in inputs or "slot" not in inputs:
            return
        pos = np.asarray(inputs["pos"]).reshape(len(np.asarray(inputs["slot"]).reshape(-1)), -1)
        for s, row in zip(np.asarray(inputs["slot"]).reshape(-1).tolist(), pos):
            live = row[row >= 0]
            if s < 0 or not live.size:
                continue
            first = int(live.min())
            if s in self.next and first != self.next.pop(s):
                raise DeviceError(f"slot {s} was restored at a boundary, then a step wrote from position {first}")
            self.last[s] = int(live.max())


def _merged(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(iv):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
