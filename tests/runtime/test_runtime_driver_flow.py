"""The one GPU driver flow (runtime/c/drv_gpu.c) on the fake HIP and CUDA drivers, call by call: the exact
sequence of driver calls of open / eager run / capture / replay / close, derived here from the schedule
(writes pageable, or through pinned staging buffers at three sizes: tests/runtime/test_staged_upload.py
checks the bytes);
the dynamic shared memory opt-in (once per kernel, for its largest call, only above the driver's default:
CUDA 48 KiB, HIP 64 KiB); and the failures inside a run (graph instantiation, a launch eager or during
capture, a graph replay): one clear error naming the driver call, nothing leaked, the runtime still usable."""

from __future__ import annotations

import collections
import ctypes
import dataclasses

import pytest
import torch

from runtime_helpers import Fake, fake_table, runtime_variant, tiny
from v4compile.errors import DeviceError
from v4compile.runtime.c_backend import CRuntime, load_library

DRIVERS = ("cuda", "hip")
# Each step of the flow -> the driver's symbols it calls (as the fake driver traces them).
CALLS = {
    "cuda": dict(open=["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuStreamCreate"],
                 load="cuModuleLoadData", getfn="cuModuleGetFunction", attr="cuFuncSetAttribute",
                 alloc="cuMemAlloc_v2", h2d="cuMemcpyHtoDAsync_v2", d2h="cuMemcpyDtoHAsync_v2",
                 sync="cuStreamSynchronize", launch="cuLaunchKernel", begin="cuStreamBeginCapture_v2",
                 end="cuStreamEndCapture", instantiate="cuGraphInstantiateWithFlags", replay="cuGraphLaunch",
                 exec_destroy="cuGraphExecDestroy", graph_destroy="cuGraphDestroy", free="cuMemFree_v2",
                 unload="cuModuleUnload", close=["cuStreamDestroy_v2", "cuDevicePrimaryCtxRelease_v2"],
                 current=["cuCtxSetCurrent"], host_alloc="cuMemHostAlloc", host_free="cuMemFreeHost",
                 event_create="cuEventCreate", event_record="cuEventRecord", event_sync="cuEventSynchronize",
                 event_destroy="cuEventDestroy_v2"),
    "hip": dict(open=["hipInit", "hipSetDevice", "hipStreamCreateWithFlags"],
                load="hipModuleLoadData", getfn="hipModuleGetFunction", attr="hipFuncSetAttribute",
                alloc="hipMalloc", h2d="hipMemcpyAsync", d2h="hipMemcpyAsync", sync="hipStreamSynchronize",
                launch="hipModuleLaunchKernel", begin="hipStreamBeginCapture", end="hipStreamEndCapture",
                instantiate="hipGraphInstantiate", replay="hipGraphLaunch", exec_destroy="hipGraphExecDestroy",
                graph_destroy="hipGraphDestroy", free="hipFree", unload="hipModuleUnload",
                close=["hipStreamDestroy"], current=[], host_alloc="hipHostMalloc", host_free="hipHostFree",
                event_create="hipEventCreateWithFlags", event_record="hipEventRecord",
                event_sync="hipEventSynchronize", event_destroy="hipEventDestroy"),
}
SHARED_DEFAULT = {"cuda": 48 * 1024, "hip": 64 * 1024}
ERRORS = {"cuda": {719: "CUDA_ERROR_LAUNCH_FAILED", 999: "CUDA_ERROR_UNKNOWN", 1: "CUDA_ERROR_INVALID_VALUE"},
          "hip": {719: "hipErrorLaunchFailure", 999: "hipErrorUnknown", 1: "hipErrorInvalidValue"}}


