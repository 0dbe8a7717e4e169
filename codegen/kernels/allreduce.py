"""One-shot all-reduce over symmetric peer memory (issue 34): the group's sum in RANK ORDER, in one launch.

Every rank of a group holds one SYMMETRIC REGION (the same size and layout on every rank, zeroed at load; see
`peers.Region`): two status words, two data slots (`[2][slot_bytes]`), flags `int64 [group][tiles]` (flag [s][t]:
the sequence number of the last all-reduce for which rank s put tile t in its slot) and per-tile sequence counters
`int64 [tiles]` (read and written by this rank only). Each rank maps every peer's region into its own address space
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

A tile is a fixed byte range of the slots (`peers.TILE_BYTES`: 2048 bf16 or 1024 fp32 elements), the same in
every call on the region whatever its element type, so a tile's counter and flags always guard the same bytes.
Why two slots suffice: rank r writes slot v % 2 of tile t again only in its all-reduce v + 2, after it finished
all-reduce v + 1 of tile t, which needed every peer's flag v + 1 for tile t; a peer sets that flag in its
all-reduce v + 1 kernel, which started after its all-reduce v kernel ended (stream order), that is after the
peer read rank r's slot v % 2 for the last time. So no peer still reads a slot when its owner overwrites it.
One slot would not do: a fast rank would overwrite its slot for v + 1 while a slow peer still reads it for v.

The wait is BOUNDED: after `spin` polls of one flag the program records the late peer in the status words
(1 + the peer's index, then the sequence number; the first program to give up writes them), writes no result,
and ends; a later all-reduce that finds them set does not wait at all. The runtime reads them after a step and
raises one clear error (`peers.late_peer_error`); the rank's runtime is then unusable, as after a GPU fault. A
kernel never hangs.

The lowering (`passes/oneshot_allreduce.py`) turns a GPU program's `all_reduce` launches into `all_reduce_oneshot`
launches, this family's op (and data parallelism's rows collectives into `all_gather_rows_oneshot` /
`reduce_scatter_rows_oneshot`: `rows_kernel`, the same halves on a subset of the tiles, `publish_range` /
`gather_range` in `rows_tiles`, the slots holding the gathered value; `passes/fuse_oneshot_rows.py` folds both into
the MoE's launch between them, `fold_rows`: the gather as its leading phase, the reduce-scatter as its trailing part);
`passes/fuse_oneshot_consumer.py` folds those read by a phased launch into it (`ar_*`,
`ops/fused_allreduce.py`): that launch's first NO programs run the same per-tile body (`oneshot_tiles`, its one home)
into the launch's scratch (`fold`, which says why no schedule deadlocks); the families that take it
(moe_router, attn_front) call `folded`. `passes/fuse_oneshot_producer.py` folds the EP MoE's into the launch that
produces it (`<moe>_ar`): the halves `publish_tiles` and `gather_tiles` run in programs of their own, the shared
expert's work between them (`fold_trailing`, which says why no schedule deadlocks; moe_router places the phases).
"""

from __future__ import annotations

from dataclasses import replace

import triton
import triton.language as tl

from ...targets import KERNEL_SCHEDULES, ONESHOT_MAX_BYTES
from ...ir.registry import Layout
from ...ir.types import TensorType
from . import KernelCall, TensorArg, call_name, ptr
from .call import in_kernel_order
from .pdl import pdl_enter
from .peers import Region, late_peer_error, tile_elements  # noqa: F401 (late_peer_error: the family's error)

GRID_MAX = 64  # programs at most: resident on every GPU we target (132 SMs on H100, 256 CUs on MI355X)
# Polls of one flag before a peer counts as late: ~30 s interpreted (~0.45 ms a poll on the host device); the GPU
# binaries take their own bound (`targets.KERNEL_SCHEDULES["allreduce.spin"]`, `KernelCall.per_target`)
SPIN = 1 << 16
MAX_BYTES = ONESHOT_MAX_BYTES  # all-reduces run one-shot are under it (`targets.oneshot_allreduce` says why)


