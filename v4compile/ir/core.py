"""IR data structures: values, ops, functions, modules.

* A `Value` is an SSA value with a `TensorType`. Its `kind` says where it comes from: an op result
  (`ssa`), a function input (`input`, e.g. token ids or a cache tensor) or a module weight (`weight`,
  printed `@name`, no data in the IR).
* An `Op` names an entry of the op registry, its operands (None for an absent optional operand), its
  results, its attributes and its provenance `loc` (e.g. `layers.7.attn.compressor`).
* A `Function` is an ordered op list with inputs and named outputs; a `Module` holds the weights and
  the entry functions (`prefill`, `decode`, ...).

Ops are immutable; passes build new op lists. Structural equality (`same_as`) compares names, types,
attributes and provenance, which is what the text round trip must preserve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .optable import get_op
from .types import TensorType

SSA, INPUT, WEIGHT = "ssa", "input", "weight"


@dataclass(eq=False)
class Value:
    name: str
    type: TensorType
    kind: str = SSA
    sources: tuple[str, ...] = ()  # weights: the checkpoint tensors it is made of

    def __repr__(self) -> str:
        return f"{'@' if self.kind == WEIGHT else '%'}{self.name}: {self.type}"

    @property
    def ref(self) -> str:
        return ("@" if self.kind == WEIGHT else "%") + self.name


@dataclass(frozen=True, eq=False)
class Op:
    name: str
    operands: tuple[Value | None, ...]
    results: tuple[Value, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    loc: str = ""

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def operand(self, name: str) -> Value | None:
        """The operand of that name in the op's signature (None when an optional one is absent)."""
        return self.operands[get_op(self.name).operand_index(name)]

    def out(self, name: str) -> Value | None:
        """The result of that name in the op's signature (None when an optional one is absent)."""
        names = get_op(self.name).result_names(self.operands, len(self.results))
        get_op(self.name).result_index(name)  # an unknown name is an error, an absent one is None
        return self.results[names.index(name)] if name in names else None

    def named_results(self) -> list[tuple[str, Value]]:
        return list(zip(get_op(self.name).result_names(self.operands, len(self.results)), self.results))

    @property
    def result(self) -> Value:
        assert len(self.results) == 1, self.name
        return self.results[0]

    def key(self) -> tuple:
        return (self.name, tuple(v.ref if v is not None else None for v in self.operands),
                tuple((r.name, r.type) for r in self.results), tuple(sorted(self.attrs.items())), self.loc)

    def replace(self, **changes: Any) -> "Op":
        d = {"name": self.name, "operands": self.operands, "results": self.results, "attrs": self.attrs,
             "loc": self.loc}
        d.update(changes)
        return Op(**d)


@dataclass
class Function:
    name: str
    inputs: list[Value]
    ops: list[Op]
    outputs: list[tuple[str, Value]]  # (output name, value)
    attrs: dict[str, Any] = field(default_factory=dict)

    def key(self, op_key: Callable[[Op], tuple] = Op.key) -> tuple:
        return (self.name, tuple((v.name, v.type) for v in self.inputs), tuple(op_key(op) for op in self.ops),
                tuple((n, v.ref) for n, v in self.outputs), tuple(sorted(self.attrs.items())))

    def output(self, name: str) -> Value:
        for n, v in self.outputs:
            if n == name:
                return v
        raise KeyError(name)

    def producers(self) -> dict[int, Op]:
        """id(value) -> the op that defines it."""
        return {id(r): op for op in self.ops for r in op.results}

    def users(self) -> dict[int, list[Op]]:
        out: dict[int, list[Op]] = {}
        for op in self.ops:
            for v in op.operands:
                if v is not None:
                    out.setdefault(id(v), []).append(op)
        return out


@dataclass
class Module:
    name: str
    weights: dict[str, Value]
    functions: dict[str, Function]
    attrs: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        return (self.name, tuple(sorted(self.attrs.items())), self.body_key())

    def body_key(self, op_key: Callable[[Op], tuple] = Op.key) -> tuple:
        """The weights' and functions' part of `key`, nearly all of its cost (every op's key): a module
        rebuilt with other attrs (`dataclasses.replace`) keeps it. `op_key`: `Op.key`, or one that remembers
        the keys of ops it has seen (the pass manager's: a pass builds new ops and leaves the others as they are)."""
        return (tuple((w.name, w.type, w.sources) for w in self.weights.values()),
                tuple(f.key(op_key) for f in self.functions.values()))

    def same_as(self, other: "Module") -> bool:
        return self.key() == other.key()

    def used_weights(self) -> set[str]:
        return {v.name for f in self.functions.values() for op in f.ops for v in op.operands
                if v is not None and v.kind == WEIGHT}
