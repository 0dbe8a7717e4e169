"""The pass manager and its instruments.

`PassManager(pipeline, options).run(module)` runs the named passes in order. Between passes its
instruments print or dump the IR, verify it, time the pass and check numerics; the passes themselves
never do any of that. Every pass gets a `PassRecord` (hits, seconds, changed, numerics error).

Every module the manager hands back records the passes run on it so far in its attribute
`passes_run` (pass specs, in order), so that a dumped module says where it stands in the pipeline
(`--start-from` reads it; the dump's file name is not needed). Time spent in the instruments (change
detection, verification, numerics checks, printing and dumps) is recorded in `options.stages` next
to the passes' own time, so that `--time-passes` accounts for the whole run.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import networkx as nx

from v4compile.errors import PassError
from v4compile.files import write_text_atomic
from v4compile.ir.core import Module, Op
from v4compile.ir.text import print_module
from v4compile.ir.verify import verify
from v4compile.program.build import carry_program
from v4compile.timing import Stages

from .base import PASSES, Pass, parse_pass_spec

log = logging.getLogger(__name__)


@dataclass
class PipelineOptions:
    print_after_all: bool = False
    print_after_change: bool = False
    print_after: tuple[str, ...] = ()
    dump_ir: str | None = None
    verify_each: bool = False
    disable: tuple[str, ...] = ()
    stop_after: str | None = None
    time_passes: bool = False
    check_numerics: Any = None  # an object with `error(module) -> float` and `tol`
    out: TextIO = field(default_factory=lambda: sys.stderr)
    stages: Stages = field(default_factory=lambda: Stages(progress_after=None))
    dump_written: list[Path] = field(default_factory=list)  # files written by `dump_ir`, in order


@dataclass
class PassRecord:
    index: int
    name: str
    spec: str
    hits: dict[str, int]
    seconds: float
    changed: bool
    numerics_error: float | None = None

    def to_json(self) -> dict:
        return {"index": self.index, "pass": self.name, "spec": self.spec, "hits": self.hits,
                "seconds": round(self.seconds, 4), "changed": self.changed, "numerics_error": self.numerics_error}


@dataclass
class RunResult:
    module: Module
    records: list[PassRecord]
    traced_error: float | None = None

    def first_numerics_failure(self, tol: float) -> PassRecord | None:
        return next((r for r in self.records if r.numerics_error is not None and r.numerics_error > tol), None)

    def hits(self) -> dict[str, dict[str, int]]:
        return {r.name: r.hits for r in self.records}


PASSES_RUN = "passes_run"  # module attribute: the specs of the passes run so far, in order


def passes_run(module: Module) -> tuple[str, ...]:
    """The passes run on `module` so far, from its own attributes (empty for a traced module)."""
    ran = module.attrs.get(PASSES_RUN, ())
    if isinstance(ran, str):
        ran = (ran,)
    if not isinstance(ran, tuple) or not all(isinstance(x, str) for x in ran):
        raise PassError(f"module attribute '{PASSES_RUN}' must be a tuple of pass specs", found=repr(ran))
    return ran


def resume_index(pipeline: list[str], ran: tuple[str, ...]) -> int:
    """Where to continue `pipeline` (pass names) on a module that has already run `ran` (specs): after
    the pipeline's prefix that matches the history, else after the last pass run (its k-th occurrence
    in the pipeline if it ran k times), else from the start (the pipeline does not contain it)."""
    done = [_name(s) for s in ran]
    if not done:
        return 0
    if pipeline[:len(done)] == done:
        return len(done)
    last = done[-1]
    where = [i for i, n in enumerate(pipeline) if n == last]
    if not where:
        return 0
    k = done.count(last)
    return (where[k - 1] if k <= len(where) else where[-1]) + 1


def _name(spec: str) -> str:
    return spec.split("{", 1)[0].strip()


def order_graph(passes: list[Pass]) -> nx.DiGraph:
    """The pipeline's positions, with an edge j -> i for each declared "the pass at j runs before the one at
    i" (`Pass.after`, `first`, `final`: passes/base.py); its `rule` is the declaration the message names."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(passes)))
    for i, p in enumerate(passes):
        for j, q in enumerate(passes):
            if q.name in p.after:
                g.add_edge(j, i, rule="after")
            elif p.final and not q.final:
                g.add_edge(j, i, rule="final")
            elif q.first and not p.first:
                g.add_edge(j, i, rule="first")
    return g


def check_order(passes: list[Pass]) -> None:
    """Refuse a pipeline that breaks a pass's declared place, naming the pass and what it needs (a misordered
    fusion would otherwise find nothing and say nothing): the declarations must be acyclic, and the
    pipeline's order a topological order of them."""
    names = ", ".join(p.name for p in passes)
    g = order_graph(passes)
    cycle = _cycle(g)
    if cycle:
        raise PassError("the passes' declared places contradict each other: "
                        + " before ".join(passes[i].name for i in cycle), where="pipeline", found=names)
    for j, i in sorted(((j, i) for j, i in g.edges if j > i), key=lambda e: (e[1], e[0])):
        p, q, rule = passes[i], passes[j], g.edges[j, i]["rule"]
        if rule == "after":
            raise PassError(f"pass '{p.name}' must run after '{q.name}' ({p.after[q.name]}); the pipeline "
                            "runs it before", where="pipeline", expected=f"'{q.name}' before '{p.name}'",
                            found=names)
        if rule == "final":
            raise PassError(f"pass '{q.name}' cannot run after '{p.name}' (a final pass: only "
                            f"{', '.join(_finals())} may follow it)", where="pipeline", found=names)
        raise PassError(f"pass '{q.name}' must run first; the pipeline runs '{p.name}' before it",
                        where="pipeline", found=names)