@triton.jit
def publish_range(o, x_ptr, lo, hi, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                  GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                  TILES: tl.constexpr, COUNTS_AT: tl.constexpr):
    """Steps 1-3 above for tiles o, o + GRID, ... of a value of NUMEL elements whose elements [lo, hi) this rank
    holds, x[i - lo] being element i: every tile's counter and flags (so the counters agree on every rank, and a
    waiting peer waits for every tile alike), the data of [lo, hi) only (the whole value for an all-reduce or a
    reduce-scatter, this rank's rows for an all-gather). The one home of the first half of the protocol, with
    `gather_range`. Nothing after a late peer (an earlier call gave up: this one does not wait again)."""
    dty = x_ptr.dtype.element_ty
    rank = tl.load(peers_ptr + GROUP)
    me = tl.load(peers_ptr + rank)
    counts = (me + COUNTS_AT).to(tl.pointer_type(tl.int64))
    offs = tl.arange(0, TILE)
    late = tl.load(me.to(tl.pointer_type(tl.int64)))
    for t in range(o, tl.cdiv(NUMEL, TILE), GRID):
        if late == 0:
            v = tl.load(counts + t) + 1
            tl.store(counts + t, v)
            slot = SLOTS_AT + (v % 2) * SLOT_BYTES
            idx = t * TILE + offs
            ok = (idx >= lo) & (idx < hi) & (idx < NUMEL)
            tl.store((me + slot).to(tl.pointer_type(dty)) + idx, tl.load(x_ptr + (idx - lo), mask=ok), mask=ok)
            tl.debug_barrier()
            for s in tl.static_range(GROUP):
                peer_flags = (tl.load(peers_ptr + s) + FLAGS_AT).to(tl.pointer_type(tl.int64))
                tl.atomic_store(peer_flags + rank * TILES + t, v, sem="release", scope="sys")


@triton.jit
def publish_tiles(o, x_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                  GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                  TILES: tl.constexpr, COUNTS_AT: tl.constexpr):
    """Steps 1-3 above for tiles o, o + GRID, ... of x, the whole value (`publish_range`)."""
    publish_range(o, x_ptr, 0, NUMEL, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES,
                  COUNTS_AT)


@triton.jit
def gather_range(o, y_ptr, lo, hi, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                 GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                 TILES: tl.constexpr, COUNTS_AT: tl.constexpr, SPIN: tl.constexpr, PART: tl.constexpr = 0):
    """Steps 4-5 above for the tiles o, o + GRID, ... that meet elements [lo, hi): the tiles `publish_range(o, ...)`
    published, so v is the counter it left (a program that did not publish them itself first acquires the
    publishers' stores, as a producer's trailing fold's gatherers do):
    the bounded wait for every peer, then element i of [lo, hi) into y[i - lo]: the rank-order sum of the ranks'
    slots (PART 0: an all-reduce, lo 0 and hi NUMEL; a reduce-scatter, this rank's rows), or with PART > 0 a copy
    from the slot of rank i // PART, the rank that published it (an all-gather of PART elements a rank).
    y may be x: each tile is read into the slot before it is written."""
    dty = y_ptr.dtype.element_ty
    rank = tl.load(peers_ptr + GROUP)
    me = tl.load(peers_ptr + rank)
    counts = (me + COUNTS_AT).to(tl.pointer_type(tl.int64))
    my_flags = (me + FLAGS_AT).to(tl.pointer_type(tl.int64))
    status = me.to(tl.pointer_type(tl.int64))
    offs = tl.arange(0, TILE)
    late = tl.load(status)
    for t in range(o, tl.cdiv(hi, TILE), GRID):  # (from o: a program gathers only tiles it published)
        if (late == 0) & ((t + 1) * TILE > lo):
            v = tl.load(counts + t)
            slot = SLOTS_AT + (v % 2) * SLOT_BYTES
            idx = t * TILE + offs
            ok = (idx >= lo) & (idx < hi)
            for s in tl.static_range(GROUP):
                polls = 0
                while (tl.atomic_load(my_flags + s * TILES + t, sem="acquire", scope="sys") < v) & (polls < SPIN):
                    polls += 1
                if (polls == SPIN) & (late == 0):
                    late = late * 0 + (s + 1)
            tl.debug_barrier()
            if late == 0:
                if PART > 0:
                    owner = idx // PART
                    acc = tl.load((tl.load(peers_ptr + owner, mask=ok, other=0) + slot).to(tl.pointer_type(dty))
                                  + idx, mask=ok)
                else:
                    acc = tl.load((tl.load(peers_ptr) + slot).to(tl.pointer_type(dty)) + idx, mask=ok)
                    for s in tl.static_range(1, GROUP):
                        part = tl.load((tl.load(peers_ptr + s) + slot).to(tl.pointer_type(dty)) + idx, mask=ok)
                        acc = (acc.to(tl.float32) + part.to(tl.float32)).to(dty)
                tl.store(y_ptr + (idx - lo), acc, mask=ok)
            elif tl.atomic_cas(status, late * 0, late, sem="relaxed", scope="sys") == 0:  # the first to give up says so
                tl.store(status + 1, v)


