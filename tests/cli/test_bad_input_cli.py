"""Bad command lines, IR files and output paths, and signals, class by class (issue 12): exit 2 with one
`error:` line and no traceback, checked before any work starts; nothing half-written is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bad_input_util import assert_one_error, cli_error, run_main
from v4compile.errors import IRError
from v4compile.ir.text import parse_module, print_module
from v4compile.ir.verify import verify

# ---- CLI values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (("generate", "--ids", str(2 ** 64)), "64-bit"),
    (("generate", "--ids", f"1,{-2 ** 63 - 1}"), "64-bit"),
    (("generate", "--ids", "1", "--seed", str(2 ** 64)), "--seed"),
    (("generate", "--ids", "1", "--seed", "-1"), "--seed"),
    (("generate", "--ids", "1", "--seed", "1.5"), "--seed"),
    (("generate", "--ids", "1", "--max-new-tokens", "-3"), "--max-new-tokens"),
    (("generate",), "--ids"),  # argparse: a required option
    (("generate", "--ids", "1", "--numerics", "exact"), "--numerics"),  # argparse: a bad choice
    (("frobnicate",), "invalid choice"),  # argparse: unknown command
    (("generate", "--ids", "1", "--bogus"), "--bogus"),  # argparse: unknown option
    (("init-random", "-o", "x", "--seed", "9" * 30), "--seed"),
    (("compile", "--batch", "0"), "--batch"),
    (("compile", "--max-context", str(2 ** 40)), "--max-context"),
    (("ir", "dump", "--tol", "nan"), "--tol"),
    (("ir", "dump", "--tol", "-1"), "--tol"),
])
def test_bad_values_and_argparse_errors(argv, needle):
    cli_error(*argv, needles=(needle,))


@pytest.mark.parametrize("passes, needle", [
    ("plan_memory{align}", "key=value"),
    ("plan_memory{align=0}", "power of two"),
    ("plan_memory{align=-256}", "power of two"),
    ("plan_memory{align=3}", "power of two"),
    ("plan_memory{align=1e3}", "int"),
    ("plan_memory{align=1,align=2}", "twice"),
    ("cse{", "unclosed"),
    ("cse}", "unbalanced"),
    ("cse{a{b}}", "nested"),
    ("cse,,dce", "empty pass name"),
    ("cse,", "ends with"),
    ("no_such_pass", "unknown pass"),
    ("cse{bogus=1}", "unknown option"),
    ("9lives", "malformed"),
])
def test_bad_pass_pipelines(passes, needle):
    cli_error("compile", "--weights", "none", "--passes", passes, needles=(needle,))


# ---- IR files --------------------------------------------------------------------------------

RANK0_LINEAR = """module @t
weight @w : fp32[4,4] from "w"
func @f(
    %x : fp32[],
) {
  %0 = linear(%x, @w, none) {block = 128} : fp32[4]
  return y = %0
}
"""


@pytest.fixture(scope="module")
def traced_text():
    from v4compile import frontend
    from v4compile.trace import TraceOptions

    fe = frontend.load(None, "tiny", "none", TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=256,
                                                          numerics="hf", dtype="fp32"))
    return print_module(fe.module)


def bad_ir_cases(text: str) -> dict[str, tuple[bytes, str]]:
    return {
        "non-utf8": (text.encode().replace(b"module @", b"module \xff@", 1), "not UTF-8"),
        "deep": (text.replace("block = 128", "block = " + "(" * 100_000 + ")" * 100_000, 1).encode(),
                 "nest deeper"),
        "rank0-linear": (RANK0_LINEAR.encode(), "outside what the op accepts"),
        "block0": (text.replace("block = 128", "block = 0", 1).encode(), "'block' must be >= 1"),
        "block-negative": (text.replace("block = 128", "block = -128", 1).encode(), "'block' must be >= 1"),
        "eps-inf": (text.replace("{eps = 1e-06,", "{eps = inf,", 1).encode(), "finite"),
        "eps-nan": (text.replace("{eps = 1e-06,", "{eps = nan,", 1).encode(), "finite"),
        "huge-dim": (text.replace("%ids : i64[2,16]", "%ids : i64[2," + "9" * 30 + "]", 1).encode(), "too large"),
        "huge-attr": (text.replace("block = 128", "block = " + "9" * 40, 1).encode(), "out of range"),
    }


def test_bad_ir_text_api_and_cli(traced_text, tmp_path):
    verify(parse_module(traced_text))  # the control
    for name, (raw, needle) in bad_ir_cases(traced_text).items():
        assert raw != traced_text.encode(), name  # the case really damages the text
        with pytest.raises(IRError, match=needle):
            verify(parse_module(raw))
        f = tmp_path / f"{name}.ir"
        f.write_bytes(raw)
        cli_error("ir", "verify", str(f), needles=(needle, str(f)))


def test_ir_verify_of_several_files_stops_at_the_bad_one(traced_text, tmp_path):
    """`ir verify A B C`: an ok line per good file up to the first bad one, then its one error (exit 2)."""
    good, bad = tmp_path / "good.ir", tmp_path / "bad.ir"
    good.write_text(traced_text)
    bad.write_bytes(bad_ir_cases(traced_text)["eps-nan"][0])
    rc, out, err = run_main("ir", "verify", str(good), str(bad), str(good), timeout=120)
    assert_one_error(rc, err, "finite", str(bad))
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith("ok: @")


def test_ir_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "p.ir")
    cli_error("ir", "verify", str(tmp_path / "p.ir"), needles=("not a regular file",), timeout=30)
    cli_error("compile", "--weights", "none", "--start-from", str(tmp_path / "p.ir"), needles=("not a regular file",),
              timeout=30)
    cli_error("ir", "verify", str(tmp_path), needles=("not a regular file",))  # a directory


@pytest.mark.parametrize("flag, value, attr", [
    ("--preset", "tiny-pro", "config"), ("--batch", "4", "batch"), ("--decode-batch", "1", "decode_batch"),
    ("--numerics", "official", "numerics"), ("--max-context", "512", "capacity"), ("--dtype", "bf16", "dtype"),
])
def test_start_from_a_module_traced_for_something_else(traced_text, tmp_path, flag, value, attr):
    f = tmp_path / "00-traced.ir"
    f.write_text(traced_text)  # tiny, batch 2, decode batch 2, hf, fp32, capacity 256
    rc, _, err = run_main("compile", "--weights", "none", "--numerics", "hf", "--dtype", "fp32", "--start-from",
                          str(f))
    assert rc == 0, err  # the control: the same trace is accepted
    argv = {"--numerics": "hf", "--dtype": "fp32", flag: value}
    cli_error("compile", "--weights", "none", *[x for kv in argv.items() for x in kv], "--start-from", str(f),
              needles=(f"`{attr}`", str(f)))


# ---- output paths ------------------------------------------------------------------------------

def test_output_paths_checked_before_work(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("mine")
    unwritable = "/proc/v4compile-test-out"  # not writable even by root
    cases = [
        (("compile", "--weights", "none", "-o", str(a_file)), "not a directory"),
        (("compile", "--weights", "none", "-o", str(a_file / "sub")), "not a directory"),
        (("compile", "--weights", "none", "-o", unwritable), "not writable"),
        (("compile", "--weights", "none", "-o", str(full)), "--force"),
        (("ir", "dump", "--weights", "none", "-o", str(tmp_path)), "names a directory"),
        (("ir", "dump", "--weights", "none", "-o", str(a_file / "x.ir")), "not a directory"),
        (("ir", "dump", "--weights", "none", "-o", unwritable + "/x.ir"), "not writable"),
        (("compile", "--weights", "none", "--dump-ir", str(a_file)), "not a directory"),
        (("compile", "--weights", "none", "--dump-ir", str(a_file / "d")), "not a directory"),
        (("init-random", "-o", str(a_file)), "not a directory"),
        (("init-random", "-o", str(a_file / "ck")), "not a directory"),
        (("init-random", "-o", str(full)), "--force"),
        (("init-random", "-o", unwritable), "not writable"),
    ]
    for argv, needle in cases:
        t0 = time.perf_counter()
        cli_error(*argv, needles=(needle,))
        assert time.perf_counter() - t0 < 5, argv  # refused before tracing or writing
    assert a_file.read_text() == "x" and (full / "keep").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_compile_output_is_atomic_and_force_replaces(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    rc, _, err = run_main("compile", "-o", str(out), "--force", "--decode-buckets", "1", "--prefill-buckets", "16",
                           "--target", "cpu")
    assert rc == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert "old" not in names and {"manifest.json", "module.ir", "report.json"} <= set(names)
    # a failure while writing leaves nothing behind, not even a temporary directory
    import v4compile.cli.report as report

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    import v4compile.cli.driver as driver

    monkeypatch.setattr(report, "build_report", boom)
    monkeypatch.setattr(driver, "write_weights", boom)
    rc, _, err = run_main("compile", "-o", str(tmp_path / "new"), "--decode-buckets", "1", "--prefill-buckets", "16",
                          "--target", "cpu")
    assert_one_error(rc, err, "No space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- signals -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_while_init_random_writes_cleans_up(tmp_path, sig):
    out = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, "-m", "v4compile", "init-random", "--preset", "tiny-pro", "--quantized",
                          "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(q.name.startswith(".ck.tmp-") for q in tmp_path.iterdir()):  # the writer has started
        assert p.poll() is None and time.monotonic() < deadline, "init-random finished before the signal"
        time.sleep(0.005)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err and f"signal {signal.Signals(sig).name}" in err
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@pytest.mark.slow
def test_sigterm_while_compiling_leaves_nothing(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "v4compile", "-v", "compile", "--weights", "none", "-o",
                          str(tmp_path / "out"), "--dump-ir", str(tmp_path / "dump")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "dump" / "00-traced.ir").exists():  # the pipeline runs
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
    assert [q.name for q in tmp_path.iterdir()] == ["dump"]  # no temporary output directory
    assert not [q for q in (tmp_path / "dump").iterdir() if q.name.startswith(".")]  # no half-written dump
