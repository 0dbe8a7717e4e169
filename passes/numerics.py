"""Numerics checks between passes, and bisection of a pipeline that breaks them.

`NumericsCheck.error(module)` runs a seeded scenario (a ragged batch prefilled in chunks, then teacher-
forced decode steps) through the module's functions with the interpreter and returns the largest logit
difference from `ReferenceModel` on the same scenario. `bisect(...)` finds the first pass whose output
breaks the tolerance and, inside it, the first op whose results diverge from the module before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from v4compile.harness import IRRunner, Scenario, ir_logits, load_ir_weights, max_error, reference_logits
from v4compile.ir.core import Module
from v4compile.ir.interpret import interpret
from v4compile.ir.types import DTYPES

from .manager import PassManager, PipelineOptions, RunResult

log = logging.getLogger(__name__)


class NumericsCheck:
    """Logits of the IR vs the reference model on one seeded scenario (reference computed once).

    `error` is the max absolute logit difference; `tol` is absolute too (callers derive it from a relative
    tolerance and `scale`, the largest reference logit). `capacity` sizes the reference's caches like the
    module's, so that a traced module reproduces the reference bit for bit.
    """

    def __init__(self, reference, source, scenario: Scenario, chunk: int, tol: float, prepare=None,
                 capacity: int | None = None):
        self.source = source
        self.scenario = scenario
        self.tol = tol
        self.prepare = prepare
        self.expected = reference_logits(reference, scenario, chunk, capacity)
        self.scale = max(float(t.abs().max()) for t in self.expected)
        self._weights: dict[tuple, torch.Tensor] = {}

    def weights(self, m: Module) -> dict[str, torch.Tensor]:
        out = {}
        for w in m.weights.values():
            key = (w.name, w.type, w.sources)
            if key not in self._weights:
                single = Module(m.name, {w.name: w}, {})
                self._weights[key] = load_ir_weights(single, self.source)[w.name]
            out[w.name] = self._weights[key]
        return out

    def runner(self, m: Module) -> IRRunner:
        return IRRunner(m, self.weights(m), prepare=self.prepare)

    def error(self, m: Module) -> float:
        return max_error(self.expected, ir_logits(self.runner(m), self.scenario))


@dataclass
class Divergence:
    pass_index: int
    pass_name: str
    pass_error: float
    op_index: int | None
    op_name: str | None
    op_loc: str | None
    op_result: str | None
    op_error: float | None

    def render(self) -> str:
        s = f"first failing pass: #{self.pass_index} {self.pass_name} (max |logit error| {self.pass_error:.3g})"
        if self.op_name is not None:
            s += (f"\nfirst diverging op in it: #{self.op_index} %{self.op_result} = {self.op_name} "
                  f"loc(\"{self.op_loc}\") (relative error {self.op_error:.3g})")
        return s


def _prefill_inputs(check: NumericsCheck, m: Module) -> dict[str, torch.Tensor]:
    """Inputs of the first prefill call of the scenario (fresh state)."""
    from v4compile.model.batching import prefill_chunks

    fn = m.functions["prefill"]
    ids, pos, _ = next(prefill_chunks([list(p) for p in check.scenario.prompts], [0] * fn.attrs["batch"],
                                      fn.attrs["tokens"]))
    inputs = {"ids": ids, "pos": pos}
    runner = check.runner(m)
    if runner.allocator is not None:
        inputs.update(runner.allocator.step_inputs(pos))
    if check.prepare is not None:
        inputs.update(check.prepare(runner, "prefill", ids, pos))
    for v in fn.inputs:
        inputs.setdefault(v.name, torch.zeros(v.type.shape, dtype=DTYPES[v.type.dtype]))
    return inputs


def first_diverging_op(check: NumericsCheck, before: Module, after: Module, rtol: float
                       ) -> tuple[int, object, str, float] | None:
    """Run the first prefill step through both modules; the first op of `after` (in order) whose result
    also exists by name in `before` and differs by more than `rtol` (relative to its magnitude)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(op, outs):
        for r, t in zip(op.results, outs):
            seen[r.name] = t

    interpret(before.functions["prefill"], check.weights(before), _prefill_inputs(check, before), observe=keep)
    found: list = []

    def compare(op, outs):
        if found:
            return
        for r, t in zip(op.results, outs):
            ref = seen.get(r.name)
            if ref is None or ref.shape != t.shape or not t.is_floating_point():
                continue
            scale = float(ref.float().abs().max()) or 1.0
            err = float((t.float() - ref.float()).nan_to_num(nan=float("inf")).abs().max()) / scale
            if err > rtol:
                found.append((op, r.name, err))
                return

    fn = after.functions["prefill"]
    interpret(fn, check.weights(after), _prefill_inputs(check, after), observe=compare)
    if not found:
        return None
    op, name, err = found[0]
    return fn.ops.index(op), op, name, err


def bisect(module: Module, pipeline: list[str], check: NumericsCheck, op_rtol: float = 1e-4) -> Divergence | None:
    """First pass of `pipeline` after which `check` exceeds its tolerance, and the op inside it."""
    modules = [module]
    records = []
    pm = PassManager(pipeline, PipelineOptions())
    for p in pm.passes:
        res = p.run(modules[-1])
        modules.append(res.module)
        records.append(p)
    # Numerics are monotone in practice (a broken value stays broken), so binary search the stages.
    lo, hi = 0, len(modules) - 1
    if check.error(modules[hi]) <= check.tol:
        return None
    if check.error(modules[lo]) > check.tol:
        return Divergence(0, "traced", check.error(modules[0]), None, None, None, None, None)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check.error(modules[mid]) > check.tol:
            hi = mid
        else:
            lo = mid
    d = Divergence(hi, records[hi - 1].spec(), check.error(modules[hi]), None, None, None, None, None)
    op = first_diverging_op(check, modules[lo], modules[hi], op_rtol)
    if op is not None:
        d.op_index, o, d.op_result, d.op_error = op
        d.op_name, d.op_loc = o.name, o.loc
    return d


def run_with_numerics(module: Module, pipeline: list[str], check: NumericsCheck,
                      options: PipelineOptions | None = None) -> RunResult:
    options = options or PipelineOptions()
    options.check_numerics = check
    return PassManager(pipeline, options).run(module)
