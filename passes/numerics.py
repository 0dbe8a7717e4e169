"""Numerics checks between passes, and bisection of a pipeline that breaks them.

`NumericsCheck.error(module)` runs a seeded scenario (a ragged batch prefilled in chunks, then teacher-
forced decode steps) through the module's functions with the interpreter and returns the largest logit
difference from `ReferenceModel` on the same scenario, relative to the largest reference logit
(`ERROR_UNIT`); its tolerance is in the same unit. `bisect(...)` finds the first pass whose output
breaks the tolerance and, inside it and in every function, the first op whose results diverge from
the module before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from v4compile.harness import DPRunner, IRRunner, Scenario, ir_logits, max_error, reference_logits
from v4compile.ir.core import Module
from v4compile.ir.interpret import interpret
from v4compile.parallel import ParallelLayout, is_rank_local, spmd_interpreter
from v4compile.weights_convert import load_ir_weights

from .manager import PassManager, PipelineOptions, RunResult

log = logging.getLogger(__name__)


ERROR_UNIT = "max |logit - reference logit| / max |reference logit|"


class NumericsCheck:
    """Logits of the IR vs the reference model on one seeded scenario (reference computed once).

    `error` and `tol` are relative: the max absolute logit difference divided by `scale`, the largest
    reference logit (`ERROR_UNIT`). `capacity` sizes the reference's caches like the module's, so that a
    traced module reproduces the reference bit for bit.

    Data parallel (`replicas` > 1, --dp): the scenario's sequences are dealt to the replicas, and the
    reference runs each replica's batch on its own, as the module runs all but its experts (which see every
    replica's tokens at once: their batch differs from the reference's, a rounding difference).

    A partitioned module is compared with the reference of its layout (`ReferenceModel.partitioned`: the
    same model summing wo_b and the routed experts per rank, in rank order, as the module's all-reduces
    do; DeepSeek's own inference code defines its numbers per layout the same way), with the same
    tolerance: the partition and every pass after it must keep those sums. How far the layout's reference
    lies from the plain one (the authority) is `layout_error`, reported beside it: rounding-order
    differences of ~1e-7, which with official numerics can flip a single FP8 rounding (a value at an e4m3
    midpoint) and so move the logits by up to about 1e-4 of their scale.
    """

    def __init__(self, reference, source, scenario: Scenario, chunk: int, tol: float, prepare=None,
                 capacity: int | None = None, replicas: int = 1):
        self.source = source
        self.scenario = scenario
        self.tol = tol
        self.prepare = prepare
        self.replicas = replicas  # data parallel (--dp): the scenario's sequences over that many replicas
        self.expected = reference_logits(reference, scenario, chunk, capacity, replicas)
        self.scale = max(float(t.abs().max()) for t in self.expected) or 1.0
        self._weights: dict[tuple, torch.Tensor] = {}
        self._reference, self._chunk, self._capacity = reference, chunk, capacity
        self._by_layout: dict[tuple[int, int], list] = {}

    def expected_for(self, m: Module) -> list:
        """The reference logits `m` is held to: its layout's reference for a partitioned module."""
        layout = ParallelLayout.of(m)
        if layout is None or (layout.tp, layout.ep) == (1, 1):
            return self.expected
        key = (layout.tp, layout.ep)
        if key not in self._by_layout:
            self._by_layout[key] = reference_logits(self._reference.partitioned(*key), self.scenario, self._chunk,
                                                    self._capacity, self.replicas)
        return self._by_layout[key]

    def layout_error(self, m: Module) -> float | None:
        """How far the reference of `m`'s layout lies from the plain reference (None: not partitioned)."""
        expected = self.expected_for(m)
        return None if expected is self.expected else max_error(self.expected, expected) / self.scale

    def weights(self, m: Module, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The module's weights (a partitioned module's: rank `rank`'s; replicated ones are shared)."""
        out = {}
        for w in m.weights.values():
            local = rank if is_rank_local(w.sources) else None
            key = (w.name, w.type, w.sources, local, local is not None and ParallelLayout.of(m))
            if key not in self._weights:
                single = Module(m.name, {w.name: w}, {}, dict(m.attrs))
                self._weights[key] = load_ir_weights(single, self.source, rank=local)[w.name]
            out[w.name] = self._weights[key]
        return out

    def runner(self, m: Module) -> IRRunner:
        layout = ParallelLayout.of(m)
        n, B = len(self.scenario.prompts), m.functions["prefill"].attrs["batch"] if "prefill" in m.functions else 0
        if layout is None and B and n > B and n % B == 0:
            # a data-parallel scenario (--dp: B sequences per replica) through a module of one replica (the
            # traced module, before the partition): its replicas independent, each with its own state
            return DPRunner(m, [self.weights(m)] * (n // B), ParallelLayout(dp=n // B), prepare=self.prepare)
        if layout is None:
            return IRRunner(m, self.weights(m), prepare=self.prepare)
        if layout.dp > 1:  # data parallel: each replica its own sequences and state (`harness.DPRunner`)
            return DPRunner(m, [self.weights(m, r) for r in range(layout.world)], layout, prepare=self.prepare)
        # A partitioned module: all its ranks in this process, in lockstep (`spmd_interpreter`).
        return IRRunner(m, [self.weights(m, r) for r in range(layout.world)], prepare=self.prepare,
                        interpreter=spmd_interpreter)

    def error(self, m: Module) -> float:
        """Relative logit error of `m` on the scenario (NaN counts as infinitely wrong)."""
        err = max_error(self.expected_for(m), ir_logits(self.runner(m), self.scenario)) / self.scale
        return float("inf") if err != err else err


@dataclass
class OpDivergence:
    func: str
    op_index: int
    op_name: str
    op_loc: str
    op_result: str
    op_error: float  # max |result - result before the pass| / max |result before the pass|


@dataclass
class Divergence:
    pass_index: int
    pass_name: str
    pass_error: float  # ERROR_UNIT
    ops: list[OpDivergence] = field(default_factory=list)  # the first diverging op of each function
    clean: list[str] = field(default_factory=list)  # functions in which no op diverges
    op_rtol: float = 0.0
    # The first op of each function whose result differs at all: where a divergence really starts when
    # rounding-order differences (1 ulp) are amplified later (e.g. by an FP8 rounding at a boundary).
    first_diffs: list[OpDivergence] = field(default_factory=list)

    def op(self, func: str) -> OpDivergence | None:
        return next((o for o in self.ops if o.func == func), None)

    def render(self) -> str:
        s = f"first failing pass: #{self.pass_index} {self.pass_name} (error {self.pass_error:.3g}; {ERROR_UNIT})"
        for o in self.ops:
            s += (f"\nfirst diverging op in @{o.func}: #{o.op_index} %{o.op_result} = {o.op_name} "
                  f"loc(\"{o.op_loc}\") (error {o.op_error:.3g}, relative to the op's result before the pass)")
        for f in self.clean:
            s += f"\n@{f}: no op's result differs from before the pass by more than {self.op_rtol:g} (relative)"
        for o in self.first_diffs:
            if self.op(o.func) is None or (o.op_index, o.op_result) != (self.op(o.func).op_index,
                                                                        self.op(o.func).op_result):
                s += (f"\nfirst op whose result differs at all in @{o.func}: #{o.op_index} %{o.op_result} = "
                      f"{o.op_name} loc(\"{o.op_loc}\") (error {o.op_error:.3g})")
        return s


class _Stop(Exception):
    pass


def _observe_first_call(check: NumericsCheck, m: Module, func: str, observe) -> bool:
    """Run the scenario through `m` (state carried as the runtime would) up to the first call of `func`,
    which runs with `observe`. False if the scenario never calls `func`."""
    def interp(fn, weights, inputs):
        if fn.name == func:
            interpret(fn, weights, inputs, observe=observe)
            raise _Stop
        return interpret(fn, weights, inputs)

    runner = IRRunner(m, check.weights(m), prepare=check.prepare, interpreter=interp)
    try:
        ir_logits(runner, check.scenario)
    except _Stop:
        return True
    return False


def first_diverging_op(check: NumericsCheck, before: Module, after: Module, rtol: float, func: str = "prefill"
                       ) -> OpDivergence | None:
    """Run the scenario through both modules up to the first call of `func`; in that call, the first op
    of `after` (in order) whose result also exists by name in `before` and differs by more than `rtol`
    (relative to its magnitude)."""
    return first_diverging_ops(check, before, after, [rtol], func)[0]


def first_diverging_ops(check: NumericsCheck, before: Module, after: Module, rtols: list[float],
                        func: str = "prefill") -> list[OpDivergence | None]:
    """`first_diverging_op` for several thresholds in one run of each module."""
    if func not in before.functions or func not in after.functions:
        return [None] * len(rtols)
    seen: dict[str, torch.Tensor] = {}

    def keep(op, outs):
        for r, t in zip(op.results, outs):
            seen[r.name] = t

    _observe_first_call(check, before, func, keep)
    found: list = [None] * len(rtols)

    def compare(op, outs):
        if all(f is not None for f in found):
            return
        for r, t in zip(op.results, outs):
            ref = seen.get(r.name)
            if ref is None or ref.shape != t.shape or not t.is_floating_point():
                continue
            scale = float(ref.float().abs().max()) or 1.0
            err = float((t.float() - ref.float()).nan_to_num(nan=float("inf")).abs().max()) / scale
            for i, rtol in enumerate(rtols):
                if found[i] is None and err > rtol:
                    found[i] = (op, r.name, err)

    _observe_first_call(check, after, func, compare)
    ops = after.functions[func].ops
    return [None if f is None else OpDivergence(func, ops.index(f[0]), f[0].name, f[0].loc, f[1], f[2])
            for f in found]


def bisect(module: Module, pipeline: list[str], check: NumericsCheck, op_rtol: float = 1e-4) -> Divergence | None:
    """First pass of `pipeline` after which `check` exceeds its tolerance, and the first diverging op
    inside it in every function."""
    modules = [module]
    records = []
    pm = PassManager(pipeline, PipelineOptions())
    for p in pm.passes:
        res = p.run(modules[-1])
        modules.append(res.module)
        records.append(p)
    errors: dict[int, float] = {}

    def err(i: int) -> float:
        if i not in errors:
            errors[i] = check.error(modules[i])
        return errors[i]

    # Numerics are monotone in practice (a broken value stays broken), so binary search the stages.
    lo, hi = 0, len(modules) - 1
    if err(hi) <= check.tol:
        return None
    if err(lo) > check.tol:
        return Divergence(0, "traced", err(0))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if err(mid) > check.tol:
            hi = mid
        else:
            lo = mid
    d = Divergence(hi, records[hi - 1].spec(), err(hi), op_rtol=op_rtol)
    for func in modules[hi].functions:
        o, any_diff = first_diverging_ops(check, modules[lo], modules[hi], [op_rtol, 0.0], func)
        if o is None:
            d.clean.append(func)
        else:
            d.ops.append(o)
        if any_diff is not None:
            d.first_diffs.append(any_diff)
    return d


def run_with_numerics(module: Module, pipeline: list[str], check: NumericsCheck,
                      options: PipelineOptions | None = None) -> RunResult:
    options = options or PipelineOptions()
    options.check_numerics = check
    return PassManager(pipeline, options).run(module)
