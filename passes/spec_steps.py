"""Compose the one-call speculative steps: `spec_b<B>` = `verify_b<B>`, the greedy acceptance (`spec_accept`),
then the MTP block's `draft_b<B>` on the kept lanes, as one function, and `spec_s<B>` the same with the sampled
acceptance (`spec_sample`: greedy or sampled per sequence), for every decode bucket that has both (the C
runtime's counterpart of the cpu device's load-time ONNX graph, `codegen/onnx_spec.py`, which is greedy only).

Requires: a verified module, before `plan_memory` (the composed functions are planned as any other).
Guarantees: every existing function unchanged; each new function is the two functions' ops, in order, with
the draft's values renamed (`draft.<name>`) and its step inputs fed from the verify: `hidden` = verify's
`streams`, `ids` = `spec.next_ids` (the token after each kept lane), `pos` = `spec.kept_pos` (-1 on the
rejected lanes: they write nothing of the MTP ring), its pool planes the verify's updated ones, block table and
slot shared; `spec_s<B>` has three more inputs: `draft_probs [B, T, V]` (each draft's q), `uniforms [B, T]`
(drawn before the step) and `temperature [B]` (fp32 each). The draft's ops keep their shapes, attributes and
weights, so each launch is a specialisation the verify or the draft already has (no new kernel but the
acceptance's). Outputs: verify's `logits` (the host checks a greedy acceptance against its own rule),
`spec.next_ids`, `spec.kept_pos`, `draft.logits`, `draft.streams`, and every pool / state plane (the pool after
the draft's writes).
Hits: `spec_b<B>.ops`, `spec_s<B>.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.artifact import draft_name, spec_buckets, spec_name, verify_name
from v4compile.ir.core import INPUT, WEIGHT, Function, Op, Value
from v4compile.ir.types import TensorType

from .base import Pass, PassResult, register
from .rewrite import new_module

DRAFT_PREFIX = "draft."  # the draft's own values inside the composed function
# the draft's step inputs: fed from the verify's output / the acceptance's results
FED = {"hidden": "streams", "ids": "spec.next_ids", "pos": "spec.kept_pos"}
OUTPUTS = {"logits": "draft.logits", "streams": "draft.streams"}  # the draft's outputs, renamed


def _cloner(known: dict[int, Value], prefix: str = ""):
    """Fresh values for one source function's (weights shared; `known`: those already mapped)."""
    def clone(v: Value | None) -> Value | None:
        if v is None or v.kind == WEIGHT:
            return v
        if id(v) not in known:
            known[id(v)] = Value(prefix + v.name, v.type, v.kind, v.sources)
        return known[id(v)]
    return clone


def _copied(ops: list[Op], clone) -> list[Op]:
    return [Op(o.name, tuple(clone(x) for x in o.operands), tuple(clone(r) for r in o.results), dict(o.attrs), o.loc)
            for o in ops]


def sampling_inputs(logits: Value) -> list[Value]:
    """The sampled step's own inputs (`spec_sample`'s): each draft's q, the step's uniforms, the temperatures."""
    B, T, V = logits.type.shape
    shapes = {"draft_probs": (B, T, V), "uniforms": (B, T), "temperature": (B,)}
    return [Value(n, TensorType(shape, "fp32"), INPUT) for n, shape in shapes.items()]


def compose_spec(verify: Function, draft: Function, name: str, sampled: bool = False) -> Function:
    """The one-call step of `verify` then `draft` (module doc); `sampled`: with `spec_sample` and its inputs."""
    vclone = _cloner({})
    inputs = [vclone(v) for v in verify.inputs]
    ops = _copied(verify.ops, vclone)
    vout = {n: vclone(v) for n, v in verify.outputs}
    by_name = {v.name: v for v in inputs}
    ids, pos = by_name["ids"], by_name["pos"]
    next_ids = Value("spec.next_ids", ids.type)
    kept_pos = Value("spec.kept_pos", pos.type)
    if sampled:
        extra = sampling_inputs(vout["logits"])
        inputs += extra
        ops.append(Op("spec_sample", (vout["logits"], ids, pos, *extra), (next_ids, kept_pos), {}, "spec"))
    else:
        ops.append(Op("spec_accept", (vout["logits"], ids, pos), (next_ids, kept_pos), {}, "spec"))
    fed = {"streams": vout["streams"], "spec.next_ids": next_ids, "spec.kept_pos": kept_pos}
    dmap: dict[int, Value] = {}
    for v in draft.inputs:
        if v.name in FED:
            dmap[id(v)] = fed[FED[v.name]]
        elif v.name.startswith(("pool.", "state.")):
            dmap[id(v)] = vout[v.name]  # the plane as the verify left it
        else:
            dmap[id(v)] = by_name[v.name]  # block_table, slot
    dclone = _cloner(dmap, DRAFT_PREFIX)
    ops += _copied(draft.ops, dclone)
    dout = {n: dclone(v) for n, v in draft.outputs}
    outputs = [("logits", vout["logits"]), ("spec.next_ids", next_ids), ("spec.kept_pos", kept_pos)]
    outputs += [(OUTPUTS[n], dout[n]) for n in OUTPUTS]
    planes = [n for n, _ in verify.outputs if n.startswith(("pool.", "state."))]
    outputs += [(n, dout.get(n, vout[n])) for n in planes]
    return Function(name, inputs, ops, outputs, dict(verify.attrs))


@register
@dataclass(frozen=True)
class SpecSteps(Pass):
    name = "spec_steps"

    def run(self, module):
        funcs, hits = dict(module.functions), {}
        for b in spec_buckets(funcs):
            for sampled in (False, True):
                fn = compose_spec(funcs[verify_name(b)], funcs[draft_name(b)], spec_name(b, sampled), sampled)
                funcs[fn.name] = fn
                hits[f"{fn.name}.ops"] = len(fn.ops)
        return PassResult(new_module(module, funcs), hits)
