"""A partitioned function for the cpu target: ONNX segments cut at its collectives.

    segment_function(fn) -> [Segment]            the IR function cut before every collective
    export_segments(module, fname) -> [(onnx model, collective op or None)]

ONNX Runtime cannot exchange values between processes, so a function with collectives runs as segments
with the collective between them (gloo under `torchrun`, or a sum in one process when every rank is
simulated). Segment k holds the ops between collective k-1 and collective k; its inputs are what it reads
from outside (step inputs, values of earlier segments, the previous collectives' results, weights), its
outputs what later segments, the next collective and the function's outputs read from it.

State (pool planes, compressor states: the function's inputs that are also its outputs) follows the
cpu backend's rule within a step: a segment takes every state it touches under the state's own name and
returns the rows it wrote (`<name>.rows` / `<name>.vals`), which the runner writes into the state before
the next segment, exactly as it does after a whole function.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.ir.core import INPUT, WEIGHT, Function, Module, Op, Value
from v4compile.ir.registry import get_op


@dataclass
class Segment:
    fn: Function  # the ops of the segment as a function (`<fname>.s<k>`)
    collective: Op | None  # the collective that follows it (None after the last segment)


def _state_roots(fn: Function) -> dict[int, Value]:
    """id(value) -> the state input it is a version of (the input itself, and the results tied to it)."""
    outs = {n for n, _ in fn.outputs}
    roots = {id(v): v for v in fn.inputs if v.name in outs}
    for op in fn.ops:
        opdef = get_op(op.name)
        for (r, v) in op.named_results():
            src = opdef.tied.get(r)
            if src is not None and id(op.operand(src)) in roots:
                roots[id(v)] = roots[id(op.operand(src))]
    return roots


def _pure_ops(fn: Function, roots: dict[int, Value]) -> set[int]:
    """The ops computed from the step inputs alone (positions, slots, block tables: the CSR row lists, the
    index arithmetic), ids. A segment recomputes those it needs rather than taking their results from an
    earlier segment: cheap, and some are not plain tensors in ONNX (a row list stands for a CSR pair)."""
    known = {id(v) for v in fn.inputs if id(v) not in roots}
    pure = set()
    for op in fn.ops:
        if get_op(op.name).collective or any(v is not None and (v.kind == WEIGHT or id(v) not in known)
                                              for v in op.operands):
            continue
        pure.add(id(op))
        known.update(id(r) for r in op.results)
    return pure


def _with_recomputed(ops: list[Op], pure: set[int], producers: dict[int, Op], order: dict[int, int]) -> list[Op]:
    """`ops` with the pure ops it reads from outside it put first (transitively, in function order)."""
    own = {id(op) for op in ops}
    extra: dict[int, Op] = {}
    todo = [v for op in ops for v in op.operands if v is not None]
    while todo:
        v = todo.pop()
        p = producers.get(id(v))
        if p is None or id(p) in own or id(p) in extra or id(p) not in pure:
            continue
        extra[id(p)] = p
        todo += [u for u in p.operands if u is not None]
    return sorted(extra.values(), key=lambda op: order[id(op)]) + ops


def segment_function(fn: Function) -> list[Segment]:
    groups: list[list[Op]] = [[]]
    cuts: list[Op] = []
    for op in fn.ops:
        if get_op(op.name).collective:
            cuts.append(op)
            groups.append([])
        else:
            groups[-1].append(op)
    roots = _state_roots(fn)
    # Where every value is read: by a segment's ops (index), by a collective (after segment index), or
    # by the function's outputs (after the last).
    last_read: dict[int, int] = {}
    for k, ops in enumerate(groups):
        for op in ops:
            for v in op.operands:
                if v is not None:
                    last_read[id(v)] = max(last_read.get(id(v), -1), k)
    for k, c in enumerate(cuts):
        last_read[id(c.operands[0])] = max(last_read.get(id(c.operands[0]), -1), k + 1)
    final = {id(v): n for n, v in fn.outputs}
    pure = _pure_ops(fn, roots)
    order = {id(op): i for i, op in enumerate(fn.ops)}
    segments = []
    for k, ops in enumerate(groups):
        ops = _with_recomputed(ops, pure, fn.producers(), order)
        defined = {id(r) for op in ops for r in op.results}
        inputs: dict[str, Value] = {}
        mapping: dict[int, Value] = {}
        states: dict[str, Value] = {}  # root name -> its latest version in this segment

        def source(v):
            if v is None or v.kind == WEIGHT or id(v) in defined:
                return v
            if id(v) in roots:
                root = roots[id(v)]
                states.setdefault(root.name, inputs.setdefault(root.name, Value(root.name, root.type, INPUT)))
                return inputs[root.name]
            if id(v) not in mapping:
                mapping[id(v)] = inputs.setdefault(v.name, Value(v.name, v.type, INPUT))
            return mapping[id(v)]

        new_ops = []
        for op in ops:
            operands = tuple(source(v) for v in op.operands)
            new_ops.append(op.replace(operands=operands))
            for r in op.results:
                if id(r) in roots:
                    states[roots[id(r)].name] = r
        outputs = [(name, v) for name, v in states.items()]
        for op in ops:
            for r in op.results:
                if id(r) in roots:
                    continue
                if last_read.get(id(r), -1) > k and id(op) not in pure:  # pure: recomputed where read
                    outputs.append((r.name, r))
                if id(r) in final:
                    outputs.append((final[id(r)], r))
        seg = Function(f"{fn.name}.s{k}", list(inputs.values()), new_ops, outputs, dict(fn.attrs))
        segments.append(Segment(seg, cuts[k] if k < len(cuts) else None))
    return segments


def export_segments(module: Module, fname: str) -> list[tuple[object, Op | None]]:
    """Each segment of `fname` as an ONNX model (`onnx_export.export_function`), with the collective after it."""
    from .onnx_export import export_function

    out = []
    for s in segment_function(module.functions[fname]):
        m = Module(module.name, module.weights, {s.fn.name: s.fn}, dict(module.attrs))
        out.append((export_function(m, s.fn.name), s.collective))
    return out
