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

GOLDEN = sorted((Path(__file__).resolve().parents[1] / "golden").glob("*.ir"))


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
    from v4compile.cli.args import split_specs
    return split_specs(text)


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


def test_filecheck_variables_bind_and_are_reused():
    src = "# CHECK: %[[A:[0-9]+]] = f(%x)\n# CHECK: = g(%[[A]], %[[A]])"
    filecheck("%7 = f(%x)\n%8 = g(%7, %7)", src)
    with pytest.raises(AssertionError, match="not found"):  # g reads another value than f's result
        filecheck("%7 = f(%x)\n%8 = g(%7, %17)", src)
    filecheck("%3 = h(%3)", "# CHECK: %[[B:[0-9]+]] = h(%[[B]])")  # a use on the defining line
    with pytest.raises(AssertionError, match="not found"):
        filecheck("%3 = h(%4)", "# CHECK: %[[B:[0-9]+]] = h(%[[B]])")
    with pytest.raises(AssertionError, match="used before"):  # a typo in the check file is an error
        filecheck("%1 = f(%x)", "# CHECK: %[[C]] = f(%x)")
    with pytest.raises(AssertionError, match="binds nothing"):  # the old, binding-free spelling
        filecheck("%1 = f(%x)", "# CHECK: %[[C:]]{{[0-9]+}} = f(%x)")


# The data flow each golden claims, broken in its real output: the check must now fail.
BROKEN_FLOW = {
    "fold_inverse_rope_fp8": ("grouped_out_proj(%2, @wo_a, none, %3)", "grouped_out_proj(%3, @wo_a, none, %2)"),
    "merge_wq_a_wkv": ("split(%4)", "split(%x)"),
    "fuse_indexer_select": ("%225, %226, %227, %228, %221", "%225, %226, %228, %227, %221"),
    "fuse_inv_rope_wo_a": ("rope_out_proj(%o, %pos,", "rope_out_proj(%pos, %o,"),
    "fuse_out_proj": ("@wo_a, none, @wo_b, none)", "@wo_b, none, @wo_a, none)"),
    "fuse_out_proj_attention": ("%227, %223, none, none, @layers.1.", "%227, %222, none, none, @layers.1."),
    "pair_sibling_gemms": ("%0, %1 = linear_pair", "%1, %0 = linear_pair"),
    "fuse_moe_router": ("moe_router_experts_shared(%x, @g, @b,", "moe_router_experts_shared(%x, @b, @g,"),
    "fuse_moe_mhc": ("none, %st, %po, %co, @fn,", "none, %st, %co, %po, @fn,"),
    "fuse_mhc_moe": ("mhc_moe_mhc(%a, %st, %po, %co, @fa,", "mhc_moe_mhc(%a, %st, %co, %po, @fa,"),
    "pair_compressors": ("compress_pair(%89, %90,", "compress_pair(%90, %89,"),
    "pair_rope_compress": ("%block_table, %pool.main, none, none)", "%block_table, %pool.index, none, none)"),
    "fuse_attn_front": ("col = 16,", "col = 48,"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_FLOW))
def test_a_golden_with_broken_data_flow_fails(name):
    path = Path(__file__).resolve().parents[1] / "golden" / f"{name}.ir"
    good, (old, new) = run_golden(path), BROKEN_FLOW[name]
    assert good.count(old) == 1, f"{name}: the output changed; update the fault to break its flow again"
    with pytest.raises(AssertionError, match="not found|not on the line"):
        filecheck(good.replace(old, new), path.read_text())
