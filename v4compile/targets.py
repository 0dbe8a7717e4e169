"""Target facts, in one place: the artifact's targets and their formats, each GPU target's figures (Triton
target, binary kind, the roofline constants, the device's memory and scale-up link, its kernels' relative
AOT compile cost), which target's binaries a runtime device launches, the driver library it opens, and the
cache root.

Read by the artifact format (`artifact.py`, `manifest.py`), the AOT stage and the roofline model
(`codegen/aot.py`, `codegen/roofline.py`), the parallel model (`codegen/parallel_model.py`), the command
line (`cli/`) and the runtime (`runtime/`); it imports nothing of the project. A list of the GPU targets is
`GPU_TARGETS` (`tests/core/test_one_home.py` finds a second one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Link:
    """The device a target's binaries run on, as the parallel model sees it (codegen/parallel_model.py)."""

    device: str
    memory_bytes: float  # HBM per device
    bytes_s: float  # per-GPU scale-up bandwidth, one direction
    allreduce_latency_s: float  # fixed cost of one small all-reduce inside a captured graph (assumption)
    source: str
    # The one-shot all-reduce over peer memory (codegen/kernels/allreduce.py) beside the other kernel calls: its
    # own time besides its launch, `oneshot_latency_s + (group - 1) * bytes / bytes_s`; None: no measured figure
    # below the collective library's, so it is modeled as the ring above
    oneshot_latency_s: float | None = None
    oneshot_source: str = ""

    def oneshot_s(self, group: int, nbytes: float) -> float | None:
        """The one-shot all-reduce's own time over `group` ranks of `nbytes` (the comment above: the fixed cost +
        what a rank pulls from its group - 1 peers); None where the link has no measured one-shot figure."""
        if self.oneshot_latency_s is None:
            return None
        return self.oneshot_latency_s + (group - 1) * nbytes / self.bytes_s


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
    launch_s: float       # per-launch latency of a graph node (kernel-to-kernel gap under graph replay)
    launch_pdl_s: float | None  # the same with programmatic dependent launch; None: the target has none
    lds_bytes: int        # shared memory / LDS per CU / SM available to CTAs
    units: int            # CUs / SMs
    llc_bytes: int        # the last cache level in front of HBM (every CU's / SM's misses pass through it)
    link: Link            # the device's memory and scale-up link
    aot_cost: float       # a kernel's AOT compile time relative to gfx950's (codegen/aot.py orders jobs by it)

    @property
    def pdl(self) -> bool:
        """Whether kernels launch with programmatic stream serialization (codegen/kernels/pdl.py)."""
        return self.launch_pdl_s is not None

    def launch_latency(self, kind: str) -> float:
        """Seconds per launch of one kind: "graph" (a graph node) or "graph_pdl" (a graph node with PDL)."""
        if kind == "graph_pdl" and self.launch_pdl_s is not None:
            return self.launch_pdl_s
        if kind == "graph":
            return self.launch_s
        raise ValueError(f"{self.name} has no launch kind {kind!r}")


