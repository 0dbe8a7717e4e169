"""The interface between the session (sequences, slots, blocks, batching, sampling) and a device.

A backend owns the device buffers of one loaded artifact (weights, KV pool planes, per-slot state) and
runs one compiled function at a time on step inputs the session builds:

    ids [B, T] i64, pos [B, T] i64 (-1 = padding lane), block_table [B, blocks_per_seq] i32 (-1 = none),
    slot [B] i32 (-1 = padding lane)

It returns the logits `[B, V]` (float32, host) and applies the step's writes to its pool / state buffers
before returning. The ONNX Runtime backend (`cpu_backend.py`) is one; the C runtime (devices host / hip /
cuda) plugs in behind the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class FunctionInfo:
    name: str
    kind: str  # decode | prefill | verify | draft (speculative artifacts: `runtime/speculative.py`)
    batch: int
    tokens: int


class Backend(Protocol):
    device: str

    def functions(self) -> dict[str, FunctionInfo]:
        """The compiled functions (one per bucket)."""
        ...

    def run(self, fname: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Run function `fname`; update the pool / state in place; return logits [B, V] (float32)."""
        ...

    def run_outputs(self, fname: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`run`, returning every output by name (float32): the logits, and a speculative artifact's final
        hidden `streams` (the MTP draft functions take them as the step input `hidden` [B, T, n, D])."""
        ...

    def close(self) -> None:
        ...
