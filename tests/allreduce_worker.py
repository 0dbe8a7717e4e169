"""One rank of the one-shot all-reduce kernel (codegen/kernels/allreduce.py) across real processes, interpreted,
for tests/kernels/test_kernels_allreduce.py:

    python allreduce_worker.py DIR

Under torchrun's environment (`dist_launch.launch`; gloo only for the barriers between scenarios). Each
scenario gives every rank a fresh symmetric region: a zeroed file DIR/<scenario>.<rank> that every rank maps
MAP_SHARED (POSIX shared memory standing in for peer memory), the peer table holding each region's address in
THIS process. A rank all-reduces seeded values (every rank's inputs are known to all, so each checks its result
against `ops.collective._rank_sum`, the IR's rank-order reference) and prints one JSON line: per scenario, the
bit-for-bit equality of each all-reduce and the status error, if any.

Scenarios (`SCENARIOS`): `exact` (bf16 and fp32, 2-3 tiles, a program looping over tiles, four all-reduces so
both slots are reused); broken kernels, each a source edit as `kernel_check.install_broken_kernel` makes:
`reversed` (the ranks added in reverse order), `no_wait` (no wait for the peers' flags; the last rank starts late,
so the others read its slot before it wrote it), `one_slot` (slot 0 for every all-reduce; the last rank reads
slowly, so a fast rank overwrites its slot first) beside `slow` (the same timing, the real kernel); and `late`
(the last rank never arrives: the others end with the status error after a few polls).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time
import zlib
from pathlib import Path

LAST_START_S = 1.5  # `no_wait`: how long the last rank waits before its all-reduce
SLOW_POLL_S = 0.4  # `slow` / `one_slot`: the last rank's pause after each flag poll
SLOW_POLL_DTYPES_S = 0.2  # `dtypes`: the same (the fast ranks' next all-reduce takes ~0.1 s interpreted)
LATE_SPIN = 64  # `late`: polls before a peer counts as late (~30 ms interpreted)
MAX_BYTES = 64 << 10

# name: (source edits of oneshot_tiles, the all-reduces as (elements, dtype), grid_max, timing)
SCENARIOS = {
    "exact": ((), ((5000, "bf16"), (3000, "fp32"), (5000, "bf16"), (2100, "fp32")), 2, None),
    "reversed": ((("(tl.load(peers_ptr) + slot)", "(tl.load(peers_ptr + GROUP - 1) + slot)"),
                  ("(tl.load(peers_ptr + s) + slot)", "(tl.load(peers_ptr + GROUP - 1 - s) + slot)")),
                 ((5000, "bf16"),), 64, None),
    "no_wait": (((" < v) & (polls < SPIN)", " < 0) & (polls < SPIN)"),), ((3000, "bf16"),), 64, "last starts late"),
    "slow": ((), ((1000, "bf16"), (1000, "bf16")), 64, "last polls slowly"),
    "one_slot": ((("slot = SLOTS_AT + (v % 2) * SLOT_BYTES", "slot = SLOTS_AT + 0 * SLOT_BYTES"),), ((1000, "bf16"), (1000, "bf16")), 64,
                 "last polls slowly"),
    "late": ((), ((3000, "fp32"),), 64, "last never arrives"),
    # element types mixed on one region, the last rank reading slowly: its fp32 all-reduce's tiles must not share
    # bytes with the next bf16 all-reduce's tiles of the same slot (tiles of fixed bytes, `peers.TILE_BYTES`);
    # `dtypes_element_tiles` gives every call 2048-element tiles (the layout before them): the fast ranks' bf16 tile
    # 1 overwrites half of the fp32 tile the slow rank is still to read (one program: it publishes every tile before
    # it waits, as concurrent programs on a GPU would)
    "dtypes": ((), ((4096, "bf16"), (2048, "fp32"), (4096, "bf16")), 1, "last polls slowly"),
    "dtypes_element_tiles": ((), ((4096, "bf16"), (2048, "fp32"), (4096, "bf16")), 1, "last polls slowly"),
    # the rows collectives (`allreduce.rows_kernel`; the gathered value's elements, each rank's part 1/3 of it,
    # not tile-aligned), between all-reduces on the same region so both slots of every tile are reused by all
    "rows": ((), ((5100, "bf16", "reduce_scatter_rows"), (5100, "bf16", "all_gather_rows"), (3000, "fp32"),
                  (6300, "fp32", "reduce_scatter_rows"), (1500, "bf16", "all_gather_rows"),
                  (5100, "bf16", "reduce_scatter_rows")), 2, None),
    "rs_reversed": ((("(tl.load(peers_ptr) + slot)", "(tl.load(peers_ptr + GROUP - 1) + slot)"),
                     ("(tl.load(peers_ptr + s) + slot)", "(tl.load(peers_ptr + GROUP - 1 - s) + slot)")),
                    ((5100, "bf16", "reduce_scatter_rows"),), 64, None),
    "ag_rank_order": ((("owner = idx // PART", "owner = GROUP - 1 - idx // PART"),),
                      ((5100, "bf16", "all_gather_rows"),), 64, None),
    "rs_no_wait": (((" < v) & (polls < SPIN)", " < 0) & (polls < SPIN)"),), ((6300, "bf16", "reduce_scatter_rows"),),
                   64, "last starts late"),
}
ROWS = ("all_gather_rows", "reduce_scatter_rows")


def inputs(rank: int, scenario: str, k: int, numel: int, dtype):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{scenario}/{k}/{rank}".encode()))
    # magnitudes over a wide range, so the order of the additions changes bf16 / fp32 roundings
    return (torch.randn(numel, generator=g) * torch.exp2(torch.randint(-6, 7, (numel,), generator=g))).to(dtype)


def kernel_variant(edits):
    """`oneshot_kernel` and `rows_kernel` with the source edits applied to the bodies they call, `oneshot_tiles`,
    its halves `publish_tiles` / `gather_tiles` and theirs, `publish_range` / `gather_range`, and `rows_tiles` /
    `scatter_tiles` (what the standalone
    kernels and the folded phases run; each `old` must
    occur, and every occurrence is edited: the slot both halves compute alike)."""
    from v4compile.codegen.kernels import allreduce

    if not edits:
        return allreduce.oneshot_kernel, allreduce.rows_kernel
    namespace = edited(edits)
    return namespace["oneshot_kernel"], namespace["rows_kernel"]


def edited(edits) -> dict:
    """The namespace of `kernel_variant`'s edited bodies and kernels (its `rows_tiles`: what a kernel that folds
    the rows collectives in calls, `moe_router.moe_fused_kernel`)."""
    import inspect

    from v4compile.codegen.kernels import allreduce

    src = "\n\n".join(inspect.getsource(f.fn) for f in (allreduce.publish_range, allreduce.publish_tiles,
                                                        allreduce.gather_range, allreduce.gather_tiles,
                                                        allreduce.oneshot_tiles, allreduce.scatter_tiles,
                                                        allreduce.rows_tiles))
    for old, new in edits:
        assert src.count(old) >= 1, f"{old!r} does not occur"
        src = src.replace(old, new)
    for k in (allreduce.oneshot_kernel, allreduce.rows_kernel):  # calling the edited bodies
        src += "\n\n" + inspect.getsource(k.fn)
    path = Path(os.environ["V4_TEST_DIR"]) / f"broken_{abs(hash(src)) % 10**8}.py"
    path.write_text(src)
    namespace = dict(vars(allreduce))
    exec(compile(src, str(path), "exec"), namespace)
    return namespace


def slow_polls(pause: float = SLOW_POLL_S):
    """Pause after every interpreted atomic load (the flag polls) of this process."""
    from triton.runtime import interpreter as it

    orig = it.InterpreterBuilder.create_atomic_load

    def slow(self, *a, **k):
        out = orig(self, *a, **k)
        time.sleep(pause)
        return out

    it.InterpreterBuilder.create_atomic_load = slow
    return lambda: setattr(it.InterpreterBuilder, "create_atomic_load", orig)


def scenario_run(rank: int, world: int, name: str, d: Path) -> dict:
    import torch
    import torch.distributed as dist

    from v4compile.codegen.kernels import TensorArg, allreduce, run_calls, torch_dtype
    from v4compile.ir.registry import get_op
    from v4compile.ops.collective import _rank_sum

    edits, values, grid_max, timing = SCENARIOS[name]
    region = allreduce.Region(world, MAX_BYTES)
    with open(d / f"{name}.{rank}", "wb") as f:
        f.truncate(region.nbytes)
    dist.barrier()
    maps = []
    for r in range(world):
        with open(d / f"{name}.{r}", "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), region.nbytes, mmap.MAP_SHARED))
    peers = torch.tensor([ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps] + [rank], dtype=torch.int64)
    fns = kernel_variant(edits)
    last = rank == world - 1
    undo = (slow_polls(SLOW_POLL_DTYPES_S if name.startswith("dtypes") else SLOW_POLL_S)
            if timing == "last polls slowly" and last else None)
    spin = LATE_SPIN if timing == "last never arrives" else allreduce.SPIN
    dist.barrier()
    t0 = time.monotonic()
    equal, error = [], None
    try:
        if timing == "last starts late" and last:
            time.sleep(LAST_START_S)
        for k, (numel, dt, *op) in enumerate(values):
            if timing == "last never arrives" and last:
                break
            op = op[0] if op else "all_reduce"
            # an all-gather's operand is a rank's part of the value; the others' the whole value
            xs = [inputs(r, name, k, numel // world if op == "all_gather_rows" else numel, torch_dtype(dt))
                  for r in range(world)]
            if op in ROWS:
                ref = get_op(op).spmd_ref([[x.view(world if op == "reduce_scatter_rows" else 1, -1)] for x in xs],
                                          {"group": world})[rank][0].reshape(-1)
                rev = get_op(op).spmd_ref([[x.view(world if op == "reduce_scatter_rows" else 1, -1)]
                                           for x in reversed(xs)], {"group": world})[rank][0].reshape(-1)
                y = torch.full_like(ref, float("nan"))
                call = allreduce.rows_call(op, TensorArg.of(xs[rank]), TensorArg.of(y), world, region, spin=spin,
                                           grid_max=grid_max)
                call.fn = fns[1]
            else:
                y = torch.full_like(xs[rank], float("nan"))
                call = allreduce.oneshot_call(TensorArg.of(xs[rank]), TensorArg.of(y), world, region, spin=spin,
                                              grid_max=grid_max)
                call.fn = fns[0]
                if name == "dtypes_element_tiles":  # 2048 elements a tile whatever the type: one fp32 tile of 8 KB
                    call.constexprs["TILE"] = 2048
                    call.constexprs["GRID"] = min(-(-numel // 2048), grid_max)
                    call.grid = (call.constexprs["GRID"], 1, 1)
            run_calls([call], {"x": xs[rank], "peers": peers}, {"y": y})
            status = tuple(torch.frombuffer(maps[rank], dtype=torch.int64, count=2,
                                            offset=0).tolist())
            error = allreduce.late_peer_error(status, rank, world, spin)
            if error:
                break
            if op not in ROWS:
                ref = _rank_sum([[x] for x in xs], list(range(world)))
                rev = _rank_sum([[x] for x in xs], list(reversed(range(world))))
            equal.append([torch.equal(y, ref), torch.equal(rev, ref)])
    finally:
        if undo:
            undo()
    seconds = time.monotonic() - t0
    dist.barrier()
    del peers
    return {"equal": equal, "error": error, "seconds": seconds}


def main(d: Path) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["V4_TEST_DIR"] = str(d)
    import torch  # noqa: F401
    import torch.distributed as dist  # noqa: F401

    from v4compile.codegen.kernels import allreduce  # noqa: F401
    from dist_launch import print_ready, run_rank

    print_ready()
    out = {}

    def body(rank: int) -> None:
        world = dist.get_world_size()
        for name in SCENARIOS:
            out[name] = scenario_run(rank, world, name, d)
        print(json.dumps(out), flush=True)

    return run_rank(body)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
