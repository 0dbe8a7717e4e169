"""v4compile: an ahead-of-time compiler for the DeepSeek-V4 model family."""

__version__ = "0.1.0"

from .config import V4Config, preset  # noqa: E402
from .errors import V4Error  # noqa: E402
from .model import ReferenceModel  # noqa: E402



def load(path, device: str = "auto", **kw):
    """Load a compiled artifact directory: a `v4compile.runtime.Session` (see runtime/session.py)."""
    from .runtime import load as _load

    return _load(path, device, **kw)


__all__ = ["ReferenceModel", "V4Config", "V4Error", "load", "preset", "__version__"]
