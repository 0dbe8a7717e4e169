"""v4compile: an ahead-of-time compiler for the DeepSeek-V4 model family.

The names below are loaded on first use, so that importing a part of the package (the IR, say) does not
load the reference model or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"ReferenceModel": ".model", "V4Config": ".config", "preset": ".config", "V4Error": ".errors",
         "load": ".runtime"}  # load(artifact_dir, device="auto") -> runtime.Session

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
