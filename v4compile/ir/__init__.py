"""The v4compile IR: types, values and ops, the op registry, building, text form, verification and
interpretation."""

from .core import INPUT, SSA, WEIGHT, Function, Module, Op, Value
from .types import TensorType

__all__ = ["Function", "Module", "Op", "Value", "TensorType", "INPUT", "SSA", "WEIGHT"]
