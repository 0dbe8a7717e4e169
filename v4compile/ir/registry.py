"""The op registry: every op of the IR, declared once.

An op is declared with a signature string and a torch reference implementation:

    @defop("rms_norm(x, weight?) -> y", attrs={"eps": float})
    def rms_norm(x, weight, *, eps): ...          # the reference: tensors in, tensors out

    @rms_norm.infer
    def _(x, weight, *, eps): return x            # the shape/dtype rule on TensorTypes

The same `OpDef` is what the reference model calls. With tensors it runs the reference; with IR
values (while tracing) it records an op in the function being built. The interpreter, the verifier,
and later the kernel tests and cost reports all read this one entry.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import IRError
from .core import Value
from .types import TensorType

REGISTRY: dict[str, "OpDef"] = {}

ATTR_TYPES = (int, float, bool, str, tuple)
_NO_DEFAULT = object()

# Provenance: the model pushes module paths (`layers.7.attn`) while it runs; traced ops record them.
_scope: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("v4_scope", default=())


@contextlib.contextmanager
def scope(name: str):
    token = _scope.set(_scope.get() + (name,))
    try:
        yield
    finally:
        _scope.reset(token)


def current_loc() -> str:
    return ".".join(_scope.get())


@dataclass(frozen=True)
class Operand:
    name: str
    optional: bool


@dataclass(frozen=True)
class AttrSpec:
    name: str
    type: type
    default: Any = _NO_DEFAULT

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT


_SIG = re.compile(r"^\s*(\w+)\s*\((.*)\)\s*->\s*(.+)$")


class OpDef:
    def __init__(self, sig: str, attrs: dict[str, Any], ref: Callable, doc: str):
        m = _SIG.match(sig)
        if not m:
            raise ValueError(f"bad op signature {sig!r}")
        self.name = m.group(1)
        self.operands = tuple(Operand(a.strip().rstrip("?"), a.strip().endswith("?"))
                              for a in m.group(2).split(",") if a.strip())
        self.results = tuple(r.strip().rstrip("?") for r in m.group(3).split(","))
        self.optional_results = sum(1 for r in m.group(3).split(",") if r.strip().endswith("?"))
        self.attrs: dict[str, AttrSpec] = {}
        for k, v in attrs.items():
            t, d = (v if isinstance(v, tuple) else (v, _NO_DEFAULT))
            if t not in ATTR_TYPES:
                raise ValueError(f"{self.name}: attribute {k} has unsupported type {t}")
            self.attrs[k] = AttrSpec(k, t, d)
        self.ref = ref
        self.doc = doc
        self._infer: Callable | None = None
        self.sig = sig

    def __repr__(self) -> str:
        return f"OpDef({self.sig})"

    def infer(self, fn: Callable) -> Callable:
        self._infer = fn
        return fn

    # ---- attribute checking --------------------------------------------------------------------
    def normalize_attrs(self, attrs: dict[str, Any], where: str = "") -> dict[str, Any]:
        """Fill defaults, reject unknown / missing / mistyped attributes. Names starting with `_` are
        annotations (e.g. the memory plan's `_arena`): any op may carry them and references never see them."""
        at = where or f"op '{self.name}'"
        notes = {k: v for k, v in attrs.items() if k.startswith("_")}
        attrs = {k: v for k, v in attrs.items() if not k.startswith("_")}
        unknown = sorted(set(attrs) - set(self.attrs))
        if unknown:
            raise IRError(f"unknown attribute '{unknown[0]}' for op '{self.name}'", where=at,
                          expected=sorted(self.attrs) or "no attributes")
        out: dict[str, Any] = {}
        for k, spec in self.attrs.items():
            if k not in attrs:
                if spec.required:
                    raise IRError(f"missing attribute '{k}' for op '{self.name}'", where=at)
                out[k] = spec.default
                continue
            v = attrs[k]
            if spec.type is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if spec.type is tuple and isinstance(v, list):
                v = tuple(v)
            ok = isinstance(v, spec.type) and not (spec.type is int and isinstance(v, bool))
            if spec.type is tuple:
                ok = ok and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v)
            if not ok:
                raise IRError(f"attribute '{k}' of op '{self.name}' must be {spec.type.__name__}", where=at,
                              found=repr(v))
            out[k] = v
        for k, v in notes.items():
            if not isinstance(v, ATTR_TYPES):
                raise IRError(f"annotation '{k}' has an unsupported value", where=at, found=repr(v))
            out[k] = v
        return out

    # ---- typing --------------------------------------------------------------------------------
    def result_types(self, operand_types: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        if self._infer is None:
            raise NotImplementedError(f"op {self.name} has no shape rule")
        r = self._infer(*operand_types, **semantic(attrs))
        rs = list(r) if isinstance(r, (tuple, list)) else [r]
        if not len(self.results) - self.optional_results <= len(rs) <= len(self.results):
            raise AssertionError(f"{self.name}: shape rule returned {len(rs)} types for {len(self.results)} results")
        return rs

    # ---- dispatch ------------------------------------------------------------------------------
    def bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        if len(args) > len(self.operands):
            raise TypeError(f"{self.name}() takes {len(self.operands)} operands, got {len(args)}")
        operands = list(args) + [None] * (len(self.operands) - len(args))
        attrs = {}
        for k, v in kwargs.items():
            idx = next((i for i, o in enumerate(self.operands) if o.name == k), None)
            if idx is not None:
                operands[idx] = v
            else:
                attrs[k] = v
        for o, v in zip(self.operands, operands):
            if v is None and not o.optional:
                raise TypeError(f"{self.name}(): missing operand '{o.name}'")
        return operands, attrs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        operands, attrs = self.bind(args, kwargs)
        attrs = self.normalize_attrs(attrs)
        if any(isinstance(v, Value) for v in operands):
            from .builder import current_builder
            results = current_builder().emit(self, operands, attrs, current_loc())
        else:
            results = self.ref(*operands, **attrs)
        if isinstance(results, (list, tuple)) and len(results) == 1:
            return results[0]
        return results

    def run(self, operands: list[Any], attrs: dict[str, Any]) -> list[Any]:
        """The reference on concrete tensors, always returning a list of results."""
        r = self.ref(*operands, **semantic(attrs))
        return list(r) if isinstance(r, (tuple, list)) else [r]


def semantic(attrs: dict[str, Any]) -> dict[str, Any]:
    """Attributes without annotations."""
    return {k: v for k, v in attrs.items() if not k.startswith("_")}


def require(cond: bool, what: str, expected: object = None, found: object = None) -> None:
    """For shape rules: an inconsistent operand raises an IRError (the verifier adds the op's place)."""
    if not cond:
        raise IRError(what, expected=expected, found=found)


def defop(sig: str, attrs: dict[str, Any] | None = None) -> Callable[[Callable], OpDef]:
    def wrap(fn: Callable) -> OpDef:
        op = OpDef(sig, attrs or {}, fn, (fn.__doc__ or "").strip())
        if op.name in REGISTRY:
            raise ValueError(f"op {op.name} registered twice")
        REGISTRY[op.name] = op
        return op
    return wrap


def get_op(name: str, where: str = "") -> OpDef:
    _ensure_loaded()
    if name not in REGISTRY:
        raise IRError(f"unknown op '{name}'", where=where or None)
    return REGISTRY[name]


def _ensure_loaded() -> None:
    from .. import ops  # noqa: F401  (registers every op)
