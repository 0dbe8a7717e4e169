"""Compose the one-call speculative steps: `spec_b<B>` = `verify_b<B>`, the greedy acceptance (`spec_accept`),
then the MTP block's `draft_b<B>` on the kept lanes, as one function; `spec_s<B>` the same with the sampled
acceptance (`spec_sample`: greedy or sampled per sequence); and, in an artifact of K >= 2 drafts, `spec_b<B>_d<k>`
for k in 2..K: `spec_b<B>` then the k - 1 recursive drafts, each one more copy of `draft_b<B>` fed by `draft_next`
(the previous copy's argmax, its streams at its last lane, one position on: what the host feeds a recursive
`draft_b<B>` call), and a last `draft_next` for the k-th draft's id; for every decode bucket that has both (the C
runtime's counterpart of the cpu device's load-time ONNX graphs `spec_b<B>_d<k>`, `codegen/onnx_spec.py`, which
are greedy only).

One function per k, as the cpu device's one graph per k: the runtime's `auto` picks k per step, and a draft copy
costs its launches whether its draft is read or not (on a GPU the block's layer and the MTP head's full weight
read; the functions share every kernel, so each k costs program text and its captured graph, no compile).
The sampled step drafts one: a recursive sampled draft is drawn from the request's generator on the host.

Requires: a verified module, before `plan_memory` (the composed functions are planned as any other).
Guarantees: every existing function unchanged; each new function is the functions' ops, in order, with
the drafts' values renamed (`draft.<name>`, the recursive copies' `draft<j>.<name>`) and the first draft's step
inputs fed from the verify: `hidden` = verify's `streams`, `ids` = `spec.next_ids` (the token after each kept
lane), `pos` = `spec.kept_pos` (-1 on the rejected lanes: they write nothing of the MTP ring); a recursive copy's
from `draft_next` (lane 0; the other lanes padding, as the host's call has them); each copy's pool planes those the
ops before it left, block table and slot shared; `spec_s<B>` has three more inputs: `draft_probs [B, T, V]` (each
draft's q), `uniforms [B, T]` (drawn before the step) and `temperature [B]` (fp32 each). The drafts' ops keep
their shapes, attributes and weights, so each launch is a specialisation the verify or the draft already has (no
new kernel but the acceptance's and `draft_next`'s, one specialisation for every k). Outputs: verify's `logits` (the host checks
a greedy acceptance against its own rule), `spec.next_ids`, `spec.kept_pos`; drafting one `draft.logits`,
`draft.streams`, drafting k > 1 `spec.draft<j>` for j = 1..k (`[B, T]`, lane 0 the j-th next draft); every pool /
state plane (after the drafts' writes: the recursive ones' the runtime restores).
Hits: `spec_b<B>.ops`, `spec_s<B>.ops`, `spec_b<B>_d<k>.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.artifact import draft_name, spec_buckets, spec_name, verify_name
from v4compile.ir.core import INPUT, WEIGHT, Function, Op, Value
from v4compile.ir.types import TensorType

from .base import Pass, PassResult, register
from .rewrite import new_module

DRAFT_PREFIX = "draft."  # the first draft's own values inside the composed function
FED = ("hidden", "ids", "pos")  # the draft's step inputs: fed from the verify and the acceptance, or `draft_next`
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


def compose_spec(verify: Function, draft: Function, name: str, sampled: bool = False, drafts: int = 1) -> Function:
    """The one-call step of `verify` then `draft` (module doc); `sampled`: with `spec_sample` and its inputs;
    `drafts` > 1 (greedy): the recursive drafts too, each one more copy of `draft` fed by `draft_next`."""
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
    planes = [n for n, _ in verify.outputs if n.startswith(("pool.", "state."))]
    now = {n: vout[n] for n in planes}  # each plane as the ops so far left it
    fed = {"hidden": vout["streams"], "ids": next_ids, "pos": kept_pos}
    outputs = [("logits", vout["logits"]), ("spec.next_ids", next_ids), ("spec.kept_pos", kept_pos)]
    for j in range(1, drafts + 1):
        dout = _draft_copy(draft, ops, fed, now, by_name, DRAFT_PREFIX if j == 1 else f"draft{j}.")
        now.update({n: dout[n] for n in planes if n in dout})
        if drafts == 1:
            outputs += [(OUTPUTS[n], dout[n]) for n in OUTPUTS]
            break
        # the next draft's step inputs (lane 0: this draft's argmax, its streams at its last lane, one position on)
        nxt = [Value(f"spec.draft{j}", ids.type), Value(f"spec.pos{j}", pos.type),
               Value(f"spec.hidden{j}", vout["streams"].type)]
        ops.append(Op("draft_next", (dout["logits"], dout["streams"], fed["pos"]), tuple(nxt), {}, "spec"))
        fed = dict(zip(("ids", "pos", "hidden"), nxt))
        outputs.append((nxt[0].name, nxt[0]))
    outputs += [(n, now[n]) for n in planes]
    return Function(name, inputs, ops, outputs, dict(verify.attrs))


def _draft_copy(draft: Function, ops: list[Op], fed: dict[str, Value], planes: dict[str, Value],
                by_name: dict[str, Value], prefix: str) -> dict[str, Value]:
    """Append one copy of `draft`'s ops to `ops` (its values renamed with `prefix`), its step inputs `fed`, its pool
    and state planes `planes`, its other inputs the step's (`by_name`: block_table, slot); its outputs by name."""
    dmap: dict[int, Value] = {}
    for v in draft.inputs:
        if v.name in FED:
            dmap[id(v)] = fed[v.name]
        elif v.name.startswith(("pool.", "state.")):
            dmap[id(v)] = planes[v.name]
        else:
            dmap[id(v)] = by_name[v.name]
    dclone = _cloner(dmap, prefix)
    ops += _copied(draft.ops, dclone)
    return {n: dclone(v) for n, v in draft.outputs}


@register
@dataclass(frozen=True)
class SpecSteps(Pass):
    name = "spec_steps"

    def run(self, module):
        funcs, hits = dict(module.functions), {}
        for b in spec_buckets(funcs):
            verify, draft = funcs[verify_name(b)], funcs[draft_name(b)]
            K = next(v for v in verify.inputs if v.name == "ids").type.shape[1] - 1  # (ids [B, 1 + K])
            steps = [(False, 1), (True, 1)] + [(False, k) for k in range(2, K + 1)]
            for sampled, k in steps:
                fn = compose_spec(verify, draft, spec_name(b, sampled, k), sampled, k)
                funcs[fn.name] = fn
                hits[f"{fn.name}.ops"] = len(fn.ops)
        return PassResult(new_module(module, funcs), hits)
