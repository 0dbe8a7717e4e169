"""Building a function by recording op calls (what the tracer uses).

While a `Builder` is active, calling an op with `Value` operands appends an `Op` to it, with result
types from the op's shape rule and provenance from the current scope.
"""

from __future__ import annotations

from typing import Any

from .core import INPUT, SSA, Function, Op, Value
from .registry import RECORDER
from .types import TensorType


class Builder:
    def __init__(self, name: str):
        self.fn = Function(name=name, inputs=[], ops=[], outputs=[])
        self._next = 0
        self._token = None

    def __enter__(self) -> "Builder":
        self._token = RECORDER.set(self)
        return self

    def __exit__(self, *exc) -> None:
        RECORDER.reset(self._token)

    def input(self, name: str, type: TensorType) -> Value:
        v = Value(name, type, INPUT)
        self.fn.inputs.append(v)
        return v

    def fresh(self, type: TensorType) -> Value:
        v = Value(str(self._next), type, SSA)
        self._next += 1
        return v

    def emit(self, opdef, operands: list[Any], attrs: dict[str, Any], loc: str) -> list[Value]:
        for o, v in zip(opdef.operands, operands):
            if v is not None and not isinstance(v, Value):
                raise TypeError(f"{opdef.name}: operand '{o.name}' must be an IR value while tracing, got "
                                f"{type(v).__name__}")
        types = opdef.result_types([v.type if v is not None else None for v in operands], attrs)
        results = tuple(self.fresh(t) for t in types)
        self.fn.ops.append(Op(opdef.name, tuple(operands), results, dict(attrs), loc))
        return list(results)

    def output(self, name: str, value: Value) -> None:
        self.fn.outputs.append((name, value))
