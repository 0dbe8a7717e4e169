"""Triton kernel families: one file per family, one shared launch description (`KernelCall`).

Each family module `v4compile.codegen.kernels.<family>` (the family an op names with `defop(kernel=...)`)
exposes

    specialise(op_name, operands: dict[str, TensorArg | None], results: dict[str, TensorArg], attrs) -> [KernelCall]

Every shape, stride and attribute is a compile-time constant of the call (`constexprs`), so a launch passes
only base pointers; that is what lets the AOT stage compile each call once and the runtime replay it.
An optional operand that is absent is passed as a `None` constexpr (Triton specialises it away).

`launch(op_name, args, attrs, outs)` runs an op through its family on real tensors (CPU under
TRITON_INTERPRET=1, or GPU). Under the interpreter it first applies `interpreter_fixes()` (see there).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CodegenError
from ...ir.registry import get_op
from ...ir.types import TensorType, dtype_of

log = logging.getLogger(__name__)

# The PDL flag's facts (the kernel half is pdl.py). They live here, not in pdl.py, because that module
# defines a @triton.jit function: importing it for these would fix Triton's compile-or-interpret choice
# before the host device makes it (runtime/kernels.py refuses a process that imported kernel modules).
PDL_PARAM = "PDL"


def declares_pdl(fn: Any) -> bool:
    """Whether a kernel (a @triton.jit function) takes the PDL flag, that is waits in `pdl_enter`."""
    return PDL_PARAM in getattr(fn, "arg_names", ())


def uses_pdl(fn: Any, target: str) -> bool:
    """Whether the kernel's launches on `target` carry the programmatic-serialization attribute."""
    from ...targets import TARGETS
    return TARGETS[target].pdl and declares_pdl(fn)


# Calls to noinline functions, a target-bound flag like PDL (same reason to live here). A kernel that calls a
# `@triton.jit(noinline=True)` function where it pays (sm_90a: the callee's registers are allocated apart, so
# its arrays do not make the caller's MMA tiles spill) takes a `CALLS: tl.constexpr` and branches on it to an
# inlined copy of the same function. KernelCall binds it to True (the interpreter runs the call); the AOT
# stage sets it from the target (`uses_calls`). On gfx950 a real call is refused: LLVM's AMDGPU backend cannot
# prove the callee needs no implicit kernel arguments, so the kernel grows the hidden-argument block
# (hidden_block_count_x ... hidden_dynamic_lds_size) behind the parameters the KernelCall describes; the
# launch's parameter array holds the explicit pointers only, so the binary's parameters and the call's no
# longer agree (the fake HIP driver, sizing the parameters from the kernarg segment, refuses the launch);
# `aot` checks every hsaco for hidden arguments.
CALLS_PARAM = "CALLS"


def declares_calls(fn: Any) -> bool:
    """Whether a kernel (a @triton.jit function) takes the CALLS flag."""
    return CALLS_PARAM in getattr(fn, "arg_names", ())


def uses_calls(target: str) -> bool:
    """Whether kernels on `target` call their noinline functions (else they run the inlined copies)."""
    from ...targets import TARGETS
    return TARGETS[target].backend == "cuda"

