"""Compile time, first half of writing an artifact's weights: which bytes each IR weight is made of, and
how the IR weights are cut into shards (the second half, `weights_write`, streams them to disk).

* Every IR weight is a list of pieces, one per source tensor (a stack of experts, or a concatenation
  along the first axis, is the pieces' bytes one after the other, row-major). A piece whose stored
  bytes are exactly the IR's (`COPY`: FP8 / FP4 / E8M0 / BF16 / F32 / I64 stored as the IR takes it) is
  *copied*: a byte range of a checkpoint file, never decoded (the non-finite check of `Checkpoint.raw`
  is done on the bits as they are copied). Any other piece is *converted* by the conversion rule
  (`weights_convert.ir_tensor`: BF16 norms to FP32, F32 scales to E8M0, dequantisation, ...).
* A checkpoint's weights are laid out in the order of their first source in the checkpoint (sequential
  reads); other sources in name order. Both are deterministic, so the shards are byte-reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import IRError
from .ir.core import Module
from .weights_convert import WeightSource, expand_sources, ir_tensor

# (IR dtype, stored safetensors dtype) pairs whose bytes are the same: such pieces are copied.
COPY = {("fp8e4m3", "F8_E4M3"), ("fp4x2", "I8"), ("fp4x2", "U8"), ("e8m0", "F8_E8M0"), ("e8m0", "U8"),
        ("bf16", "BF16"), ("fp32", "F32"), ("i64", "I64")}


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


def plan_weights(module: Module, source: WeightSource) -> list[TensorPlan]:
    """Every IR weight as pieces to copy or convert, in the order they will be written."""
    from .checkpoint import Checkpoint

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
                want = (source.rows(n), *t.shape[1:])
            if e is not None:
                f, off, nbytes = ck.stored_range(n)
                position = position or (file_index[f], off)
                if (t.dtype, e.dtype) in COPY and e.shape == tuple(want):
                    bits = None if ck.allow_nonfinite else _nonfinite_bits(e.dtype, n.endswith(".scale"))
                    pieces.append(Piece(nbytes, n, f, off, bits))
                    continue
            # Converted by the rule (`ir_tensor`); the result's shape is checked when it is produced.
            nbytes = row if stacked else t.nbytes if len(names) == 1 else want[0] * row
            pieces.append(Piece(nbytes, n, convert=_converter(source, n, t.dtype, tuple(want), w.name)))
        if sum(p.nbytes for p in pieces) != t.nbytes:
            raise IRError(f"weight @{w.name}: source tensors do not give its IR type", expected=str(t),
                          found=f"{sum(p.nbytes for p in pieces)} bytes from {len(pieces)} source tensors")
        plans.append(TensorPlan(w.name, t.dtype, tuple(t.shape), t.nbytes, pieces, position))
    plans.sort(key=lambda p: (0, p.position, p.name) if p.position else (1, (), p.name))
    return plans


def _converter(source: WeightSource, name: str, dtype: str, shape: tuple[int, ...], weight: str):
    def run():
        v = ir_tensor(source, name, dtype).contiguous()
        if tuple(v.shape) != shape:
            raise IRError(f"weight @{weight}: source tensors do not give its IR type",
                          expected=f"{dtype} {list(shape)} from '{name}'", found=f"{v.dtype} {list(v.shape)}")
        return v
    return run


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