# Per-launch latency (launch_s, launch_pdl_s): the gap a kernel boundary adds to a step replayed as a graph.
# * sm_90a graph node, 1.3 us: Hazy Research, "Look Ma, No Bubbles!" (2025-05-27), measured on an H100 with CUDA
#   graphs: ~1.3 us of launch cost per kernel during which no useful work is done (Hopper, as the H200).
# * sm_90a graph node with PDL, 0.35 us: msaroufim/megakernels-vs-cuda-graphs (llama/docs/RESULTS.md), Llama-1B
#   batch-1 decode on an H200: CUDA graphs + PDL 794.74 us per step vs the Hazy megakernel 759.83 us; the 34.9 us
#   difference spread over the ~100 kernel boundaries of a Llama-1B forward (Hazy's count) is ~0.35 us each
#   (an upper bound: it also holds every other difference of the two arms; on the H100 the same study gives
#   6.7 us, ~0.07 us each).
# * gfx950 graph node, 3.9 us: ROCm/rocm-systems#10834, HIP graph replay of 941 serial tiny kernels, 3.865 us per
#   node (gfx1100; RDNA3). No public per-node figure exists for MI300X / MI355X (shared/notes/anchor-engines.md),
#   so the one HIP measurement stands in. HIP has no programmatic dependent launch: no PDL figure.
# Last-level cache (llc_bytes), what a launch's re-reads can hit instead of HBM (codegen/roofline.py, `hbm_bytes`):
# * gfx950, 256 MB: the MI355X's AMD Infinity Cache (AMD CDNA 4 architecture whitepaper, 2025), a memory-side cache
#   every XCD's L2 misses go through (the 4 MB L2 per XCD is private to its XCD, so it is not the one counted).
# * sm_90a, 50 MB: the L2 of the H100 SXM5 / H200 (NVIDIA H100 Tensor Core GPU architecture whitepaper; the H200 is
#   the same GH100 with HBM3E), shared by every SM.
# Links: the all-reduce latency, NCCL / RCCL all-reduce of a few hundred KB inside one 8-GPU node, is ~5-15 us;
# we model 10 us.
# One-shot all-reduce over peer memory (vLLM's custom all-reduce, ours in codegen/kernels/allreduce.py):
# * gfx950: vLLM PR #39080 measured 6.3-7.0 us a call at 24-192 KB on 8x MI355X, launch included. Of the 6.3 us
#   at 24 KB, the graph node (3.9 us, counted with the kernel calls) and the 7 peers' 24 KB at 537.6 GB/s (0.3 us)
#   leave 2.1 us of fixed cost. The model is conservative above 24 KB: at 192 KB it gives 8.6 us (measured 7.0).
# * sm_90a: no measured one-shot figure below NCCL's (sglang PR #2904: a custom all-reduce ~11 us at ~112 KB on
#   8x H100): modeled as the ring.
# A group of up to ONESHOT_MAX_GROUP ranks (one node: peer memory reaches no further) and values under
# ONESHOT_MAX_BYTES run one-shot; the rest on the collective library. 256 KB: where vLLM's custom all-reduce
# (csrc/custom_all_reduce.cuh) leaves its one-stage kernel for two stages at 8 ranks, as a rank's (n - 1) x bytes
# pulled then cost more than a ring's 2 (n - 1) / n x bytes (the model above: 7 x 256 KB at 537.6 GB/s is 3.4 us).
ONESHOT_MAX_GROUP = 8
ONESHOT_MAX_BYTES = 256 << 10


def oneshot_allreduce(group: int, nbytes: int) -> bool:
    """Whether an all-reduce of `nbytes` over `group` ranks runs one-shot (passes/oneshot_allreduce.py); for the
    rows all-gather / reduce-scatter `nbytes` is a rank's part, as for the all-reduce what a rank pulls from each
    peer."""
    return 1 < group <= ONESHOT_MAX_GROUP and 0 < nbytes < ONESHOT_MAX_BYTES
# AOT compile cost: sm_90a costs more per kernel than gfx950 (ptxas): measured ~1.5x on V4-Pro with nvdisasm on
# its MMA kernels, ~1.4x without (codegen/aot.py reads their SASS itself).
TARGETS: dict[str, TargetSpec] = {
    # MI355X: 8 TB/s HBM3E, ~2.5 PFLOP/s dense fp8 (OCP), ~1.25 PFLOP/s dense bf16, 256 CUs, 160 KB LDS / CU.
    # AMD Instinct MI355X spec sheet: 288 GB HBM3E; 7 Infinity Fabric links, 1075 GB/s aggregate peer
    # bandwidth (both directions): 537.6 GB/s one way.
    "gfx950": TargetSpec("gfx950", "hip", "gfx950", 64, "hsaco", 8.0e12, 2.5e15, 1.25e15, 3.9e-6, None,
                         160 * 1024, 256, 256 << 20,
                         link=Link("MI355X", 288e9, 537.6e9, 10e-6,
                                   "AMD MI355X data sheet: 288 GB HBM3E, 1075 GB/s Infinity Fabric", 2.1e-6,
                                   "vLLM PR #39080: one-shot all-reduce 6.3-7.0 us at 24-192 KB on 8x MI355X"),
                         aot_cost=1.0),
    # H200: 4.8 TB/s HBM3E, 1979 TFLOP/s dense fp8, 989 TFLOP/s dense bf16, 132 SMs, 227 KB smem / SM.
    # NVIDIA H200 SXM spec sheet: 141 GB HBM3E; NVLink 4, 900 GB/s per GPU (both directions): 450 GB/s one way.
    "sm_90a": TargetSpec("sm_90a", "cuda", 90, 32, "cubin", 4.8e12, 1.979e15, 0.989e15, 1.3e-6, 0.35e-6,
                         227 * 1024, 132, 50 << 20,
                         link=Link("H200", 141e9, 450e9, 10e-6,
                                   "NVIDIA H200 data sheet: 141 GB HBM3E, 900 GB/s NVLink"),
                         aot_cost=1.5),
}

