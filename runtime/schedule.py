"""The launch schedule of a program: what the C runtime (runtime/c) reads, as one binary table.

A table rather than generated C source: the C core is compiled once (cached by its source hash) and reads
any artifact's table, so loading an artifact never needs a compiler, and the table is plain data the
runtime checks (magic, version, sizes, every index and offset, an FNV-1a checksum against tampering).

* Buffers are program-wide: one `arena` (the largest function's), one `scratch` region (the largest
  launch's kernel scratch), `semaphores` when a kernel asks for arrival counters (zeroed at load, left
  zero by every call), and pool planes, state and weights shared by name; step inputs and outputs
  are per function (`<function>/<name>`), since their shapes differ between buckets.
* A launch becomes one or more KERNEL CALLS (code object, symbol, grid, block, shared bytes, pointer
  parameters = buffer + byte offset, in the order the kernel declares them: a GPU binds them by
  position; with binaries, the order of the compiled kernel's sidecar, checked against the call).
  When a family provides `specialise` (see `kernels.py`), its KernelCalls are the calls; otherwise (the `reference` kernels mode) one placeholder call per launch whose
  parameters are the launch's operands then results in signature order (absent optionals: NULL), run
  by the host driver's callback with the op's reference.
* The one-shot all-reduce (`all_reduce_oneshot`, codegen/kernels/allreduce.py; or folded into its consumer's
  launch, `ar_*`, `passes/fuse_oneshot_consumer.py`, or its producer's, `*_ar`; and the one-shot rows collectives,
  `*_rows_oneshot`, or both folded into the MoE's launch between them, `ag_moe_router_experts_dp_rs`) is a
  kernel call whose `peers`
  pointer is the `peers` buffer (kind PEERS: the table of the group's regions as mapped in this process, which
  the runtime writes at load), beside one `symmetric` buffer (kind SYMMETRIC: this rank's region, zeroed at load,
  which peers map; `Schedule.region` its layout; one for all such launches: `passes/oneshot_allreduce.py` gives
  them one group and region size).
* A kernel call with a pointer table (`KernelCall.tabled`: pointers the kernel loads where it reads them, not
  arguments) takes its part of the `tables` buffer (kind TABLE, code 7 like PEERS: written by the runtime at load,
  every entry's buffer address plus offset, `Schedule.tables`).
* A communicator launch (a partitioned program's `all_reduce`, `all_gather`) becomes one COLLECTIVE call
  (code V4RT_COLLECTIVE, runtime/c/v4rt.h): symbol = the op, grid = (group, dtype code, 1), shared = the
  operand's element count, parameters = operand, result. The driver runs it in order with the kernels
  (GPU: NCCL / RCCL on its stream; host: the callback, like a placeholder call).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from v4compile.errors import DeviceError, IRError
from v4compile.ir.registry import get_op
from v4compile.program.core import Arg, FunctionProgram, Launch, Program

MAGIC = b"V4RTTBL1"
TABLE_VERSION = 3  # 2: per-call launch flags; collective calls; 3: the peer table and the symmetric region
LAUNCH_PDL = 1  # call flag: programmatic dependent launch (runtime/c/driver.h V4DRV_LAUNCH_PDL)
SEMAPHORES = "semaphores"  # the schedule's buffer of kernel arrival counters (see `schedule`)
KIND_CODE = {"arena": 0, "input": 1, "pool": 2, "state": 3, "weight": 4, "output": 5, "scratch": 6, "peers": 7,
             "table": 7, "symmetric": 8}  # ("table": the calls' pointer tables, like the peer table written at load)
PEERS, SYMMETRIC = "peers", "symmetric"  # the one-shot all-reduce's peer table and region (see `schedule`)
TABLES = "tables"  # the calls' pointer tables (`KernelCall.tabled`; `Schedule.tables`: what the runtime writes)
PER_FUNCTION = ("input", "output")
HOST_CODE_OBJECT = b"v4rt host placeholder code object\0"  # host kernels run in the callback
COLLECTIVE = 0xFFFFFFFF  # the code of a collective call (V4RT_COLLECTIVE)
COLLECTIVE_DTYPE = {"fp32": 0, "bf16": 1, "i64": 2}  # V4RT_F32, V4RT_BF16, V4RT_I64 (gathered token ids)


def fnv1a64(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class Param:
    buffer: int  # -1: NULL (an absent optional)
    offset: int
    role: str = ""  # "operand:x", "result:y", "scratch:s", "semaphore:c" (what it is, for the host callback and checks)


@dataclass(frozen=True)
class Call:
    code: int
    symbol: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    params: tuple[Param, ...]
    kernel: Any = None  # the KernelCall it came from (None: placeholder running the op's reference)
    pdl: bool = False  # launched with programmatic stream serialization (its binary waits: sidecar "pdl")

    @property
    def flags(self) -> int:
        return LAUNCH_PDL if self.pdl else 0


@dataclass
class FunctionSchedule:
    name: str
    program: FunctionProgram
    calls: list[Call]
    launch_of: list[int]  # call index -> launch index


@dataclass
class Schedule:
    buffer_names: list[str]
    buffer_kinds: list[str]
    buffer_bytes: list[int]
    buffer_align: list[int]
    code_objects: list[bytes]
    functions: list[FunctionSchedule]
    index: dict[str, int] = field(default_factory=dict)
    region: Any = None  # the symmetric region's layout (`codegen.kernels.peers.Region`) when a call has peers
    # each call's pointer table in the `tables` buffer: (its byte offset there, ((buffer index or -1 for a null
    # entry, byte offset) per `KernelCall.tabled` entry)); the runtime writes every entry's address at load
    tables: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)

    def buffer_index(self, fname: str, name: str) -> int:
        key = f"{fname}/{name}" if f"{fname}/{name}" in self.index else name
        return self.index[key]

    def function_index(self, fname: str) -> int:
        for i, f in enumerate(self.functions):
            if f.name == fname:
                return i
        raise KeyError(fname)

    def to_bytes(self) -> bytes:
        out = bytearray()
        for n, a, k in zip(self.buffer_bytes, self.buffer_align, self.buffer_kinds):
            out += struct.pack("<QII", n, a, KIND_CODE[k])
        for img in self.code_objects:
            out += struct.pack("<Q", len(img)) + img + b"\0" * (-len(img) % 8)
        for f in self.functions:
            out += struct.pack("<II", len(f.calls), 0)
            for c in f.calls:
                sym = c.symbol.encode()
                out += struct.pack("<II3I3IIII", c.code, len(sym), *c.grid, *c.block, c.shared, len(c.params),
                                   c.flags)
                out += sym + b"\0" * (8 - len(sym) % 8)  # NUL-terminated, padded to 8
                for p in c.params:
                    out += struct.pack("<qQ", p.buffer, p.offset)
        header = MAGIC + struct.pack("<IIIIQQ", TABLE_VERSION, len(self.buffer_names), len(self.code_objects),
                                     len(self.functions), len(out), fnv1a64(bytes(out)))
        return header + bytes(out)


def compiled_params(kc, side: dict, where: str = "") -> list[tuple[str, str, str, str]]:
    """The call's pointers in the order of the compiled kernel's parameters (its sidecar, written from the
    kernel's signature at compile time; Triton's scratch pointers left out). The call and the binary must
    agree on every name and type: a parameter one has and the other lacks, or typed differently, is one
    clear error naming the kernel and the parameter (an artifact compiled from other kernel sources)."""
    mine = {p[0]: p for p in kc.pointers}
    compiled = [p for p in side["params"] if p.get("kind") != "triton_scratch"]
    names = [p["name"] for p in compiled]
    kernel = side.get("symbol", kc.name)
    where = where or kc.name
    for p in compiled:
        if p["name"] not in mine:
            raise DeviceError(f"compiled kernel {kernel} has a parameter '{p['name']}' the call does not bind",
                              where=where, expected=", ".join(mine))
        if p["type"] != mine[p["name"]][3]:
            raise DeviceError(f"parameter '{p['name']}' of compiled kernel {kernel} is {p['type']}, the call "
                              f"passes {mine[p['name']][3]}", where=where)
    for n in mine:
        if names.count(n) != 1:
            raise DeviceError(f"the call binds '{n}', which compiled kernel {kernel} declares "
                              f"{names.count(n)} times", where=where, expected=", ".join(names))
    return [mine[n] for n in names]


def _placeholder(l: Launch, slot, code: int) -> Call:
    params = [Param(-1, 0, f"operand:{n}") if a is None else Param(*slot(a), f"operand:{n}") for n, a in l.operands]
    params += [Param(*slot(a), f"result:{n}") for n, a in l.results]
    return Call(code, l.specialisation, (1, 1, 1), (1, 1, 1), 0, tuple(params))


def _collective(l: Launch, slot) -> Call:
    (xn, x), = l.operands
    (yn, y), = l.results
    if x.type.dtype not in COLLECTIVE_DTYPE:
        raise IRError(f"{l.op} of {x.type.dtype} values", expected=", ".join(COLLECTIVE_DTYPE))
    for a in (x, y):  # NCCL reads and writes whole contiguous ranges
        dense = [1]
        for n in reversed(a.type.shape[1:]):
            dense.insert(0, dense[0] * n)
        if a.type.rank and list(a.strides) != dense:
            raise IRError(f"{l.op}: %{a.value} is not contiguous", expected=dense, found=list(a.strides))
    return Call(COLLECTIVE, l.op, (int(l.attrs["group"]), COLLECTIVE_DTYPE[x.type.dtype], 1), (1, 1, 1),
                x.type.numel, (Param(*slot(x), f"operand:{xn}"), Param(*slot(y), f"result:{yn}")))


def build_schedule(p: Program, kernel_calls=None, functions: list[str] | None = None, warp: int = 32,
                   binaries=None) -> Schedule:
    """`kernel_calls(launch) -> list[KernelCall] | None` (see kernels.py): the real kernels of a launch
    where its family has them. `warp`: threads per warp of the target (32 CUDA, 64 AMD).
    `binaries([KernelCall]) -> {name: (code object bytes, sidecar)}` (a GPU target; see kernels.py): each
    kernel then gets its own code object, its compiled symbol, block and shared bytes from the sidecar, and
    Triton's trailing scratch pointers (global, profile): a per-program scratch region, or NULL."""
    names = list(functions or p.functions)
    plan = {fname: [(l, kernel_calls(l) if kernel_calls is not None else None) for l in p.functions[fname].launches]
            for fname in names}
    bins = {}
    if binaries is not None:
        todo = {kc.name: kc for pl in plan.values() for _, kcs in pl for kc in (kcs or ())}
        bins = binaries(list(todo.values()))
    bnames, kinds, sizes, aligns, index = [], [], [], [], {}

    def add(key: str, kind: str, nbytes: int, align: int) -> None:
        if key in index:
            i = index[key]
            if kind in ("arena", "scratch"):
                sizes[i] = max(sizes[i], nbytes)
                aligns[i] = max(aligns[i], align)
            elif (kinds[i], sizes[i]) != (kind, nbytes):
                raise IRError(f"buffer %{key} differs between functions", expected=(kinds[i], sizes[i]),
                              found=(kind, nbytes))
            return
        index[key] = len(bnames)
        bnames.append(key)
        kinds.append(kind)
        sizes.append(nbytes)
        aligns.append(align)

    add("scratch", "scratch", 0, 256)
    # Kernel semaphores (`KernelCall` pointers of kind "semaphore"): one zeroed, persistent buffer for all
    # calls; each call leaves its counters zero, so they may all start at offset 0. A "state" buffer is
    # zeroed at load like the pool.
    sem_bytes = max((n for pl in plan.values() for _, kcs in pl for kc in (kcs or ()) for p in kc.pointers
                     if p[1] == "semaphore" for n in (kc.scratch_bytes[p[2]],)), default=0)
    if sem_bytes:
        add(SEMAPHORES, "state", (sem_bytes + 255) // 256 * 256, 256)
    regions = {(int(l.attrs["group"]), int(l.attrs["region_bytes"])) for pl in plan.values() for l, kcs in pl
               for kc in (kcs or ()) if any(p[1] == "peers" for p in kc.pointers)}
    if len(regions) > 1:
        raise IRError("one-shot all-reduces of several groups or region sizes in one program",
                      expected="one (passes/oneshot_allreduce.py)", found=sorted(regions))
    region = None
    if regions:
        from v4compile.codegen.kernels.peers import Region

        region = Region(*regions.pop())
        add(PEERS, "peers", region.table_bytes, 256)
        add(SYMMETRIC, "symmetric", region.nbytes, 256)
    if any(kc.tabled for pl in plan.values() for _, kcs in pl for kc in (kcs or ())):
        add(TABLES, "table", 0, 256)  # (its size grows below, a table per call)
    for fname in names:
        for b in p.functions[fname].buffers:
            add(f"{fname}/{b.name}" if b.kind in PER_FUNCTION else b.name, b.kind, b.nbytes, b.align)
    sched = Schedule(bnames, kinds, sizes, aligns, [], [], index, region)
    code_of: dict[str, int] = {}

    def host_code() -> int:  # the placeholder object, present only if some call runs in the host callback
        if "" not in code_of:
            code_of[""] = len(sched.code_objects)
            sched.code_objects.append(HOST_CODE_OBJECT)
        return code_of[""]
    for fname in names:
        f = p.functions[fname]

        def slot(a: Arg, fname=fname) -> tuple[int, int]:
            return sched.buffer_index(fname, a.buffer), a.offset

        calls, launch_of = [], []
        for li, (l, kcs) in enumerate(plan[fname]):
            if get_op(l.op).communicator:
                calls.append(_collective(l, slot))
                launch_of.append(li)
                continue
            if kcs is None:
                calls.append(_placeholder(l, slot, host_code()))
                launch_of.append(li)
                continue
            scratch_at, top = {}, 0

            def region(key: str, n: int) -> None:
                nonlocal top
                if key not in scratch_at:
                    scratch_at[key] = top
                    top += (max(n, 16) + 255) // 256 * 256

            for k, kc in enumerate(kcs):
                sems = {p[2] for p in kc.pointers if p[1] == "semaphore"}
                for name, n in kc.scratch_bytes.items():
                    if name not in sems:
                        region(name, n)
                for tp in (bins[kc.name][1]["params"] if kc.name in bins else ()):
                    if tp.get("kind") == "triton_scratch" and tp["size_per_program"]:
                        region(f"{k}:{tp['name']}", tp["size_per_program"] * kc.grid[0] * kc.grid[1] * kc.grid[2])
            sizes[index["scratch"]] = max(sizes[index["scratch"]], top)
            ops, res = dict(l.operands), dict(l.results)
            for k, kc in enumerate(kcs):
                if 0 in kc.grid:
                    continue  # nothing to do for this shape
                params = []
                order = compiled_params(kc, bins[kc.name][1]) if kc.name in bins else kc.pointers
                for param, kind, name, _ty in order:
                    if kind == "scratch":
                        params.append(Param(index["scratch"], scratch_at[name], f"scratch:{name}"))
                        continue
                    if kind == "semaphore":
                        params.append(Param(index[SEMAPHORES], 0, f"semaphore:{name}"))
                        continue
                    if kind == "peers":
                        params.append(Param(index[PEERS], 0, f"peers:{name}"))
                        continue
                    if kind == "table":
                        at = sizes[index[TABLES]]
                        entries = tuple((-1, 0) if a is None else slot(a) for a in
                                        ((ops if k == "operand" else res).get(n) for _, k, n, _ in kc.tabled))
                        sched.tables.append((at, entries))
                        sizes[index[TABLES]] = at + (len(entries) * 8 + 255) // 256 * 256
                        params.append(Param(index[TABLES], at, f"table:{name}"))
                        continue
                    a = (ops if kind == "operand" else res).get(name)
                    if a is None:
                        params.append(Param(-1, 0, f"{kind}:{name}"))
                    else:  # the call's launch-time offset (e.g. a layer's first pool row) moves the pointer on
                        buf, off = slot(a)
                        params.append(Param(buf, off + kc.offsets.get(param, 0), f"{kind}:{name}"))
                if kc.name not in bins:
                    calls.append(Call(host_code(), kc.name, tuple(kc.grid), (kc.num_warps * warp, 1, 1), 0, tuple(params),
                                      kc))
                else:
                    image, side = bins[kc.name]
                    if kc.name not in code_of:
                        code_of[kc.name] = len(sched.code_objects)
                        sched.code_objects.append(image)
                    for tp in side["params"]:
                        if tp.get("kind") == "triton_scratch":
                            key = f"{k}:{tp['name']}"
                            params.append(Param(index["scratch"], scratch_at[key], f"scratch:{tp['name']}")
                                          if key in scratch_at else Param(-1, 0, f"scratch:{tp['name']}"))
                    calls.append(Call(code_of[kc.name], side["symbol"], tuple(kc.grid), tuple(side["block"]),
                                      int(side["shared_bytes"]), tuple(params), kc, bool(side.get("pdl", False))))
                launch_of.append(li)
        sched.functions.append(FunctionSchedule(fname, f, calls, launch_of))
    return sched
