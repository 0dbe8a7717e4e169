"""A signal inside an import is acted on once the import has returned (v4compile/signals.py): raising inside
one can abort the process when a C extension's initialisation is on the stack. Inside `held()` (C code that
calls back into Python) it waits for a callback's `act_pending` or the block's end."""

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import time

import pytest

from v4compile import signals
from v4compile.signals import act_pending, held, outside_imports, take_pending

_BODY = """import os, signal, time
os.kill(os.getpid(), signal.SIGUSR1)
t = time.monotonic()
while time.monotonic() - t < 0.2:  # Python running inside the import when the signal arrives
    pass
FINISHED = True
"""


@pytest.mark.parametrize("wrap, finishes", [(outside_imports, True), (lambda act: act, False)],
                         ids=["deferred", "broken-raises-inside-the-import"])
def test_a_signal_inside_an_import_is_raised_after_it(tmp_path, monkeypatch, wrap, finishes):
    name = f"slow_import_{finishes}"
    (tmp_path / f"{name}.py").write_text(_BODY)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def act(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    old_usr1, old_alrm = signal.signal(signal.SIGUSR1, wrap(act)), signal.getsignal(signal.SIGALRM)
    try:
        with pytest.raises(KeyboardInterrupt):
            importlib.import_module(name)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the deferred signal lands here, after the import
                time.sleep(0.005)
        assert seen == [signal.SIGUSR1]
        assert (name in sys.modules and sys.modules[name].FINISHED) is finishes
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGUSR1, old_usr1)
        signal.signal(signal.SIGALRM, old_alrm)
        sys.modules.pop(name, None)


def test_a_command_that_ends_first_still_reports_the_deferred_signal(tmp_path, monkeypatch):
    """The import returns and the program ends before the retry timer fires: `take_pending` hands the signal
    over (and cancels the timer), so it is not lost nor raised later at some arbitrary point."""
    (tmp_path / "quick_import.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGUSR1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    old_usr1, old_alrm = signal.signal(signal.SIGUSR1, outside_imports(lambda s, f: None)), signal.getsignal(signal.SIGALRM)
    try:
        importlib.import_module("quick_import")
        assert take_pending() == signal.SIGUSR1
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and take_pending() is None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGUSR1, old_usr1)
        signal.signal(signal.SIGALRM, old_alrm)
        sys.modules.pop("quick_import", None)


@contextlib.contextmanager
def _usr1_raises(seen):
    def act(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGUSR1, outside_imports(act))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


def _spin(seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:  # Python running when the signal arrives
        pass


@pytest.mark.parametrize("hold, finishes", [(held, True), (contextlib.nullcontext, False)],
                         ids=["held", "broken-not-held"])
def test_a_signal_inside_a_held_block_is_raised_at_its_end(hold, finishes):
    """Catches a signal raised in the middle of the block (where a ctypes callback could be running: the
    planted variant holds nothing and `finished is finishes` fails)."""
    seen, finished = [], False
    with _usr1_raises(seen), pytest.raises(KeyboardInterrupt):
        with hold():
            os.kill(os.getpid(), signal.SIGUSR1)
            _spin(0.1)
            finished = True
    assert seen == [signal.SIGUSR1] and finished is finishes and take_pending() is None


@pytest.mark.parametrize("act, stops_inside", [(act_pending, True), (lambda: None, False)],
                         ids=["acted-on-in-the-callback", "broken-callback-ignores-it"])
def test_a_held_signal_is_raised_in_the_next_callback_inside_its_try(act, stops_inside):
    """Through a real ctypes callback (libffi calls back into Python, as the C runtime's host kernels do):
    the signal is raised where the callback's `try` turns it into a status for the C code, so the run stops
    at once and no exception crosses C. Catches a callback that never acts on it (the planted variant: the
    callback returns 0, the C code would run on: `rc == 1` fails; the block's end still raises it)."""
    caught, seen = [], []

    def body() -> int:
        try:
            act()
            _spin(0.02)
            return 0
        except BaseException as e:  # as `CRuntime._host_kernel`: never unwind through C
            caught.append(e)
            return 1

    callback = ctypes.CFUNCTYPE(ctypes.c_int)(body)
    with _usr1_raises(seen), pytest.raises(KeyboardInterrupt) if not stops_inside else contextlib.nullcontext():
        with held():
            os.kill(os.getpid(), signal.SIGUSR1)
            _spin(0.05)
            rc = callback()
    assert seen == [signal.SIGUSR1]
    if stops_inside:
        assert rc == 1 and len(caught) == 1 and isinstance(caught[0], KeyboardInterrupt)
    else:
        with pytest.raises(AssertionError, match="assert 0 == 1"):
            assert rc == 1
    assert not signals._pending
