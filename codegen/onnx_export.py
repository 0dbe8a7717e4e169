"""ONNX export of a lowered IR function (the CPU target, run by ONNX Runtime).

Each function of the `cpu` pipeline becomes one ONNX model (opset 23, plus ONNX Runtime's `FusedMatMul`
for batched GEMMs against a transposed weight). Every op's lowering lives with its kernel family's in
`codegen/onnx/<family>.py` (`lower_<op>(g, o, a, r) -> results`, see `codegen/onnx/__init__.py`), where `g`
is the `Graph` below. This file holds the graph-building machinery and the helpers the lowerings share.

Interface of an exported model (what the runtime binds):
* inputs: the step inputs (`ids`, `pos`, `block_table`, `slot`), every pool plane / state tensor the
  function updates (read only: never copied), every stored weight the function reads as it is, by its IR
  name, and the weights it reads derived (an expert of a stacked weight, a quantised or bf16 weight as
  fp32: `Graph.weight`, `onnx_weights.py`; listed in the model's metadata and the manifest). The artifact
  stores the tensors in `weights/*.safetensors`; the runtime hands them (and the derived ones, built once
  at load) to ONNX Runtime as shared initializers, so the ONNX files hold no weight bytes;
* outputs: `logits`, and for each updated plane / state tensor `X` the rows the step wrote: `X.rows`
  (int64 `[N]`, negative = nothing to write) and `X.vals` (`[N, *row shape]`), in write order (a later row
  wins).
  The runtime stores them in place into its own buffers.

bf16 (a model traced in bf16): the graphs compute in fp32 (ONNX Runtime's cpu kernels have none in bf16);
bf16 weights come in upcast once at load (derived), bf16 planes and state are held in fp32, and every value
the IR holds in bf16 (an op's result, a row written) is rounded to bf16 (`compute_type`, `Graph.bf16_round`).

No copy of the pool: a write op only records its rows (`Graph.write_rows`); a later reader in the same step
gathers the rows it needs from the input plane and patches those that an earlier write in this step
replaced (`Graph.read_rows`), so a step costs what it reads, never the pool's capacity.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from v4compile.errors import IRError
from v4compile.ir.core import WEIGHT, Function, Module
from v4compile.ir.registry import get_op, semantic
from v4compile.ir.types import TensorType

from .onnx import COMMON, lowering

OPSET = 23
MS_DOMAIN = "com.microsoft"
ONNX_DTYPES = {"fp32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "i32": TensorProto.INT32,
               "i64": TensorProto.INT64, "bool": TensorProto.BOOL, "fp8e4m3": TensorProto.UINT8,
               "e8m0": TensorProto.UINT8, "fp4x2": TensorProto.INT8}
NP_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64, TensorProto.INT32: np.int32,
             TensorProto.BOOL: np.bool_, TensorProto.UINT8: np.uint8}
NEG_INF = float("-inf")
# a written row that is no row, so far below 0 that a layer's row offset added to it leaves it negative: one
# Add offsets a shared row list (a compare and a Where to keep a -1 a -1 otherwise)
SKIP_ROW = -(1 << 40)
DERIVED_KEY = "v4compile.derived"  # model metadata: the derived weight inputs (onnx_weights), for the manifest


@dataclass(frozen=True)
class Planes:
    """A pool plane or state tensor as the step sees it: the input tensor `base` plus the writes made so far
    in this step, in write order (a later row wins): (layer scope, rows int64 [N] (negative = none), vals
    [N, *row], vals' static shape or None, kind or None) each. A reader patches only its own layer's writes
    (`Graph.read_rows`); the function's outputs `X.rows` / `X.vals` are all of them concatenated once, at
    the end (`lower_function`), not a Concat per write."""

    base: str
    segs: tuple = ()

    @property
    def written(self) -> bool:
        return bool(self.segs)


@dataclass(frozen=True)
class RowList:
    """What a CSR construction op hands to its readers in ONNX: padded physical rows `[L, W]` (int64,
    -1 = no row). The packed indptr / indices form is a device layout; in ONNX a reader wants the rows
    padded, so the pair (indptr, indices) of the IR both map to this one object."""

    rows: str
    # where the maker has them at no cost: the mask `rows >= 0` and the rows with an in-range row (weighted
    # 0 by the reader) in place of each -1, so a reader needs neither a compare nor a Where of its own
    keep: str | None = None
    safe: str | None = None


@dataclass
class Operands:
    """Operands of one op by signature name, and their IR types (`types.<name>`)."""

    values: dict[str, Any]
    types: dict[str, TensorType | None] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


class Graph:
    """An ONNX graph under construction, with small helpers that the op lowerings share."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}
        self.memo: dict[tuple, Any] = {}  # per-graph caches of helpers (cos / sin tables, casts)
        self.uses_ms = False
        self.loc = ""
        self.derived: dict[str, dict] = {}  # graph inputs built from stored weights at load (onnx_weights)
        self.bf16_planes: set[str] = set()  # state inputs the IR stores in bf16 (held in fp32 here)
        self._outs: dict[str, str] = {}  # values renamed to graph outputs (`output_as`): value -> output

    # ---- raw construction ----------------------------------------------------------------------
    def fresh(self, hint: str = "t") -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def op(self, op_type: str, *inputs: str | None, n_out: int = 1, domain: str = "", out: str | None = None,
           **attrs) -> Any:
        outs = [out] if out else [self.fresh(op_type.lower()) for _ in range(n_out)]
        node = helper.make_node(op_type, ["" if i is None else i for i in inputs], outs,
                                name=self.fresh("n"), domain=domain or None, **attrs)
        if self.loc:
            node.doc_string = self.loc
        if domain == MS_DOMAIN:
            self.uses_ms = True
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.float32) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh("c")
            self.inits.append(onnx.numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def i64(self, *values: int) -> str:
        return self.const(list(values), np.int64)

    def scalar(self, v: float) -> str:
        return self.const(v, np.float32)

    def iscalar(self, v: int) -> str:
        return self.const(v, np.int64)

    def one_token(self, T: int, what: str) -> bool:
        """Whether lowering `what` takes its one-token (decode step) form: a chunk of one token a sequence.
        The forms are exact rewrites of the general lowering for that case (`sparse_attention`'s reorders
        one fp32 sum), and tests/onnx/test_onnx_decode_lowerings.py holds each against it."""
        return T == 1

    def live(self, pos: str) -> str:
        """pos >= 0: the lanes (tokens) of the step that are real, not padding; one node per graph."""
        return self.cached(("live", pos), lambda: self.op("GreaterOrEqual", pos, self.iscalar(0)))

    def cached(self, key: tuple, make):
        """One graph value per key: index arithmetic that depends only on the step inputs (positions,
        slots, block tables) is built once and shared by every layer."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    # ---- shape / arithmetic shorthands ---------------------------------------------------------
    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", x, self.i64(*shape))

    def unsqueeze(self, x: str, *axes: int) -> str:
        return self.op("Unsqueeze", x, self.i64(*axes))

    def squeeze(self, x: str, *axes: int) -> str:
        return self.op("Squeeze", x, self.i64(*axes))

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", x, self.i64(start), self.i64(end), self.i64(axis))

    def split(self, x: str, sizes, axis: int = -1) -> list[str]:
        return self.op("Split", x, self.i64(*sizes), n_out=len(sizes), axis=axis)

    def concat(self, xs, axis: int = -1) -> str:
        return xs[0] if len(xs) == 1 else self.op("Concat", *xs, axis=axis)

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", x, to=to)

    def bf16_round(self, x: str) -> str:
        """x rounded to bf16 (to nearest, ties to even, as torch's `.to(bfloat16)`), kept in fp32."""
        return self.cast(self.cast(x, TensorProto.BFLOAT16), TensorProto.FLOAT)

    def as_i64(self, x: str, ir_dtype: str | None) -> str:
        if ir_dtype == "i64":
            return x
        key = ("i64", x)
        if key not in self.memo:
            self.memo[key] = self.cast(x, TensorProto.INT64)
        return self.memo[key]

    def where(self, c: str, a: str, b: str) -> str:
        return self.op("Where", c, a, b)

    def sum(self, x: str, axis: int, keepdims: int = 0) -> str:
        return self.op("ReduceSum", x, self.i64(axis), keepdims=keepdims)

    def max(self, x: str, axis: int, keepdims: int = 0) -> str:
        return self.op("ReduceMax", x, self.i64(axis), keepdims=keepdims)

    def mean(self, x: str, axis: int, keepdims: int = 1) -> str:
        return self.op("ReduceMean", x, self.i64(axis), keepdims=keepdims)

    def clamp_min0(self, x: str) -> str:
        return self.op("Max", x, self.iscalar(0))

    def matmul_t(self, x: str, w: str) -> str:
        """x @ w^T over the last two axes (a batched GEMM against a weight stored [.., out, in])."""
        return self.op("FusedMatMul", x, w, domain=MS_DOMAIN, transB=1)

    # ---- model-level helpers -------------------------------------------------------------------
    def weight(self, w: str, wt: TensorType, scale: str | None = None, block: int | None = None,
               index: int | None = None) -> tuple[str, TensorType]:
        """The graph input that holds weight `w` (expert `index` of it) as dense fp32, and its type: `w`
        itself, or a tensor the runtime derives from it once at load (`onnx_weights`)."""
        from .onnx_weights import QUANTISED, derived_name, entry

        if wt.dtype not in ("fp32", "bf16", *QUANTISED) or (scale is None) != (wt.dtype not in QUANTISED):
            raise IRError("the ONNX (cpu) target takes fp32, bf16, FP8 or FP4 weights (scaled iff quantised)",
                          found=f"{wt.dtype}{' with' if scale else ' without'} a scale")
        if index is None and wt.dtype == "fp32":
            return w, wt
        name = derived_name(w, index, wt.dtype != "fp32")
        if name not in self.derived:
            self.derived[name] = entry(w, wt.dtype, wt.shape, index, scale, block)
        return name, TensorType(tuple(self.derived[name]["shape"]), "fp32")

    def linear(self, x: str, xt: TensorType, w: str, wt: TensorType, scale: str | None = None,
               block: int | None = None) -> str:
        """`x W^T` for a 2-D weight `[out, in]` (dense fp32 as the graph sees it): one Gemm over the
        flattened rows."""
        w, wt = self.weight(w, wt, scale, block)
        if xt.rank == 2:
            return self.op("Gemm", x, w, transB=1)
        if wt.numel < 65536:  # small weights: one node, no reshapes
            return self.matmul_t(x, w)
        # large weights: Gemm, whose constant B ONNX Runtime pre-packs once (transposed B included)
        y = self.op("Gemm", self.reshape(x, (-1, xt.shape[-1])), w, transB=1)
        return self.reshape(y, (*xt.shape[:-1], wt.shape[0]))

    def rms(self, x: str, w: str | None, eps: float, width: int | None = None) -> str:
        """RMSNorm over the last axis (fp32); unweighted: scale 1 (`width` channels)."""
        if w is None:
            w = self.const(np.ones(width, np.float32))
        return self.op("RMSNormalization", x, w, axis=-1, epsilon=eps)

    def rope_tables(self, pos: str, pos_rank: int, extra: int, dim: int, theta: float, yarn: tuple,
                    inverse: bool, width: int | None = None) -> tuple[str, str]:
        """cos / sin `[*pos, 1 * extra, width]` (each pair's value twice) at integer positions, for the last
        `dim` of `width` channels: the first `width - dim` have frequency 0 (cos 1, sin 0 exactly). One
        Sin / Cos per positions and frequencies: the other ranks (q's head axis) are Unsqueezes of them and
        the inverse's sin their Neg (the same values, so every user shares the one computation)."""
        width = width or dim
        key = (pos, dim, width, theta, tuple(yarn))

        def base():
            from v4compile.ops.rope import inv_freq

            f = np.concatenate([np.zeros(width - dim, np.float32), np.repeat(inv_freq(dim, theta, tuple(yarn)).numpy(), 2)])
            ang = self.op("Mul", self.unsqueeze(self.cast(pos, TensorProto.FLOAT), -1), self.const(f))
            return self.op("Cos", ang), self.op("Sin", ang)

        def ranked():
            cos, sin = self.cached(("rope",) + key, base)
            if not extra:
                return cos, sin
            axes = self.i64(*range(pos_rank, pos_rank + extra))
            return self.op("Unsqueeze", cos, axes), self.op("Unsqueeze", sin, axes)

        def make():
            cos, sin = self.cached(("rope", extra) + key, ranked)
            return cos, (self.op("Neg", sin) if inverse else sin)
        return self.cached(("rope", extra, inverse) + key, make)

    def rotate(self, x: str, xt: TensorType, pos: str, pos_rank: int, dim: int, theta: float, yarn: tuple,
               inverse: bool = False, fused: bool = False) -> str:
        """Interleaved RoPE on the last `dim` channels, as `ops.rope.rotate`: x * cos + rot_half(x) * sin over
        all D channels, rot_half (pairs (a, b) -> (-b, a)) an exact product with a constant +-1 matrix that
        is zero on the first D - dim channels, where cos is 1 and sin 0: those come out as x + 0 = x, bit
        for bit (finite x), with no Split / Concat around the rotation (two nodes fewer a call). The inverse
        (sin negated) subtracts the product instead: x * cos - r * sin is x * cos + r * (-sin) bit for bit.

        `fused`, at a single position (a decode step at batch 1, `one_token(1, "rotate")`): one MatMul with
        the step's rotation matrix diag(cos) + R diag(sin), built once per positions and frequencies, for
        the four nodes. The first D - dim channels still come out exactly (a column of the identity); a
        rotated one is x_a cos + x_b sin in one GEMM sum (an FMA may round once where the four nodes round
        twice: ~1 ulp), so a caller whose result feeds a rounding to a coarse grid (FP4) keeps it off."""
        lead, D = xt.shape[:-1], xt.shape[-1]
        R = np.zeros((D, D), np.float32)
        for i in range(D - dim, D, 2):
            R[i + 1, i], R[i, i + 1] = -1.0, 1.0
        if fused and math.prod(lead[:pos_rank]) == 1 and self.one_token(1, "rotate"):
            def matrix():
                cos, sin = self.rope_tables(pos, pos_rank, 0, dim, theta, yarn, False, D)  # [1.., D]
                m = self.op("Sub" if inverse else "Add", self.op("Mul", cos, self.const(np.eye(D, dtype=np.float32))),
                            self.op("Mul", sin, self.const(R)))
                return m if pos_rank == 1 else self.reshape(m, (D, D))  # cos [1, D]: m is [D, D] already
            return self.op("MatMul", x, self.cached(("rope_matrix", pos, dim, D, theta, tuple(yarn), inverse), matrix))
        cos, sin = self.rope_tables(pos, pos_rank, len(lead) - pos_rank, dim, theta, yarn, False, D)
        return self.op("Sub" if inverse else "Add", self.op("Mul", x, cos),
                       self.op("Mul", self.op("MatMul", x, self.const(R)), sin))

    def pow2_scale(self, amax: str, qmax: float, floor: float) -> str:
        """2^ceil(log2(max(amax, floor) / qmax)), exact: the log2 estimate is corrected by one step each way."""
        r = self.op("Div", self.op("Max", amax, self.scalar(floor)), self.scalar(qmax))
        e = self.op("Ceil", self.op("Div", self.op("Log", r), self.scalar(math.log(2.0))))
        two = self.scalar(2.0)
        lower = self.op("Pow", two, self.op("Sub", e, self.scalar(1.0)))
        e = self.where(self.op("GreaterOrEqual", lower, r), self.op("Sub", e, self.scalar(1.0)), e)
        e = self.where(self.op("Less", self.op("Pow", two, e), r), self.op("Add", e, self.scalar(1.0)), e)
        return self.op("Pow", two, e)

    def fp8_qdq(self, x: str, xt: TensorType, block: int) -> str:
        """Spec 13.2: round through e4m3 with one UE8M0 scale per `block` values of the last axis."""
        lead, n = xt.shape[:-1], xt.shape[-1]
        g = self.reshape(x, (*lead, n // block, block))
        s = self.pow2_scale(self.max(self.op("Abs", g), -1, 1), 448.0, 1e-4)
        q = self.op("Clip", self.op("Div", g, s), self.scalar(-448.0), self.scalar(448.0))
        q = self.cast(self.op("Cast", q, to=TensorProto.FLOAT8E4M3FN, saturate=1), TensorProto.FLOAT)
        return self.reshape(self.op("Mul", q, s), xt.shape)

    def fp4_qdq(self, x: str, xt: TensorType, block: int = 32) -> str:
        """Spec 13.3: round through e2m1 (nearest magnitude, ties to the even code) with a UE8M0 scale."""
        from v4compile.formats import FP4_VALUES

        lead, n = xt.shape[:-1], xt.shape[-1]
        g = self.reshape(x, (*lead, n // block, block))
        s = self.pow2_scale(self.max(self.op("Abs", g), -1, 1), 6.0, 6.0 * 2.0 ** -126)
        y = self.op("Clip", self.op("Div", g, s), self.scalar(-6.0), self.scalar(6.0))
        dist = self.op("Abs", self.op("Sub", self.unsqueeze(self.op("Abs", y), -1), self.const(FP4_VALUES)))
        best = self.op("ReduceMin", dist, self.i64(-1), keepdims=1)
        pref = self.op("Mul", self.cast(self.op("Equal", dist, best), TensorProto.FLOAT),
                       self.const([2.0 - (i & 1) for i in range(8)]))
        code = self.op("ArgMax", pref, axis=-1, keepdims=0)
        mag = self.op("Gather", self.const(FP4_VALUES), code)
        val = self.where(self.op("Less", y, self.scalar(0.0)), self.op("Neg", mag), mag)
        return self.reshape(self.op("Mul", val, s), xt.shape)

    def act_qdq(self, x: str, xt: TensorType, block: int = 128) -> str:
        """`formats.act_qdq`: the FP8 GEMM's activation, per `block` values of the last axis (a partial last
        block has its own scale: its zero padding changes no amax)."""
        n = xt.shape[-1]
        full = n - n % block
        if full == 0:
            return self.fp8_qdq(x, xt, n)
        if full == n:
            return self.fp8_qdq(x, xt, block)
        a, b = self.split(x, (full, n - full))
        return self.concat([self.fp8_qdq(a, xt.with_shape(*xt.shape[:-1], full), block),
                            self.fp8_qdq(b, xt.with_shape(*xt.shape[:-1], n - full), n - full)], -1)

    def hadamard_fp4(self, x: str, xt: TensorType, block: int = 32) -> str:
        from v4compile.formats import hadamard

        h = self.op("MatMul", x, self.const(hadamard(xt.shape[-1]).numpy()))
        return self.fp4_qdq(h, xt, block)

    def ring_lanes(self, pos: str, slots: int) -> str:
        """Lanes whose token a ring of `slots` entries keeps after this chunk (`ops.attention.ring_lanes`)."""
        key = ("ring", pos, slots)
        if key not in self.memo:
            valid = self.op("GreaterOrEqual", pos, self.iscalar(0))
            n = self.sum(self.cast(valid, TensorProto.INT64), 1, 1)
            last = self.op("Sub", self.op("Add", self.clamp_min0(self.slice(pos, 0, 1, 1)), n), self.iscalar(1))
            keep = self.op("And", valid, self.op("Greater", pos, self.op("Sub", last, self.iscalar(slots))))
            self.memo[key] = keep
        return self.memo[key]

    # ---- mHC ----------------------------------------------------------------------------------

    # ---- pool planes ---------------------------------------------------------------------------
    def read_rows(self, p: Planes, rows: str, n_rows: int | None = None, shape: tuple | None = None,
                  unseen: tuple = ()) -> str:
        """`plane[rows]` (rows int64 of any shape, >= 0) as this step sees it: the input plane, patched
        with the rows written earlier in the step (a later write wins), shaped rows' shape + the row's;
        `shape`: the caller's shape for the result instead (one static Reshape); `unseen`: kinds of write
        (`write_rows`) the caller knows its rows never hit, left out of the patch."""
        got = self.op("Gather", p.base, rows, axis=0)  # [*rows, *row]
        # A layer's pool rows (and state) are its own: only that layer's writes can hit its reads, so the
        # [reads x writes] match below is over this layer's writes, not every earlier layer's too.
        key = self.pool_scope()
        segs = [sg for sg in p.segs if (key is None or sg[0] in (key, None)) and sg[4] not in unseen]
        if not segs:
            return got if shape is None else self.reshape(got, shape)
        if all(sg[3] is not None and sg[3][0] == 1 for sg in segs):
            out = self._patch_single_rows(got, rows, segs)
            return out if shape is None else self.reshape(out, shape)
        w_rows = self.concat([sg[1] for sg in segs], 0)
        w_vals = self.concat([sg[2] for sg in segs], 0)
        # hit[..., w]: the read row is write w's (a skipped write's -1 never is); kept in rows' own shape, so
        # the patched rows come out in the reader's shape with no flattening or reshaping back
        hit = self.cast(self.op("Equal", self.unsqueeze(rows, -1), w_rows), TensorProto.INT32)  # [*rows, W]
        j = self.op("ArgMax", hit, axis=-1, keepdims=0, select_last_index=1)  # a later write wins
        # only the hit reads take their row from the writes: a ScatterND of those K rows into the gathered
        # ones (a Where over all M rows costs ~4x an elementwise op in ONNX Runtime: prefill reads are big)
        at = self.op("Transpose", self.op("NonZero", self.max(hit, -1)), perm=[1, 0])  # [K, rank of rows]
        new = self.op("Gather", w_vals, self.op("GatherND", j, at), axis=0)
        out = self.op("ScatterND", got, at, new)
        return out if shape is None else self.reshape(out, shape)

    def _patch_single_rows(self, got: str, rows: str, segs: list) -> str:
        """The patch when every write is one row (a decode step at batch 1): one Where per write, in write
        order, so a later write of a row wins; 2 nodes a write and one Unsqueeze (the general match takes 10
        and two Concats). The reads are few there, so a Where over all of them is cheap."""
        row_rank = len(segs[0][3]) - 1
        ru = self.unsqueeze(rows, *range(-row_rank, 0))  # [*rows, 1 * row_rank]
        for _, w_row, w_val, _, _ in segs:  # w_row [1] vs ru [*rows, 1 * row_rank]; w_val [1, *row]
            got = self.where(self.op("Equal", ru, w_row), w_val, got)
        return got

    def write_rows(self, p: Planes, rows: str, vals: str, vals_shape: tuple | None = None,
                   kind: str | None = None) -> Planes:
        """Record `plane[rows] = vals` (rows int64 [N], negative = skip; vals [N, *row], of static shape
        `vals_shape` where the caller knows it: a read patches a one-row write with a Where; `kind`: what
        the rows are, for a reader that knows it never reads such rows, `read_rows(unseen=)`)."""
        if p.base in self.bf16_planes:
            vals = self.bf16_round(vals)
        return Planes(p.base, p.segs + ((self.pool_scope(), rows, vals, vals_shape, kind),))

    def pool_scope(self) -> str | None:
        """The layer the op being lowered belongs to (`layers.3`, `mtp.0`), from its location; None when
        it names none (its reads then patch with every write)."""
        parts = self.loc.split(" ")[-1].split(".")
        return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] in ("layers", "mtp") and parts[1].isdigit() \
            else None

    # ---- attention-side helpers -------------------------------------------------------------
    def fp8_round(self, x: str, xt: TensorType, dims: int, block: int) -> str:
        """`ops.numerics.fp8_round_ref`: FP8 on the first `dims` channels, the rest kept."""
        head, tail = self.split(x, (dims, xt.shape[-1] - dims))
        return self.concat([self.fp8_qdq(head, xt.with_shape(*xt.shape[:-1], dims), block), tail], -1)

    def window_rows(self, pos: str, slot: str, window: int, slot_rows: int, n_rows: int) -> str:
        """Physical ring row of each position (before the layer's ring offset); pos [B, X], slot [B]. A
        padding lane (slot -1) gets slot 0's rows: in range, so a reader may read them masked (weight 0)."""
        base = self.cached(("slot_rows", slot, slot_rows, n_rows), lambda: self.unsqueeze(self.op(
            "Sub", self.iscalar(n_rows), self.op("Mul", self.op("Add", self.cached(("clamp0", slot), lambda: self.clamp_min0(
                slot)), self.iscalar(1)), self.iscalar(slot_rows))), -1))
        return self.op("Add", base, self.op("Mod", pos, self.iscalar(window)))

    def block_rows(self, w: str, bt: str, ratio: int, block_tokens: int, envelope_rows: int, n_blocks: int,
                   per_lane: bool, lanes: tuple | None = None) -> str:
        """Physical row of window `w` (`ops.paged.compressed_row`): w `[W]` shared by all sequences
        (-> `[B, W]`) or `[B, ...]` per sequence (`per_lane`; `lanes`: w's static shape with -1 for at most
        one dynamic axis, where the caller knows it: constant reshapes, none for `[B, k]`)."""
        return self.cached(("block_rows", w, bt, ratio, block_tokens, envelope_rows, per_lane),
                           lambda: self._block_rows(w, bt, ratio, block_tokens, envelope_rows, n_blocks, per_lane,
                                                    lanes))

    def _block_rows(self, w, bt, ratio, block_tokens, envelope_rows, n_blocks, per_lane, lanes) -> str:
        per_block = block_tokens // ratio
        bi = self.op("Clip", self.op("Div", w, self.iscalar(per_block)), self.iscalar(0), self.iscalar(n_blocks - 1))
        btc = self.cached(("clamp0", bt), lambda: self.clamp_min0(bt))
        if per_lane and lanes is not None and len(lanes) == 2:
            blk = self.op("GatherElements", btc, bi, axis=1)
        elif per_lane and lanes is not None:
            blk = self.reshape(self.op("GatherElements", btc, self.reshape(bi, (lanes[0], -1)), axis=1), lanes)
        elif per_lane:
            shape = self.op("Shape", w)
            B = self.op("Shape", bt, start=0, end=1)
            blk = self.op("GatherElements", btc, self.op("Reshape", bi, self.concat([B, self.i64(-1)], 0)), axis=1)
            blk = self.op("Reshape", blk, shape)
        else:
            blk = self.op("Gather", btc, bi, axis=1)
        return self.op("Add", self.op("Mul", blk, self.iscalar(envelope_rows)),
                       self.op("Mod", w, self.iscalar(per_block)))

    def visible_limit(self, pos: str, ratio: int) -> str:
        """floor((t + 1) / ratio): compressed rows a query at t may see."""
        return self.cached(("limit", pos, ratio),
                           lambda: self.op("Div", self.op("Add", pos, self.iscalar(1)), self.iscalar(ratio)))

    def dyn_range(self, limit: str, max_rows: int) -> str:
        """0..W-1 with W = the largest limit of the step (at least 1, at most `max_rows`): the rows a
        static kernel would mask are never read, so the cost follows the context, not the capacity."""
        def make():
            w = self.op("Clip", self.op("ReduceMax", limit, keepdims=0), self.iscalar(1), self.iscalar(max_rows))
            return self.op("Range", self.iscalar(0), w, self.iscalar(1))
        return self.cached(("range", limit, max_rows), make)

    def window_write(self, plane: Planes, kv: str, kvt: TensorType, pos: str, slot: str, a: dict) -> Planes:
        B, T, d = kvt.shape
        key = ("winrows", pos, slot, a["window"], a["slot_rows"], a["n_rows"])
        # a one-token chunk keeps its token iff the lane is live (`ring_lanes` of one lane)
        lanes = (lambda: self.live(pos)) if self.one_token(T, "window_write") else \
            (lambda: self.ring_lanes(pos, a["window"]))
        base = self.cached(key, lambda: self.reshape(self.where(
            lanes(), self.window_rows(pos, slot, a["window"], a["slot_rows"], a["n_rows"]),
            self.iscalar(SKIP_ROW)), (B * T,)))
        rows = self.op("Add", base, self.iscalar(a["layer_row"])) if a["layer_row"] else base
        return self.write_rows(plane, rows, self.reshape(kv, (B * T, d)), (B * T, d), "window")

    # ---- finish --------------------------------------------------------------------------------
    def output_as(self, x: str, name: str) -> None:
        """Graph output `name` holding value `x`: the node that makes `x` renamed to make `name` (an
        Identity costs ONNX Runtime a node a step: it keeps those that write a graph output); an Identity
        where `x` is no node's own (a graph input, a constant, a value already output under a name)."""
        if x in self._outs:  # already an output: it goes by that name now
            self.op("Identity", self._outs[x], out=name)
            return
        prod = next((n for n in reversed(self.nodes) if x in n.output), None)
        if prod is None:
            self.op("Identity", x, out=name)
            return
        prod.output[:] = [name if o == x else o for o in prod.output]
        for n in self.nodes:
            if x in n.input:
                n.input[:] = [name if i == x else i for i in n.input]
        self._outs[x] = name

    def merge_splits(self) -> None:
        """A Split of a part that another Split made (same axis, static sizes, the part read by nothing
        else) becomes more parts of that Split: a merged GEMM's output cut by a chain of `split` ops is one
        node (each costs a decode step ~0.3 us; the parts are the same values)."""
        sizes = {t.name: [int(v) for v in onnx.numpy_helper.to_array(t).ravel()]
                 for t in self.inits if t.data_type == TensorProto.INT64}
        readers: dict[str, int] = {}
        for n in self.nodes:
            for i in n.input:
                readers[i] = readers.get(i, 0) + 1
        outs = {o.name for o in self.outputs}  # a part the graph outputs stays a value of its own
        made: dict[str, onnx.NodeProto] = {}  # a part -> the Split that makes it
        keep = []
        for n in self.nodes:
            if n.op_type != "Split" or len(n.input) != 2 or n.input[1] not in sizes:
                keep.append(n)
                continue
            p = made.get(n.input[0])
            if p is None or readers[n.input[0]] != 1 or n.input[0] in outs or list(n.attribute) != list(p.attribute):
                keep.append(n)
                made.update({o: n for o in n.output})
                continue
            at = list(p.output).index(n.input[0])
            parts = sizes[p.input[1]]
            merged = [*parts[:at], *sizes[n.input[1]], *parts[at + 1:]]
            p.input[1] = self.i64(*merged)
            sizes[p.input[1]] = merged
            p.output[:] = [*p.output[:at], *n.output, *p.output[at + 1:]]
            made.update({o: p for o in n.output})
        self.nodes[:] = keep
        read = {i for n in self.nodes for i in n.input}
        self.inits[:] = [t for t in self.inits if t.name in read]
        self._consts = {k: v for k, v in self._consts.items() if v in read}

    def model(self, doc: str = "") -> onnx.ModelProto:
        opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if self.uses_ms else [])
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.inits)
        m = helper.make_model(g, opset_imports=opsets, producer_name="v4compile", doc_string=doc)
        m.ir_version = 10
        if self.derived:
            helper.set_model_props(m, {DERIVED_KEY: json.dumps(self.derived, sort_keys=True)})
        return m


def compute_type(t: TensorType | None) -> TensorType | None:
    """The type a value has in the ONNX graph: a bf16 value is held in fp32 (ONNX Runtime's cpu kernels
    compute in fp32), rounded to bf16 wherever the IR stores it (an op's result, a plane's written rows),
    so it carries exactly the reference's bf16 values between ops."""
    return TensorType(t.shape, "fp32") if t is not None and t.dtype == "bf16" else t


def value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], list(t.shape))


def state_names(fn: Function) -> list[str]:
    """Inputs the function updates (pool planes, per-slot state): inputs that are also outputs by name."""
    outs = {n for n, _ in fn.outputs}
    return [v.name for v in fn.inputs if v.name in outs]


def lower_function(module: Module, fname: str) -> onnx.ModelProto:
    fn = module.functions[fname]
    g = Graph(f"{module.name}.{fname}")
    states = set(state_names(fn))
    env: dict[int, Any] = {}
    types: dict[int, TensorType] = {}
    for v in fn.inputs:
        if v.type.dtype not in ("fp32", "bf16", "i32", "i64"):
            raise IRError("the ONNX (cpu) target needs native fp32 / bf16 pool planes and fp32 / bf16 compute",
                          where=f"@{fname} %{v.name}", expected="fp32 / bf16 native planes", found=v.type.dtype)
        g.inputs.append(value_info(v.name, compute_type(v.type)))
        if v.name in states:
            env[id(v)] = Planes(v.name)
            if v.type.dtype == "bf16":
                g.bf16_planes.add(v.name)
        else:
            env[id(v)] = v.name
        types[id(v)] = v.type
    weights_used = []
    for op in fn.ops:
        for v in op.operands:
            if v is not None and v.kind == WEIGHT and id(v) not in env:
                env[id(v)] = v.name
                types[id(v)] = v.type
                weights_used.append(v)
    for op in fn.ops:
        opdef = get_op(op.name)
        lower = lowering(opdef)
        if lower is None:
            raise IRError(f"op '{op.name}' has no ONNX lowering", where=f"@{fname} ({op.loc})",
                          expected=f"lower_{op.name} in v4compile/codegen/onnx/{opdef.kernel or COMMON}.py")
        names = opdef.operand_names
        o = Operands({n: (env[id(v)] if v is not None else None) for n, v in zip(names, op.operands)},
                     {n: (types.get(id(v), v.type) if v is not None else None) for n, v in zip(names, op.operands)})
        g.loc = f"{op.name} {op.loc}"
        try:
            outs = lower(g, o, semantic(op.attrs), [r.type for r in op.results])
        except NotImplementedError as e:  # a variant the cpu target does not cover: one clear error
            raise IRError(f"no ONNX lowering for this use of '{op.name}': {e}", where=f"@{fname} ({op.loc})") from None
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if len(outs) < len(op.results):
            raise IRError(f"ONNX lowering of '{op.name}' returned {len(outs)} results", expected=len(op.results))
        for r, x in zip(op.results, outs):
            if r.type.dtype == "bf16" and isinstance(x, str):
                x = g.bf16_round(x)  # a bf16 result: computed in fp32, stored as the reference stores it
            env[id(r)] = x
            types[id(r)] = r.type
    # weights: the stored ones the graph reads as they are, then those it takes derived (onnx_weights)
    read = {i for n in g.nodes for i in n.input}
    upcast = {w.name: g.weight(w.name, w.type)[0] for w in weights_used if w.name in read and w.type.dtype == "bf16"}
    for n in g.nodes:  # a bf16 weight read as it is (norm weights, tables): its fp32 upcast, made at load
        n.input[:] = [upcast.get(i, i) for i in n.input]
    read = {i for n in g.nodes for i in n.input}
    for w in sorted({w.name: w for w in weights_used if w.name in read}.values(), key=lambda w: w.name):
        g.inputs.append(value_info(w.name, w.type))
    g.derived = {n: d for n, d in sorted(g.derived.items()) if n in read}
    for n, d in g.derived.items():
        g.inputs.append(value_info(n, TensorType(tuple(d["shape"]), "fp32")))
    for name, v in fn.outputs:
        x = env[id(v)]
        if isinstance(x, Planes):
            if not x.written:
                continue  # never written by this function
            t = v.type
            g.output_as(g.concat([sg[1] for sg in x.segs], 0), f"{name}.rows")
            g.output_as(g.concat([sg[2] for sg in x.segs], 0), f"{name}.vals")
            g.outputs.append(helper.make_tensor_value_info(f"{name}.rows", TensorProto.INT64, [None]))
            g.outputs.append(helper.make_tensor_value_info(f"{name}.vals", ONNX_DTYPES[compute_type(t).dtype],
                                                           [None, *t.shape[1:]]))
        else:
            g.output_as(x, name)
            g.outputs.append(value_info(name, compute_type(v.type)))
    g.merge_splits()
    return g.model(doc=f"v4compile function @{fname} of module @{module.name}")


def export_function(module: Module, fname: str, check: bool = True) -> onnx.ModelProto:
    m = lower_function(module, fname)
    if check:
        onnx.checker.check_model(m, full_check=True)
    return m


def function_io(model: onnx.ModelProto, weight_names: set[str]) -> dict[str, Any]:
    """The model's inputs split into step inputs (and state), stored weights and derived weights (name ->
    how the runtime builds it, `onnx_weights`); its outputs."""
    ins = [i.name for i in model.graph.input]
    props = {p.key: p.value for p in model.metadata_props}
    derived = json.loads(props.get(DERIVED_KEY, "{}"))
    io = {"weights": [n for n in ins if n in weight_names],
          "inputs": [n for n in ins if n not in weight_names and n not in derived],
          "outputs": [o.name for o in model.graph.output]}
    return {**io, "derived": derived} if derived else io


