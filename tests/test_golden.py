"""FileCheck-style golden tests: each `tests/golden/*.ir` file is IR in (parsed, verified, run through the
passes on its `# RUN: passes=` line) and `# CHECK` lines out (matched against the printed result)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from filecheck import filecheck
from v4compile.ir.text import parse_module, print_module
from v4compile.ir.verify import verify
from v4compile.passes import PassManager, PipelineOptions

GOLDEN = sorted((Path(__file__).parent / "golden").glob("*.ir"))


def run_golden(path: Path) -> str:
    """`# RUN: [trace=PRESET] passes=a,b [func=NAME]`: the IR in the file body (or the traced preset, with
    TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160)), through the passes, printed."""
    src = path.read_text()
    m = re.search(r"#\s*RUN:(.*)$", src, re.M)
    assert m, f"{path.name}: no RUN line"
    args = dict(kv.split("=", 1) for kv in m.group(1).split())
    passes = [p for p in _split(args.get("passes", "")) if p]
    if "trace" in args:
        from v4compile.config import preset
        from v4compile.trace import TraceOptions, trace

        module = trace(preset(args["trace"]), TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160))
    else:
        module = verify(parse_module(src))
    out = PassManager(passes, PipelineOptions(verify_each=True)).run(module).module
    assert verify(parse_module(print_module(out))).same_as(out)  # the output round-trips
    return print_module(out, [args["func"]] if "func" in args else None)


def _split(text: str) -> list[str]:
    from v4compile.compile_cli import _split_specs
    return _split_specs(text)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden(path):
    filecheck(run_golden(path), path.read_text())


def test_filecheck_can_fail():
    with pytest.raises(AssertionError, match="CHECK-NOT"):
        filecheck("a\nb\nc", "# CHECK: a\n# CHECK-NOT: b\n# CHECK: c")
    with pytest.raises(AssertionError, match="CHECK-NEXT"):
        filecheck("a\nx\nb", "# CHECK: a\n# CHECK-NEXT: b")
    with pytest.raises(AssertionError, match="not found"):
        filecheck("a", "# CHECK: z")
