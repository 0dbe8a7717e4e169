"""Helpers for bad-input tests: run the CLI (in-process or as a subprocess) and check the error convention."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import sys

from v4compile.cli import main


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("the command blocked")


def run_main(*argv: str, timeout: int = 120) -> tuple[int, str, str]:
    """`v4compile ARGV` in this process: (exit status, stdout, stderr). An exception other than SystemExit
    escaping `main` is a traceback the user would see: it propagates and fails the test. A command that
    blocks longer than `timeout` raises `Hang`."""
    out, err = io.StringIO(), io.StringIO()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        signal.alarm(0)
        for s, h in saved.items():
            signal.signal(s, h)
    return rc, out.getvalue(), err.getvalue()


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4compile", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_error(rc: int, stderr: str, *needles: str) -> str:
    """Exit status 2, exactly one `error:` line (usage may follow), no traceback; returns the line."""
    assert rc == 2, (rc, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def cli_error(*argv: str, needles: tuple[str, ...] = (), timeout: int = 120) -> str:
    rc, _, err = run_main(*argv, timeout=timeout)
    return assert_one_error(rc, err, *needles)


def cli_in_process(*args: str, timeout: int = 600, cwd=None) -> subprocess.CompletedProcess:
    """`run_main` shaped as `run_cli`'s result, for tests that check a command's output rather than a fresh
    process: the interpreter's start-up (~3 s a command) is most of a short command's time. Restores what a
    command may set for the process (torch's thread count, the SIGINT handler, the working directory)."""
    import os

    import torch

    threads, sigint, here = torch.get_num_threads(), signal.getsignal(signal.SIGINT), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        rc, out, err = run_main(*args, timeout=timeout)
    finally:
        os.chdir(here)
        signal.signal(signal.SIGINT, sigint)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["v4compile", *args], rc, out, err)