@triton.jit
def gather_tiles(o, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                 GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                 TILES: tl.constexpr, COUNTS_AT: tl.constexpr, SPIN: tl.constexpr):
    """Steps 4-5 above for the tiles `publish_tiles(o, ...)` published: the rank-order sum of the whole value into
    y (`gather_range`)."""
    gather_range(o, y_ptr, 0, NUMEL, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES,
                 COUNTS_AT, SPIN)


@triton.jit
def oneshot_tiles(o, x_ptr, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                  GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                  TILES: tl.constexpr, COUNTS_AT: tl.constexpr, SPIN: tl.constexpr):
    """The protocol (steps 1-5 above) for tiles o, o + GRID, ... of x into y: both halves back to back, run by
    program o of `oneshot_kernel` and by program o of a consumer's leading phase (`fold`); a producer's trailing
    fold (`fold_trailing`) runs the halves in programs of their own, its independent work between them."""
    publish_tiles(o, x_ptr, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES, COUNTS_AT)
    gather_tiles(o, y_ptr, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES, COUNTS_AT, SPIN)


@triton.jit
def oneshot_kernel(x_ptr, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                   GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr, TILES: tl.constexpr,
                   COUNTS_AT: tl.constexpr, SPIN: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # sm_90a: after the kernel before it (which wrote x), as every kernel of the stream
    oneshot_tiles(tl.program_id(0), x_ptr, y_ptr, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT,
                  TILES, COUNTS_AT, SPIN)


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
    tile = tile_elements(x.dtype)
    tiles = max(1, triton.cdiv(numel, tile))
    ce = dict(NUMEL=numel, GROUP=group, TILE=tile, GRID=min(tiles, grid_max), SLOTS_AT=region.slots_at, SLOT_BYTES=region.slot_bytes,
              FLAGS_AT=region.flags_at, TILES=region.tiles, COUNTS_AT=region.counts_at,
              SPIN=spin)
    pointers = [ptr("x_ptr", "operand", names[0], x), ptr("y_ptr", "result", names[1], y),
                ptr("peers_ptr", "peers", "peers", "*i64")]
    # No flops or bytes for the roofline: a collective's time is the parallel model's (codegen/parallel_model.py:
    # the measured one-shot figure + the bytes pulled over the links), as NCCL's is; its launch is a kernel call.
    return KernelCall(call_name("allreduce_oneshot", ce, f"{numel}_{x.dtype}_g{group}"), oneshot_kernel, ce, pointers,
                      (ce["GRID"], 1, 1), num_warps=4,
                      per_target=KERNEL_SCHEDULES["allreduce.spin"] if spin == SPIN else {})


@triton.jit
def scatter_tiles(o, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                  GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                  TILES: tl.constexpr, COUNTS_AT: tl.constexpr, SPIN: tl.constexpr):
    """A reduce-scatter's second half for the tiles `publish_tiles(o, ...)` published: the rank-order sum of this
    rank's part only, elements [r P, (r + 1) P) (P = NUMEL / GROUP, r this rank), into y (P elements)."""
    lo = tl.load(peers_ptr + GROUP) * (NUMEL // GROUP)
    gather_range(o, y_ptr, lo, lo + NUMEL // GROUP, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES,
                 FLAGS_AT, TILES, COUNTS_AT, SPIN)


@triton.jit
def rows_tiles(o, x_ptr, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
               GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
               TILES: tl.constexpr, COUNTS_AT: tl.constexpr, SPIN: tl.constexpr, GATHER: tl.constexpr):
    """The one-shot all-gather (GATHER) or reduce-scatter of rows for tiles o, o + GRID, ... (both halves back to
    back): run by program o of `rows_kernel` and (the all-gather) by program o of DP's MoE's leading phase
    (`fold_rows`). The value has NUMEL elements (the gathered rows), of which rank r's part is elements
    [r P, (r + 1) P), P = NUMEL / GROUP. All-gather: each rank publishes its part (x: P elements), then copies every
    tile from its publisher (y: NUMEL). Reduce-scatter: each rank publishes its whole partial (x: NUMEL), then sums
    its part's tiles in rank order (y: P, `scatter_tiles`): bit for bit `ops/collective`'s `reduce_scatter_rows`
    (`_rank_sum`, then the rank's chunk)."""
    if GATHER:
        lo = tl.load(peers_ptr + GROUP) * (NUMEL // GROUP)
        publish_range(o, x_ptr, lo, lo + NUMEL // GROUP, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES,
                      FLAGS_AT, TILES, COUNTS_AT)
        gather_range(o, y_ptr, 0, NUMEL, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES,
                     COUNTS_AT, SPIN, NUMEL // GROUP)
    else:
        publish_tiles(o, x_ptr, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES, COUNTS_AT)
        scatter_tiles(o, y_ptr, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT, TILES, COUNTS_AT,
                      SPIN)


@triton.jit
def rows_kernel(x_ptr, y_ptr, peers_ptr, NUMEL: tl.constexpr, GROUP: tl.constexpr, TILE: tl.constexpr,
                GRID: tl.constexpr, SLOTS_AT: tl.constexpr, SLOT_BYTES: tl.constexpr, FLAGS_AT: tl.constexpr,
                TILES: tl.constexpr, COUNTS_AT: tl.constexpr, SPIN: tl.constexpr, GATHER: tl.constexpr,
                PDL: tl.constexpr = False):
    """The one-shot all-gather (GATHER) or reduce-scatter of rows over the group (`rows_tiles`)."""
    pdl_enter(PDL)
    rows_tiles(tl.program_id(0), x_ptr, y_ptr, peers_ptr, NUMEL, GROUP, TILE, GRID, SLOTS_AT, SLOT_BYTES, FLAGS_AT,
               TILES, COUNTS_AT, SPIN, GATHER)


def rows_call(op: str, x: TensorArg, y: TensorArg, group: int, region: Region, spin: int = SPIN,
              grid_max: int = GRID_MAX) -> KernelCall:
    """The one-shot `all_gather_rows` / `reduce_scatter_rows` (op) of contiguous `x` into `y` over `group` ranks
    (one replica a rank: tp 1) whose regions are laid out as `region`: the slots hold the gathered value. Why the
    two slots suffice as for the all-reduce: every call publishes (counter and flags) every tile of the gathered
    value on every rank, and every rank waits on each of its tiles for every peer, so a rank's call v + 1 on a
    tile ends only after every peer's call v ended."""
    gather = op == "all_gather_rows"
    if op not in ("all_gather_rows", "reduce_scatter_rows"):
        raise ValueError(f"one-shot rows collective '{op}': all_gather_rows or reduce_scatter_rows expected")
    whole, part = (y, x) if gather else (x, y)
    if x.dtype != y.dtype or x.dtype not in ("fp32", "bf16") or whole.type.numel != group * part.type.numel:
        raise ValueError(f"one-shot {op} of {x.type} into {y.type} over {group} ranks: fp32 / bf16, the gathered "
                         f"value {group} parts")
    if region.group != group or whole.type.nbytes > region.max_bytes:
        raise ValueError(f"one-shot {op} of {whole.type.nbytes} bytes over {group} ranks: the region holds "
                         f"{region.max_bytes} bytes over {region.group}")
    numel = whole.type.numel
    tile = tile_elements(x.dtype)
    tiles = max(1, triton.cdiv(numel, tile))
    ce = dict(NUMEL=numel, GROUP=group, TILE=tile, GRID=min(tiles, grid_max), SLOTS_AT=region.slots_at,
              SLOT_BYTES=region.slot_bytes, FLAGS_AT=region.flags_at, TILES=region.tiles, COUNTS_AT=region.counts_at,
              SPIN=spin, GATHER=gather)
    pointers = [ptr("x_ptr", "operand", "x", x), ptr("y_ptr", "result", "y", y),
                ptr("peers_ptr", "peers", "peers", "*i64")]
    kind = "gather" if gather else "rscatter"
    return KernelCall(call_name(f"{kind}_oneshot", ce, f"{numel}_{x.dtype}_g{group}"), rows_kernel, ce, pointers,
                      (ce["GRID"], 1, 1), num_warps=4,
                      per_target=KERNEL_SCHEDULES["allreduce.spin"] if spin == SPIN else {})


# the leading phase's constexprs in a consumer's kernel (`fold`): the one-shot's, renamed
FOLDED_CONSTEXPRS = {n: "AR_" + n for n in ("NUMEL", "GROUP", "TILE", "SLOTS_AT", "SLOT_BYTES", "FLAGS_AT", "TILES",
                                             "COUNTS_AT", "SPIN")}
FOLDED_CONSTEXPRS["GRID"] = "NO"
# a consumer's kernel with nothing folded: no leading phase (NO = 0 programs; the branch is compiled out)
UNFOLDED = {"ar_x_ptr": None, "peers_ptr": None, **{n: 1 for n in FOLDED_CONSTEXPRS.values()}, "AR_TILE": tile_elements("bf16"),
            "NO": 0}


# a producer's trailing fold's constexprs in its kernel (`fold_trailing`): the one-shot's, renamed (NP: the programs
# of each half)
TRAILING_CONSTEXPRS = {n: "TR_" + n for n in FOLDED_CONSTEXPRS if n != "GRID"}
TRAILING_CONSTEXPRS["GRID"] = "NP"
# a producer's kernel with nothing folded (NP = 0: the halves' branches are compiled out; TR_SCATTER: the trailing
# part a reduce-scatter into `tr_y_ptr`, `fold_rows`)
UNTRAILED = {**{n: 1 for n in TRAILING_CONSTEXPRS.values()}, "TR_TILE": tile_elements("bf16"), "NP": 0, "TR_SCATTER": False,
             "tr_y_ptr": None}
# a consumer's leading phase an all-reduce, or (AR_GATHER, `fold_rows`) an all-gather
UNGATHERED = {"AR_GATHER": False}


def spin_of(constexprs: dict) -> int:
    """The poll bound of a call that runs the protocol: the one-shot's own, or a folded phase's (leading or
    trailing: one bound, `oneshot_call`'s)."""
    if "SPIN" in constexprs:
        return int(constexprs["SPIN"])
    return int(constexprs["AR_SPIN"] if constexprs.get("NO", 0) > 0 else constexprs["TR_SPIN"])


def fold_trailing(call: KernelCall, y: TensorArg, group: int, region_bytes: int, programs: int,
                  constexprs: dict) -> KernelCall:
    """`call` (a producer's one launch that writes its result `y` in place) with the one-shot all-reduce of `y`
    folded in as a trailing part: NP programs run `publish_tiles` (once `y` is complete), the producer's
    independent work follows (`programs` more programs, `constexprs` the family's switches that order them
    there), then NP programs run `gather_tiles` into `y` (in place: each tile was copied to the slot before),
    each after the NP publishers (`phases.wait_for`). The family's kernel places the phases
    (`moe_router.moe_fused_kernel`); this sets the protocol's constexprs (TR_*, NP), the peer table and the grid.

    Why no schedule deadlocks: a publisher waits only for earlier tickets on its rank (the programs that complete
    `y`); a gatherer waits for earlier tickets on its rank (the publishers) and for the publishers of the same
    tiles on its peers, which wait only for earlier tickets on THEIR rank. So by induction on the ticket every
    program finishes, however few programs are resident (no program waits for a later ticket, unlike the leading
    phase no residency of the whole grid is needed), and the wait is bounded besides. The slots' argument of the
    one-shot's docstring holds: every all-reduce of a region uses the same tiles (t: bytes [t, t + 1) TILE_BYTES
    of the slots, elements [t TILE, (t+1) TILE) of the value), and the launch's gatherers read the peers' slots
    before the launch ends; with a leading phase
    in the same launch (`fold`) the trailing publishers run after it (they wait for work that waited for it), so
    the two all-reduces are in order on every rank. Why NP programs of their own and not the D tiles' combining
    programs: a D tile (columns of every token) is not a run of the value's elements, and a tile geometry of its
    own would break the slots' argument when another all-reduce on the region uses the runs."""
    single = oneshot_call(y, y, group, Region(group, region_bytes))  # (its poll bound and grid: the one-shot's)
    ce = {n: v for n, v in call.constexprs.items() if n != "peers_ptr"}
    ce.update({TRAILING_CONSTEXPRS[n]: v for n, v in single.constexprs.items() if n in TRAILING_CONSTEXPRS})
    ce.update(constexprs)
    return _joined(call, single, TRAILING_CONSTEXPRS, ce, list(call.pointers), "_rd", group, 2 * ce["NP"] + programs)


def fold_rows(call: KernelCall, x: TensorArg, y: TensorArg, group: int, region_bytes: int, programs: int,
              constexprs: dict) -> KernelCall:
    """`call` (data parallelism's MoE launch, which reads every rank's tokens as scratch and writes its routed
    partial sum of them, every rank's rows, to scratch) with the one-shot all-gather of `x` (this rank's tokens,
    which the kernel also reads through its own pointer) folded in as its leading phase and the reduce-scatter of
    the partial into `y` (this rank's rows) as its trailing part: tickets [0, NO) run `rows_tiles` (GATHER) into
    the gathered scratch, as `fold`'s run `oneshot_tiles` (AR_GATHER), and the trailing
    part is `fold_trailing`'s, its gatherers summing this rank's part alone (`scatter_tiles`, TR_SCATTER) into `y`
    through `tr_y_ptr`. The family's kernel places the phases (`moe_router.moe_fused_kernel`: every program that
    reads the gathered tokens waits for the NO first); this sets the protocol's constexprs, the peer table, `y` and
    the grid (`programs`, `constexprs`: as `fold_trailing`'s).

    Why no schedule deadlocks: `fold`'s argument for the leading phase (NO <= GRID_MAX ticket-holders resident on
    every rank, each waiting only for the same ticket's program on its peers) and `fold_trailing`'s for the
    trailing part. The slots: the two collectives are the two of `rows_call` in one launch, in order on every rank
    (the trailing publishers wait for the combined partial, which waited for the router, which waited for the
    gathered tokens), each publishing every tile of its value: its docstring's argument holds."""
    region = Region(group, region_bytes)
    whole = [gathered(a, group) for a in (x, y)]
    gather = rows_call("all_gather_rows", x, whole[0], group, region)  # (its poll bound and grid: the one-shot's)
    scatter = rows_call("reduce_scatter_rows", whole[1], y, group, region)
    ce = {n: v for n, v in call.constexprs.items() if n not in ("peers_ptr", "tr_y_ptr")}
    ce.update({FOLDED_CONSTEXPRS[n]: v for n, v in gather.constexprs.items() if n in FOLDED_CONSTEXPRS})
    ce.update({TRAILING_CONSTEXPRS[n]: v for n, v in scatter.constexprs.items() if n in TRAILING_CONSTEXPRS})
    ce.update(constexprs, AR_GATHER=True, TR_SCATTER=True)
    led = _joined(call, gather, FOLDED_CONSTEXPRS, {**ce, "tr_y_ptr": None}, list(call.pointers), "_ag", group,
                  ce["NO"])
    return _joined(led, scatter, TRAILING_CONSTEXPRS, ce, [*led.pointers, ptr("tr_y_ptr", "result", "partial", y)],
                   "_rs", group, 2 * ce["NP"] + programs)


def _joined(call: KernelCall, single: KernelCall, names: dict[str, str], ce: dict, pointers: list, suffix: str,
            group: int, programs: int) -> KernelCall:
    """`call` with the one-shot `single` folded in (either fold): its constexprs `ce` and `pointers`, the peer
    table bound, the GPU binaries' poll bound (`single`'s, renamed by `names`), `programs` more programs, its name
    `suffix`ed."""
    if "peers_ptr" not in [q[0] for q in pointers]:  # (a call with the other fold binds it already)
        pointers.append(ptr("peers_ptr", "peers", "peers", "*i64"))
    per_target = {t: dict(o) for t, o in call.per_target.items()}
    for t, o in single.per_target.items():
        per_target.setdefault(t, {}).setdefault("constexprs", {}).update(
            {names[n]: v for n, v in o["constexprs"].items()})
    name = call_name(call.name.rsplit("_", 1)[0] + suffix, ce, f"g{group}")
    return replace(call, name=name, constexprs=ce, pointers=in_kernel_order(name, call.fn, pointers, ce),
                   grid=(call.grid[0] + programs, *call.grid[1:]), per_target=per_target,
                   scratch_bytes=dict(call.scratch_bytes))


def oneshot_in_place(y: TensorArg, name: str, group: int, region_bytes: int) -> KernelCall:
    """The one-shot all-reduce of result `name` into itself: a grouped producer's (a prefill chunk's MoE) as a call
    of its own after its calls."""
    call = oneshot_call(y, y, group, Region(group, region_bytes), names=(name, name))
    call.pointers = [(p, "result", n, ty) if kind == "operand" else (p, kind, n, ty)
                     for p, kind, n, ty in call.pointers]
    return call


def fold(call: KernelCall, x: TensorArg, reduced: tuple[str, str], group: int, region_bytes: int) -> KernelCall:
    """`call` (a phased consumer's one launch, specialised on the reduced value as dense scratch) with the
    one-shot all-reduce of `x` (this rank's partial value, the op's operand `y`) as its leading phase.

    `reduced`: (the kernel's pointer param, the scratch name) the consumer reads the reduced value through. The
    kernel takes the partial as `ar_x_ptr`, the peer table as `peers_ptr`, the one-shot's constexprs as AR_* and its
    grid as NO: tickets [0, NO) run `oneshot_tiles(ticket, ar_x_ptr, <reduced param>, ...)` and each publishes;
    every program that reads the reduced value first waits for all NO (`phases.wait_for`).

    Why no schedule deadlocks: tickets are taken at program start, so the NO ticket-holders of every rank are
    resident together (NO <= GRID_MAX, fewer than the SMs / CUs of every GPU we target); a leading-phase program
    waits only for the same ticket's program on its peers (the same tiles, in the same order: each rank's program
    o handles tiles o, o + NO, ...), which is resident by the same argument, and a later program waits only for
    earlier tickets on its own rank. What the one-shot's docstring says of its slots holds as well: the consumer's
    launch ends after its leading phase's last read of a peer's slot."""
    single = oneshot_call(x, x, group, Region(group, region_bytes))  # (its poll bound and grid: the one-shot's)
    param, name = reduced
    if (param, "scratch", name) not in [q[:3] for q in call.pointers]:
        raise ValueError(f"{call.name}: no scratch '{name}' at '{param}' to fold the all-reduce into")
    ce = {n: v for n, v in call.constexprs.items() if n not in ("ar_x_ptr", "peers_ptr")}
    ce.update({FOLDED_CONSTEXPRS[n]: v for n, v in single.constexprs.items() if n in FOLDED_CONSTEXPRS})
    pointers = [ptr("ar_x_ptr", "operand", "y", x), *call.pointers]
    return _joined(call, single, FOLDED_CONSTEXPRS, ce, pointers, "_ar", group, ce["NO"])


def folded(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg], attrs: dict,
           consumer_specialise, reduced_param: str) -> list[KernelCall]:
    """The calls of `ar_<consumer>` (`ops/fused_allreduce.py`): the consumer's family's calls on the reduced value as
    dense scratch (`ar_y`), with the one-shot all-reduce of the partial `y` folded in as the leading phase of its one
    launch (`fold`; `reduced_param`: the consumer kernel's pointer to the reduced value). Where the consumer is
    several calls (a grouped launch), the one-shot is a call of its own before them, writing that scratch."""
    from ...ir.registry import Layout
    from ...ops.fused_allreduce import REDUCED, consumer_of, inner_attrs

    x = operands[REDUCED]
    _contiguous(op_name, REDUCED, x)
    y = TensorArg(x.type, Layout.contiguous(x.shape).strides)
    calls = consumer_specialise(consumer_of(op_name), {**operands, REDUCED: y}, results,
                                inner_attrs(attrs, consumer_of(op_name)))
    for c in calls:
        c.pointers = [(p, "scratch", "ar_y", ty) if (kind, name) == ("operand", REDUCED) else (p, kind, name, ty)
                      for p, kind, name, ty in c.pointers]
        c.scratch_bytes["ar_y"] = x.type.nbytes
    group, region_bytes = int(attrs["group"]), int(attrs["region_bytes"])
    if len(calls) == 1 and (reduced_param, "scratch", "ar_y") in [q[:3] for q in calls[0].pointers]:
        return [fold(calls[0], x, (reduced_param, "ar_y"), group, region_bytes)]
    single = oneshot_call(x, y, group, Region(group, region_bytes), names=(REDUCED, "ar_y"))
    single.pointers = [(p, "scratch", name, ty) if kind == "result" else (p, kind, name, ty)
                       for p, kind, name, ty in single.pointers]
    single.scratch_bytes["ar_y"] = x.type.nbytes
    return [single, *calls]


def gathered(a: TensorArg, group: int) -> TensorArg:
    """The contiguous value whose rank's rows `a` is, over `group` ranks (a rows collective's whole value)."""
    shape = (a.shape[0] * group, *a.shape[1:])
    return TensorArg(TensorType(shape, a.dtype), Layout.contiguous(shape).strides)


def _contiguous(op_name: str, name: str, a: TensorArg) -> None:
    """A tile is a run of consecutive elements: the one-shot's values are contiguous."""
    dense = [1]
    for n in reversed(a.shape[1:]):
        dense.insert(0, dense[0] * n)
    if a.type.rank and list(a.strides) != dense:
        raise ValueError(f"{op_name}: '{name}' is not contiguous (strides {list(a.strides)})")


def specialise(op_name: str, operands: dict[str, TensorArg | None], results: dict[str, TensorArg],
               attrs: dict) -> list[KernelCall]:
    if op_name not in ("all_reduce_oneshot", "all_gather_rows_oneshot", "reduce_scatter_rows_oneshot"):
        raise KeyError(f"allreduce family has no op '{op_name}'")
    x, y = operands["x"], results["y"]
    for name, a in (("x", x), ("y", y)):
        _contiguous(op_name, name, a)
    group = int(attrs["group"])
    if op_name != "all_reduce_oneshot":
        return [rows_call(op_name.removesuffix("_oneshot"), x, y, group, Region(group, int(attrs["region_bytes"])))]
    return [oneshot_call(x, y, group, Region(group, int(attrs["region_bytes"])))]
