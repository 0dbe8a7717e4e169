"""The C runtime from Python (ctypes): `CRuntime` runs a program's functions through libv4rt.

* `device="host"`: buffers in host memory; each kernel call comes back to `_host_kernel` (a
  `ctypes.CFUNCTYPE` callback) with its pointers. A placeholder call runs the op's reference
  (`program.execute.run_launch`) on tensors viewing the C buffers at those pointers, so a wrong
  pointer, offset or order in the C runtime gives wrong numbers; a real KernelCall runs its Triton
  kernel (under TRITON_INTERPRET=1) on the packed 64-bit parameter array a GPU driver would get, bound by
  position to the kernel's signature (`_run_kernel`), so a wrong parameter order gives wrong numbers too.
* `device="hip" | "cuda"`: the C runtime on a GPU (the driver library is dlopened; `driver_lib`
  overrides its path, which is how the fake drivers of the tests are plugged in).
Function runs are launch by launch (`graph=False`) or through a graph captured on first use and then
replayed (`graph=True`): per-step inputs are re-uploaded into the same buffers before each replay.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch

from v4compile.errors import DeviceError, InputError
from v4compile.ir.registry import get_op
from v4compile.ir.types import DTYPES
from v4compile.ops.fused_allreduce import (DP_MOE, GATHERED, PRODUCED, REDUCED, SEAM_IN, SEAM_ROWS_FOLDED,
                                           consumer_of, inner_attrs, producer_of, rows_folded)
from v4compile.program.core import Program
from v4compile.program.execute import _typed, run_launch
from v4compile.signals import act_pending, held
from v4compile.targets import DEVICE_TARGET

from .build import library
from .schedule import PEERS, SYMMETRIC, TABLES, Schedule, build_schedule

log = logging.getLogger(__name__)

ABI_VERSION = 1
DEVICES = ("host", "hip", "cuda")
STATUS = ("ok", "bad argument", "ABI version mismatch", "bad launch table", "driver unavailable",
          "code object load failed", "kernel symbol missing", "out of memory", "launch failed", "graph failed")
HOST_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                               ctypes.POINTER(ctypes.c_uint64))


COPY_SAVE, COPY_RESTORE, COPY_DEVICE = 0, 1, 2  # v4rt.h V4RT_COPY_*
COPY_CALL = 0xFFFFFFFE  # the host callback's function index for a copy of the copy table


class Range(ctypes.Structure):
    """A copy table entry (v4rt.h v4rt_range): at index k, bytes [offset + k * stride, + nbytes) of a buffer."""
    _fields_ = [("buffer", ctypes.c_uint32), ("group", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("stride", ctypes.c_int64), ("nbytes", ctypes.c_uint64)]


PROBE_AFTER, PROBE_BEFORE = 0, 1  # v4rt.h V4RT_PROBE_*


class Probe(ctypes.Structure):
    """A probe table entry (v4rt.h v4rt_probe): `nbytes` at `offset` of a buffer copied to `host` before or after a
    call of the function, in its runs launch by launch."""
    _fields_ = [("call", ctypes.c_uint32), ("when", ctypes.c_uint32), ("buffer", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32), ("offset", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("host", ctypes.c_void_p)]


class Stats(ctypes.Structure):
    _fields_ = [("launches", ctypes.c_uint64), ("captures", ctypes.c_uint64), ("replays", ctypes.c_uint64),
                ("bytes_allocated", ctypes.c_uint64)]


_LIBS: dict[str, ctypes.CDLL] = {}


def load_library(path=None, sanitize: bool = False) -> ctypes.CDLL:
    path = str(path or library(sanitize))
    if path in _LIBS:
        return _LIBS[path]
    lib = ctypes.CDLL(path)
    c = ctypes
    lib.v4rt_abi_version.restype = c.c_uint32
    lib.v4rt_last_error.restype = c.c_char_p
    lib.v4rt_open.argtypes = [c.c_uint32, c.c_char_p, c.c_char_p, c.c_void_p, c.c_size_t, HOST_KERNEL, c.c_void_p,
                              c.POINTER(c.c_void_p)]
    lib.v4rt_close.argtypes = [c.c_void_p]
    lib.v4rt_close.restype = None
    lib.v4rt_buffer_info.argtypes = [c.c_void_p, c.c_uint32, c.POINTER(c.c_uint64), c.POINTER(c.c_uint64)]
    lib.v4rt_write.argtypes = [c.c_void_p, c.c_uint32, c.c_uint64, c.c_void_p, c.c_uint64]
    lib.v4rt_read.argtypes = [c.c_void_p, c.c_uint32, c.c_uint64, c.c_void_p, c.c_uint64]
    lib.v4rt_run.argtypes = [c.c_void_p, c.c_uint32, c.c_int]
    lib.v4rt_sync.argtypes = [c.c_void_p]
    lib.v4rt_get_stats.argtypes = [c.c_void_p, c.POINTER(Stats)]
    lib.v4rt_copy_table.argtypes = [c.c_void_p, c.c_uint32, c.POINTER(Range)]
    lib.v4rt_copy.argtypes = [c.c_void_p, c.c_uint32, c.c_uint32, c.c_uint64, c.c_uint64, c.c_void_p, c.c_uint64]
    lib.v4rt_probe_table.argtypes = [c.c_void_p, c.c_uint32, c.c_uint32, c.POINTER(Probe)]
    lib.v4rt_comm_unique_id.argtypes = [c.c_char_p, c.c_char_p, c.c_void_p]
    lib.v4rt_comm_init.argtypes = [c.c_void_p, c.c_char_p, c.c_uint32, c.c_uint32, c.POINTER(c.c_uint32), c.c_void_p]
    lib.v4rt_ipc_handle.argtypes = [c.c_void_p, c.c_uint32, c.c_void_p]
    lib.v4rt_ipc_open.argtypes = [c.c_void_p, c.c_uint32, c.c_uint32, c.c_uint32, c.c_void_p, c.POINTER(c.c_uint64)]
    if lib.v4rt_abi_version() != ABI_VERSION:
        raise DeviceError("the C runtime library has another ABI version", where=path, expected=ABI_VERSION,
                          found=lib.v4rt_abi_version())
    _LIBS[path] = lib
    return lib


class CRuntime:
    """One program loaded in the C runtime: every buffer allocated, weights uploaded, pool / state zeroed."""

    def __init__(self, program: Program, weights: Mapping[str, torch.Tensor], device: str = "host", *,
                 driver_lib: str | None = None, kernel_calls: Callable | None = None,
                 functions: list[str] | None = None, lib: ctypes.CDLL | None = None, abi: int = ABI_VERSION,
                 table: Callable[[Schedule], bytes] | None = None, binaries: Callable | None = None,
                 collective: Callable | None = None, exchange: Callable | None = None):
        if device not in DEVICES:
            raise InputError(f"unknown device '{device}'", expected=", ".join(DEVICES))
        self.program = program
        self.device = device
        # (op, tensor, group) -> the group's result: a partitioned program's collective launches (host device:
        # `distributed.Ranks.collective`, torch.distributed with gloo); None: a collective is refused
        self.collective = collective
        self.lib = lib or load_library()
        self.sched: Schedule = build_schedule(program, kernel_calls, functions, warp=64 if device == "hip" else 32,
                                              binaries=binaries)
        # `table`: how the schedule becomes the bytes handed to the C runtime (tests use fake code objects)
        self.table = self.sched.to_bytes() if table is None else table(self.sched)
        self.error: BaseException | None = None
        self.group_rank = None  # this rank's index in the one-shot all-reduce's group (`_map_peers`)
        # the host device's check of the copy table's copies and of the steps' writes between them
        # (`copy_check.CopyCheck`); None: unchecked (the GPU devices, or a runtime without copies)
        self.copy_check = None
        # host device, check mode only (the self-check's router picks and layer statistics): called with (function
        # schedule, call index, launch) before / after each call the callback runs; never set for the steps users run
        self.before_call: Callable | None = None
        self.after_call: Callable | None = None
        self._probes: dict[str, list[np.ndarray]] = {}  # each function's probe arrays (`probe_table`), kept alive
        self._cb = HOST_KERNEL(self._host_kernel)  # kept alive as long as the runtime
        self.handle = ctypes.c_void_p()
        rc = self.lib.v4rt_open(abi, device.encode(), driver_lib.encode() if driver_lib else None, self.table,
                                len(self.table), self._cb, None, ctypes.byref(self.handle))
        if rc:
            self.handle = None
            self._raise(rc, f"opening the C runtime ({device})")
        try:
            self.addr, self.views = [], {}
            for i, key in enumerate(self.sched.buffer_names):
                a, n = ctypes.c_uint64(), ctypes.c_uint64()
                self._check(self.lib.v4rt_buffer_info(self.handle, i, ctypes.byref(a), ctypes.byref(n)), "buffer info")
                self.addr.append(a.value)
                if device == "host":  # tensors viewing the C memory (no copy): what the callback computes on
                    raw = (ctypes.c_uint8 * max(n.value, 1)).from_address(a.value)
                    self.views[key] = torch.frombuffer(raw, dtype=torch.uint8)[: n.value]
            self._by_addr = sorted((a, i) for i, a in enumerate(self.addr))
            self._allocations = [(a, a + n) for a, n in zip(self.addr, self.sched.buffer_bytes)]
            wbuf = {}
            for i, (key, kind) in enumerate(zip(self.sched.buffer_names, self.sched.buffer_kinds)):
                if kind == "weight":
                    if key not in weights:
                        raise InputError(f"no tensor for weight @{key}")
                    wbuf[key] = i
                elif kind in ("pool", "state", "symmetric"):
                    self.write(i, torch.zeros(self.sched.buffer_bytes[i], dtype=torch.uint8))
            self._upload(weights, wbuf)
            for at, entries in self.sched.tables:  # each call's pointer table: its entries' addresses here
                self.write(self.sched.index[TABLES], torch.tensor([self.addr[b] + off if b >= 0 else 0
                                                                   for b, off in entries], dtype=torch.int64), at)
            if self.sched.region is not None:
                self._map_peers(exchange)
        except BaseException:
            self.close()
            raise

    def _upload(self, weights, wbuf: dict[str, int]) -> None:
        """Every weight into its buffer. An artifact's weights (`weights_map.MappedWeights`) are streamed in
        file order through a few reused chunk buffers (hashed on the way when the load deferred their check),
        so host memory holds the weights once (host device) or not at all (GPU devices), never twice."""
        if not hasattr(weights, "chunks"):
            for key, i in wbuf.items():
                self.write(i, weights[key])
            return
        for key, off, buf, start, n in weights.chunks():
            if key in wbuf:
                ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf, start))
                self._check(self.lib.v4rt_write(self.handle, wbuf[key], off, ptr, n),
                            f"writing buffer {self.sched.buffer_names[wbuf[key]]}")

    def _map_peers(self, exchange: Callable | None) -> None:
        """The one-shot all-reduce's peers (`schedule.PEERS`): this rank's region exported, the group's handles
        exchanged (`exchange(group, handle) -> (handles in rank order, this rank's index)`: `Ranks.exchange`),
        the peers' regions mapped, and the table of every region's address here, then this rank's index, written.
        Every rank zeroed its region before its handle left it, so no peer writes into it before that."""
        region = self.sched.region
        if exchange is None:
            raise DeviceError(f"the program's one-shot all-reduces over {region.group} ranks need the process group "
                              "of a partitioned artifact (v4compile.load under torchrun)")
        sym = self.sched.index[SYMMETRIC]
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(self.lib.v4rt_ipc_handle(self.handle, sym, handle), "exporting the symmetric region")
        handles, me = exchange(region.group, handle.raw)
        if len(handles) != region.group or any(len(h) != IPC_HANDLE_BYTES for h in handles):
            raise DeviceError("the group's IPC handles came back malformed", expected=region.group,
                              found=[len(h) for h in handles])
        addrs = (ctypes.c_uint64 * region.group)()
        self._check(self.lib.v4rt_ipc_open(self.handle, sym, region.group, me, b"".join(handles), addrs),
                    "mapping the peers' symmetric regions")
        self.write(self.sched.index[PEERS], torch.tensor(list(addrs) + [me], dtype=torch.int64))
        self.group_rank = me
        # the kernel's poll bound, for the late-peer error: found once here, not in every step's check
        kc = next(c.kernel for f in self.sched.functions for c in f.calls
                  if c.kernel is not None and any(p[1] == "peers" for p in c.kernel.pointers))
        from v4compile.codegen.kernels.allreduce import spin_of

        self._spin = spin_of(kc.for_target(DEVICE_TARGET[self.device])[2] if self.device != "host" else kc.constexprs)
        # the host device's memory guard: the peers' regions are memory the kernel may touch
        self._allocations += [(a, a + region.nbytes) for i, a in enumerate(addrs) if i != me]

    def check_peers(self) -> None:
        """After a run: a one-shot all-reduce that gave up waiting for a peer left its mark in the status words
        (`codegen/kernels/peers.py`); one clear error then, naming the rank and the peer."""
        from v4compile.codegen.kernels.peers import STATUS_WORDS, WORD, late_peer_error

        region = self.sched.region
        status = self.read(self.sched.index[SYMMETRIC], 0, STATUS_WORDS * WORD).view(torch.int64).tolist()
        err = late_peer_error(tuple(status), self.group_rank, region.group, self._spin)
        if err:
            raise DeviceError(err)

    # ---- errors ----------------------------------------------------------------------------------
    def _raise(self, rc: int, what: str):
        if self.error is not None:  # the host callback failed: its exception is the cause
            e, self.error = self.error, None
            if not isinstance(e, Exception):  # Ctrl-C, SIGTERM (cli.Terminated), exit: stopped, not a kernel fault
                raise e
            raise DeviceError(f"{what}: a host kernel failed: {e}") from e
        msg = self.lib.v4rt_last_error().decode(errors="replace")
        kind = STATUS[rc] if 0 <= rc < len(STATUS) else f"status {rc}"
        raise DeviceError(f"{what}: {kind}: {msg}")

    def _check(self, rc: int, what: str) -> None:
        if rc:
            self._raise(rc, what)

    # ---- buffers ---------------------------------------------------------------------------------
    def write(self, buffer: int, t, offset: int = 0) -> None:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(t))
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self._check(self.lib.v4rt_write(self.handle, buffer, offset, b.data_ptr(), b.numel()),
                    f"writing buffer {self.sched.buffer_names[buffer]}")

    def read(self, buffer: int, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        n = self.sched.buffer_bytes[buffer] - offset if nbytes is None else nbytes
        out = torch.empty(n, dtype=torch.uint8)
        self._check(self.lib.v4rt_read(self.handle, buffer, offset, out.data_ptr(), out.numel()),
                    f"reading buffer {self.sched.buffer_names[buffer]}")
        return out

    def copy_table(self, ranges: list[tuple[int, int, int, int, int]]) -> None:
        """Give the C runtime its copy table: (buffer, group, offset, stride, nbytes) each (v4rt.h)."""
        arr = (Range * max(len(ranges), 1))(*[Range(*r) for r in ranges])
        self._check(self.lib.v4rt_copy_table(self.handle, len(ranges), arr), "setting the copy table")

    def copy(self, kind: int, group: int, index: int, to: int = 0, host: np.ndarray | None = None,
             what: tuple | None = None) -> None:
        """One copy of a group's ranges at `index` (COPY_SAVE into `host`, COPY_RESTORE from it, COPY_DEVICE to
        index `to`), issued by the C runtime; `what` tells the host device's check what it is for."""
        ptr, n = (None, 0) if host is None else (host.ctypes.data, host.nbytes)
        if host is not None and not host.flags.c_contiguous:
            raise InputError("a copy's host side must be contiguous")
        if self.copy_check is not None:
            self.copy_check.begin(kind, group, index, to, what)
        with held():  # the host device's check is a callback, as a host kernel is
            rc = self.lib.v4rt_copy(self.handle, kind, group, index, to, ptr, n)
        self._check(rc, "copying")
        if self.copy_check is not None:
            self.copy_check.end()

    def probe_table(self, fname: str, probes: list[tuple[int, int, int, int, np.ndarray]]) -> None:
        """Set `fname`'s probes (v4rt.h v4rt_probe_table; [] clears them): (call, PROBE_AFTER / PROBE_BEFORE,
        buffer index, byte offset, host array) each, the array's bytes filled from that range in the function's
        next runs launch by launch. Check mode only: a graph run of the function is refused while they are set.
        The arrays are kept alive here until the table is replaced."""
        for *_, host in probes:
            if not isinstance(host, np.ndarray) or not host.flags.c_contiguous or not host.flags.writeable:
                raise InputError("a probe's host side must be a writeable contiguous numpy array")
        arr = (Probe * max(len(probes), 1))(*[Probe(c, w, b, 0, off, h.nbytes, h.ctypes.data)
                                             for c, w, b, off, h in probes])
        self._check(self.lib.v4rt_probe_table(self.handle, self.sched.function_index(fname), len(probes), arr),
                    f"setting the probes of @{fname}")
        self._probes[fname] = [h for *_, h in probes]

    def buffer(self, fname: str, name: str) -> torch.Tensor:
        """A copy of a function's buffer as raw bytes (pool, state, arena, input, output ...)."""
        return self.read(self.sched.buffer_index(fname, name))

    def stats(self) -> dict[str, int]:
        s = Stats()
        self._check(self.lib.v4rt_get_stats(self.handle, ctypes.byref(s)), "stats")
        return {k: getattr(s, k) for k, _ in Stats._fields_}

    # ---- running ---------------------------------------------------------------------------------
    def run(self, fname: str, inputs: Mapping[str, object], graph: bool = False) -> dict[str, torch.Tensor]:
        """Upload the step inputs, run `fname`, return its `output` buffers (pool and state stay here)."""
        self.upload(fname, inputs)
        self.launch(fname, graph)
        if self.copy_check is not None:
            self.copy_check.ran(inputs)
        f = self.program.functions[fname]
        out = {}
        for n, a in f.outputs:
            if f.buffer(a.buffer).kind == "output":
                out[n] = _typed(self.buffer(fname, a.buffer), a).clone()
        if self.sched.region is not None:  # after the outputs' read: the step has finished on the device
            self.check_peers()
        return out

    def upload(self, fname: str, inputs: Mapping[str, object]) -> None:
        """Write `fname`'s step inputs into their buffers (checked: every input, its shape)."""
        if fname not in self.program.functions:
            raise InputError(f"no function '{fname}'", expected=", ".join(self.program.functions))
        f = self.program.functions[fname]
        for b in f.buffers:
            if b.kind != "input":
                continue
            if b.name not in inputs:
                raise InputError(f"missing step input '{b.name}'", where=f"@{fname}")
            t = inputs[b.name]
            t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else torch.as_tensor(t)
            if tuple(t.shape) != b.type.shape:
                raise InputError(f"step input '{b.name}' has the wrong shape", where=f"@{fname}",
                                 expected=list(b.type.shape), found=list(t.shape))
            self.write(self.sched.buffer_index(fname, b.name), t.to(DTYPES[b.type.dtype]))

    def launch(self, fname: str, graph: bool = False) -> None:
        """Run `fname` on the inputs already uploaded (no transfers; for timing)."""
        with held():  # its host kernels and collectives are callbacks: a signal is acted on in one (`_host_kernel`)
            rc = self.lib.v4rt_run(self.handle, self.sched.function_index(fname), 1 if graph else 0)
        self._check(rc, f"running @{fname}")

    def comm_init(self, rank: int, ids: Mapping[int, bytes], comm_lib: str | None = None) -> None:
        """Join the NCCL / RCCL communicators (GPU devices): group size -> its unique id (`comm_unique_id`,
        shared by the group's ranks: `distributed.Ranks.comm_ids`)."""
        sizes = sorted(ids)
        arr = (ctypes.c_uint32 * len(sizes))(*sizes)
        blob = b"".join(ids[n] for n in sizes)
        self._check(self.lib.v4rt_comm_init(self.handle, comm_lib.encode() if comm_lib else None, rank, len(sizes),
                                            arr, blob), "joining the communicators")

    def sync(self) -> None:
        with held():
            rc = self.lib.v4rt_sync(self.handle)
        self._check(rc, "synchronising")

    def _where(self, ptr: int) -> tuple[str, int]:
        i = bisect.bisect_right(self._by_addr, (ptr, 1 << 62)) - 1
        if i >= 0:
            base, b = self._by_addr[i]
            if ptr - base <= self.sched.buffer_bytes[b]:
                return self.sched.buffer_names[b], ptr - base
        raise DeviceError(f"kernel pointer {ptr:#x} lies in no buffer of the runtime")

    def _place(self, ptr: int, nbytes: int) -> tuple[str, int] | None:
        """(buffer, offset) of a copy's side in the runtime's buffers, or None for host memory outside them."""
        i = bisect.bisect_right(self._by_addr, (ptr, 1 << 62)) - 1
        if i >= 0:
            base, b = self._by_addr[i]
            if ptr + nbytes <= base + self.sched.buffer_bytes[b]:
                return self.sched.buffer_names[b], ptr - base
        return None

    def _host_kernel(self, _user, fidx: int, cidx: int, n: int, params) -> int:
        try:
            act_pending()  # a signal that came while C ran (`held`): raised here, where the run stops cleanly
            if fidx == COPY_CALL:  # a copy of the copy table: checked before the driver makes it
                if self.copy_check is not None:
                    dst, src, nbytes, kind = (params[i] for i in range(4))
                    self.copy_check.copy(cidx, kind, self._place(dst, nbytes), self._place(src, nbytes), nbytes)
                return 0
            fs = self.sched.functions[fidx]
            call = fs.calls[cidx]
            if n != len(call.params):
                raise DeviceError(f"call {cidx} of @{fs.name}: {n} parameters", expected=len(call.params))
            places = [None if params[i] == 0 else self._where(params[i]) for i in range(n)]
            launch = fs.program.launches[fs.launch_of[cidx]]
            if self.before_call is not None:
                self.before_call(fs, cidx, launch)
            if call.kernel is None:
                self._run_reference(launch, call, places)
            else:
                self._run_kernel(launch, call, cidx, places)
            if self.after_call is not None:
                self.after_call(fs, cidx, launch)
            return 0
        except BaseException as e:  # never unwind through C (a signal's exception too: `_raise` re-raises it)
            self.error = e
            return 1

    def _run_reference(self, launch, call, places) -> None:
        """The op's reference on the values at the pointers the C runtime passed (types and strides from
        the program: they are compile-time constants of the kernel)."""
        at = {p.role: w for p, w in zip(call.params, places)}

        def moved(kind, n, a):
            w = at[f"{kind}:{n}"]
            if a is None or w is None:
                if (a is None) != (w is None):
                    raise DeviceError(f"{launch.op}: '{n}' is {'NULL' if w is None else 'set'} in the call")
                return a
            return dataclasses.replace(a, buffer=w[0], offset=w[1])

        l = dataclasses.replace(launch, operands=tuple((n, moved("operand", n, a)) for n, a in launch.operands),
                                results=tuple((n, moved("result", n, a)) for n, a in launch.results))
        run_launch(l, self.views, self._collective if get_op(l.op).collective else None)

    def _collective(self, l, args, outs) -> None:
        """A collective launch (its placeholder call: no kernel family runs it) through `collective`; a one-shot
        all-reduce folded into its consumer (`ar_*`) as the all-reduce of its `y`, then the consumer's reference;
        DP's MoE with its rows collectives folded in as the gather, the MoE's reference, the reduce-scatter (the seam
        before it first, where it is folded in too)."""
        if self.collective is None:
            raise DeviceError(f"{l.op}: a collective launch needs the process group of a partitioned artifact "
                              "(v4compile.load under torchrun)")
        if rows_folded(l.op):
            from v4compile.ops.fused import IN_MHC_ATTRS, _in_attrs

            group, opdef, seam = int(l.attrs["group"]), get_op(DP_MOE), []
            attrs = {n: v for n, v in inner_attrs(l.attrs).items() if n not in IN_MHC_ATTRS}
            if l.op == SEAM_ROWS_FOLDED:  # the seam before: the MoE's x, and its streams / post / comb results
                s, x, p, c = get_op("mhc_post_pre").run([args[n] for n in SEAM_IN], _in_attrs(l.attrs))
                args, seam = {**args, "x": x}, [s, p, c]
            args = {**args, GATHERED: self.collective("all_gather_rows", args["x"], group)}
            got = list(opdef.run([args[n] for n in opdef.operand_names], attrs))
            at = opdef.results.index(PRODUCED)
            got[at] = self.collective("reduce_scatter_rows", got[at], group)
            for (n, y), g in zip(outs.items(), [*got, *seam]):
                y.copy_(g)
            return
        inner, producer = consumer_of(l.op), producer_of(l.op)
        if inner is not None or producer is not None:
            group = int(l.attrs["group"])
            if inner is not None:  # folded into its consumer: the sum (on gloo), then the consumer's reference
                args = {**args, REDUCED: self.collective("all_reduce", args[REDUCED], group)}
                producer = producer_of(inner)
            opdef = get_op(producer or inner)
            got = list(opdef.run([args[n] for n in opdef.operand_names], inner_attrs(l.attrs)))
            if producer is not None:  # folded into its producer: its reference, then the sum of its partial
                at = opdef.results.index(PRODUCED)
                got[at] = self.collective("all_reduce", got[at], group)
            for (n, y), g in zip(outs.items(), got):
                y.copy_(g)
            return
        (name, y), = outs.items()
        y.copy_(self.collective(l.op, args[get_op(l.op).operand_names[0]], int(l.attrs["group"]),
                                int(l.attrs.get("tp", 1))))

    def _run_kernel(self, launch, call, cidx: int, places) -> None:
        """The Triton kernel on the packed parameter values, bound by position as a GPU binds them: the
        i-th value goes to the i-th pointer parameter the kernel declares, viewed as that parameter's
        element type. Before running, each value must point into one buffer with room for what the kernel
        reads or writes through that parameter (the extent of the value the call binds it to, from the
        program's types and strides), and every address the kernel then touches must lie in a buffer
        (`memory_guard`: what a GPU would fault on, the interpreter would read or write unchecked; the guard also
        applies `interpreter_fixes()`, without which the interpreter's fp8 casts round otherwise than a GPU)."""
        from v4compile.codegen.kernels.dtypes import typed_from
        from v4compile.codegen.kernels.interpreter import memory_guard

        kc = call.kernel
        if len(places) != len(kc.pointers):
            raise DeviceError(f"call {cidx} ({kc.kernel_name}): {len(places)} parameters, the kernel declares "
                              f"{len(kc.pointers)} pointers")
        ops, res = dict(launch.operands), dict(launch.results)
        values = []
        for (param, kind, name, ty), w in zip(kc.pointers, places):
            if w is None:
                values.append(None)
                continue
            if kind in ("scratch", "semaphore"):
                need = kc.scratch_bytes[name]
            elif kind == "peers":
                need = self.sched.region.table_bytes
            elif kind == "table":
                need = 8 * len(kc.tabled)
            else:
                a = (ops if kind == "operand" else res)[name]
                first, end = a.extent if a is not None else (0, 0)
                need = end - first - kc.offsets.get(param, 0)
            room = self.sched.buffer_bytes[self.sched.index[w[0]]] - w[1]
            if need > room:
                raise DeviceError(f"call {cidx} ({kc.kernel_name}): parameter '{param}' points at {w[0]}+{w[1]}, "
                                  f"{need} bytes are read or written from there, the buffer has {room} left")
            values.append(typed_from(self.views[w[0]][w[1]:], ty))
        with memory_guard(self._allocations):
            kc.fn[kc.grid](*kc.bind(values), num_warps=kc.num_warps, num_stages=kc.num_stages)

    def close(self) -> None:
        if getattr(self, "handle", None):
            self.lib.v4rt_close(self.handle)
            self.handle = None
        self.views = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


COMM_ID_BYTES = 128  # V4RT_COMM_ID_BYTES (ncclUniqueId)
IPC_HANDLE_BYTES = 64  # V4RT_IPC_HANDLE_BYTES (cudaIpcMemHandle_t, hipIpcMemHandle_t, the host's fd path)


def comm_unique_id(device: str, comm_lib: str | None = None, lib: ctypes.CDLL | None = None) -> bytes:
    """A new communicator unique id from NCCL (cuda) / RCCL (hip), or `comm_lib`."""
    lib = lib or load_library()
    out = ctypes.create_string_buffer(COMM_ID_BYTES)
    if lib.v4rt_comm_unique_id(device.encode(), comm_lib.encode() if comm_lib else None, out):
        raise DeviceError(f"collectives: {lib.v4rt_last_error().decode(errors='replace')}")
    return out.raw
