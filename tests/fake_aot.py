"""A stand-in for `codegen.aot.compile_calls` that compiles nothing: a placeholder binary and a sidecar per
(call, target), laid out as the real stage lays them out. For tests of what the compile driver writes, and for
benchmarks whose subject is not the kernels (`bench/bench_weights.py`)."""

from __future__ import annotations

import hashlib
import json


def placeholder_compile_calls(seen: list[tuple[str, str]] | None = None, loadable: bool = False):
    """`compile_calls` writing placeholders; each (call name, target) is appended to `seen` when given.
    `loadable`: sidecars a loader accepts (the target's warp size, the call's parameters), so the artifact
    loads on the host device and, with a fake driver's table, on a GPU device (no binary is ever run)."""
    from v4compile.codegen import aot

    def compile_calls(calls, targets, out_dir, jobs=None):
        rows = []
        for c in calls:
            for t in targets:
                if seen is not None:
                    seen.append((c.name, t))
                d = out_dir / t
                d.mkdir(parents=True, exist_ok=True)
                binary = f"placeholder {c.name} {t}".encode()
                ext = aot.TARGETS[t].binary_ext
                (d / f"{c.name}.{ext}").write_bytes(binary)
                side = {"name": c.name, "symbol": c.kernel_name, "grid": list(c.grid), "target": t,
                        "binary_sha256": hashlib.sha256(binary).hexdigest(), "params": [], "shared_bytes": 0,
                        "block": [c.for_target(t)[0] * aot.TARGETS[t].warp_size, 1, 1],
                        "num_warps": c.for_target(t)[0]}
                if loadable:
                    side.update(warp_size=aot.TARGETS[t].warp_size,
                                params=[{"kind": k, "name": p, "type": ty, "value": n} for p, k, n, ty in c.pointers])
                (d / f"{c.name}.json").write_text(json.dumps(side, sort_keys=True))
                rows.append({"name": c.name, "target": t, "regs": 1, "spills": 0, "shared_bytes": 0,
                             "mma_instructions": 1, "occupancy": 1, "flops": c.flops, "bytes": c.bytes_moved,
                             "modeled_us": 1.0, "bandwidth_us": 0.5, "compile_s": 0.1, "cached": False,
                             "path": f"{t}/{c.name}.{ext}", "sidecar": f"{t}/{c.name}.json"})
        return rows
    return compile_calls
