"""Compiler passes (installed as `v4compile.passes`).

One pass per file, each a `Pass` subclass registered by name, whose docstring states what it requires
and guarantees, and which declares where it may stand in a pipeline (`after`, `first`, `final`: the
`PassManager` refuses a pipeline that breaks one). The default pipeline is a list of names in `pipeline.py`; dumping, verification,
timing and numerics checks are instruments of the `PassManager`, never inside passes.
"""

from .base import PASSES, Pass, PassResult, get_pass, parse_pass_spec, register
from .manager import PassManager, PipelineOptions
from .pipeline import CPU_PIPELINE, DEFAULT_PIPELINE, GPU_PIPELINE, PIPELINES, PROGRAM_PASSES

__all__ = ["PASSES", "Pass", "PassResult", "get_pass", "parse_pass_spec", "register", "PassManager",
           "PipelineOptions", "DEFAULT_PIPELINE", "GPU_PIPELINE", "CPU_PIPELINE", "PIPELINES",
           "PROGRAM_PASSES"]
