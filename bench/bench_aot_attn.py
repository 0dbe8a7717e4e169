"""AOT-compile one representative specialisation per (op, shape, variant) of the attention-side kernel
families (mhc, qkv_norm_rope, compress, rope_compress, csr, indexer, sparse_attention, pool_write) of a preset's final
IR and print regs / spills / MMA count / shared memory per target. A measurement, not a test.

Per-layer row offsets (layer_row, layer_offset, win_base, comp_base) are constexprs, so V4-Pro decode
has ~250 specialisations of these families that differ only in such constants; the representatives
have the same code and register allocation.

    python bench/bench_aot_attn.py --preset v4-pro --decode-batch 4 --capacity 65536 -j 2
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_aot_kernels as B  # noqa: E402
from v4compile.codegen import aot  # noqa: E402

FAMILIES = {"mhc", "qkv_norm_rope", "compress", "rope_compress", "csr", "indexer", "sparse_attention", "pool_write"}
VARIANT_KEYS = ("OVERLAP", "ROUND", "NPLANES", "POST", "MIX", "QI_FP4", "FMT")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-pro")
    p.add_argument("--funcs", default="decode")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--capacity", type=int, default=65536)
    p.add_argument("--targets", default="gfx950,sm_90a")
    p.add_argument("--only", default="", help="comma-separated kernel name fragments")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--json", help="write the report rows here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from v4compile import frontend
    from v4compile.cli.pipeline import pipeline_of
    from v4compile.passes import PassManager, PipelineOptions
    from v4compile.trace import TraceOptions
    fe = frontend.load(None, a.preset, "none", TraceOptions(batch=1, chunk=a.chunk, decode_batch=a.decode_batch,
                                                            capacity=a.capacity, numerics="official", dtype="bf16"))
    module = PassManager(pipeline_of(argparse.Namespace(passes=None)), PipelineOptions()).run(fe.module).module
    calls, _ = B.calls_of(module, a.funcs.split(","), FAMILIES)
    pick, seen = [], set()
    for _, c in calls:
        key = (c.name.rsplit("_", 1)[0], tuple(sorted(k for k, v in c.constexprs.items() if v is None)),
               tuple(str(c.constexprs.get(k)) for k in VARIANT_KEYS))
        if key not in seen and (not a.only or any(o in c.name for o in a.only.split(","))):
            seen.add(key)
            pick.append(c)
    print(f"{len(calls)} specialisations, {len(pick)} representatives")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        rows = aot.compile_calls(pick, a.targets.split(","), d, a.jobs)
    print(f"AOT {time.perf_counter() - t0:.0f} s wall")
    for r in rows:
        print(f"{r['name'][:62]:62s} {r['target']:7s} regs={r['regs']:4d} spills={r['spills']:5d} "
              f"mma={r['mma_instructions']:4d} smem={r['shared_bytes']:6d} occ={r['occupancy']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
