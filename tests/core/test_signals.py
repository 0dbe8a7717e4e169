"""A signal inside an import is acted on once the import has returned (v4compile/signals.py): raising inside
one can abort the process when a C extension's initialisation is on the stack."""

import importlib
import signal
import sys
import time

import pytest

from v4compile.signals import outside_imports, take_pending

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
