"""Target facts, in one place: the artifact's targets and their formats, each GPU target's figures (Triton
target, binary kind, the roofline constants), which target's binaries a runtime device launches, the
driver library it opens, and the cache root.

Read by the artifact format (`artifact.py`, `manifest.py`), the AOT stage and the roofline model
(`codegen/aot.py`, `codegen/roofline.py`) and the runtime (`runtime/`); it imports nothing of the project.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TargetSpec:
    name: str
    backend: str          # GPUTarget backend
    arch: Any             # GPUTarget arch ("gfx950" or the int 90)
    warp_size: int
    binary_ext: str
    hbm_bytes_s: float    # peak HBM bandwidth
    fp8_flops_s: float    # dense fp8 MMA peak
    bf16_flops_s: float   # dense bf16 MMA peak
    launch_s: float       # per-launch latency under graph replay (kernel-to-kernel gap, stated assumption)
    lds_bytes: int        # shared memory / LDS per CU / SM available to CTAs
    units: int            # CUs / SMs


TARGETS: dict[str, TargetSpec] = {
    # MI355X: 8 TB/s HBM3E, ~2.5 PFLOP/s dense fp8 (OCP), ~1.25 PFLOP/s dense bf16, 256 CUs, 160 KB LDS / CU.
    # Graph-replay launch gap on MI300-class parts measures ~2-4 us; we model 3 us.
    "gfx950": TargetSpec("gfx950", "hip", "gfx950", 64, "hsaco", 8.0e12, 2.5e15, 1.25e15, 3.0e-6, 160 * 1024, 256),
    # H200: 4.8 TB/s HBM3E, 1979 TFLOP/s dense fp8, 989 TFLOP/s dense bf16, 132 SMs, 227 KB smem / SM.
    # CUDA graph kernel-node gap ~1.5-2 us; we model 2 us.
    "sm_90a": TargetSpec("sm_90a", "cuda", 90, 32, "cubin", 4.8e12, 1.979e15, 0.989e15, 2.0e-6, 227 * 1024, 132),
}

# The artifact's targets and the format each is written in.
TARGET_FORMATS = {"cpu": "onnx", **{t: "triton-aot" for t in TARGETS}}
GPU_TARGETS = tuple(TARGETS)  # gfx950, sm_90a

# The artifact target whose program a runtime device runs and whose binaries it launches. `host` runs the
# GPU program on host memory with the kernels interpreted (every GPU target's program is the same).
DEVICE_TARGET = {"cuda": "sm_90a", "hip": "gfx950", "host": "gfx950"}
DRIVER_LIB = {"cuda": "libcuda.so.1", "hip": "libamdhip64.so"}  # the C drivers' defaults (runtime/c/drv_*.c)


def cache_root() -> Path:
    """`$V4COMPILE_CACHE`, default ~/.cache/v4compile: AOT kernels (`aot/`), the C runtime (`runtime/`)."""
    return Path(os.environ.get("V4COMPILE_CACHE") or Path.home() / ".cache" / "v4compile")
