"""The op registry: every op of the IR, declared once.

An op is declared with a signature string and a torch reference implementation:

    @defop("rms_norm(x, weight?) -> y", attrs={"eps": float})
    def rms_norm(x, weight, *, eps): ...          # the reference: tensors in, tensors out

    @rms_norm.infer
    def _(x, weight, *, eps): return x            # the shape/dtype rule on TensorTypes

The same `OpDef` is what the reference model calls. With tensors it runs the reference; with IR
values (while tracing) it records an op in the function being built. The interpreter, the verifier,
the memory plan, the program stage, the kernel tests, the ONNX export and the cost reports all read
this one entry.

Traits, declared with `defop`:
* `view=`: the result is a view of an operand (no launch): a rule giving each result's layout (byte
  offset, element strides) from the operand's layout. See `Layout`, `split_view`, `reshape_view`.
* `tied={"result": "operand"}`: that result is the operand updated in place (same buffer, same type).
* `kernel="family"`: the kernel family that runs it: its Triton kernels (`v4compile.codegen.kernels.<family>`)
  and its ONNX lowerings (`v4compile.codegen.onnx.<family>`); backends are wired by family, never imported here.
* `@op.cost`: FLOPs and bytes moved from the operand / result types (a default counts bytes only).
* `@op.spmd`: a collective: the reference across ranks (each rank's operands in, each rank's results out),
  which the interpreter runs with every rank's values at once (`interpret_ranks`); `ref` is the one-rank case.
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
from .optable import REGISTRY, get_op  # noqa: F401 (get_op: the registry's reader)
from .semantics import TAGS, check_tags
from .types import TensorType

ATTR_TYPES = (int, float, bool, str, tuple)
_NO_DEFAULT = object()

# Provenance: the model pushes module paths (`layers.7.attn`) and semantic tags (`layer`, `role`; see
# `semantics.py`) while it runs; traced ops record them.
_scope: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("v4_scope", default=())
_tags: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("v4_tags", default={})
# While tracing: the builder that records op calls on IR values (set by `builder.Builder`).
RECORDER: contextvars.ContextVar[Any] = contextvars.ContextVar("v4_builder", default=None)


def current_builder() -> Any:
    b = RECORDER.get()
    if b is None:
        raise RuntimeError("an op was called on IR values outside of a Builder")
    return b


@contextlib.contextmanager
def scope(name: str = "", *, layer: int | None = None, role: str | None = None):
    """Inside: ops record `name` in their `loc` (an empty name adds nothing) and the given tags (inner
    scopes and explicit `role=` on a call override)."""
    tags = {k: v for k, v in (("layer", layer), ("role", role)) if v is not None}
    token = _scope.set(_scope.get() + (name,)) if name else None
    ttoken = _tags.set({**_tags.get(), **tags}) if tags else None
    try:
        yield
    finally:
        if ttoken is not None:
            _tags.reset(ttoken)
        if token is not None:
            _scope.reset(token)


def current_loc() -> str:
    return ".".join(_scope.get())


def current_tags() -> dict[str, Any]:
    return dict(_tags.get())


@dataclass(frozen=True)
class Operand:
    name: str
    optional: bool


@dataclass(frozen=True)
class Layout:
    """Where a value sits in its buffer: a byte offset from the buffer's base and element strides."""
    offset: int
    strides: tuple[int, ...]

    @staticmethod
    def contiguous(shape: tuple[int, ...], offset: int = 0) -> "Layout":
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(s, 1)
        return Layout(offset, tuple(reversed(strides)))

    def is_contiguous(self, shape: tuple[int, ...]) -> bool:
        want = Layout.contiguous(shape).strides
        return all(st == w for st, w, n in zip(self.strides, want, shape) if n > 1)


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes_read: int
    bytes_written: int


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
    def __init__(self, sig: str, attrs: dict[str, Any], ref: Callable, doc: str, *, view: Callable | None = None,
                 tied: dict[str, str] | None = None, kernel: str | None = None,
                 follows: dict[str, str] | None = None, variants: dict[str, tuple[str, ...]] | None = None,
                 offset_attrs: tuple[str, ...] = ()):
        m = _SIG.match(sig)
        if not m:
            raise ValueError(f"bad op signature {sig!r}")
        self.name = m.group(1)
        self.operands = tuple(Operand(a.strip().rstrip("?"), a.strip().endswith("?"))
                              for a in m.group(2).split(",") if a.strip())
        self.results = tuple(r.strip().rstrip("?") for r in m.group(3).split(","))
        self.optional_result_names = tuple(r.strip().rstrip("?") for r in m.group(3).split(",")
                                           if r.strip().endswith("?"))
        self.optional_results = len(self.optional_result_names)
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
        self.view = view
        self.tied = dict(tied or {})
        self.kernel = kernel
        # Attributes that are launch-time pointer offsets (a layer's first pool row, `KernelCall.offsets`):
        # not part of what a compiled kernel depends on, so every layer of a kind shares one binary.
        self.offset_attrs = tuple(offset_attrs)
        if set(self.offset_attrs) - set(attrs):
            raise ValueError(f"{self.name}: offset_attrs {sorted(set(self.offset_attrs) - set(attrs))} are not attributes")
        # An optional result exists exactly when the operand it is tied to (or `follows`) is given.
        self.follows = dict(follows or {})
        # One behaviour per op: where optional operands select a behaviour, the `variant` attribute names it
        # and the verifier checks that exactly that variant's operands are given.
        self.variants = {k: frozenset(v) for k, v in (variants or {}).items()}
        self.variant_operands = frozenset().union(*self.variants.values()) if self.variants else frozenset()
        if self.variants:
            if not all(self.operands[self.operand_index(n)].optional for n in self.variant_operands):
                raise ValueError(f"{self.name}: variants may only select optional operands")
            self.attrs["variant"] = AttrSpec("variant", str)
        self._cost: Callable | None = None
        self.spmd_ref: Callable | None = None
        for r, o in self.tied.items():
            if r not in self.results or o not in self.operand_names:
                raise ValueError(f"{self.name}: tied {r} -> {o} names no result / operand")

    @property
    def operand_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.operands)

    def operand_index(self, name: str) -> int:
        try:
            return self.operand_names.index(name)
        except ValueError:
            raise KeyError(f"op '{self.name}' has no operand '{name}'") from None

    def result_index(self, name: str) -> int:
        try:
            return self.results.index(name)
        except ValueError:
            raise KeyError(f"op '{self.name}' has no result '{name}'") from None

    def variant_of(self, operands: list[Any] | tuple[Any, ...]) -> str:
        """The variant that the given optional operands select."""
        present = frozenset(n for n in self.variant_operands if operands[self.operand_index(n)] is not None)
        for k, v in self.variants.items():
            if v == present:
                return k
        raise IRError(f"op '{self.name}' has no variant taking optional operands {sorted(present) or 'none'}",
                      expected=", ".join(f"{k}: {sorted(v) or 'none'}" for k, v in self.variants.items()))

    def with_variant(self, operands: list[Any] | tuple[Any, ...], attrs: dict[str, Any]) -> dict[str, Any]:
        if self.variants and "variant" not in attrs:
            return {**attrs, "variant": self.variant_of(operands)}
        return attrs

    def check_variant(self, operands: list[Any] | tuple[Any, ...], attrs: dict[str, Any]) -> None:
        v = attrs.get("variant")
        if v not in self.variants:
            raise IRError(f"unknown variant of op '{self.name}'", expected=", ".join(self.variants), found=v)
        got = self.variant_of(operands)
        if got != v:
            raise IRError(f"the optional operands given are those of variant '{got}', not '{v}'",
                          expected=f"{sorted(self.variants[v]) or 'no optional operands'}")

    def result_names(self, operands: list[Any] | tuple[Any, ...], n_results: int) -> list[str]:
        """The signature names of an op's actual results: an optional result tied to (or following) an
        optional operand is there exactly when that operand is; other optional results are trailing."""
        names = []
        for r in self.results:
            link = self.tied.get(r) or self.follows.get(r)
            if r in self.optional_result_names and link is not None and operands[self.operand_index(link)] is None:
                continue
            names.append(r)
        return names[:n_results]

    @property
    def launch(self) -> bool:
        """Whether the op becomes a kernel launch (views do not)."""
        return self.view is None

    def cost(self, fn: Callable) -> Callable:
        self._cost = fn
        return fn

    def spmd(self, fn: Callable) -> Callable:
        self.spmd_ref = fn
        return fn

    @property
    def collective(self) -> bool:
        """Whether the op exchanges values between ranks (its reference needs every rank's operands)."""
        return self.spmd_ref is not None

    @property
    def communicator(self) -> bool:
        """Whether a launch of the op runs on the runtime's communicator (NCCL / RCCL on GPUs, gloo on the host)
        rather than as kernel calls: a collective of the `collective` family (not e.g. the one-shot all-reduce,
        a collective with kernels of its own)."""
        return self.collective and self.kernel == "collective"

    def cost_of(self, operands: list[TensorType | None], results: list[TensorType], attrs: dict[str, Any]) -> Cost:
        """FLOPs and bytes of one launch. The default reads every operand once and writes every result once
        (a tied result that is a pool / state plane writes only what the op's own rule says)."""
        if self.view is not None:
            return Cost(0, 0, 0)
        if self._cost is not None:
            return self._cost(operands, results, ref_attrs(attrs))
        read = sum(t.nbytes for t in operands if t is not None)
        written = sum(t.nbytes for t in results)
        return Cost(sum(t.numel for t in results), read, written)

    def __repr__(self) -> str:
        return f"OpDef({self.sig})"

    def infer(self, fn: Callable) -> Callable:
        self._infer = fn
        return fn

    # ---- attribute checking --------------------------------------------------------------------
    def normalize_attrs(self, attrs: dict[str, Any], where: str = "") -> dict[str, Any]:
        """Fill defaults, reject unknown / missing / mistyped attributes. Names starting with `_` are
        annotations (e.g. the memory plan's `_arena`) and `layer` / `role` are semantic tags
        (`semantics.py`): any op may carry them and references never see them."""
        at = where or f"op '{self.name}'"
        notes = {k: v for k, v in attrs.items() if k.startswith("_")}
        tags = check_tags({k: v for k, v in attrs.items() if k in TAGS}, at)
        attrs = {k: v for k, v in attrs.items() if not k.startswith("_") and k not in TAGS}
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
        out.update(tags)
        for k, v in notes.items():
            if not isinstance(v, ATTR_TYPES):
                raise IRError(f"annotation '{k}' has an unsupported value", where=at, found=repr(v))
            out[k] = v
        return out

    # ---- typing --------------------------------------------------------------------------------
    def result_types(self, operand_types: list[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        if self._infer is None:
            raise NotImplementedError(f"op {self.name} has no shape rule")
        r = self._infer(*operand_types, **ref_attrs(attrs))
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
        tracing = any(isinstance(v, Value) for v in operands)
        if tracing:
            attrs = {**current_tags(), **attrs}
        attrs = self.normalize_attrs(self.with_variant(operands, attrs))
        if tracing:
            results = current_builder().emit(self, operands, attrs, current_loc())
        else:
            results = self.ref(*operands, **ref_attrs(attrs))
        if isinstance(results, (list, tuple)) and len(results) == 1:
            return results[0]
        return results

    def run(self, operands: list[Any], attrs: dict[str, Any]) -> list[Any]:
        """The reference on concrete tensors, always returning a list of results."""
        r = self.ref(*operands, **ref_attrs(attrs))
        return list(r) if isinstance(r, (tuple, list)) else [r]


def semantic(attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes an op's own rules (reference, shape, cost) take: without annotations (`_...`) and
    without the semantic tags (`layer`, `role`)."""
    return {k: v for k, v in attrs.items() if not k.startswith("_") and k not in TAGS}


# Attributes that describe an op for the compiler (which variant) but are not arguments of its reference.
NON_REF_ATTRS = frozenset({"variant"})


def ref_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of an op's reference and shape rule (no annotations, no semantic tags)."""
    return {k: v for k, v in attrs.items() if not k.startswith("_") and k not in NON_REF_ATTRS and k not in TAGS}


def require(cond: bool, what: str, expected: object = None, found: object = None) -> None:
    """For shape rules: an inconsistent operand raises an IRError (the verifier adds the op's place)."""
    if not cond:
        raise IRError(what, expected=expected, found=found)


def split_view(operand: Layout, operand_type: TensorType, results: list[TensorType], attrs: dict) -> list[Layout]:
    """`split` on the last axis: both parts keep the operand's strides; the second starts `at` columns in."""
    from .types import BYTES
    step = operand.strides[-1] * BYTES[operand_type.dtype]
    return [Layout(operand.offset, operand.strides), Layout(operand.offset + attrs["at"] * step, operand.strides)]


def reshape_view(operand: Layout, operand_type: TensorType, results: list[TensorType], attrs: dict) -> list[Layout]:
    """`reshape` as a view: possible when every run of merged / split axes is contiguous in the operand
    (the same rule as torch's `view`); the strides follow from the operand's."""
    old, new = list(operand_type.shape), list(results[0].shape)
    strides = _view_strides(old, list(operand.strides), new)
    if strides is None:
        raise IRError("reshape of a strided value is not a view", expected="groups of axes contiguous in memory",
                      found=f"shape {old} strides {list(operand.strides)} -> {new}")
    return [Layout(operand.offset, tuple(strides))]


def _view_strides(old: list[int], old_strides: list[int], new: list[int]) -> list[int] | None:
    # Drop size-1 axes of the operand (their stride is irrelevant), then walk both shapes in chunks of equal
    # element count; each operand chunk must be contiguous within itself.
    pairs = [(n, s) for n, s in zip(old, old_strides) if n != 1]
    out: list[int] = [0] * len(new)
    if any(n == 0 for n in new):
        return [1] * len(new)
    i, j = 0, 0
    while j < len(new):
        if new[j] == 1:
            out[j] = 1
            j += 1
            continue
        if i >= len(pairs):
            return None
        chunk_old, chunk_new = [pairs[i]], [j]
        a, b = pairs[i][0], new[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(pairs):
                    return None
                chunk_old.append(pairs[i])
                a *= pairs[i][0]
            else:
                j += 1
                if j >= len(new):
                    return None
                if new[j] != 1:
                    chunk_new.append(j)
                else:
                    out[j] = 1
                b *= new[j]
        for (n0, s0), (n1, s1) in zip(chunk_old, chunk_old[1:]):
            if s0 != n1 * s1:
                return None
        stride = chunk_old[-1][1]
        for k in reversed(chunk_new):
            out[k] = stride
            stride *= new[k]
        i += 1
        j += 1
    if i != len(pairs):
        return None
    for k in reversed(range(len(new))):  # size-1 axes: the stride a contiguous tensor would have
        if new[k] == 1:
            out[k] = out[k + 1] * new[k + 1] if k + 1 < len(new) else 1
    return out


def defop(sig: str, attrs: dict[str, Any] | None = None, *, view: Callable | None = None,
          tied: dict[str, str] | None = None, kernel: str | None = None,
          follows: dict[str, str] | None = None,
          variants: dict[str, tuple[str, ...]] | None = None,
          offset_attrs: tuple[str, ...] = ()) -> Callable[[Callable], OpDef]:
    def wrap(fn: Callable) -> OpDef:
        op = OpDef(sig, attrs or {}, fn, (fn.__doc__ or "").strip(), view=view, tied=tied, kernel=kernel,
                   follows=follows, variants=variants, offset_attrs=offset_attrs)
        if op.name in REGISTRY:
            raise ValueError(f"op {op.name} registered twice")
        REGISTRY[op.name] = op
        return op
    return wrap


