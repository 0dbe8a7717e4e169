"""The ONNX graph builder of the cpu target: `Graph` (nodes, constants, inputs and outputs, and the
shorthands every lowering uses), the value every lowering hands on, and the model it becomes.

The helpers several families share live each in its topic's module, as functions of the graph (`f(g, ...)`),
not as `Graph` methods: quantisation (`quant`), rotary tables (`rotary`), pool row addressing (`pool_rows`),
weights read dense (`linear`); `merge_splits` is the one graph optimisation. The export driver that lowers a
function through them is `codegen/onnx_export.py`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...ir.types import TensorType

OPSET = 23
MS_DOMAIN = "com.microsoft"
ONNX_DTYPES = {"fp32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "i32": TensorProto.INT32,
               "i64": TensorProto.INT64, "bool": TensorProto.BOOL, "fp8e4m3": TensorProto.UINT8,
               "e8m0": TensorProto.UINT8, "fp4x2": TensorProto.INT8}
NEG_INF = float("-inf")
FEW_LANES = 4  # the most tokens a sequence a chunk's few-lane forms take (`Graph.few_lanes`): verify's 1 + k
DERIVED_KEY = "v4compile.derived"  # model metadata: the derived weight inputs (onnx_weights), for the manifest


class Graph:
    """An ONNX graph under construction, and the shorthands that every op lowering uses."""

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

    def few_lanes(self, T: int, what: str) -> bool:
        """Whether lowering `what` takes its few-lane form: a chunk of 2..FEW_LANES tokens a sequence (a
        speculative verify step: the last token and its drafts). The forms are exact rewrites of the general
        lowering for that case, with index tables built at export time, or decode's reordered-sum forms
        applied lane by lane (`sparse_attention`'s chunk keys; at batch 1 `rotate`), within decode's
        tolerance; tests/onnx/test_onnx_verify_lowerings.py holds each against it. Prefill chunks (16 and
        more) keep the general form."""
        return 1 < T <= FEW_LANES

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

    def rms(self, x: str, w: str | None, eps: float, width: int | None = None) -> str:
        """RMSNorm over the last axis (fp32); unweighted: scale 1 (`width` channels)."""
        if w is None:
            w = self.const(np.ones(width, np.float32))
        return self.op("RMSNormalization", x, w, axis=-1, epsilon=eps)

    def drop_unread_consts(self) -> None:
        """Drop the initializers no node reads any more (after a rewrite such as `merge_splits`)."""
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


def value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, ONNX_DTYPES[t.dtype], list(t.shape))
