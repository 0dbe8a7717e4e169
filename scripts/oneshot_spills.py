"""AOT-compile every V4-Pro kernel that runs the one-shot protocol (codegen/kernels/allreduce.py: the one-shot
all-reduce, the rows all-gather / reduce-scatter, the MoE launches with a folded phase) for gfx950 and sm_90a,
from V4-Pro's first 7 layers as `compile --tp 8 --ep 8` and `--dp 8 --ep 8` (`--decode-batch 8 --max-context
4096`) build them; print each binary's spills and exit 1 if any spills.

    python scripts/oneshot_spills.py
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile

from v4compile.codegen import aot
from v4compile.codegen.program_kernels import program_kernels
from v4compile.config import preset
from v4compile.passes import GPU_PIPELINE, PassManager
from v4compile.program.build import build_program
from v4compile.targets import GPU_TARGETS
from v4compile.trace import TraceOptions, trace


def main() -> int:
    full = preset("v4-pro")
    cfg = dataclasses.replace(full, n_layers=7, layer_kinds=full.layer_kinds[:7], n_mtp_layers=0).validate()
    m = trace(cfg, TraceOptions(batch=2, chunk=16, decode_batch=8, capacity=4096, dtype="bf16", numerics="official",
                                weights="released"))
    calls = {}
    for layout in ("partition{tp=8,ep=8}", "partition{tp=1,ep=8,dp=8}"):
        pk = program_kernels(build_program(PassManager([layout, *GPU_PIPELINE]).run(m).module))
        calls.update({c.name: c for c in pk.unique.values() if any(p[1] == "peers" for p in c.pointers)})
    rows = aot.compile_calls(list(calls.values()), list(GPU_TARGETS), tempfile.mkdtemp(), jobs=2)
    for r in rows:
        print(f"{r['target']:7s} {r['name']}: {r['spills']} spills")
    return 1 if any(r["spills"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
