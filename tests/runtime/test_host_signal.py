"""A signal while the host device runs a step is an interruption, never a kernel fault (issue 42, item 2).

The host device runs every kernel in a Python callback of the C runtime (`c_backend.CRuntime._host_kernel`),
which keeps any exception from unwinding through C and hands it to `_raise` when the run returns. SIGTERM's
`cli.Terminated` raised inside a kernel was reported as "running @prefill_c16: a host kernel failed: 15",
exit 2. Now a signal during a run waits (`signals.held`) for the next kernel's start, inside its `try`
(tests/core/test_signals.py); `_raise` re-raises an interruption as itself; and the CLI reports any error
after a signal as the interruption (`cli.signalled`). Each layer has its test with the fault planted; the
end-to-end test plants the last two (either alone is enough to report the signal).
"""

from __future__ import annotations

import random
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from v4compile import cli
from v4compile.cli import Terminated, main
from v4compile.errors import DeviceError
from v4compile.runtime.c_backend import CRuntime

# The fault: the callback's exception, whatever it was, wrapped as a kernel failure (as before the fix)
OLD_RAISE = textwrap.dedent("""\
    def old_raise(self, rc, what, _fixed=CRuntime._raise):
        if self.error is not None:
            e, self.error = self.error, None
            raise DeviceError(f"{what}: a host kernel failed: {e}") from e
        _fixed(self, rc, what)
""")

# The child: says `in-kernel` on stdout once the first host kernel runs (the test signals then), and with
# `broken` runs with both faults planted
_CHILD = textwrap.dedent("""\
    import sys
    from v4compile import cli
    from v4compile.errors import DeviceError
    from v4compile.runtime.c_backend import CRuntime

    real = CRuntime._host_kernel
    said = []

    def announced(self, *args):
        if not said:
            said.append(1)
            print("in-kernel", flush=True)
        return real(self, *args)

    CRuntime._host_kernel = announced
    if sys.argv[1] == "broken":
        exec({old!r})
        CRuntime._raise = old_raise
        cli.signalled = lambda: False
    sys.exit(cli.main(sys.argv[2:]))
""").format(old=OLD_RAISE)


def _old_raise():
    ns = {"CRuntime": CRuntime, "DeviceError": DeviceError}
    exec(OLD_RAISE, ns)
    return ns["old_raise"]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("sig") / "tiny"
    assert main(["compile", "--preset", "tiny", "-o", str(out), "--target", "cpu"]) == 0
    return out


def _assert_interrupted(rc: int, err: str, sig: int) -> None:
    """Exit 128 + signal, one line saying so, nothing blamed on the artifact or its kernels."""
    assert rc == 128 + sig, (rc, err[-2000:])
    assert err.rstrip().splitlines()[-1] == f"interrupted by signal {signal.Signals(sig).name}", err[-2000:]
    assert "error:" not in err and "kernel failed" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fixed", "broken"], ids=["fixed", "broken-signal-reported-as-kernel-failure"])
def test_sigterm_while_the_host_device_runs_a_step_is_an_interruption(art, variant):
    """`v4compile run --device host`, SIGTERM once a host kernel runs. Catches a signal reported as a kernel
    fault (the planted variant exits 2 with "a host kernel failed: 15": `rc == 128 + sig` fails)."""
    ids = ",".join(str(random.Random(11).randrange(64)) for _ in range(5))
    p = subprocess.Popen([sys.executable, "-c", _CHILD, variant, "run", str(art), "--ids", ids, "--max-new-tokens",
                          "4", "--device", "host", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([p.stdout], [], [], 300)[0], "no host kernel ran within 300 s"
        assert p.stdout.readline() == "in-kernel\n"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    if variant == "fixed":
        _assert_interrupted(p.returncode, err, signal.SIGTERM)
        return
    assert "a host kernel failed: 15" in err, err[-2000:]
    with pytest.raises(AssertionError, match=r"\(2, "):
        _assert_interrupted(p.returncode, err, signal.SIGTERM)


@pytest.mark.parametrize("broken", [False, True], ids=["fixed", "broken-wraps-the-interruption"])
@pytest.mark.parametrize("caught", [Terminated(signal.SIGTERM), KeyboardInterrupt(), SystemExit(3)],
                         ids=["sigterm", "ctrl-c", "exit"])
def test_an_interruption_in_a_host_kernel_is_raised_as_itself(monkeypatch, broken, caught):
    """What the callback caught comes back out of the run as itself. Catches the wrap as a kernel failure
    (the planted `_raise`: DeviceError, not `type(caught)`)."""
    if broken:
        monkeypatch.setattr(CRuntime, "_raise", _old_raise())
    rt = CRuntime.__new__(CRuntime)  # `_raise` needs only the callback's error
    rt.error = caught
    with pytest.raises(BaseException) as got:
        rt._raise(1, "running @decode_b8")
    if broken:
        assert type(got.value) is DeviceError and "a host kernel failed" in str(got.value)
        return
    assert got.value is caught and rt.error is None


def test_a_kernels_own_error_is_still_a_kernel_failure():
    """The other side of the same line: an exception of the kernel (not an interruption) stays a DeviceError
    naming the run, with the kernel's error as its cause."""
    rt = CRuntime.__new__(CRuntime)
    rt.error = ValueError(f"bad value {random.Random(5).randrange(1000)}")
    with pytest.raises(DeviceError, match=r"running @decode_b8: a host kernel failed: bad value \d+") as got:
        rt._raise(1, "running @decode_b8")
    assert isinstance(got.value.__cause__, ValueError) and rt.error is None


@pytest.mark.parametrize("broken", [False, True], ids=["fixed", "broken-error-after-a-signal-reported"])
def test_an_error_after_a_signal_is_reported_as_the_interruption(tmp_path, monkeypatch, capsys, broken):
    """The CLI's own layer: SIGTERM recorded, then the command fails (here: the artifact directory is gone,
    as if removed under a run being stopped). Catches the error reported as the input's fault (the planted
    variant: exit 2 with `error: not an artifact directory`, `rc == 128 + sig` fails)."""
    monkeypatch.setattr(cli, "RECEIVED", [signal.SIGTERM])
    if broken:
        monkeypatch.setattr(cli, "signalled", lambda: False)
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        rc = main(["run", str(tmp_path / "gone"), "--ids", "1,2", "--max-new-tokens", "1"])
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    if not broken:
        _assert_interrupted(rc, err, signal.SIGTERM)
        return
    assert err.startswith("error: ") and "not an artifact directory" in err, err
    with pytest.raises(AssertionError, match=r"\(2, "):
        _assert_interrupted(rc, err, signal.SIGTERM)