# Kernel schedules a target needs where a family's default spills registers there (issue 40): per family
# config, per target the `KernelCall.per_target` entry (warps, stages, scheduling-only constexprs); the
# families pick theirs by key (codegen/kernels/compress.py, out_proj.py), and `compile -o` fails on any spill.
# * compress.wide_row (rows of 512 channels or more): V4-Pro's HCA compressor took 168 registers and spilled
#   32 B on sm_90a with 4 warps; with 8 warps 160 registers, no spills (one program per sequence, so fewer CTAs
#   per SM cost nothing; gfx950 spills nothing with 4).
# * out_proj.prefill (the projection's prefill tiles, BM >= 64): on gfx950 wo_a's K loop pipelined 2 deep beside
#   its inverse-RoPE prologue took 256 VGPRs and spilled 93 at 8 warps in V4-Pro's 64-token chunk (4 warps: 458
#   VGPRs, 88 spilled); unpipelined, 246 and none. Pipelining only schedules: same tiles, sums and results.
# * out_proj.verify (the projection's tiles with BM >= 32: a verify step's 24 or 32 tokens, 8 sequences x 3 or 4
#   lanes, and the prefill tiles): on sm_90a V4-Pro's BM = 32 tile (--draft-tokens 3, 32 tokens) took 255
#   registers and spilled 104 B with 4 warps (24 tokens: 215, none); with 8 warps 127, none (122 at 24 tokens),
#   its loops still pipelined, 2 CTAs per SM either way (unpipelined at 4 warps instead: 252, none, at the cap).
#   Warps split the [BN, BM] tile among them, not K: every output's sum is the same sequence of MMA steps. The
#   BM = 64 tile has 8 already (gemm.py's rule); gfx950 spills nothing at BM = 32 with 4.
# * rope_compress.pair (a CSA layer's query prologue and two compressors in one decode launch,
#   codegen/kernels/rope_compress.py): on gfx950 its ~30 pointer arguments hold V4-Pro's kernel at the 106-SGPR
#   cap, and 12 scalar registers spilled (to VGPR lanes) with 4 warps, 2 with 8; with 16 warps 76 VGPRs, none.
#   Warps split each program's tiles among them (the q heads x channels, a compressor's slots x channels): the
#   same sums in the same order. sm_90a takes its parts' warps (8: compress.wide_row) and spills nothing.
# * allreduce.spin (the one-shot all-reduce's bound on a peer's wait, codegen/kernels/allreduce.py): 2^23 polls on
#   a GPU (a system-scope load of peer memory, ~1-2 us: ~8-16 s) where the interpreter's 2^16 (~0.45 ms a poll:
#   ~30 s) would give up after ~0.1 s. A bound on a wait: the arithmetic is the same.
KERNEL_SCHEDULES: dict[str, dict[str, dict[str, Any]]] = {
    "compress.wide_row": {"sm_90a": {"num_warps": 8}},
    "out_proj.prefill": {"gfx950": {"constexprs": {"A_STAGES": 1}}},
    "out_proj.verify": {"sm_90a": {"num_warps": 8}},
    "rope_compress.pair": {"gfx950": {"num_warps": 16}},
    "allreduce.spin": {"gfx950": {"constexprs": {"SPIN": 1 << 23}}, "sm_90a": {"constexprs": {"SPIN": 1 << 23}}},
}

# The artifact's targets and the format each is written in.
TARGET_FORMATS = {"cpu": "onnx", **{t: "triton-aot" for t in TARGETS}}
GPU_TARGETS = tuple(TARGETS)  # gfx950, sm_90a
GPU_TARGET_NAMES = ", ".join(GPU_TARGETS)  # for messages and help: "gfx950, sm_90a"

# The artifact target whose program a runtime device runs and whose binaries it launches. `host` runs the
# GPU program on host memory with the kernels interpreted (every GPU target's program is the same).
DEVICE_TARGET = {"cuda": "sm_90a", "hip": "gfx950", "host": "gfx950"}
DRIVER_LIB = {"cuda": "libcuda.so.1", "hip": "libamdhip64.so"}  # the C drivers' defaults (runtime/c/drv_*.c)


def cache_root() -> Path:
    """`$V4COMPILE_CACHE`, default ~/.cache/v4compile: AOT kernels (`aot/`), the C runtime (`runtime/`)."""
    return Path(os.environ.get("V4COMPILE_CACHE") or Path.home() / ".cache" / "v4compile")
