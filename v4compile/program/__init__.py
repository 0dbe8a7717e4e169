"""The program: the launch-level form of a compiled function that codegen, every runtime and the CPU
executor run. `core` (data), `build` (from a memory-planned module), `text` (print / parse), `verify`,
`execute` (the oracle: each launch's op reference on raw CPU bytes)."""

from .core import Arg, Buffer, FunctionProgram, Launch, Program

__all__ = ["Arg", "Buffer", "FunctionProgram", "Launch", "Program"]
