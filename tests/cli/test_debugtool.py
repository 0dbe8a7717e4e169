"""The debugging tool as a user meets it (issue 13): numerics failures fail, the printed bisect command
reproduces, every file written parses back, and the output says what was written and checked."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from bad_input_util import cli_in_process
from v4compile.ir.diff import diff_modules
from v4compile.ir.text import ir_ident, parse_module, print_module
from v4compile.ir.verify import verify

FAST = ("--check-prompt-len", "40", "--check-steps", "2", "--max-context", "64", "--threads", "1")


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """In-process (`bad_input_util.cli_in_process`): what a user meets is the exit status and the output, the
    same from `main` as from a fresh interpreter, whose start-up (~3 s a command, over 20 commands here) the
    file would otherwise spend; the CLI in a fresh process is tests/cli/test_cli.py's."""
    return cli_in_process(*args, cwd=cwd)


def ir_verify(*paths) -> None:
    """`ir verify` of every path in one process: one `ok:` line each, in order."""
    r = cli("ir", "verify", *map(str, paths))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(paths) and all(x.startswith("ok: @") for x in lines), \
        (paths, r.stderr)


# ---- numerics: a broken tolerance fails, and the hint reproduces it --------------------------------

@pytest.mark.slow
def test_broken_tolerance_exits_1_and_the_hint_reproduces(tmp_path):
    r = cli("compile", "--preset", "tiny", "--passes", "cse,testing-corrupt{factor=1000000000.0},dce", "--check-numerics",
            *FAST)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: numerics check failed: pass testing-corrupt{factor=1000000000.0} breaks the tolerance")
    # The hint: the full command (preset, numerics, dtype, batch, passes, ...), run as printed.
    hint = next(ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("v4compile ir bisect"))
    for flag in ("--preset tiny", "--numerics official", "--dtype fp32", "--batch 2", "--max-context 64",
                 "--check-steps 2"):
        assert flag in hint, hint
    argv = shlex.split(hint)
    b = cli(*argv[1:], "--threads", "1")
    assert b.returncode == 1 and "first failing pass: #2 testing-corrupt{factor=1000000000.0}" in b.stdout, (hint, b.stdout)
    # One unit in both: the same relative error.
    e_check = float(re.search(r"testing-corrupt\{factor=1000000000.0\}\s+([0-9.e+-]+)\s+<--", r.stderr).group(1))
    e_bisect = float(re.search(r"\(error ([0-9.e+-]+); max \|logit", b.stdout).group(1))
    assert e_bisect == pytest.approx(e_check, rel=1e-2)


def test_testing_corrupt_defaults_break_tolerance_on_tiny():
    r = cli("ir", "dump", "--preset", "tiny", "--passes", "testing-corrupt", "--check-numerics", *FAST)
    assert r.returncode == 1 and "testing-corrupt" in r.stderr.splitlines()[-1], r.stderr


@pytest.mark.parametrize("tol", ["-1", "nan", "inf", "x"])
def test_bad_tolerance_is_rejected(tol):
    r = cli("compile", "--preset", "tiny", "--check-numerics", "--tol", tol)
    assert r.returncode == 2 and "--tol" in r.stderr and "Traceback" not in r.stderr


def test_threads_flag():
    r = cli("compile", "--preset", "tiny", "--threads", "0")
    assert r.returncode == 2 and "--threads" in r.stderr
    r = cli("ir", "dump", "--preset", "tiny", "--threads", "1", "--stage", "traced")
    assert r.returncode == 0 and "threads 1" in r.stderr


# ---- round trips -----------------------------------------------------------------------------------

def test_module_names_print_as_identifiers():
    assert ir_ident("tiny-pro.v2") == "tiny-pro.v2"
    assert ir_ident("/tmp/x y/config.json") == "_tmp_x_y_config.json"
    from v4compile.config import preset
    from v4compile.trace import TraceOptions, module_name, trace

    assert module_name("/a/b/ckpt dir/config.json") == "ckpt_dir"
    m = trace(preset("tiny"), TraceOptions(batch=1, chunk=4, decode_batch=1, capacity=32))
    m.name = "/path/to/config.json"  # any name prints as something that parses back
    back = verify(parse_module(print_module(m)))
    assert back.name == "_path_to_config.json"


