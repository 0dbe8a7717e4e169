"""The table of registered ops by name: `defop` (registry.py) fills it as op sets load, `get_op` reads it.

It sits below the IR's core so that `Op` can name its operands and results by signature without importing
the registry, which builds on the core (no loop of imports: tests/cli/test_layers.py).
"""

from __future__ import annotations

from typing import Any

from ..errors import IRError

REGISTRY: dict[str, Any] = {}  # name -> registry.OpDef


def get_op(name: str, where: str = "") -> Any:
    """A registered op (`registry.OpDef`). Op sets are registered by loading them (`v4compile.ops.load(...)`);
    the registry imports none itself."""
    if name not in REGISTRY:
        raise IRError(f"unknown op '{name}'", where=where or None,
                      expected="an op of a loaded op set" if REGISTRY else "an op (no op set is loaded)")
    return REGISTRY[name]
