"""Load-and-run: `v4compile.load(artifact_dir, device=...)` -> a `Session` (installed as `v4compile.runtime`)."""

from .session import Session, load

__all__ = ["Session", "load"]
