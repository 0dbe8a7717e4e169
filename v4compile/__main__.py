import signal
import sys

from .signals import outside_imports, take_pending

_early: list[int] = []  # signals before `main` installs its handlers (its imports take a second or two)


def _on_early_signal(signum, frame) -> None:
    _early.append(signum)
    raise KeyboardInterrupt


for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_s) is not signal.SIG_IGN:
        signal.signal(_s, outside_imports(_on_early_signal))

try:  # a signal here is no traceback either: also when it surfaces as an extension's import error
    from .cli import RECEIVED, main
    _late = take_pending()  # the imports returned before the deferred signal's timer fired
    if _late is not None:
        _early.append(_late)
        raise KeyboardInterrupt
except BaseException:
    if not _early:
        raise
    sys.stderr.write("interrupted\n" if _early[-1] == signal.SIGINT
                     else f"interrupted by signal {signal.Signals(_early[-1]).name}\n")
    sys.exit(128 + _early[-1])

RECEIVED.extend(_early)
sys.exit(main())
