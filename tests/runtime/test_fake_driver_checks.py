"""The fake drivers refuse what the real drivers refuse, each shown on a deliberately broken table or
runtime with the real driver's error code in the message:

* parameter count and sizes, and the thread limit, read from the real binary (a cubin's .nv.info
  KPARAM_INFO / MAX_THREADS records, an hsaco's kernel descriptor and metadata note): a small kernel is
  compiled ahead of time for both targets and loaded by the fake drivers as the real ones would load it;
* a block one warp larger than the kernel's limit, and a grid beyond the device's, are INVALID_VALUE;
* inside stream capture, a synchronize, an allocation, a copy from host memory or a module load is
  STREAM_CAPTURE_UNSUPPORTED (a runtime patched to do one inside its capture);
* a pointer parameter outside every live allocation is ILLEGAL_ADDRESS (the host device, which knows
  each parameter's extent from the program, refuses a pointer one row past its buffer);
* HIP copies must name their direction rightly (a runtime patched to swap the kinds); on both drivers a
  copy's device side must lie wholly in one live allocation and its host side outside them (INVALID_VALUE);
  the prefix cache's copies (a slot's snapshot, its restore, a block copied device to device) go through
  them, issued by the C runtime from its copy table; a graph replays on
  the runtime's stream (a runtime patched to replay on the default stream is INVALID_HANDLE);
* programmatic dependent launch: every launch carries cuLaunchKernelEx's serialization attribute exactly where
  the schedule says (the compiled kernel waits: sidecar `pdl`), eagerly and in every replay of the captured
  graph (a table that drops the flag is caught); HIP, which has none, refuses such a launch; a table with an
  unknown launch flag is refused at open;
* `run` from a thread other than the opener's works: the runtime makes the CUDA context current on every
  entry (a runtime patched not to is CUDA_ERROR_INVALID_CONTEXT on the fake driver, whose context is per
  thread as CUDA's is).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime_helpers import Fake, fake_code_object, fake_table, runtime_variant, tiny  # noqa: E402
from runtime_helpers import PROMPTS, step_inputs  # noqa: E402
from v4compile.errors import DeviceError  # noqa: E402
from v4compile.runtime.c_backend import CRuntime, load_library  # noqa: E402
from v4compile.runtime.kernels import make_kernel_calls  # noqa: E402
from v4compile.runtime.schedule import HOST_CODE_OBJECT  # noqa: E402

DRIVERS = ("cuda", "hip")
TARGET = {"cuda": "sm_90a", "hip": "gfx950"}
WARP = {"cuda": 32, "hip": 64}
# sm_90a kernels launch with programmatic dependent launch (codegen/kernels/pdl.py): through cuLaunchKernelEx
INVALID_VALUE = {"cuda": "cuLaunchKernelEx failed with error 1 (CUDA_ERROR_INVALID_VALUE)",
                 "hip": "hipModuleLaunchKernel failed with error 1 (hipErrorInvalidValue)"}


def _inputs(prog, fname):
    return {b.name: torch.zeros(b.type.shape, dtype=torch.long) for b in prog.functions[fname].buffers
            if b.kind == "input"}


def _embed_only(launch):
    """The embed launches' real kernels; every other launch a placeholder."""
    return make_kernel_calls()(launch) if launch.kernel == "embed" else None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The embed family's kernel, the one of tiny's embed launches, compiled for both targets:
    {target: {call name: (binary, sidecar)}}."""
    from v4compile.codegen.aot import compile_calls

    m, prog, w = tiny()
    calls = {kc.name: kc for f in prog.functions.values() for l in f.launches for kc in (_embed_only(l) or ())}
    out = tmp_path_factory.mktemp("aot")
    compile_calls(list(calls.values()), list(TARGET.values()), out, jobs=1)
    res = {}
    for t in TARGET.values():
        res[t] = {}
        for name in calls:
            side = json.loads((out / t / f"{name}.json").read_text())
            res[t][name] = ((out / t / side["binary"]).read_bytes(), side)
    return res


def _runtime(device, compiled, change=None, **kw):
    """tiny on the fake driver: embed launches its compiled binary, every other launch a placeholder.
    `change(call, schedule) -> call` edits the first embed call of decode in the table."""
    m, prog, w = tiny()
    bins = compiled[TARGET[device]]

    def table(sched):
        sched.code_objects = [fake_code_object(sched) if c == HOST_CODE_OBJECT else c for c in sched.code_objects]
        if change is not None:
            f = sched.functions[sched.function_index("decode")]
            i = next(i for i, c in enumerate(f.calls) if c.kernel is not None)
            f.calls[i] = change(f.calls[i], sched)
        return sched.to_bytes()

    fake = Fake(device)
    rt = CRuntime(prog, w, device, driver_lib=fake.path, table=table, kernel_calls=_embed_only,
                  binaries=lambda kcs: {kc.name: bins[kc.name] for kc in kcs}, **kw)
    return rt, fake, prog


@pytest.mark.parametrize("device", DRIVERS)
def test_parameters_and_thread_limit_are_read_from_the_binary(device, compiled):
    rt, fake, prog = _runtime(device, compiled)
    try:
        rt.run("decode", _inputs(prog, "decode"))
        name, geom, args, _ = fake.log()[0]
        side = next(s for _, s in compiled[TARGET[device]].values() if s["symbol"] == name)
        # what the fake driver read from the ELF image: one 8-byte slot per parameter of the kernel's
        # signature + Triton's two scratch pointers, and the kernel's own thread limit
        info = _kernel_info(fake, rt, device, side)
        assert info == (len(side["params"]), [8] * len(side["params"]), side["block"][0]) == (5, [8] * 5, geom[3])
        l = prog.functions["decode"].launches[0]  # embed(ids, table) -> x, declared (ids_ptr, t_ptr, y_ptr)
        idx = rt.sched.buffer_index
        want = (rt.addr[idx("decode", l.operands[0][1].buffer)] + l.operands[0][1].offset,
                rt.addr[idx("decode", l.operands[1][1].buffer)] + l.operands[1][1].offset,
                rt.addr[idx("decode", l.results[0][1].buffer)] + l.results[0][1].offset)
        assert l.op == "embed" and args[:3] == want and len(args) == 5
    finally:
        rt.close()


def _kernel_info(fake, rt, device, side):
    """(parameter count, parameter sizes, max threads per block) the fake driver read for a symbol: the
    driver is asked through its own entry points, from the binary bytes the table holds."""
    import ctypes

    lib = fake.lib
    image = next(c for c in rt.sched.code_objects if c[:4] == b"\x7fELF")
    load, getfn = (("cuModuleLoadData", "cuModuleGetFunction") if device == "cuda"
                   else ("hipModuleLoadData", "hipModuleGetFunction"))
    if device == "cuda":
        lib.cuCtxSetCurrent(ctypes.c_void_p(1))
    m, f = ctypes.c_void_p(), ctypes.c_void_p()
    assert getattr(lib, load)(ctypes.byref(m), image) == 0
    assert getattr(lib, getfn)(ctypes.byref(f), m, side["symbol"].encode()) == 0
    out = (ctypes.c_long * 69)()
    lib.fake_kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.fake_kernel(f, out)
    getattr(lib, "cuModuleUnload" if device == "cuda" else "hipModuleUnload")(m)
    n = out[0]
    return n, list(out[5:5 + n]), out[4]


@pytest.mark.parametrize("device", DRIVERS)
@pytest.mark.parametrize("fault", ["block one warp too large", "grid beyond the limit"])
def test_a_launch_beyond_the_kernels_or_devices_limits_is_refused(device, fault, compiled):
    change = {"block one warp too large": lambda c, s: dataclasses.replace(c, block=(c.block[0] + WARP[device], 1, 1)),
              "grid beyond the limit": lambda c, s: dataclasses.replace(c, grid=(c.grid[0], 65536, 1))}[fault]
    rt, fake, prog = _runtime(device, compiled, change)
    try:
        with pytest.raises(DeviceError) as e:
            rt.run("decode", _inputs(prog, "decode"))
        assert INVALID_VALUE[device] in str(e.value), str(e.value)
    finally:
        rt.close()


@pytest.mark.parametrize("device", DRIVERS)
def test_a_pointer_outside_every_allocation_is_an_illegal_address(device, compiled):
    """One past the end of its buffer (the table allows no further): the kernel would fault."""
    def past_the_end(c, sched):
        p = c.params[0]
        return dataclasses.replace(c, params=(dataclasses.replace(p, offset=sched.buffer_bytes[p.buffer]),)
                                   + c.params[1:])

    rt, fake, prog = _runtime(device, compiled, past_the_end)
    code = {"cuda": "error 700 (CUDA_ERROR_ILLEGAL_ADDRESS)", "hip": "error 700 (hipErrorIllegalAddress)"}[device]
    try:
        with pytest.raises(DeviceError) as e:
            rt.run("decode", _inputs(prog, "decode"))
        assert code in str(e.value), str(e.value)
    finally:
        rt.close()


def test_the_host_device_refuses_a_pointer_one_row_past_its_buffer():
    """The host device knows each parameter's extent (the program's type and strides): the embed kernel's
    ids pointer moved one row on now reads past the end of the ids buffer."""
    m, prog, w = tiny()

    def one_row_on(sched):
        f = sched.functions[sched.function_index("prefill")]
        c = f.calls[0]
        p = c.params[0]
        f.calls[0] = dataclasses.replace(c, params=(dataclasses.replace(p, offset=p.offset + 8),) + c.params[1:])
        return sched.to_bytes()

    for table, ok in ((None, True), (one_row_on, False)):
        rt = CRuntime(prog, w, "host", kernel_calls=_embed_only, table=table)
        fname, inputs = next(step_inputs(m, PROMPTS, 0))
        try:
            if ok:
                rt.run(fname, inputs)
            else:
                with pytest.raises(DeviceError, match="parameter 'ids_ptr' points at prefill/ids\\+8, .* bytes are read "
                                                      "or written from there, the buffer has .* left"):
                    rt.run(fname, inputs)
        finally:
            rt.close()


# ---- deliberately broken runtimes -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken():
    """broken(file, old, new): the C runtime built from its sources with one edit (`old` -> `new` in
    `file`)."""
    return lambda file, old, new: load_library(runtime_variant(edit=(file, old, new)))


ISSUE = "static v4rt_status issue(v4rt *rt, uint32_t f) {\n"
IN_CAPTURE = {  # an operation done first thing in every run (so inside a capture too)
    "sync": ("if (rt->drv.sync(&rt->drv)) return V4RT_E_LAUNCH;", {"cuda": "cuStreamSynchronize",
                                                                     "hip": "hipStreamSynchronize"}),
    "allocation": ("uint64_t a_; if (rt->drv.mem_alloc(&rt->drv, 64, &a_)) return V4RT_E_LAUNCH;"
                   " rt->drv.mem_free(&rt->drv, a_);", {"cuda": "cuMemAlloc", "hip": "hipMalloc"}),
    "copy": ("char c_[1] = {0}; if (rt->drv.h2d(&rt->drv, rt->buffers[0].addr, c_, 1)) return V4RT_E_LAUNCH;",
             {"cuda": "cuMemcpyHtoDAsync", "hip": "hipMemcpyAsync(H2D)"}),
    "module load": ("void *m_; if (rt->drv.module_load(&rt->drv, \"FAKE\\nx 1\\n\", 10, &m_)) return V4RT_E_LAUNCH;"
                    " rt->drv.module_unload(&rt->drv, m_);", {"cuda": "cuModuleLoadData", "hip": "hipModuleLoadData"}),
}
CAPTURE_UNSUPPORTED = {"cuda": "error 900 (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)",
                       "hip": "error 900 (hipErrorStreamCaptureUnsupported)"}


@pytest.mark.parametrize("device", DRIVERS)
@pytest.mark.parametrize("what", list(IN_CAPTURE))
def test_inside_capture_the_driver_refuses_what_a_graph_cannot_hold(device, what, broken):
    code, call = IN_CAPTURE[what]
    lib = broken("v4rt.c", ISSUE, ISSUE + "    " + code + "\n")
    m, prog, w = tiny()
    fake = Fake(device)
    rt = CRuntime(prog, w, device, driver_lib=fake.path, table=fake_table(), lib=lib)
    try:
        rt.run("decode", _inputs(prog, "decode"))  # launch by launch: allowed
        with pytest.raises(DeviceError) as e:
            rt.run("decode", _inputs(prog, "decode"), graph=True)
        assert f"{call[device]} failed with {CAPTURE_UNSUPPORTED[device]}" in str(e.value), str(e.value)
        assert fake.counts()["graphs"] == 0  # the invalidated capture left nothing
    finally:
        rt.close()
    c = fake.counts()
    assert c["live"] == 0 and c["frees"] == c["allocs"] and c["unloads"] == c["loads"]


def test_a_hip_copy_in_the_wrong_direction_is_refused(broken):
    lib = broken("drv_hip.c", "#define HIP_MEMCPY_H2D 1\n#define HIP_MEMCPY_D2H 2\n",
                          "#define HIP_MEMCPY_H2D 2\n#define HIP_MEMCPY_D2H 1\n")
    m, prog, w = tiny()
    fake = Fake("hip")
    with pytest.raises(DeviceError) as e:
        CRuntime(prog, w, "hip", driver_lib=fake.path, table=fake_table(), lib=lib)
    assert "hipMemcpyAsync(H2D) failed with error 1 (hipErrorInvalidValue)" in str(e.value)
    assert fake.counts()["live"] == 0


def _run_in_thread(fn):
    res = {}

    def target():
        try:
            res["out"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed back to the test's thread)
            res["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in res:
        raise res["error"]
    return res["out"]


@pytest.mark.parametrize("device", ["host", "cuda", "hip"])
def test_run_from_another_thread(device):
    """The runtime opened on this thread runs from a second one, eager and as a graph: the host device
    computes the same bytes there, a fake driver sees the same launches."""
    m, prog, w = tiny()
    fake = Fake(device) if device != "host" else None
    kw = {} if fake is None else dict(driver_lib=fake.path, table=fake_table())
    rt = CRuntime(prog, w, device, **kw)
    try:
        fname, inputs = list(step_inputs(m, PROMPTS, 1))[-1]
        here = rt.run(fname, inputs)
        there = _run_in_thread(lambda: rt.run(fname, inputs))
        graph = _run_in_thread(lambda: rt.run(fname, inputs, graph=True))
        if fake is None:
            assert all(torch.equal(here[k], there[k]) and torch.equal(here[k], graph[k]) for k in here)
            assert not here["logits"].isnan().any()
        else:
            log = [(n, g, a) for n, g, a, _ in fake.log()]
            n = len(log) // 3
            assert n == len(rt.sched.functions[rt.sched.function_index(fname)].calls)
            assert log[:n] == log[n:2 * n] == log[2 * n:] and [r for *_, r in fake.log()][2 * n:] == [True] * n
    finally:
        rt.close()


def test_without_the_context_made_current_another_thread_is_refused(broken):
    lib = broken("drv_cuda.c", "{ return gpu_check(g, C(g)->cuCtxSetCurrent(C(g)->ctx), \"cuCtxSetCurrent\"); }",
                          "{ (void)g; return 0; }")
    m, prog, w = tiny()
    rt = CRuntime(prog, w, "cuda", driver_lib=Fake("cuda").path, table=fake_table(), lib=lib)
    try:
        fname, inputs = list(step_inputs(m, PROMPTS, 1))[-1]
        rt.run(fname, inputs)
        with pytest.raises(DeviceError) as e:
            _run_in_thread(lambda: rt.run(fname, inputs))
        assert "error 201 (CUDA_ERROR_INVALID_CONTEXT)" in str(e.value), str(e.value)
    finally:
        rt.close()


@pytest.mark.parametrize("device", DRIVERS)
def test_a_replay_on_another_stream_is_refused(device, broken):
    """The captured graph replays on the runtime's stream; a runtime replaying it on the legacy default
    stream (NULL) is refused as an invalid handle."""
    lib = broken("drv_gpu.c", "g->graph_launch(((graph_t *)graph)->exec, g->stream)",
                 "g->graph_launch(((graph_t *)graph)->exec, NULL)")
    m, prog, w = tiny()
    fake = Fake(device)
    rt = CRuntime(prog, w, device, driver_lib=fake.path, table=fake_table(), lib=lib)
    try:
        rt.run("decode", _inputs(prog, "decode"))  # launch by launch: the stream is right
        with pytest.raises(DeviceError) as e:
            rt.run("decode", _inputs(prog, "decode"), graph=True)
        code = {"cuda": "cuGraphLaunch failed with error 400 (CUDA_ERROR_INVALID_HANDLE)",
                "hip": "hipGraphLaunch failed with error 400 (hipErrorInvalidHandle)"}[device]
        assert code in str(e.value), str(e.value)
    finally:
        rt.close()


def _pdl_mismatches(rt, fake, steps):
    """(logged launch, recorded attribute, the schedule's flag) for every launch of `steps` runs of decode
    (logged eagerly or replayed) whose programmatic-serialization attribute differs from its call's flag."""
    calls = rt.sched.functions[rt.sched.function_index("decode")].calls
    want = [c.pdl for c in calls] * steps
    got = fake.pdl()
    if len(got) != len(want):
        return [("count", len(got), len(want))]
    return [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]


@pytest.mark.parametrize("device", DRIVERS)
def test_pdl_launches_carry_the_attribute_exactly_where_the_schedule_says(device, compiled):
    """sm_90a binaries wait for the previous kernel (PTX griddepcontrol.wait, checked when compiled) and launch
    with the attribute; gfx950 binaries have neither. Eager, then two replays of the captured graph."""
    for name, (_, side) in compiled[TARGET[device]].items():
        assert side["pdl"] is (device == "cuda"), name
    rt, fake, prog = _runtime(device, compiled)
    try:
        calls = rt.sched.functions[rt.sched.function_index("decode")].calls
        assert any(c.pdl for c in calls) is (device == "cuda") and not all(c.pdl for c in calls)  # placeholders
        rt.run("decode", _inputs(prog, "decode"))
        for _ in range(2):
            rt.run("decode", _inputs(prog, "decode"), graph=True)
        assert fake.counts()["captures"] == 1
        assert _pdl_mismatches(rt, fake, 3) == []
        assert ("cuLaunchKernelEx" in fake.trace()) is (device == "cuda")
    finally:
        rt.close()


def test_a_table_that_drops_the_pdl_flag_is_caught(compiled, monkeypatch):
    """The broken variant of the test above: the table loses every call's flag, the kernels still wait."""
    from v4compile.runtime import schedule

    monkeypatch.setattr(schedule.Call, "flags", property(lambda self: 0))
    rt, fake, prog = _runtime("cuda", compiled)
    try:
        rt.run("decode", _inputs(prog, "decode"))
        rt.run("decode", _inputs(prog, "decode"), graph=True)
        bad = _pdl_mismatches(rt, fake, 2)
        assert bad and all(g is False and w is True for _, g, w in bad)
        assert "cuLaunchKernelEx" not in fake.trace()
    finally:
        rt.close()


def test_hip_refuses_a_programmatic_launch(compiled):
    rt, fake, prog = _runtime("hip", compiled, lambda c, sched: dataclasses.replace(c, pdl=True))
    try:
        with pytest.raises(DeviceError, match="hip: programmatic dependent launch is not available"):
            rt.run("decode", _inputs(prog, "decode"))
    finally:
        rt.close()


def test_an_unknown_launch_flag_is_a_table_error(compiled, monkeypatch):
    from v4compile.runtime import schedule

    monkeypatch.setattr(schedule.Call, "flags", property(lambda self: 4 if self.kernel is not None else 0))
    with pytest.raises(DeviceError, match=r"launch table: function \d+ call \d+ \(embed_kernel\): unknown launch "
                                          r"flags 0x4"):
        _runtime("cuda", compiled)


@pytest.mark.parametrize("device", DRIVERS)
def test_the_prefix_cache_copies_go_through_the_driver(device, broken):
    """The copy table's copies on a GPU driver: a slot's snapshot reads exactly its ranges (as `rt.read` sees
    them), its restore into another slot writes them there, a pool block is copied device to device (one
    cuMemcpyDtoDAsync / hipMemcpyAsync(D2D) per range). A runtime patched to name the HIP device-to-device
    copy host-to-device is refused (hipErrorInvalidValue)."""
    import types

    import numpy as np

    from v4compile.runtime import snapshot
    from v4compile.runtime.undo import access

    m, prog, w = tiny()
    for lib in (None, broken("drv_hip.c", "#define HIP_MEMCPY_D2D 3", "#define HIP_MEMCPY_D2D 1")
                if device == "hip" else None):
        fake = Fake(device)
        rt = CRuntime(prog, w, device, driver_lib=fake.path, table=fake_table(), lib=lib)
        try:
            backend = types.SimpleNamespace(rt=rt, program=prog)
            store, c = access(backend), snapshot.copies(backend)
            rng = np.random.default_rng(0)
            for n in store.names():
                i = rt.sched.buffer_index(store.fname, n)
                rt.write(i, rng.integers(0, 256, rt.sched.buffer_bytes[i], dtype=np.uint8))
            ranges = snapshot.copy_ranges(store.geometry, store.names(), store.shape)

            def at(group, k):
                return np.concatenate([store.get_rows(n, first + k * stride, rows).reshape(-1)
                                       for n, g, first, stride, rows in ranges if g == group])
            snap = c.save(0, 0)["slot"]
            assert snap.tobytes() == at(snapshot.SLOT, 0).tobytes()
            c.restore(2, {"slot": snap}, 0)
            assert at(snapshot.SLOT, 2).tobytes() == snap.tobytes()
            if lib is not None:
                with pytest.raises(DeviceError) as e:
                    c.copy_block(0, 3)
                assert "hipMemcpyAsync(D2D) failed with error 1 (hipErrorInvalidValue)" in str(e.value)
                continue
            before = fake.copies()["d2d"]
            c.copy_block(0, 3)
            assert at(snapshot.BLOCK, 3).tobytes() == at(snapshot.BLOCK, 0).tobytes()
            assert fake.copies()["d2d"] - before == sum(1 for r in ranges if r[1] == snapshot.BLOCK)
        finally:
            rt.close()
        assert fake.counts()["live"] == 0


@pytest.mark.parametrize("device", DRIVERS)
def test_the_fake_drivers_refuse_copies_out_of_range_or_in_the_wrong_direction(device):
    """Called directly: a device-to-device copy one byte past its allocation, a host-to-device copy whose
    destination is host memory and a device-to-host copy whose source is, are INVALID_VALUE; in range and
    the right way they are made."""
    import ctypes

    fake = Fake(device)
    lib, v, n = fake.lib, ctypes.c_void_p, ctypes.c_size_t
    s, a, b = v(), v(), v()
    host = (ctypes.c_uint8 * 64)()
    if device == "cuda":
        assert lib.cuCtxSetCurrent(v(1)) == 0
        assert lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        assert lib.cuMemAlloc_v2(ctypes.byref(a), n(64)) == 0 and lib.cuMemAlloc_v2(ctypes.byref(b), n(64)) == 0
        d2d = lambda d, x, k: lib.cuMemcpyDtoDAsync_v2(d, x, n(k), s)  # noqa: E731
        h2d = lambda d, x, k: lib.cuMemcpyHtoDAsync_v2(d, x, n(k), s)  # noqa: E731
        d2h = lambda d, x, k: lib.cuMemcpyDtoHAsync_v2(d, x, n(k), s)  # noqa: E731
        free = lambda p: lib.cuMemFree_v2(p)  # noqa: E731
    else:
        assert lib.hipStreamCreateWithFlags(ctypes.byref(s), 1) == 0
        assert lib.hipMalloc(ctypes.byref(a), n(64)) == 0 and lib.hipMalloc(ctypes.byref(b), n(64)) == 0
        d2d = lambda d, x, k: lib.hipMemcpyAsync(d, x, n(k), 3, s)  # noqa: E731
        h2d = lambda d, x, k: lib.hipMemcpyAsync(d, x, n(k), 1, s)  # noqa: E731
        d2h = lambda d, x, k: lib.hipMemcpyAsync(d, x, n(k), 2, s)  # noqa: E731
        free = lambda p: lib.hipFree(p)  # noqa: E731
    host[:] = range(64)
    assert h2d(a, host, 64) == 0 and d2d(b, a, 64) == 0
    out = (ctypes.c_uint8 * 64)()
    assert d2h(out, b, 64) == 0 and list(out) == list(range(64))
    assert d2d(b, a, 65) == 1 and d2d(v(b.value + 1), a, 64) == 1  # past the end of an allocation
    assert h2d(host, a, 8) == 1 and d2h(a, host, 8) == 1  # the host and device sides swapped
    assert free(a) == 0 and free(b) == 0
