"""v4compile: an ahead-of-time compiler for the DeepSeek-V4 model family.

The names below are loaded on first use, so that importing a part of the package (the IR, say) does not
load the reference model or torch.
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

import importlib  # noqa: E402
from typing import Any  # noqa: E402

__version__ = "0.1.0"

_LAZY = {"ReferenceModel": ".model", "V4Config": ".config", "preset": ".config", "V4Error": ".errors",
         "load": ".runtime"}  # load(artifact_dir, device="auto") -> runtime.Session

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
