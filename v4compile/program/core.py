"""Program data: buffers, and ordered launches whose arguments are (buffer, byte offset, type, strides).

Buffers are named once per program and shared by name between its functions:
* `arena`  - every intermediate value (one arena for the whole program: functions run one at a time);
* `input`  - a step input the runtime fills before each call (`ids`, `pos`, `block_table`, `slot`);
* `pool`   - a KV-pool plane, `state` - per-sequence compressor state (both persist across calls and are
             updated in place by tied results);
* `weight` - a module weight (read-only), `output` - a step output the runtime reads after the call.
A launch is one op of the lowered IR: its registry op name, its kernel family, its semantic attributes
(the scalar arguments) and every operand / result as an `Arg`. Functions never copy a buffer: a state
or pool output is its input buffer, updated in place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ..ir.types import BYTES, TensorType

BUFFER_KINDS = ("arena", "input", "pool", "state", "weight", "output")


@dataclass(frozen=True)
class Buffer:
    name: str
    kind: str
    nbytes: int
    align: int = 256
    type: TensorType | None = None  # the whole buffer's type (None for the arena: raw bytes)


@dataclass(frozen=True)
class Arg:
    buffer: str
    offset: int  # bytes from the buffer's base
    type: TensorType
    strides: tuple[int, ...]  # elements
    value: str = ""  # the IR value it holds (for reading the program)
    root: str = ""  # the value owning the storage (views and in-place updates share their root's)

    @property
    def extent(self) -> tuple[int, int]:
        """[first byte, one past the last byte) that the value touches."""
        if self.type.numel == 0:
            return self.offset, self.offset
        last = sum((n - 1) * s for n, s in zip(self.type.shape, self.strides))
        return self.offset, self.offset + (last + 1) * BYTES[self.type.dtype]


@dataclass(frozen=True)
class Launch:
    op: str
    kernel: str | None
    operands: tuple[tuple[str, Arg | None], ...]
    results: tuple[tuple[str, Arg], ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    loc: str = ""

    @property
    def specialisation(self) -> str:
        """What a compiled kernel depends on: op, attributes but the op's launch-time offsets (registry trait
        `offset_attrs`: a layer's pool rows), and every argument's type and strides (not its address).
        Launches with equal keys share one binary."""
        from ..ir.registry import get_op

        offsets = get_op(self.op).offset_attrs
        parts = [self.op, repr(sorted((k, v) for k, v in self.attrs.items() if k not in offsets))]
        for n, a in self.operands + self.results:
            parts.append(f"{n}:-" if a is None else f"{n}:{a.type}:{a.strides}")
        return f"{self.op}-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:12]}"


@dataclass
class FunctionProgram:
    name: str
    buffers: list[Buffer]
    launches: list[Launch]
    outputs: list[tuple[str, Arg]]
    attrs: dict[str, Any] = field(default_factory=dict)

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)


@dataclass
class Program:
    name: str
    functions: dict[str, FunctionProgram]
    attrs: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        return (self.name, tuple(sorted(self.attrs.items())),
                tuple((f.name, tuple(f.buffers), tuple((l.op, l.kernel, l.operands, l.results,
                                                        tuple(sorted(l.attrs.items())), l.loc) for l in f.launches),
                       tuple(f.outputs), tuple(sorted(f.attrs.items()))) for f in self.functions.values()))

    def same_as(self, other: "Program") -> bool:
        return self.key() == other.key()
