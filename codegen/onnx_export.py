"""ONNX export of a lowered IR function (the CPU target, run by ONNX Runtime).

Each function of the `cpu` pipeline becomes one ONNX model (opset 23, plus ONNX Runtime's `FusedMatMul`
for batched GEMMs against a transposed weight). Every op's lowering lives with its kernel family's in
`codegen/onnx/<family>.py` (`lower_<op>(g, o, a, r) -> results`, see `codegen/onnx/__init__.py`), where `g`
is the graph builder (`codegen/onnx/graph.Graph`; the helpers several families share are functions in
`codegen/onnx/`: `quant`, `rotary`, `pool_rows`, `linear`). This file is the driver: it lowers a function
op by op, binds its inputs and outputs, and runs the graph optimisation (`codegen/onnx/merge_splits`).

Interface of an exported model (what the runtime binds):
* inputs: the step inputs (`ids`, `pos`, `block_table`, `slot`), every pool plane / state tensor the
  function updates (read only: never copied, `codegen/onnx/pool_rows.py`), every stored weight the
  function reads as it is, by its IR name, and the weights it reads derived (an expert of a stacked
  weight, a quantised or bf16 weight as fp32: `codegen/onnx/linear.weight`, `onnx_weights.py`; listed in
  the model's metadata and the manifest). The artifact stores the tensors in `weights/*.safetensors`; the
  runtime hands them (and the derived ones, built once at load) to ONNX Runtime as shared initializers,
  so the ONNX files hold no weight bytes;
* outputs: `logits`, and for each updated plane / state tensor `X` the rows the step wrote: `X.rows`
  (int64 `[N]`, negative = nothing to write) and `X.vals` (`[N, *row shape]`), in write order (a later row
  wins).
  The runtime stores them in place into its own buffers.

bf16 (a model traced in bf16): the graphs compute in fp32 (ONNX Runtime's cpu kernels have none in bf16);
bf16 weights come in upcast once at load (derived), bf16 planes and state are held in fp32, and every value
the IR holds in bf16 (an op's result, a row written) is rounded to bf16 (`compute_type`, `Graph.bf16_round`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto, helper

from v4compile.errors import IRError
from v4compile.ir.core import WEIGHT, Function, Module
from v4compile.ir.registry import get_op, semantic
from v4compile.ir.types import TensorType

from .onnx import COMMON, linear, lowering
from .onnx.graph import DERIVED_KEY, ONNX_DTYPES, Graph, value_info
from .onnx.merge_splits import merge_splits
from .onnx.pool_rows import Planes


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


def output_as(g: Graph, x: str, name: str, named: dict[str, str]) -> None:
    """Graph output `name` holding value `x`: the node that makes `x` renamed to make `name` (an
    Identity costs ONNX Runtime a node a step: it keeps those that write a graph output); an Identity
    where `x` is no node's own (a graph input, a constant, a value already output under a name: `named`,
    value -> output name, the caller's across its outputs)."""
    if x in named:  # already an output: it goes by that name now
        g.op("Identity", named[x], out=name)
        return
    prod = next((n for n in reversed(g.nodes) if x in n.output), None)
    if prod is None:
        g.op("Identity", x, out=name)
        return
    prod.output[:] = [name if o == x else o for o in prod.output]
    for n in g.nodes:
        if x in n.input:
            n.input[:] = [name if i == x else i for i in n.input]
    named[x] = name


def compute_type(t: TensorType | None) -> TensorType | None:
    """The type a value has in the ONNX graph: a bf16 value is held in fp32 (ONNX Runtime's cpu kernels
    compute in fp32), rounded to bf16 wherever the IR stores it (an op's result, a plane's written rows),
    so it carries exactly the reference's bf16 values between ops."""
    return TensorType(t.shape, "fp32") if t is not None and t.dtype == "bf16" else t


def state_names(fn: Function) -> list[str]:
    """Inputs the function updates (pool planes, per-slot state): inputs that are also outputs by name."""
    outs = {n for n, _ in fn.outputs}
    return [v.name for v in fn.inputs if v.name in outs]


def lower_function(module: Module, fname: str) -> onnx.ModelProto:
    fn = module.functions[fname]
    g = Graph(f"{module.name}.{fname}")
    named: dict[str, str] = {}  # values renamed to graph outputs (`output_as`)
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
    upcast = {w.name: linear.weight(g, w.name, w.type)[0]
              for w in weights_used if w.name in read and w.type.dtype == "bf16"}
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
            output_as(g, g.concat([sg[1] for sg in x.segs], 0), f"{name}.rows", named)
            output_as(g, g.concat([sg[2] for sg in x.segs], 0), f"{name}.vals", named)
            g.outputs.append(helper.make_tensor_value_info(f"{name}.rows", TensorProto.INT64, [None]))
            g.outputs.append(helper.make_tensor_value_info(f"{name}.vals", ONNX_DTYPES[compute_type(t).dtype],
                                                           [None, *t.shape[1:]]))
        else:
            output_as(g, x, name, named)
            g.outputs.append(value_info(name, compute_type(v.type)))
    merge_splits(g)
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