@pytest.mark.slow
def test_every_written_file_parses_back(tmp_path):
    """`compile CHECKPOINT -o`, `--dump-ir` of compile and ir dump, `ir dump -o`: each goes through
    `ir verify`; `--start-from` resumes from a dump under any file name."""
    ck = tmp_path / "ck"
    assert cli("init-random", "--preset", "tiny", "-o", str(ck)).returncode == 0
    # one GPU target is enough for the files of the GPU side (the other's kernels: tests/runtime/test_gpu_artifact.py)
    r = cli("compile", str(ck), "-o", str(tmp_path / "out"), "--dump-ir", str(tmp_path / "dumps"), "--verify-each",
            "--threads", "1", "--target", "cpu,sm_90a")
    assert r.returncode == 0, r.stderr
    written = re.findall(r"^info: wrote (\S+) \(([\d,]+) bytes", r.stderr, re.M)
    files = sorted(p for p in (tmp_path / "dumps").iterdir())
    assert {p for p, _ in written} >= {str(f) for f in files}
    assert f"info: wrote artifact {tmp_path / 'out'}" in r.stderr
    files.append(tmp_path / "out" / "module.ir")  # the artifact's IR parses back too, that of the GPU targets too
    files.append(tmp_path / "out" / "gpu" / "module.ir")
    from v4compile.program.text import parse_program
    from v4compile.program.verify import verify_program

    verify_program(parse_program((tmp_path / "out" / "gpu" / "program.txt").read_text()))
    assert "verified the IR before the pipeline and after each of" in r.stderr
    ir_verify(*files)
    assert parse_module((tmp_path / "out" / "module.ir").read_text()).name == "ck"
    r = cli("ir", "dump", "--preset", "tiny", "--stage", "after:cse", "--func", "all", "-o", str(tmp_path / "d.ir"),
            "--dump-ir", str(tmp_path / "d2"), "--threads", "1")
    assert r.returncode == 0 and "parses back and verifies" in r.stderr, r.stderr
    ir_verify(tmp_path / "d.ir", *(tmp_path / "d2").iterdir())
    # --start-from: where the module stands comes from the module (file renamed on purpose).
    dumps = sorted((tmp_path / "dumps").iterdir())
    mid = tmp_path / "somewhere.ir"
    mid.write_text(dumps[5].read_text())
    r = cli("compile", str(ck), "--start-from", str(mid), "--dump-ir", str(tmp_path / "resumed"), "--threads", "1",
            "--dtype", "fp32", "--target", "cpu,sm_90a")  # as the first run (which wrote an artifact: fp32)
    assert r.returncode == 0 and "continuing with" in r.stderr, r.stderr
    last = sorted((tmp_path / "resumed").iterdir())[-1]
    assert last.read_text() == dumps[-1].read_text()  # resumed mid-way, it ends where the full run ended


def test_start_from_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.ir"
    bad.write_text('module @x attributes {passes_run = 3}\n')
    r = cli("ir", "dump", "--preset", "tiny", "--start-from", str(bad))
    # (refused by the trace check, or by the malformed passes_run: either way the file is named)
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr
    bad.write_text("module @x\nfunc @f(%a : fp32[2]) {\n  %1 = rms_norm(%a, none) : fp32[3]\n  return y = %1\n}\n")
    r = cli("compile", "--preset", "tiny", "--start-from", str(bad))
    assert r.returncode == 2 and str(bad) in r.stderr


def test_semantic_verifier_errors_carry_line_and_column(tmp_path):
    # Parses (rms_norm exists, operands defined), but the result type breaks the shape rule.
    f = tmp_path / "bad.ir"
    f.write_text("module @x\nfunc @f(%a : fp32[2]) {\n  # a comment\n    %1 = rms_norm(%a, none) {eps = 1e-06} "
                 ": fp32[3]\n  return y = %1\n}\n")
    r = cli("ir", "verify", str(f))
    assert r.returncode == 2 and f"{f}: line 4:5: @f op #0 (rms_norm)" in r.stderr, r.stderr