# Triton pointer element type -> the torch dtype a tensor is viewed as before launch (same element size).
TRITON_TORCH: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn,
    "u8": torch.uint8, "i8": torch.int8, "i32": torch.int32, "i64": torch.int64, "i1": torch.bool,
}
# IR dtype -> the Triton element type kernels read it as. e8m0 scale bytes and packed fp4 pairs are bytes.
IR_TRITON: dict[str, str] = {
    "fp32": "fp32", "bf16": "bf16", "fp8e4m3": "fp8e4nv", "e8m0": "u8", "fp4x2": "u8", "i32": "i32", "i64": "i64",
    "bool": "i1",
}
KINDS = ("operand", "result", "scratch", "semaphore")
BYTES_OF = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8e4nv": 1, "u8": 1, "i8": 1, "i32": 4, "i64": 8, "i1": 1}


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
        return TensorArg(TensorType(tuple(t.shape), _ir_dtype(t)), tuple(t.stride()), align)

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
    a launch finishes a split reduction in its last-arriving program instead of a second call. A family may list them in any order: they are kept in the order
    `fn` declares its parameters, which is the order a GPU launch packs them in (Triton: by position,
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
    then compete for the cache with that phase's footprint only (`hbm_bytes`).

    `offsets`: bytes added to a pointer param's base at launch. Not part of the specialisation (not a
    constexpr, not in `name`): per-layer row offsets into the shared pool planes go here, so every layer of
    a kind launches the same binary (V4-Pro decode: 547 specialisations -> ~60)."""
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

    def __post_init__(self) -> None:
        self.grid = tuple(int(g) for g in self.grid)
        if len(self.grid) != 3 or any(g < 0 for g in self.grid):
            raise ValueError(f"{self.name}: grid must be 3 non-negative ints, got {self.grid}")
        if not 0 <= self.reread_bytes <= self.bytes_moved:
            raise ValueError(f"{self.name}: reread_bytes {self.reread_bytes} outside [0, bytes_moved {self.bytes_moved}]")
        if self.phases and (sum(b for b, _ in self.phases), sum(r for _, r in self.phases)) != (self.bytes_moved,
                                                                                             self.reread_bytes):
            raise ValueError(f"{self.name}: phases {self.phases} do not sum to the call's bytes and re-reads")
        for p in self.pointers:
            if len(p) != 4 or p[1] not in KINDS or not p[3].startswith("*"):
                raise ValueError(f"{self.name}: bad pointer entry {p}")
            if p[1] in ("scratch", "semaphore") and p[2] not in self.scratch_bytes:
                raise ValueError(f"{self.name}: {p[1]} '{p[2]}' has no size in scratch_bytes")
        if declares_pdl(self.fn):  # off unless the AOT stage turns it on for its target (pdl.py)
            self.constexprs = {**self.constexprs, PDL_PARAM: self.constexprs.get(PDL_PARAM, False)}
        if declares_calls(self.fn):  # calls unless the AOT stage inlines them for its target (CALLS_PARAM above)
            self.constexprs = {**self.constexprs, CALLS_PARAM: self.constexprs.get(CALLS_PARAM, True)}
        self.pointers = in_kernel_order(self.name, self.fn, self.pointers, self.constexprs)
        params = {p[0]: p[1] for p in self.pointers}
        for param, off in self.offsets.items():
            if params.get(param) not in ("operand", "result") or off < 0:
                raise ValueError(f"{self.name}: offset {off} for '{param}' (not an operand / result pointer)")

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


def typed_from(raw: torch.Tensor, ty: str) -> torch.Tensor:
    """Bytes from a kernel pointer on (1-D uint8) as the 1-D tensor of its pointer type `ty` ("*bf16")."""
    n = BYTES_OF[ty[1:]]
    return raw[: raw.numel() // n * n].view(TRITON_TORCH[ty[1:]])


def run_calls(calls: list[KernelCall], args: dict[str, torch.Tensor | None], outs: dict[str, torch.Tensor]) -> None:
    """Launch prepared calls on tensors (scratch buffers allocated per name, shared by the calls, poisoned;
    semaphores zeroed, and checked to be left zero, as the runtime's shared `semaphores` buffer needs)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_fixes()
    device = next(t.device for t in list(args.values()) + list(outs.values()) if t is not None)
    scratch: dict[str, torch.Tensor] = {}
    for call in calls:
        values = []
        for param, kind, name, ty in call.pointers:
            if kind in ("scratch", "semaphore"):
                if name not in scratch:
                    # scratch starts as NaN bytes, so a read of what no program wrote shows in the result
                    scratch[name] = torch.full((max(call.scratch_bytes[name], 16),), 0 if kind == "semaphore" else 0xFF,
                                               dtype=torch.uint8, device=device)
                t = scratch[name]
            else:
                t = (args if kind == "operand" else outs)[name]
            want = TRITON_TORCH[ty[1:]]
            off = call.offsets.get(param, 0)
            if off:
                values.append(typed_from(t.view(torch.uint8).reshape(-1)[off:], ty))
            else:
                values.append(t if t.dtype == want else t.view(want))
        call.fn[call.grid](*call.bind(values), num_warps=call.num_warps, num_stages=call.num_stages)
        for param, kind, name, _ in call.pointers:
            if kind == "semaphore" and bool(scratch[name].any()):
                raise CodegenError(f"semaphore '{name}' left non-zero by {call.kernel_name}", where=call.name)


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return str(v)  # tl.dtype constexprs


def _ir_dtype(t: torch.Tensor) -> str:
    if t.dtype == torch.int8:
        return "fp4x2"
    if t.dtype == torch.float8_e8m0fnu:
        return "e8m0"
    return dtype_of(t)


def family(op_name: str):
    """The kernel family module of an op."""
    op = get_op(op_name)
    if op.kernel is None:
        raise KeyError(f"op '{op_name}' names no kernel family")
    return importlib.import_module(f"{__name__}.{op.kernel}")


def full_attrs(op_name: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """The op's attributes with declared defaults filled in (private `_` attributes dropped)."""
    op = get_op(op_name)
    out = {k: s.default for k, s in op.attrs.items() if not s.required}
    out.update({k: v for k, v in attrs.items() if not k.startswith("_")})
    return out


def specialise_tensors(op_name: str, args: dict[str, torch.Tensor | None], attrs: dict[str, Any],
               outs: dict[str, torch.Tensor]) -> list[KernelCall]:
    """The family's `specialise` on the TensorArgs of real tensors (types, strides, base alignment)."""
    operands = {k: (None if v is None else TensorArg.of(v)) for k, v in args.items()}
    results = {k: TensorArg.of(v) for k, v in outs.items()}
    return family(op_name).specialise(op_name, operands, results, full_attrs(op_name, attrs))


def launch(op_name: str, args: dict[str, torch.Tensor | None], attrs: dict[str, Any],
           outs: dict[str, torch.Tensor]) -> list[KernelCall]:
    """Run an op's kernels on real tensors. `outs` are preallocated (possibly strided) results; a tied result
    must be the operand tensor itself. Returns the calls it ran."""
    op = get_op(op_name)
    for r, o in op.tied.items():
        if r in outs and args.get(o) is not None and outs[r].data_ptr() != args[o].data_ptr():
            raise ValueError(f"{op_name}: tied result '{r}' must be operand '{o}' itself")
    calls = specialise_tensors(op_name, args, attrs, outs)
    run_calls(calls, args, outs)
    return calls


# ---- memory guard (the host device's illegal-address check) --------------------------------------------

class IllegalAddress(RuntimeError):
    """A kernel under the interpreter touched memory outside every live allocation (on a GPU: a fault,
    CUDA_ERROR_ILLEGAL_ADDRESS / hipErrorIllegalAddress)."""


_GUARD: list[Any] = []  # the active allocations: (sorted starts, ends) as numpy arrays, or empty


@contextlib.contextmanager
def memory_guard(allocations: list[tuple[int, int]]):
    """Within the block, every load, store and atomic of an interpreted kernel must lie, whole, inside one of
    `allocations` ([start, end) byte ranges); otherwise `IllegalAddress`. The interpreter itself reads and
    writes raw addresses unchecked, so a wrong pointer or index would read other memory or crash.
    Entering it applies `interpreter_fixes()`: the check lives in their patched loads and stores, and a
    kernel run under the guard (the host device's) must also round as the GPU does."""
    import numpy as np

    interpreter_fixes()
    spans = sorted(allocations)
    _GUARD.append((np.array([a for a, _ in spans], dtype=np.uint64), np.array([b for _, b in spans], dtype=np.uint64)))
    try:
        yield
    finally:
        _GUARD.pop()


def _check_access(what: str, ptrs, mask, nbytes: int) -> None:
    import numpy as np

    starts, ends = _GUARD[-1]
    p = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
    if mask is not None:
        p = p[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)]
    if p.size == 0:
        return
    i = np.searchsorted(starts, p, side="right").astype(np.int64) - 1
    ok = (i >= 0) & (p + np.uint64(nbytes) <= ends[np.maximum(i, 0)])
    if not ok.all():
        bad = int(p[~ok][0])
        raise IllegalAddress(f"illegal address: a {what} of {nbytes} bytes at {bad:#x} lies outside every live "
                             f"allocation ({int((~ok).sum())} of {p.size} lanes)")


# ---- interpreter fixes ---------------------------------------------------------------------------------

_FIXED = False
# (owner, attribute, Triton's own value) of each patched attribute: a test restores them to see what an
# unfixed interpreter computes (`interpreter_fixes` run again then patches them anew)
UNFIXED: list[tuple[Any, str, Any]] = []


def interpreter_fixes() -> None:
    """Make Triton 3.9's CPU interpreter compute what the GPU computes, in this one place.

    1. bf16 `tl.dot`: the interpreter multiplies the raw uint16 storage of bf16 operands (results ~1e10;
       triton-lang/triton#11584). Fix: widen bf16 (and fp16) operands to fp32 before the matmul, which is
       what the MMA units do (exact products, fp32 accumulation).
    2. fp32 -> bf16 / fp8 casts: the interpreter truncates (and its fp8 "rtne" carries a mantissa overflow
       into the wrong bit). The GPU rounds to nearest even. Fix: do float downcasts with torch, which rounds
       to nearest even; fp8 e4m3 values are saturated to +-448 first, like the GPU's satfinite conversion.
    With both, interpreter results match a correctly rounded reference, so tests need no extra slack.
    3. Inside `memory_guard`, loads, stores and atomics are bounds-checked against live allocations.
    Idempotent; only call it under TRITON_INTERPRET=1."""
    global _FIXED
    if _FIXED:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    orig_convert = it._convert_float
    torch_of = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float8e4nv: torch.float8_e4m3fn,
                tl.float8e5: torch.float8_e5m2, tl.float32: torch.float32}
    uint_of = {16: torch.int16, 8: torch.uint8, 32: torch.int32}

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if (input_dtype.primitive_bitwidth > output_dtype.primitive_bitwidth and input_dtype in torch_of
                and output_dtype in torch_of):
            src = torch.from_numpy(np.ascontiguousarray(data)).view(torch_of[input_dtype]).float()
            if output_dtype == tl.float8e4nv:
                src = torch.where(src.isnan(), src, src.clamp(-448.0, 448.0))
            out = src.to(torch_of[output_dtype]).view(uint_of[output_dtype.primitive_bitwidth])
            return out.numpy().view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(data.shape)
        return orig_convert(data, input_dtype, output_dtype, rounding_mode)

    orig_dot = it.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in (tl.bfloat16, tl.float16) and b.dtype.scalar in (tl.bfloat16, tl.float16):
            a = it.TensorHandle(convert_float_up(a), tl.float32)
            b = it.TensorHandle(convert_float_up(b), tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def convert_float_up(h):
        if h.dtype.scalar == tl.float16:
            return h.data.astype(np.float32)
        return orig_convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32)

    builder = it.InterpreterBuilder
    orig_load, orig_store = builder.create_masked_load, builder.create_masked_store
    orig_rmw, orig_cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def width(ptrs) -> int:
        return max(1, ptrs.get_element_ty().primitive_bitwidth // 8)

    def load(self, ptrs, mask, other, *a):
        if _GUARD:
            _check_access("load", ptrs.data, mask.data, width(ptrs))
        return orig_load(self, ptrs, mask, other, *a)

    def store(self, ptrs, value, mask, *a):
        if _GUARD:
            _check_access("store", ptrs.data, mask.data, width(ptrs))
        return orig_store(self, ptrs, value, mask, *a)

    def rmw(self, op, ptr, val, mask, *a):
        if _GUARD:
            _check_access("atomic", ptr.data, mask.data, width(ptr))
        return orig_rmw(self, op, ptr, val, mask, *a)

    def cas(self, ptr, cmp, val, *a):
        if _GUARD:
            _check_access("atomic", ptr.data, None, width(ptr))
        return orig_cas(self, ptr, cmp, val, *a)

    fixed = ((it, "_convert_float", convert_float), (builder, "create_dot", create_dot),
             (builder, "create_masked_load", load), (builder, "create_masked_store", store),
             (builder, "create_atomic_rmw", rmw), (builder, "create_atomic_cas", cas))
    UNFIXED[:] = UNFIXED or [(owner, name, getattr(owner, name)) for owner, name, _ in fixed]
    for owner, name, fn in fixed:
        setattr(owner, name, fn)
    _FIXED = True
    log.debug("applied Triton interpreter fixes (bf16 dot, rounding downcasts)")