def _inputs(prog, fname, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {b.name: torch.randint(0, 4, b.type.shape, generator=g)
            for b in prog.functions[fname].buffers if b.kind == "input"}


# The staging of drv_gpu.c (V4RT_STAGE_COUNT, _BYTES, _MIN): its defaults, and small ones under which the tiny
# program's writes are staged (a buffer's copies spanning buffers, several of them in one).
STAGING = {"default": (2, 16 << 20, 1 << 20), "small": (2, 65536, 16384), "three": (3, 40000, 4096)}


def staged_runtime(staging: str):
    """The C runtime built with these staging sizes (None: the default build)."""
    if staging == "default":
        return None
    n, size, least = STAGING[staging]
    return load_library(runtime_variant((f"V4RT_STAGE_COUNT={n}", f"V4RT_STAGE_BYTES={size}",
                                         f"V4RT_STAGE_MIN={least}")))


class _Flow:
    """The driver calls of the GPU flow, derived from its rules: a write below the staging minimum before
    the staging buffers exist is one pageable copy; from the first large one on, each write is cut into
    copies from the staging buffers filled in turn (the full one's event recorded, the next one's waited
    for); the copies stay in flight until a synchronise, which a read, a capture's beginning and the
    first free after them do."""

    def __init__(self, driver: str, staging: str):
        self.k, (self.count, self.size, self.least) = CALLS[driver], STAGING[staging]
        self.staged = self.pending = False
        self.fill = 0

    def write(self, n: int) -> list[str]:
        k, out = self.k, list(self.k["current"])
        if not self.staged and n < self.least:
            return out + [k["h2d"]]
        if not self.staged:
            out += [k["host_alloc"], k["event_create"]] * self.count
            self.staged, self.fill = True, 0
        while n:
            if self.fill == self.size:
                out += [k["event_record"], k["event_sync"]]
                self.fill = 0
            m = min(n, self.size - self.fill)
            out.append(k["h2d"])
            self.fill, n, self.pending = self.fill + m, n - m, True
        return out

    def drain(self) -> list[str]:
        out, self.pending = [self.k["sync"]] if self.pending else [], False
        return out

    def read(self) -> list[str]:
        self.pending = False
        return self.k["current"] + [self.k["sync"], self.k["d2h"], self.k["sync"]]

    def close(self) -> list[str]:
        return [self.k["host_free"], self.k["event_destroy"]] * self.count if self.staged else []


def _expected_trace(rt, driver, steps, staging="default"):
    """The driver calls of CRuntime(...) then `steps` [(function, graph)] then close(), from the schedule."""
    k, s, flow = CALLS[driver], rt.sched, _Flow(driver, staging)
    out = list(k["open"]) + [k["load"]] * len(s.code_objects)
    seen = set()
    for f in s.functions:
        for c in f.calls:
            if (c.code, c.symbol) not in seen:
                seen.add((c.code, c.symbol))
                out.append(k["getfn"])
    out += [k["alloc"]] * len(s.buffer_names)
    # every public entry first makes the device current on the calling thread (CUDA: its context)
    cur = k["current"]
    for kinds in (("pool", "state"), ("weight",)):  # pool and state zeroed, then the weights uploaded
        for kind, n in zip(s.buffer_kinds, s.buffer_bytes):
            if kind in kinds and n:
                out += flow.write(n)
    captured = []
    for fname, graph in steps:
        f, fs = rt.program.functions[fname], s.functions[s.function_index(fname)]
        for b in f.buffers:
            if b.kind == "input" and s.buffer_bytes[s.buffer_index(fname, b.name)]:
                out += flow.write(s.buffer_bytes[s.buffer_index(fname, b.name)])
        out += cur
        if not graph:
            out += [k["launch"]] * len(fs.calls)
        elif fname in captured:
            out += [k["replay"]]
        else:
            captured.append(fname)
            out += flow.drain() + [k["begin"]] + [k["launch"]] * len(fs.calls) + [k["end"], k["instantiate"], k["replay"]]
        for _ in range(sum(1 for _, a in f.outputs if f.buffer(a.buffer).kind == "output")):
            out += flow.read()
    captured.sort(key=s.function_index)
    out += cur + [k["exec_destroy"], k["graph_destroy"]] * len(captured) + flow.drain()
    return (out + [k["free"]] * len(s.buffer_names) + [k["unload"]] * len(s.code_objects) + flow.close()
            + list(k["close"]))


@pytest.mark.parametrize("staging", list(STAGING))
@pytest.mark.parametrize("driver", DRIVERS)
def test_every_driver_call_in_order(driver, staging):
    """(Under the default staging the tiny program's writes are all pageable copies; under the small ones
    they are staged, with the input writes of every step.)"""
    m, prog, w = tiny()
    fake = Fake(driver)
    rt = CRuntime(prog, w, driver, driver_lib=fake.path, table=fake_table(), lib=staged_runtime(staging))
    steps = [("decode", False), ("decode", True), ("decode", True), ("prefill", True), ("prefill", False),
             ("decode", True)]
    for i, (fname, graph) in enumerate(steps):
        rt.run(fname, _inputs(prog, fname, i), graph=graph)
    rt.close()
    want, got = _expected_trace(rt, driver, steps, staging), fake.trace()
    assert got == want, next((i, g, w_) for i, (g, w_) in enumerate(zip(got + [None], want + [None])) if g != w_)
    assert fake.counts()["attrs"] == 0  # no kernel of the tiny table needs more than the default shared memory
    c = fake.copies()
    assert (c["pinned"] > 0) == (staging != "default") and c["waited"] == 0
    assert c["pinned_live"] == c["events_live"] == c["queued"] == 0


def _first_two_repeated_and_one_single(sched):
    decode = sched.functions[sched.function_index("decode")]
    by = collections.defaultdict(list)
    for i, c in enumerate(decode.calls):
        by[c.symbol].append(i)
    repeated = next(s for s, ix in by.items() if len(ix) >= 2)
    other = next(s for s in by if s != repeated)
    return repeated, by[repeated][:2], other, by[other][0]


def _with_shared(sizes):
    """A fake table whose decode calls (by index) ask for these dynamic shared bytes."""
    def make(sched):
        f = sched.functions[sched.function_index("decode")]
        for i, n in sizes(sched).items():
            f.calls[i] = dataclasses.replace(f.calls[i], shared=n)
        return fake_table()(sched)
    return make


@pytest.mark.parametrize("driver", DRIVERS)
def test_large_shared_memory_is_opted_in_once_per_kernel(driver):
    """A kernel above the driver's default gets one attribute call at open, for its largest call; one
    between CUDA's 48 KiB and HIP's 64 KiB only on CUDA; small ones none. The launches then carry their
    shared bytes (the fake refuses a launch above the kernel's limit, as the drivers do)."""
    m, prog, w = tiny()
    fake = Fake(driver)
    picked = {}

    def sizes(sched):
        rep, (i, j), other, k = _first_two_repeated_and_one_single(sched)
        picked.update(rep=rep, other=other)
        return {i: 70 * 1024, j: 100 * 1024, k: 50 * 1024}

    rt = CRuntime(prog, w, driver, driver_lib=fake.path, table=_with_shared(sizes))
    want = {picked["rep"]: 100 * 1024}
    if 50 * 1024 > SHARED_DEFAULT[driver]:
        want[picked["other"]] = 50 * 1024
    attrs = fake.attrs()
    assert {name: value for name, _, value, _, _ in attrs} == want and len(attrs) == len(want)
    assert all(a == 8 and before == 0 and not capturing for _, a, _, before, capturing in attrs)
    trace = fake.trace()  # after every function lookup, before the first allocation
    k = CALLS[driver]
    assert trace.index(k["attr"]) > max(i for i, t in enumerate(trace) if t == k["getfn"])
    assert max(i for i, t in enumerate(trace) if t == k["attr"]) < trace.index(k["alloc"])
    for graph in (False, True, True):
        rt.run("decode", _inputs(prog, "decode"), graph=graph)
    fs = rt.sched.functions[rt.sched.function_index("decode")]
    shared = [g[6] for _, g, _, _ in fake.log()]
    assert shared == [c.shared for c in fs.calls] * 3 and max(shared) == 100 * 1024
    assert len(fake.attrs()) == len(want)  # nothing more at launch, capture or replay
    rt.close()
    assert fake.counts()["live"] == 0


def test_the_fake_driver_refuses_large_shared_memory_without_the_opt_in():
    """What makes the opt-in check able to fail: a launch above the default limit fails until the kernel's
    attribute is raised (and raising it beyond the device fails)."""
    for driver in DRIVERS:
        lib, k = Fake(driver).lib, CALLS[driver]
        load, getfn, launch, attr, unload = (getattr(lib, k[s]) for s in ("load", "getfn", "launch", "attr", "unload"))
        if driver == "cuda":  # as the runtime does: a context current on this thread, a stream of its own
            assert lib.cuCtxSetCurrent(ctypes.c_void_p(1)) == 0
        stream = ctypes.c_void_p()
        create = lib.cuStreamCreate if driver == "cuda" else lib.hipStreamCreateWithFlags
        assert create(ctypes.byref(stream), 1) == 0
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        assert load(ctypes.byref(mod), b"FAKE\nk 0\n\0") == 0 and getfn(ctypes.byref(fn), mod, b"k") == 0
        u = ctypes.c_uint
        n = SHARED_DEFAULT[driver]

        def go(shared):
            return launch(fn, u(1), u(1), u(1), u(1), u(1), u(1), u(shared), stream, None, None)

        assert go(n) == 0 and go(n + 1) == 1
        assert attr(fn, 8, n + 1) == 0 and go(n + 1) == 0 and go(n + 2) == 1
        assert attr(fn, 8, 1 << 20) == 1 and attr(fn, 7, n) == 1
        assert unload(mod) == 0
        assert (lib.cuStreamDestroy_v2 if driver == "cuda" else lib.hipStreamDestroy)(stream) == 0


@pytest.mark.parametrize("driver", DRIVERS)
def test_an_opt_in_the_device_refuses_is_one_clear_error_with_nothing_leaked(driver):
    m, prog, w = tiny()
    fake = Fake(driver)
    picked = {}

    def sizes(sched):
        rep, (i, _), _, _ = _first_two_repeated_and_one_single(sched)
        picked["code"] = sched.functions[sched.function_index("decode")].calls[i].code
        picked["rep"] = rep
        return {i: 300_000}

    with pytest.raises(DeviceError) as e:
        CRuntime(prog, w, driver, driver_lib=fake.path, table=_with_shared(sizes))
    attr = CALLS[driver]["attr"]
    assert str(e.value) == (f"opening the C runtime ({driver}): launch failed: kernel '{picked['rep']}' in code "
                            f"object {picked['code']}: allowing 300000 bytes of dynamic shared memory failed: "
                            f"{driver}: {attr} failed with error 1 ({ERRORS[driver][1]})")
    c = fake.counts()
    assert c["live"] == 0 and c["allocs"] == 0 and c["unloads"] == c["loads"] == 1 and c["streams"] == 0


# (fake failure, graph run?) -> status, what the error says before the driver's part, the failing call
RUN_FAILURES = {
    "instantiate": (("instantiate", 1), True, "graph failed", "capturing function {f}", "instantiate", 999),
    "launch in capture": (("launch", 3), True, "launch failed",
                          "capturing function {f}: function {f} call 2 ({sym}): launch failed", "launch", 719),
    "replay": (("graph_launch", 1), True, "graph failed", "replaying function {f}", "replay", 719),
    "eager launch": (("launch", 3), False, "launch failed", "function {f} call 2 ({sym}): launch failed", "launch",
                     719),
}


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("case", list(RUN_FAILURES))
def test_a_failure_in_a_run_is_one_clear_error_and_the_runtime_recovers(driver, case):
    m, prog, w = tiny()
    fake = Fake(driver)
    rt = CRuntime(prog, w, driver, driver_lib=fake.path, table=fake_table())
    (what, n), graph, status, where, call, code = RUN_FAILURES[case]
    f = rt.sched.function_index("decode")
    sym = rt.sched.functions[f].calls[2].symbol
    fake.fail(what, n)
    with pytest.raises(DeviceError) as e:
        rt.run("decode", _inputs(prog, "decode"), graph=graph)
    assert str(e.value) == (f"running @decode: {status}: {where.format(f=f, sym=sym)}: {driver}: "
                            f"{CALLS[driver][call]} failed with error {code} ({ERRORS[driver][code]})")
    c = fake.counts()
    captured = case == "replay"  # only a failed replay keeps its (good) graph
    assert c["graphs"] == c["execs"] == int(captured) and rt.stats()["captures"] == int(captured)
    rt.run("decode", _inputs(prog, "decode", 1), graph=graph)  # the same run now works
    # the fake counts instantiated graphs: the one of a failed capture was instantiated, then destroyed
    assert rt.stats()["captures"] == int(graph) and fake.counts()["captures"] == int(graph) + (case == "launch in capture")
    rt.close()
    c = fake.counts()
    assert c["live"] == 0 and c["frees"] == c["allocs"] and c["unloads"] == c["loads"]
    assert c["streams"] == 0 and c["graphs"] == 0 and c["execs"] == 0
