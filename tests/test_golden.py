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
    src = path.read_text()
    m = re.search(r"#\s*RUN:\s*passes=(.*)$", src, re.M)
    assert m, f"{path.name}: no RUN line"
    passes = [p for p in m.group(1).strip().split(",") if p]
    module = verify(parse_module(src))
    out = PassManager(passes, PipelineOptions(verify_each=True)).run(module).module
    text = print_module(out)
    assert verify(parse_module(text)).same_as(out)  # and the output round-trips
    return text


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