def _module(attrs, weights):
    from v4compile.ir.core import WEIGHT, Module, Value
    from v4compile.ir.types import TensorType

    ws = {n: Value(n, TensorType((2,), "fp32"), WEIGHT, (n,)) for n in weights}
    return Module("m", ws, {}, attrs)


def test_ir_diff_is_sorted_and_one_line_per_attribute():
    a = _module({"x": 1, "y": "a", "z": (1, 2)}, [f"w{i}" for i in range(50)])
    b = _module({"x": 2, "y": "a", "n": True}, [f"v{i}" for i in range(50)])
    d = diff_modules(a, b)
    lines = d.splitlines()
    assert lines[:3] == ["+ module attribute n = true", "~ module attribute x = 1 -> 2",
                         "- module attribute z = (1, 2)"]
    minus = [ln for ln in lines if ln.startswith("- weight")]
    plus = [ln for ln in lines if ln.startswith("+ weight")]
    assert minus == sorted(minus) and plus == sorted(plus) and len(minus) == len(plus) == 50
    # Deterministic across processes (set order depends on the hash seed).
    code = ("import sys; sys.path[:0] = ['tests/cli', 'tests']; from test_debugtool import _module; "
            "from v4compile.ir.diff import diff_modules; "
            "print(diff_modules(_module({}, [f'w{i}' for i in range(50)]), _module({}, [f'v{i}' for i in range(50)])))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": s},
                           cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2])).stdout for s in ("1", "2")}
    assert len(outs) == 1 and "weight @w0" in outs.pop()


# ---- what a user sees ------------------------------------------------------------------------------

def test_compile_says_what_it_wrote(tmp_path):
    r = cli("compile", "--preset", "tiny", "-o", str(tmp_path / "o"), "--time-passes", "--threads", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("info: compile: preset tiny (weights random, seed 0), numerics official, dtype fp32")
    assert "WARNING" not in r.stderr
    assert f"info: wrote artifact {tmp_path / 'o'}" in r.stderr
    # --time-passes: every stage, and rows that add up to the total (the wall clock of the process).
    table = r.stderr[r.stderr.index("// ----- timing"):]
    rows = re.findall(r"^\s+([\d.]+) s\s+[\d.]+%\s+(.+)$", table, re.M)
    names = [n for _, n in rows]
    for stage in ("trace", "pass cse", "change detection", "write output", "total"):
        assert stage in names, names
    assert sum(float(s) for s, n in rows[:-1]) == pytest.approx(float(rows[-1][0]), abs=2e-3)
    assert json.loads((tmp_path / "o" / "report.json").read_text())


def test_check_numerics_in_bf16_explains_the_shadow_trace():
    r = cli("compile", "--preset", "tiny", "--passes", "cse", "--check-numerics", *FAST)
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr and "info: --check-numerics checks the passes on an fp32 trace" in r.stderr
    assert "every pass within tolerance" in [ln.strip() for ln in r.stderr.splitlines()]


def test_ir_dump_views_and_v4_pro_default(tmp_path):
    r = cli("ir", "dump", "--preset", "v4-pro", "--no-weights", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "shape-only weights" in r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("module @v4-pro") and out[1].startswith("# ") and "weight declarations left out" in out[1]
    assert not any(ln.startswith("weight @") for ln in out) and "func @decode(" in r.stdout
    r = cli("ir", "dump", "--preset", "tiny", "--functions-first", "--threads", "1")
    text = r.stdout
    assert r.returncode == 0 and text.index("func @decode(") < text.index("\nweight @")


def test_ir_passes_summary_and_detail():
    r = cli("ir", "passes")
    assert r.returncode == 0
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln and not ln.startswith((" ", "pipeline ", "`"))}
    for name, ln in rows.items():
        assert ln.rstrip().endswith((".", ")")), ln  # a whole sentence, not a cut line
    r = cli("ir", "passes", "lower_sparse_attention")
    assert r.returncode == 0 and "Requires:" in r.stdout and "Guarantees:" in r.stdout and "kv_format" in r.stdout
    r = cli("ir", "passes", "nope")
    assert r.returncode == 2 and "unknown pass 'nope'" in r.stderr