def declaration_cycle(classes: dict[str, type[Pass]]) -> list[str]:
    """A cycle among the registered passes' `after` declarations (each pass, then one it must follow ...), or []."""
    return _cycle(nx.DiGraph((n, m) for n, c in classes.items() for m in c.after))


def _cycle(g: nx.DiGraph) -> list:
    """The nodes of one cycle of `g` in edge order, or []."""
    try:
        return [u for u, _ in nx.find_cycle(g)]
    except nx.NetworkXNoCycle:
        return []


def _finals() -> list[str]:
    return sorted(n for n, c in PASSES.items() if c.final)


class _OpKeys:
    """`Op.key` of each op object computed once over a pipeline run (change detection keys every pass's
    output; most of its ops are the input's own). Passes never change what they are given (ops are frozen,
    a pass builds new ones), so an op seen before has the key it had. Each op is held with its key, so its id
    is not reused while remembered."""

    def __init__(self):
        self.seen: dict[int, tuple[Op, tuple]] = {}

    def __call__(self, op: Op) -> tuple:
        hit = self.seen.get(id(op))
        if hit is None:
            hit = self.seen[id(op)] = (op, op.key())
        return hit[1]


class PassManager:
    def __init__(self, pipeline: list[str], options: PipelineOptions | None = None):
        from v4compile import ops

        ops.load_all()  # passes create ops of every set
        self.options = options or PipelineOptions()
        self.passes: list[Pass] = [parse_pass_spec(s) for s in pipeline]
        check_order(self.passes)
        names = [p.name for p in self.passes]
        for n in list(self.options.disable) + list(self.options.print_after) + (
                [self.options.stop_after] if self.options.stop_after else []):
            if n not in names:
                raise PassError(f"pass '{n}' is not in the pipeline", expected=", ".join(names))

    def _print(self, title: str, module: Module) -> None:
        o = self.options.out
        o.write(f"// ----- IR {title} -----\n")
        o.write(print_module(module))
        o.flush()

    def run(self, module: Module, start_after: str | None = None) -> RunResult:
        """Run the pipeline. A module that has already run passes (`passes_run`) continues after them;
        `start_after` (a pass name) overrides that."""
        opts = self.options
        st = opts.stages
        dump = Path(opts.dump_ir) if opts.dump_ir else None
        ran = list(passes_run(module))
        names = [p.name for p in self.passes]
        if start_after is not None:
            if start_after != "traced" and start_after not in names:
                raise PassError(f"cannot start after '{start_after}': not in the pipeline", expected=", ".join(names))
            start = 0 if start_after == "traced" else names.index(start_after) + 1
        else:
            start = resume_index(names, tuple(ran))
        if start:
            log.info("module has run %s: continuing with %s", ", ".join(ran) or "nothing",
                     ", ".join(names[start:]) or "nothing")
        if dump:
            with st("print / dump IR"):
                dump.mkdir(parents=True, exist_ok=True)
                self._dump(dump / f"{start:02d}-{'traced' if not ran else _name(ran[-1])}.ir", module)
        if opts.verify_each:
            with st("verify"):
                verify(module)
        result = RunResult(module, [])
        if opts.check_numerics is not None:
            with st("numerics checks"):
                result.traced_error = opts.check_numerics.error(module)
            log.debug("numerics of the input module: max |logit error| %.3g", result.traced_error)
        body = None  # the input module's `body_key`, computed once: each pass's output is the next one's input
        op_key = _OpKeys()
        for i, p in enumerate(self.passes, start=1):
            if i <= start:
                continue
            if p.name in opts.disable:
                log.info("pass %s disabled", p.name)
                continue
            with st("change detection"):
                body = module.body_key(op_key) if body is None else body
            t0 = time.perf_counter()
            res = p.run(module)
            seconds = time.perf_counter() - t0
            st.add(f"pass {p.spec()}", seconds)
            with st("change detection"):  # what `same_as` compares, the input's side taken before the pass ran
                out = res.module.body_key(op_key)
                changed = out != body or res.module.name != module.name or res.module.attrs != module.attrs
                body = out  # the attrs' update below keeps the weights and functions
            rec = PassRecord(i, p.name, p.spec(), res.hits, seconds, changed)
            ran.append(p.spec())
            module = dataclasses.replace(res.module, attrs={**res.module.attrs, PASSES_RUN: tuple(ran)})
            carry_program(res.module, module)  # lower_to_program's program, with the record above
            if opts.verify_each:
                with st("verify"):
                    try:
                        verify(module)
                    except Exception as e:
                        done = ", ".join(r.name for r in result.records)
                        raise PassError(f"IR after pass '{p.name}' does not verify: {e}",
                                        where=f"pipeline (after: {done or 'nothing'})") from None
            if opts.check_numerics is not None:
                with st("numerics checks"):
                    rec.numerics_error = opts.check_numerics.error(module)
                log.debug("numerics after %s: max |logit error| %.3g", p.name, rec.numerics_error)
            with st("print / dump IR"):
                if opts.print_after_all or p.name in opts.print_after or (opts.print_after_change and changed):
                    self._print(f"after {p.spec()}{'' if changed else ' (unchanged)'}", module)
                if dump:
                    self._dump(dump / f"{i:02d}-{p.name}.ir", module)
            result.records.append(rec)
            log.debug("pass %-28s %6.3f s  %s", p.spec(), seconds, rec.hits)
            if opts.stop_after == p.name:
                break
        result.module = module
        if opts.time_passes:
            opts.out.write(st.render(title="pass timing"))
        return result

    def _dump(self, path: Path, module: Module) -> None:
        write_text_atomic(path, print_module(module))
        self.options.dump_written.append(path)
