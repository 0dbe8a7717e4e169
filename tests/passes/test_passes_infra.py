"""Pass registry, pass manager instruments, numerics checks and bisection, and the `ir` CLI."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

from bad_input_util import cli_in_process
from conftest import dense_weights, make_model
from v4compile.config import preset
from v4compile.errors import PassError
from v4compile.harness import Scenario
from v4compile.ir.core import Function
from v4compile.ir.text import parse_module
from v4compile.passes import PIPELINES, PROGRAM_PASSES, PassManager, PipelineOptions, get_pass, parse_pass_spec
from v4compile.passes import manager as pass_manager
from v4compile.passes.base import PASSES, Pass, PassResult, load_all, register
from v4compile.passes.pipeline import LAUNCH_ONLY_PASSES
from v4compile.passes.numerics import NumericsCheck, bisect
from v4compile.passes.rewrite import new_module
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource

OPTS = TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160)
CORRUPT = "testing-corrupt{op=rms_norm,index=9}"


@pytest.fixture(scope="module")
def traced():
    return trace(preset("tiny"), OPTS)


@pytest.fixture(scope="module")
def check():
    sc = Scenario.make(512, 2, 100, 32, seed=0)
    return NumericsCheck(make_model("tiny"), DenseSource(dense_weights("tiny")), sc, 16, 1e-4)


def test_pass_specs():
    p = parse_pass_spec("testing-corrupt{op=hc_pre, index=3, factor=2.5}")
    assert (p.op, p.index, p.factor) == ("hc_pre", 3, 2.5)
    assert p.spec() == "testing-corrupt{op=hc_pre,index=3,factor=2.5}"
    with pytest.raises(PassError, match="unknown pass 'nope'"):
        get_pass("nope")
    with pytest.raises(PassError, match="unknown option 'bogus'"):
        parse_pass_spec("dce{bogus=1}")
    with pytest.raises(PassError, match="must be int"):
        parse_pass_spec("testing-corrupt{index=x}")
    with pytest.raises(PassError, match="not in the pipeline"):
        PassManager(["dce"], PipelineOptions(stop_after="cse"))


def test_instruments(traced, tmp_path):
    out = io.StringIO()
    opts = PipelineOptions(print_after_change=True, print_after=("dce",), dump_ir=str(tmp_path / "d"),
                           verify_each=True, time_passes=True, out=out)
    res = PassManager(["cse", CORRUPT, "dce"], opts).run(traced)
    text = out.getvalue()
    assert "IR after testing-corrupt" in text and "IR after dce (unchanged)" in text
    assert "IR after cse" not in text  # cse changed nothing on the traced graph
    assert "pass timing" in text and "total" in text
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["00-traced.ir", "01-cse.ir",
                                                                  "02-testing-corrupt.ir", "03-dce.ir"]
    assert [r.changed for r in res.records] == [False, True, False]
    # stop-after, disable-pass, start-from
    res = PassManager(["cse", CORRUPT, "dce"], PipelineOptions(stop_after="cse")).run(traced)
    assert [r.name for r in res.records] == ["cse"]
    res = PassManager(["cse", CORRUPT, "dce"], PipelineOptions(disable=("testing-corrupt",))).run(traced)
    assert res.module.attrs["passes_run"] == ("cse", "dce")
    assert _without_history(res.module).same_as(traced)
    resumed = parse_module((tmp_path / "d" / "02-testing-corrupt.ir").read_text())
    res = PassManager(["cse", CORRUPT, "dce"]).run(resumed, start_after="testing-corrupt")
    assert [r.name for r in res.records] == ["dce"]
    # Without start_after, the module's own record of the passes it has run says where it stands.
    assert resumed.attrs["passes_run"] == ("cse", "testing-corrupt{index=9}")
    res = PassManager(["cse", CORRUPT, "dce"]).run(resumed)
    assert [r.name for r in res.records] == ["dce"] and res.module.attrs["passes_run"][-1] == "dce"


def _without_history(m):
    import dataclasses

    return dataclasses.replace(m, attrs={k: v for k, v in m.attrs.items() if k != "passes_run"})


@pytest.mark.parametrize("pipeline, ran, start", [
    (["a", "b", "c"], (), 0), (["a", "b", "c"], ("a",), 1), (["a", "b", "c"], ("a", "b{x=1}"), 2),
    (["c"], ("a", "b"), 0),  # the pipeline does not contain the last pass run: run all of it
    (["b", "c"], ("a", "b"), 1),  # a different pipeline: continue after the last pass run
    (["dce", "x", "dce", "y"], ("dce", "x", "dce"), 3), (["x", "dce", "dce", "y"], ("q", "dce", "dce"), 3),
])
def test_resume_index(pipeline, ran, start):
    from v4compile.passes.manager import resume_index

    assert resume_index(pipeline, ran) == start


@register
@dataclass(frozen=True)
class _BreakIR(Pass):
    """Test-only: drops the first op, leaving its users with undefined operands."""

    name = "testing-break-ir"

    def run(self, module):
        fns = {n: Function(f.name, f.inputs, f.ops[1:], f.outputs, f.attrs) for n, f in module.functions.items()}
        return PassResult(new_module(module, fns))


def test_verify_each_names_the_broken_pass(traced):
    with pytest.raises(PassError) as e:
        PassManager(["cse", "testing-break-ir"], PipelineOptions(verify_each=True)).run(traced)
    assert "after pass 'testing-break-ir'" in str(e.value) and "after: cse" in str(e.value)


def test_check_numerics_names_the_first_bad_pass(traced, check):
    res = PassManager(["cse", "dce", CORRUPT, "dce"], PipelineOptions(check_numerics=check)).run(traced)
    assert res.traced_error < 1e-5
    errs = [r.numerics_error for r in res.records]
    assert errs[0] < 1e-5 and errs[1] < 1e-5 and errs[2] > 1e-4
    assert res.first_numerics_failure(1e-4).name == "testing-corrupt"


@pytest.mark.parametrize("op, index", [("rms_norm", 9), ("hc_pre", 4), ("compress", 2)])
def test_bisect_finds_the_pass_and_the_op(traced, check, op, index):
    pipeline = ["cse", "dce", f"testing-corrupt{{op={op},index={index}}}", "dce"]
    d = bisect(traced, pipeline, check)
    assert d is not None and d.pass_index == 3 and d.pass_name.startswith("testing-corrupt")
    corrupted = [o for o in traced.functions["prefill"].ops if o.name == op][index]
    o = d.op("prefill")
    assert o is not None and o.op_name == op and o.op_result == corrupted.results[0].name and o.op_loc == corrupted.loc
    assert bisect(traced, ["cse", "dce"], check) is None


def cli(*args):
    """In-process (`bad_input_util.cli_in_process`): exit status, stdout and stderr are what these tests check,
    and 14 fresh interpreters cost ~40 s of start-up (the CLI in a fresh process: tests/cli/test_cli.py)."""
    return cli_in_process(*args)


def test_ir_cli(tmp_path):
    r = cli("ir", "dump", "--preset", "tiny", "--func", "prefill")
    assert r.returncode == 0 and "func @prefill(" in r.stdout and "func @decode(" not in r.stdout
    r = cli("ir", "dump", "--preset", "tiny", "--passes", f"cse,{CORRUPT},dce", "--dump-ir", str(tmp_path / "d"),
            "--check-numerics", "--check-steps", "4", "-o", str(tmp_path / "final.ir"))
    assert r.returncode == 1, r.stderr  # a broken tolerance fails the command
    assert "first pass that breaks tolerance: testing-corrupt" in r.stderr
    r = cli("ir", "diff", str(tmp_path / "d" / "01-cse.ir"), str(tmp_path / "d" / "02-testing-corrupt.ir"))
    assert r.returncode == 0 and r.stdout.count("~ %") == 1 and "rms_norm" in r.stdout
    r = cli("ir", "verify", str(tmp_path / "final.ir"))
    assert r.returncode == 0 and r.stdout.startswith("ok: @tiny")
    r = cli("ir", "bisect", "--preset", "tiny", "--passes", f"cse,{CORRUPT},dce", "--check-steps", "2")
    assert r.returncode == 1 and "first failing pass: #2 testing-corrupt" in r.stdout
    assert "first diverging op in @prefill:" in r.stdout and "rms_norm" in r.stdout
    # A corruption of decode only: bisect names the op there too.
    r = cli("ir", "bisect", "--preset", "tiny", "--passes", "cse,testing-corrupt{func=decode,index=3}",
            "--check-steps", "2")
    assert r.returncode == 1 and "first diverging op in @decode:" in r.stdout and "rms_norm" in r.stdout, r.stdout
    r = cli("ir", "dump", "--preset", "tiny", "--format", "dot")
    assert r.returncode == 0 and r.stdout.startswith('digraph "decode"')
    r = cli("ir", "dump", "--preset", "tiny", "--format", "json")
    assert r.returncode == 0 and '"op": "hc_pre"' in r.stdout


@pytest.mark.parametrize("args, needle", [
    (("ir", "dump", "--preset", "tiny", "--passes", "nope"), "unknown pass 'nope'"),
    (("ir", "dump", "--preset", "tiny", "--passes", "dce{x=1}"), "unknown option 'x'"),
    (("ir", "dump", "--preset", "tiny", "--stop-after", "cse", "--passes", "dce"), "not in the pipeline"),
    (("ir", "dump", "--preset", "tiny", "--weights", "none", "--check-numerics"), "need weights"),
    # a misordered pipeline (test_a_misordered_pipeline_is_refused shows what it would do unrefused)
    (("ir", "dump", "--preset", "tiny", "--passes", "cse,fuse_moe_router,fuse_moe"),
     "pass 'fuse_moe_router' must run after 'fuse_moe'"),
])
def test_ir_cli_errors(args, needle):
    r = cli(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ir_cli_bad_files(tmp_path):
    f = tmp_path / "bad.ir"
    f.write_text("module @x\nfunc @f(%a : fp32[2]) {\n  %1 = frob(%a) : fp32[2]\n  return y = %1\n}\n")
    r = cli("ir", "verify", str(f))
    assert r.returncode == 2 and "line 3:8: unknown op 'frob'" in r.stderr and "Traceback" not in r.stderr
    f.write_text("module @x\nfunc @f(%a : fp32[2]) {\n  return y = %b\n}\n")
    r = cli("ir", "diff", str(f), str(f))
    assert r.returncode == 2 and "line 3:14: use of undefined value %b" in r.stderr


# ---- where a pass may stand (Pass.after / first / final, checked by manager.check_order) -------------

def _shipped_pipelines() -> dict[str, list[str]]:
    """Every pipeline the compiler runs: per target, the host device's (cpu, then the program passes, on one
    module), the program passes alone, the launch-only fusions in their order, each also partitioned."""
    gpu = PIPELINES["gpu"]
    base = {**PIPELINES, "cpu+program": PIPELINES["cpu"] + PROGRAM_PASSES, "program": PROGRAM_PASSES,
            "launch-only": [p for p in gpu if p in LAUNCH_ONLY_PASSES]}
    return base | {f"partition+{k}": ["partition{tp=2,ep=2}", *v] for k, v in base.items()}


def _name(spec: str) -> str:
    return spec.split("{", 1)[0]


def _declared_pairs(pipeline: list[str]) -> list[tuple[int, int]]:
    """(i, j): the pass at j must run after the one at i, by the declaration of the one at j."""
    names = [_name(p) for p in pipeline]
    return [(i, j) for j, n in enumerate(names) for i, m in enumerate(names) if m in load_all()[n].after]


@pytest.mark.parametrize("name", sorted(_shipped_pipelines()))
def test_every_shipped_pipeline_keeps_the_declared_order(name):
    """Each shipped pipeline is accepted, and each declared pair in it, swapped, is refused (alone: naming
    both passes). Fault caught: a pipeline list edited against a declaration (the swap is that edit; the first
    assertion fails on it), or a declaration the manager does not check."""
    pipeline = _shipped_pipelines()[name]
    PassManager(pipeline)
    pairs = _declared_pairs(pipeline)
    assert pairs or name in ("program", "partition+program") or "launch-only" in name, name
    for i, j in pairs:
        swapped = list(pipeline)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        with pytest.raises(PassError, match="must run after"):  # (the first of what the swap breaks)
            PassManager(swapped)
        with pytest.raises(PassError, match=f"pass '{_name(pipeline[j])}' must run after '{_name(pipeline[i])}'"):
            PassManager([pipeline[j], pipeline[i]])


def _undeclared(passes: dict[str, type[Pass]]) -> list[str]:
    return [f"{n}.after names '{m}'" for n, c in passes.items() for m in c.after if m not in passes]


def test_every_declared_pass_exists():
    """Fault caught: a declaration naming no pass (a typo, a renamed pass), which would order nothing."""
    assert _undeclared(load_all()) == []

    @dataclass(frozen=True)
    class Typo(Pass):
        name = "typo"
        after = {"fuse_mo": "a misspelt fuse_moe"}

    assert _undeclared({**load_all(), "typo": Typo}) == ["typo.after names 'fuse_mo'"]


def test_first_and_final_passes_stand_first_and_last():
    """`partition` first, `plan_memory` / `lower_to_program` last: a pass on the wrong side is refused."""
    with pytest.raises(PassError, match="pass 'partition' must run first; the pipeline runs 'cse' before it"):
        PassManager(["cse", "partition{tp=2}"])
    with pytest.raises(PassError, match="pass 'dce' cannot run after 'plan_memory'"):
        PassManager(["plan_memory", "dce"])
    PassManager(["partition{tp=2}", "cse", "plan_memory", "lower_to_program"])


def test_a_misordered_pipeline_is_refused(traced, monkeypatch):
    """`fuse_moe_router` before `fuse_moe` is refused naming both. Fault caught: without the check the same
    pipeline runs, and the router fusion finds nothing and says nothing (its hits 0, where in order > 0)."""
    bad = ["fuse_moe_router", "fuse_moe"]
    with pytest.raises(PassError, match="pass 'fuse_moe_router' must run after 'fuse_moe' \\(it folds the router"):
        PassManager(bad)
    in_order = PassManager(bad[::-1]).run(traced).hits()["fuse_moe_router"]
    assert sum(in_order.values()) > 0
    monkeypatch.setattr(pass_manager, "check_order", lambda passes: None)
    unchecked = PassManager(bad).run(traced).hits()["fuse_moe_router"]
    assert sum(unchecked.values()) == 0  # what the refusal saves a user from


def test_the_declarations_are_acyclic():
    """The registered passes' `after` declarations form a DAG. Fault caught: two passes each declared to
    run after the other (planted: `testing_a` after `testing_b` and back), named as a cycle by
    `declaration_cycle`, and refused by `check_order` in a pipeline holding both."""
    assert pass_manager.declaration_cycle(load_all()) == []

    @dataclass(frozen=True)
    class A(Pass):
        name = "testing_a"
        after = {"testing_b": "planted"}

    @dataclass(frozen=True)
    class B(Pass):
        name = "testing_b"
        after = {"testing_a": "planted"}

    assert sorted(pass_manager.declaration_cycle({**load_all(), "testing_a": A, "testing_b": B})) == [
        "testing_a", "testing_b"]
    with pytest.raises(PassError, match="contradict each other: testing_a before testing_b|"
                                        "contradict each other: testing_b before testing_a"):
        pass_manager.check_order([A(), B()])
