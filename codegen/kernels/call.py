"""`KernelCall`, one static launch of a kernel with its modeled cost (flops, bytes, re-reads, phases), the
`TensorArg` a kernel sees, and the helpers the families build calls with (pointer entries, row offsets,
alignment, names, strides)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import CodegenError
from ...ir.types import TensorType
from .dtypes import BYTES_OF, IR_TRITON, ir_dtype
from .flags import CALLS_PARAM, PDL_PARAM, declares_calls, declares_pdl

if TYPE_CHECKING:
    import torch

KINDS = ("operand", "result", "scratch", "semaphore", "peers", "table")


@dataclass(frozen=True)
class TensorArg:
    """A value as a kernel sees it: its type and element strides. `align` is the byte alignment known for
    its base address (16 for every buffer the memory plan places; less for e.g. the second half of a split)."""
    type: TensorType
    strides: tuple[int, ...]
    align: int = 16

    @staticmethod
    def of(t: torch.Tensor) -> "TensorArg":
        ptr = t.data_ptr()
        align = 16 if ptr % 16 == 0 else (ptr & -ptr)
        return TensorArg(TensorType(tuple(t.shape), ir_dtype(t)), tuple(t.stride()), align)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def ptr_type(self) -> str:
        return "*" + IR_TRITON[self.type.dtype]


@dataclass
class KernelCall:
    """One static launch: `fn[grid](*bind(pointer values), num_warps=, num_stages=)`.

    pointers: (kernel param, kind, signature name, Triton pointer type) with kind in KINDS; the signature
    name is the op's operand / result name, or the scratch buffer's name (size in `scratch_bytes`, shared
    by the calls of one op in order). A "semaphore" pointer (size also in `scratch_bytes`) is int32 arrival
    counters: zero before the call, and the call leaves them zero (the last program of a group resets its
    counter), so every call of a program can share one zeroed buffer (runtime: `semaphores`). That is how
    a launch finishes a split reduction in its last-arriving program instead of a second call. A "peers"
    pointer is the int64 table of the group's symmetric regions (`allreduce.py`; runtime: the `peers` buffer). A
    "table" pointer (name "table") is the call's own int64 table of the addresses of `tabled`'s entries (pointers of
    the same form, in table order, that the kernel loads from it where it needs them instead of taking them as
    arguments, each of which holds scalar registers for the whole kernel; a null entry for an unbound one;
    runtime: its part of the `tables` buffer, filled at load). A family may list them in any order: they are kept
    in the order `fn` declares its parameters, which is the order a GPU launch packs them in (Triton: by position,
    constexprs left out), and a pointer `fn` lacks, or a parameter of `fn` bound twice or not at all, is
    refused here (`CodegenError`, naming the kernel and the parameter). `unaligned` names pointer params
    whose base is not known to be 16-byte aligned (the AOT stage gives every other pointer `tt.divisibility=16`).
    `flops` / `bytes_moved` are the modeled work of this launch and `mma_dtype` ("bf16" | "fp8" | "fp4") the
    MMA precision that bounds it (for the roofline cost in `codegen.aot`). `reread_bytes`: the part of
    `bytes_moved` that reads again what this same launch has already read or written (a row read by every
    head block, x read by every K split, split partials read back by the reducing program): cache hits when
    the launch's footprint fits the target's cache (`codegen/roofline.py`, `hbm_bytes`), HBM bytes otherwise.
    `phases`: for a launch run as ticketed phases, each of which waits for every program of the one before
    (`phases.py`), the (bytes_moved, reread_bytes) of each phase, summing to the call's: a phase's re-reads
    then compete for the cache with that phase's footprint only (`hbm_bytes`). `reuse_bytes`: per phase (one
    entry for a launch without phases; None or no entry: not declared), a bound on the distinct bytes the launch
    touches between a re-read byte's previous touch and the re-read, its programs taken one after another in
    the order they start (the re-read's LRU stack distance): where the programs' order keeps re-reads near
    their last touch, they hit a cache far smaller than the phase's footprint (`hbm_bytes`).

    `offsets`: bytes added to a pointer param's base at launch. Not part of the specialisation (not a
    constexpr, not in `name`): per-layer row offsets into the shared pool planes go here, so every layer of
    a kind launches the same binary (V4-Pro decode: 547 specialisations -> ~60).

    `per_target`: {target: {"num_warps": n, "num_stages": s, "constexprs": {...}}} where a target's binary is
    compiled otherwise (a family's config table, chosen to keep that target's registers from spilling): other
    warps / stages, or other values of constexprs that only schedule (a loop's pipelining depth), never ones
    that change a tile, a grid or an order of arithmetic. Only the binary and its sidecar change (the block
    the runtime launches is the sidecar's); the program, the grid, the name and the interpreted result do not."""
    name: str
    fn: Any
    constexprs: dict[str, Any]
    pointers: list[tuple[str, str, str, str]]
    grid: tuple[int, int, int]
    num_warps: int = 4
    num_stages: int = 1
    scratch_bytes: dict[str, int] = field(default_factory=dict)
    unaligned: tuple[str, ...] = ()
    flops: int = 0
    bytes_moved: int = 0
    reread_bytes: int = 0
    mma_dtype: str = "bf16"
    offsets: dict[str, int] = field(default_factory=dict)
    phases: tuple[tuple[int, int], ...] = ()
    reuse_bytes: tuple[int | None, ...] = ()
    per_target: dict[str, dict[str, Any]] = field(default_factory=dict)
    tabled: tuple[tuple[str, str, str, str], ...] = ()

    def __post_init__(self) -> None:
        self.grid = tuple(int(g) for g in self.grid)
        if len(self.grid) != 3 or any(g < 0 for g in self.grid):
            raise ValueError(f"{self.name}: grid must be 3 non-negative ints, got {self.grid}")
        if not 0 <= self.reread_bytes <= self.bytes_moved:
            raise ValueError(f"{self.name}: reread_bytes {self.reread_bytes} outside [0, bytes_moved {self.bytes_moved}]")
        if self.phases and (sum(b for b, _ in self.phases), sum(r for _, r in self.phases)) != (self.bytes_moved,
                                                                                             self.reread_bytes):
            raise ValueError(f"{self.name}: phases {self.phases} do not sum to the call's bytes and re-reads")
        if len(self.reuse_bytes) > max(len(self.phases), 1):
            raise ValueError(f"{self.name}: reuse_bytes {self.reuse_bytes} has more entries than phases")
        for p in self.pointers:
            if len(p) != 4 or p[1] not in KINDS or not p[3].startswith("*"):
                raise ValueError(f"{self.name}: bad pointer entry {p}")
            if p[1] in ("scratch", "semaphore") and p[2] not in self.scratch_bytes:
                raise ValueError(f"{self.name}: {p[1]} '{p[2]}' has no size in scratch_bytes")
        if any(p[1] in ("table", "scratch", "semaphore", "peers") for p in self.tabled) or \
                bool(self.tabled) != any(p[1] == "table" for p in self.pointers):
            raise ValueError(f"{self.name}: tabled {self.tabled} needs one 'table' pointer, and holds operands / "
                             "results only")
        if declares_pdl(self.fn):  # off unless the AOT stage turns it on for its target (pdl.py)
            self.constexprs = {**self.constexprs, PDL_PARAM: self.constexprs.get(PDL_PARAM, False)}
        if declares_calls(self.fn):  # calls unless the AOT stage inlines them for its target (CALLS_PARAM above)
            self.constexprs = {**self.constexprs, CALLS_PARAM: self.constexprs.get(CALLS_PARAM, True)}
        self.pointers = in_kernel_order(self.name, self.fn, self.pointers, self.constexprs)
        for t, o in self.per_target.items():
            if set(o) - {"num_warps", "num_stages", "constexprs"} or set(o.get("constexprs", {})) - set(self.constexprs):
                raise ValueError(f"{self.name}: per_target[{t!r}] may set num_warps, num_stages and existing "
                                 f"constexprs only, got {o}")
        params = {p[0]: p[1] for p in self.pointers}
        for param, off in self.offsets.items():
            if params.get(param) not in ("operand", "result") or off < 0:
                raise ValueError(f"{self.name}: offset {off} for '{param}' (not an operand / result pointer)")

    def for_target(self, target: str) -> tuple[int, int, dict[str, Any]]:
        """(num_warps, num_stages, constexprs) of the binary compiled for `target`."""
        o = self.per_target.get(target, {})
        return (o.get("num_warps", self.num_warps), o.get("num_stages", self.num_stages),
                {**self.constexprs, **o.get("constexprs", {})})

    @property
    def kernel_name(self) -> str:
        return self.fn.__name__ if hasattr(self.fn, "__name__") else self.fn.fn.__name__

    def signature(self) -> dict[str, str]:
        """Every parameter of `fn` in order: a pointer type or "constexpr" (what `ASTSource` takes)."""
        ptr = {p[0]: p[3] for p in self.pointers}
        return {a: ptr.get(a, "constexpr") for a in self.fn.arg_names}

    def bind(self, values: list[Any]) -> list[Any]:
        """The positional arguments of `fn` for the pointer values of one launch, given in `pointers`
        order (the packed order of a GPU launch): each value goes to the next pointer parameter `fn`
        declares, constexprs fill the rest. No names are involved, so a value packed in the wrong place
        reaches the wrong parameter, as it would on a GPU."""
        if len(values) != len(self.pointers):
            raise CodegenError(f"{len(values)} pointer values for the {len(self.pointers)} pointer parameters of "
                               f"{self.kernel_name}", where=self.name)
        ptrs = {p[0] for p in self.pointers}
        it = iter(values)
        return [next(it) if a in ptrs else self.constexprs[a] for a in self.fn.arg_names]


def in_kernel_order(name: str, fn: Any, pointers: list, constexprs: dict[str, Any]) -> list:
    """`pointers` in the order `fn` declares them; every parameter of `fn` bound exactly once (a pointer or
    a constexpr), nothing bound that `fn` lacks."""
    kernel = fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__
    declared = list(fn.arg_names)
    by_param: dict[str, tuple] = {}
    for p in pointers:
        if p[0] not in declared:
            raise CodegenError(f"pointer '{p[0]}' is not a parameter of {kernel}", where=name,
                               expected=", ".join(declared))
        if p[0] in by_param or p[0] in constexprs:
            raise CodegenError(f"parameter '{p[0]}' of {kernel} is bound twice", where=name)
        by_param[p[0]] = p
    for a in declared:
        if a not in by_param and a not in constexprs:
            raise CodegenError(f"parameter '{a}' of {kernel} is bound to nothing (neither a pointer nor a constexpr)",
                               where=name)
    extra = sorted(set(constexprs) - set(declared))
    if extra:
        raise CodegenError(f"constexpr '{extra[0]}' is not a parameter of {kernel}", where=name)
    return [by_param[a] for a in declared if a in by_param]


def ptr(param: str, kind: str, name: str, arg: TensorArg | str) -> tuple[str, str, str, str]:
    """A `pointers` entry; `arg` is the TensorArg (its pointer type) or an explicit type like "*fp32"."""
    return (param, kind, name, arg if isinstance(arg, str) else arg.ptr_type)


def row_offsets(params: dict[str, TensorArg | None], rows: int) -> dict[str, int]:
    """Launch-time byte offsets (`KernelCall.offsets`) moving each [N, ...] plane pointer `rows` rows on."""
    return {p: rows * a.strides[0] * BYTES_OF[a.ptr_type[1:]] for p, a in params.items() if a is not None and rows}


def any_row(a: TensorArg | None) -> TensorArg | None:
    """`a` with the base alignment that holds at every row offset (what a pointer moved by `row_offsets`
    can promise the compiler, whatever the layer)."""
    if a is None:
        return None
    row = a.strides[0] * BYTES_OF[a.ptr_type[1:]]
    return TensorArg(a.type, a.strides, min(a.align, row & -row if row else a.align))


def unaligned(pairs: dict[str, TensorArg | None]) -> tuple[str, ...]:
    """Kernel params (keyed by param name) whose TensorArg base is not 16-byte aligned."""
    return tuple(sorted(p for p, a in pairs.items() if a is not None and a.align % 16))


def call_name(prefix: str, constexprs: dict[str, Any], readable: str = "") -> str:
    """A deterministic, unique name: family prefix, a readable shape tag, a hash of the specialisation."""
    blob = json.dumps({k: _jsonable(v) for k, v in sorted(constexprs.items())}, sort_keys=True)
    h = hashlib.sha256(f"{prefix}|{blob}".encode()).hexdigest()[:10]
    return "_".join(p for p in (prefix, readable, h) if p)


def rows_of(a: TensorArg, what: str) -> tuple[int, int, int]:
    """(rows, row stride, column stride) of a [..., D] value whose leading axes collapse to one stride
    (true for contiguous values and for the halves of a `split`)."""
    shape, st = a.shape, a.strides
    rows = 1
    for n in shape[:-1]:
        rows *= n
    lead = [(n, s) for n, s in zip(shape[:-1], st[:-1]) if n != 1]
    for (n0, s0), (n1, s1) in zip(lead, lead[1:]):
        if s0 != n1 * s1:
            raise ValueError(f"{what}: leading axes {shape[:-1]} with strides {st[:-1]} do not collapse to rows")
    return rows, (lead[-1][1] if lead else shape[-1] * st[-1]), st[-1]


def dims4(a: TensorArg, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """Element strides of `a` broadcast to `shape` (rank <= 4), left-padded to 4 axes (stride 0 where
    broadcast)."""
    if len(shape) > 4:
        raise ValueError(f"rank {len(shape)} > 4 not supported")
    pad = len(shape) - len(a.shape)
    st = []
    for i, n in enumerate(shape):
        j = i - pad
        st.append(0 if j < 0 or a.shape[j] == 1 and n != 1 else a.strides[j])
    return tuple([0] * (4 - len(st)) + st)


def pad4(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    return tuple([1] * (4 - len(shape)) + list(shape))


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return str(v)  # tl.dtype constexprs
