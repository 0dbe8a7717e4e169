"""Signal handlers that never raise inside an import.

A handler that raises runs at the main thread's next bytecode. During an import that bytecode can be Python
that a C extension's initialisation calls back into (pybind11 modules: torch, onnxruntime, triton); the
exception cannot unwind through the C++ frames and the process aborts ("terminate called after throwing an
instance of 'pybind11::error_already_set'", SIGABRT), which is neither the clean exit nor the one-line message
a signal gets. So a handler that finds an import on the stack only records the signal and looks again on a
short timer (SIGALRM); it raises once the import has returned. Stdlib only: `__main__` installs these before
anything else is imported.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

RETRY_S = 0.02  # how soon a deferred signal looks again; an import of the big extensions takes ~0.1-2 s

_pending: list[tuple[Callable, int]] = []


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _retry(signum, frame) -> None:
    if not _pending:
        return
    if _importing(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    act, deferred = _pending.pop()
    _pending.clear()
    act(deferred, frame)


def outside_imports(act: Callable[[int, object], None]) -> Callable[[int, object], None]:
    """A handler that calls `act(signum, frame)` now, or as soon as the import it interrupted has returned."""

    def handler(signum, frame) -> None:
        if _importing(frame):
            _pending.append((act, signum))
            signal.signal(signal.SIGALRM, _retry)
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
            return
        act(signum, frame)

    return handler


def take_pending() -> int | None:
    """The signal still waiting for an import to return (the timer cancelled), if any: for a caller that
    finishes before the timer fires."""
    if not _pending:
        return None
    signal.setitimer(signal.ITIMER_REAL, 0)
    signum = _pending[-1][1]
    _pending.clear()
    return signum
