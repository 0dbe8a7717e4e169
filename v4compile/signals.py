"""Signal handlers that never raise inside an import, nor inside C code's calls back into Python.

A handler that raises runs at the main thread's next bytecode. During an import that bytecode can be Python
that a C extension's initialisation calls back into (pybind11 modules: torch, onnxruntime, triton); the
exception cannot unwind through the C++ frames and the process aborts ("terminate called after throwing an
instance of 'pybind11::error_already_set'", SIGABRT), which is neither the clean exit nor the one-line message
a signal gets. So a handler that finds an import on the stack only records the signal and looks again on a
short timer (SIGALRM); it raises once the import has returned. Stdlib only: `__main__` installs these before
anything else is imported.

Likewise inside `held()`: C code that calls back into Python (the C runtime's host kernels, ctypes callbacks)
must never see an exception leave a callback (ctypes prints it as "Exception ignored", and C gets an undefined
result), and a handler may run at a callback's very first bytecode, before any `try` of its own. So a signal
there is recorded too; the callback acts on it where it can stop the C code cleanly (`act_pending` inside its
`try`), or the end of the block does.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

RETRY_S = 0.02  # how soon a deferred signal looks again; an import of the big extensions takes ~0.1-2 s

_pending: list[tuple[Callable, int]] = []
_held = threading.local()  # .depth: nesting of `held()` in this thread (handlers run in the main thread)


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _holding() -> bool:
    return getattr(_held, "depth", 0) > 0


def _retry(signum, frame) -> None:
    if not _pending or _holding():  # a held block acts on it
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
        if _holding():
            _pending.append((act, signum))
            return
        if _importing(frame):
            _pending.append((act, signum))
            signal.signal(signal.SIGALRM, _retry)
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
            return
        act(signum, frame)

    return handler


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Around a call into C code that calls back into Python: a signal inside waits for `act_pending` (in a
    callback's `try`) or for the block's end, where it is acted on (its exception raised)."""
    depth = getattr(_held, "depth", 0)
    _held.depth = depth + 1
    try:
        yield
    finally:
        _held.depth = depth
        if depth == 0:
            act_pending()


def act_pending() -> None:
    """Act on a signal that is waiting (raise its exception here), in the main thread (where handlers run; another
    thread's callbacks leave it to the main thread) and outside imports (there the retry timer acts on it)."""
    if not _pending or threading.current_thread() is not threading.main_thread():
        return
    if _importing(sys._getframe(1)):
        signal.signal(signal.SIGALRM, _retry)
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    signal.setitimer(signal.ITIMER_REAL, 0)
    act, signum = _pending.pop()
    _pending.clear()
    act(signum, sys._getframe(1))


def take_pending() -> int | None:
    """The signal still waiting for an import to return (the timer cancelled), if any: for a caller that
    finishes before the timer fires."""
    if not _pending:
        return None
    signal.setitimer(signal.ITIMER_REAL, 0)
    signum = _pending[-1][1]
    _pending.clear()
    return signum
