"""v4compile.codegen: the Triton kernel families (`kernels/`), their ahead-of-time compilation for the GPU
targets (`aot`, `gpu_target`), a launch's kernel calls (`program_kernels.calls_of`), the roofline model of
a step (`roofline`) and the ONNX export of the cpu target (`onnx_export`, lowerings by family in `onnx/`).

Both backends are wired by kernel family, the family an op names with `defop(kernel=...)`."""

from __future__ import annotations

import importlib
from types import ModuleType


def family_module(backend: str, family: str) -> ModuleType | None:
    """`v4compile.codegen.<backend>.<family>` (backend `kernels` or `onnx`), or None when the family has no
    module there (an import error inside the module is raised, not taken for a missing family)."""
    name = f"{__name__}.{backend}.{family}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        return None
