"""The pass manager and its instruments.

`PassManager(pipeline, options).run(module)` runs the named passes in order. Between passes its
instruments print or dump the IR, verify it, time the pass and check numerics; the passes themselves
never do any of that. Every pass gets a `PassRecord` (hits, seconds, changed, numerics error).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from v4compile.errors import PassError
from v4compile.ir.core import Module
from v4compile.ir.text import print_module
from v4compile.ir.verify import verify

from .base import Pass, parse_pass_spec

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


_DUMP_NAME = re.compile(r"^(\d+)-(.+)\.ir$")


def stage_of_dump(path: str | Path) -> str | None:
    """The pass that produced a dump named `NN-<pass>.ir`, if the name says so."""
    m = _DUMP_NAME.match(Path(path).name)
    return m.group(2) if m else None


class PassManager:
    def __init__(self, pipeline: list[str], options: PipelineOptions | None = None):
        from v4compile import ops

        ops.load_all()  # passes create ops of every set
        self.options = options or PipelineOptions()
        self.passes: list[Pass] = [parse_pass_spec(s) for s in pipeline]
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
        opts = self.options
        dump = Path(opts.dump_ir) if opts.dump_ir else None
        if dump:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / "00-traced.ir").write_text(print_module(module))
        if opts.verify_each:
            verify(module)
        result = RunResult(module, [])
        if opts.check_numerics is not None:
            result.traced_error = opts.check_numerics.error(module)
            log.info("numerics of the traced module: max |logit error| %.3g", result.traced_error)
        names = [p.name for p in self.passes]
        start = 0
        if start_after not in (None, "traced"):
            if start_after not in names:
                raise PassError(f"cannot start after '{start_after}': not in the pipeline", expected=", ".join(names))
            start = names.index(start_after) + 1
        for i, p in enumerate(self.passes, start=1):
            if i <= start:
                continue
            if p.name in opts.disable:
                log.info("pass %s disabled", p.name)
                continue
            t0 = time.perf_counter()
            res = p.run(module)
            seconds = time.perf_counter() - t0
            changed = not res.module.same_as(module)
            rec = PassRecord(i, p.name, p.spec(), res.hits, seconds, changed)
            module = res.module
            if opts.verify_each:
                try:
                    verify(module)
                except Exception as e:
                    ran = ", ".join(r.name for r in result.records)
                    raise PassError(f"IR after pass '{p.name}' does not verify: {e}",
                                    where=f"pipeline (after: {ran or 'nothing'})") from None
            if opts.check_numerics is not None:
                rec.numerics_error = opts.check_numerics.error(module)
                log.info("numerics after %s: max |logit error| %.3g", p.name, rec.numerics_error)
            if opts.print_after_all or p.name in opts.print_after or (opts.print_after_change and changed):
                self._print(f"after {p.spec()}{'' if changed else ' (unchanged)'}", module)
            if dump:
                (dump / f"{i:02d}-{p.name}.ir").write_text(print_module(module))
            result.records.append(rec)
            log.info("pass %-28s %6.3f s  %s", p.spec(), seconds, rec.hits)
            if opts.stop_after == p.name:
                break
        result.module = module
        if opts.time_passes:
            o = opts.out
            total = sum(r.seconds for r in result.records)
            o.write("// ----- pass timing -----\n")
            for r in result.records:
                o.write(f"  {r.seconds:8.4f} s  {100 * r.seconds / max(total, 1e-9):5.1f}%  {r.spec}\n")
            o.write(f"  {total:8.4f} s  total\n")
        return result
