"""v4compile: an ahead-of-time compiler for the DeepSeek-V4 model family.

The names below are loaded on first use, so that importing a part of the package (the IR, say) does not
load the reference model, torch or the runtime. This module is the top layer's (ARCHITECTURE.md): it names
the runtime's `load`, so no module of the package imports it (the version is `version.py`'s).
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_at_start(signum, frame):  # noqa: ARG001
    sys.stderr.write(f"interrupted by signal {signal.Signals(signum).name}\n")
    raise SystemExit(128 + signum)  # SystemExit: no traceback, wherever the start-up was


# Run as the command line (`python -m v4compile`: argv[0] is "-m" while the package is imported; or the
# `v4compile` script): a signal during the imports before `cli.main` installs its own handlers ends the
# process quietly. A library import leaves the handlers alone.
if sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == "v4compile":
    for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_s, _interrupted_at_start)

from typing import Any  # noqa: E402

from .version import __version__  # noqa: E402

__all__ = ["ReferenceModel", "V4Config", "preset", "V4Error", "load", "__version__"]


def __getattr__(name: str) -> Any:
    # Import statements, not importlib with a table of names: the layer test reads them (this package's
    # names reach every layer, the runtime's `load` included, so the package module is the top layer's).
    if name == "ReferenceModel":
        from .model import ReferenceModel as value
    elif name in ("V4Config", "preset"):
        from . import config
        value = getattr(config, name)
    elif name == "V4Error":
        from .errors import V4Error as value
    elif name == "load":  # load(artifact_dir, device="auto") -> runtime.Session
        from .runtime import load as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return value
