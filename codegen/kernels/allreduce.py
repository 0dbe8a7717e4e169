"""One-shot all-reduce over symmetric peer memory (issue 34): the group's sum in RANK ORDER, in one launch.

Every rank of a group holds one SYMMETRIC REGION (the same size and layout on every rank, zeroed at load; see
`Region`): two data slots (`[2][slot_bytes]`), flags `int64 [group][tiles]` (flag [s][t]: the sequence number of
the last all-reduce for which rank s put tile t in its slot), per-tile sequence counters `int64 [tiles]` (read
and written by this rank only) and a status word. Each rank maps every peer's region into its own address space
(CUDA / HIP IPC handles; on the host device POSIX shared memory), and the call's `peers` operand is an int64
table `[group + 1]`: each rank's region base as mapped in THIS process, then this rank's index in the group (the
program is the same on every rank; only the table differs).

A program owns tiles t = pid, pid + GRID, ... (a persistent grid no larger than the SMs / CUs, so every
program is resident and no program waits on a peer's program that cannot be scheduled). For each tile it:
1. reads its counter c_t, and stores v = c_t + 1 back (only this program touches counter t, and every rank runs
   the same all-reduces in the same order, so v is the same on every rank);
2. copies tile t of x into its own region's slot v % 2;
3. sets flag [my rank][t] to v in every rank's region (a release store at system scope, after a barrier, so
   the copy is visible before the flag);
4. waits (acquire loads at system scope) until every flag [s][t] in its own region is >= v;
5. sums tile t of every rank's slot v % 2 in rank order, each partial sum rounded to the value's dtype (what
   the IR's reference, `ops/collective._rank_sum`, computes with torch's `total += x`), into y.
So the result is bit-identical to the reference (NCCL's ring adds in another order). Each program waits only
for the same tile on its peers: no barrier across the programs of a rank, which is also why the Triton
interpreter (programs one after another) runs it.

Why two slots suffice: rank r writes slot v % 2 of tile t again only in its all-reduce v + 2, after it finished
all-reduce v + 1 of tile t, which needed every peer's flag v + 1 for tile t; a peer sets that flag in its
all-reduce v + 1 kernel, which started after its all-reduce v kernel ended (stream order), that is after the
peer read rank r's slot v % 2 for the last time. So no peer still reads a slot when its owner overwrites it.
One slot would not do: a fast rank would overwrite its slot for v + 1 while a slow peer still reads it for v.

The wait is BOUNDED: after `spin` polls of one flag the program records the late peer in the status word
(1 + the peer's index, then the sequence number), writes no result, and ends; the runtime reads
the status after a step and raises one clear error (`late_peer_error`). A kernel never hangs.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from . import KernelCall, TensorArg, call_name, ptr

TILE = 2048  # elements of one tile (one program step; 4 KB of bf16)
GRID_MAX = 64  # programs at most: resident on every GPU we target (132 SMs on H100, 256 CUs on MI355X)
# Polls of one flag before a peer counts as late: ~30 s interpreted (~0.45 ms a poll on the host device), and on a
# GPU (a system-scope load of peer memory, ~1-2 us) ~8-16 s; a bound on a wait, no part of the arithmetic, so
# the GPU binaries take their own value (`KernelCall.per_target`)
SPIN = 1 << 16
GPU_SPIN = {"gfx950": 1 << 23, "sm_90a": 1 << 23}
MAX_BYTES = 8 << 20  # the largest all-reduce run one-shot (vLLM's custom all-reduce default max_size)
FLAG_BYTES = 8  # int64 flags, counters and status words (2^63 all-reduces: never wraps)


@dataclass(frozen=True)
class Region:
    """The symmetric region's layout (byte offsets), the same on every rank of a group of `group` ranks for
    all-reduces of up to `max_bytes` bytes."""
    group: int
    max_bytes: int

    @property
    def slot_bytes(self) -> int:
        return (self.max_bytes + 255) // 256 * 256

    @property
    def tiles(self) -> int:  # the most tiles a value can have (bf16, the smallest element, gives the most)
        return max(1, triton.cdiv(self.max_bytes // 2, TILE))

    @property
    def flags_at(self) -> int:
        return 2 * self.slot_bytes

    @property
    def counts_at(self) -> int:
        return self.flags_at + self.group * self.tiles * FLAG_BYTES

    @property
    def status_at(self) -> int:
        return self.counts_at + self.tiles * FLAG_BYTES

    @property
    def nbytes(self) -> int:
        return (self.status_at + 2 * FLAG_BYTES + 255) // 256 * 256


@triton.jit
def oneshot_kernel(x_ptr, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                   GRID: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr, TILES: tl.constexpr,
                   COUNTS_AT: tl.constexpr, STATUS_AT: tl.constexpr, SPIN: tl.constexpr):
    dty = x_ptr.dtype.element_ty
    rank = tl.load(peers_ptr + GROUP)
    me = tl.load(peers_ptr + rank)
    counts = (me + COUNTS_AT).to(tl.pointer_type(tl.int64))
    my_flags = (me + FLAGS_AT).to(tl.pointer_type(tl.int64))
    status = (me + STATUS_AT).to(tl.pointer_type(tl.int64))
    offs = tl.arange(0, TILE)
    late = tl.zeros((), tl.int64)
    for t in range(tl.program_id(0), tl.cdiv(NUMEL, TILE), GRID):
        if late == 0:
            v = tl.load(counts + t) + 1
            tl.store(counts + t, v)
            slot = (v % 2) * SLOT_BYTES
            idx = t * TILE + offs
            ok = idx < NUMEL
            tl.store((me + slot).to(tl.pointer_type(dty)) + idx, tl.load(x_ptr + idx, mask=ok), mask=ok)
            tl.debug_barrier()
            for s in tl.static_range(GROUP):
                peer_flags = (tl.load(peers_ptr + s) + FLAGS_AT).to(tl.pointer_type(tl.int64))
                tl.atomic_store(peer_flags + rank * TILES + t, v, sem="release", scope="sys")
            for s in tl.static_range(GROUP):
                polls = 0
                while (tl.atomic_load(my_flags + s * TILES + t, sem="acquire", scope="sys") < v) & (polls < SPIN):
                    polls += 1
                if (polls == SPIN) & (late == 0):
                    late = late * 0 + (s + 1)
            tl.debug_barrier()
            if late == 0:
                acc = tl.load((tl.load(peers_ptr) + slot).to(tl.pointer_type(dty)) + idx, mask=ok)
                for s in tl.static_range(1, GROUP):
                    part = tl.load((tl.load(peers_ptr + s) + slot).to(tl.pointer_type(dty)) + idx, mask=ok)
                    acc = (acc.to(tl.float32) + part.to(tl.float32)).to(dty)
                tl.store(y_ptr + idx, acc, mask=ok)
            else:
                tl.store(status + 1, v)
                tl.atomic_store(status, late, sem="release", scope="sys")


def oneshot_call(x: TensorArg, y: TensorArg, group: int, region: Region, names=("x", "y"), spin: int = SPIN,
                 grid_max: int = GRID_MAX) -> KernelCall:
    """The one-shot all-reduce of contiguous `x` into `y` over `group` ranks whose regions are laid out as
    `region`; the peer table is the call's `peers` operand."""
    numel, nbytes = x.type.numel, x.type.nbytes
    if x.type != y.type or x.dtype not in ("fp32", "bf16"):
        raise ValueError(f"one-shot all-reduce of {x.type} into {y.type}: the same fp32 / bf16 type expected")
    if region.group != group or nbytes > region.max_bytes:
        raise ValueError(f"one-shot all-reduce of {nbytes} bytes over {group} ranks: the region holds "
                         f"{region.max_bytes} bytes over {region.group}")
    tiles = max(1, triton.cdiv(numel, TILE))
    ce = dict(NUMEL=numel, GROUP=group, TILE=TILE, GRID=min(tiles, grid_max), SLOT_BYTES=region.slot_bytes,
              FLAGS_AT=region.flags_at, TILES=region.tiles, COUNTS_AT=region.counts_at, STATUS_AT=region.status_at,
              SPIN=spin)
    pointers = [ptr("x_ptr", "operand", names[0], x), ptr("y_ptr", "result", names[1], y),
                ptr("peers_ptr", "peers", "peers", "*i64")]
    # bytes: x read and copied to the slot, every rank's slot read (group - 1 of them over the links), y written
    return KernelCall(call_name("allreduce_oneshot", ce, f"{numel}_{x.dtype}_g{group}"), oneshot_kernel, ce, pointers,
                      (ce["GRID"], 1, 1), num_warps=4, flops=numel * (group - 1),
                      bytes_moved=nbytes * (group + 3),
                      per_target={} if spin != SPIN else {t: {"constexprs": {"SPIN": n}} for t, n in GPU_SPIN.items()})


def late_peer_error(status: tuple[int, int], rank: int, group: int, spin: int = SPIN) -> str | None:
    """The error a region's status words (late peer + 1, sequence number) stand for; None when clear."""
    peer, seq = status
    if peer == 0:
        return None
    return (f"rank {rank}: peer rank {peer - 1} of its group of {group} did not reach one-shot all-reduce "
            f"{seq} within {spin} polls")
