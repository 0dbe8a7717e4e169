"""The C runtime's probe table (v4rt.h `v4rt_probe_table`; issue 35: the self-check's layer statistics on every
device): byte ranges copied to host memory before / after chosen calls of a function run launch by launch, on the
runtime's stream in order with the kernels. The same table on the host driver and the fake HIP / CUDA drivers
(made to compute: `Fake.compute`): each probe holds the bytes the callback saw at that point; every entry is
checked before the table changes; a graph run of a function with probes is refused; and a copy outside its
allocation that the core's check keeps out, the fake drivers refuse as the real ones do."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from runtime_helpers import PROMPTS, Fake, fake_table, runtime_variant, step_inputs, tiny
from v4compile.errors import DeviceError
from v4compile.runtime.c_backend import PROBE_AFTER, PROBE_BEFORE, CRuntime, Probe, load_library
from v4compile.runtime.self_check import stream_launches

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the ops' references: many tiny torch ops
F = "prefill"


def _runtime(device: str, lib=None, compute: bool = True):
    m, prog, w = tiny()
    if device == "host":
        return CRuntime(prog, w, "host", lib=lib), None
    fake = Fake(device)
    rt = CRuntime(prog, w, device, driver_lib=fake.path, table=fake_table(), lib=lib)
    if compute:
        fake.compute(rt)
    return rt, fake


def _inputs():
    m, _, _ = tiny()
    return next(step_inputs(m, PROMPTS, 0))[1]


def _plan(rt):
    """Probes after the last call of each layer's stream launch and before the first call of the last one:
    (call, when, buffer, offset, host array) each, with the launch index and the result it reads."""
    fs = rt.sched.functions[rt.sched.function_index(F)]
    first, last = {}, {}
    for c, li in enumerate(fs.launch_of):
        first.setdefault(li, c)
        last[li] = c
    out = []
    watched = sorted(stream_launches(fs.program))
    for li in watched + watched[-1:]:
        name = stream_launches(fs.program)[li][1]
        a = dict(fs.program.launches[li].results)[name]
        lo, hi = a.extent
        when = PROBE_BEFORE if len(out) == len(watched) else PROBE_AFTER
        out.append(((first if when == PROBE_BEFORE else last)[li], when, rt.sched.buffer_index(F, a.buffer), lo,
                    np.zeros(hi - lo, np.uint8), (a.buffer, lo, hi)))
    return out


def _seen(rt, plan):
    """The bytes of each probe's range as the callback finds them at that point (the host hooks)."""
    seen = {}

    def at(when):
        def hook(fs, cidx, launch):
            for i, (c, w, _, _, _, (buf, lo, hi)) in enumerate(plan):
                if fs.name == F and c == cidx and w == when:
                    seen[i] = rt.views[buf][lo:hi].clone().numpy()
        return hook
    rt.before_call, rt.after_call = at(PROBE_BEFORE), at(PROBE_AFTER)
    return seen


@pytest.mark.parametrize("device", ["host", "hip"])  # cuda: the same drv_gpu.c flow (its d2h: below)
def test_each_probe_holds_the_bytes_at_its_call(device):
    rt, fake = _runtime(device)
    try:
        plan = _plan(rt)
        seen = _seen(rt, plan)
        rt.probe_table(F, [p[:5] for p in plan])
        rt.run(F, _inputs())
        assert len(seen) == len(plan) >= 3
        for i, p in enumerate(plan):
            assert np.array_equal(p[4], seen[i]), f"probe {i} ({'before' if p[1] else 'after'} call {p[0]})"
        # the before-probe reads other bytes than the after-probe of the same launch: the timing is observed
        assert not np.array_equal(plan[-1][4], plan[-2][4])
        if fake is not None:  # each copy went on the stream between the launches it sits between
            kinds = [t for t in fake.trace() if "Launch" in t or "Memcpy" in t]
            at = [i for i, t in enumerate(kinds) if "Launch" in t]
            run = kinds[at[0]: at[-1] + 1]  # the run's launches and the copies among them: the probes
            launches_before = [sum("Launch" in t for t in run[:i]) for i, t in enumerate(run) if "Memcpy" in t]
            assert sorted(launches_before) == sorted(p[0] + (p[1] == PROBE_AFTER) for p in plan)
    finally:
        rt.close()


def test_a_probe_made_on_the_wrong_side_of_its_call_is_caught():
    """Broken variant of the comparison above: probes made on the other side of their call (the table's `when`
    swapped) give other bytes than the callback saw there."""
    rt, _ = _runtime("host")
    try:
        plan = _plan(rt)
        seen = _seen(rt, plan)
        rt.probe_table(F, [(c, PROBE_AFTER + PROBE_BEFORE - w, b, off, h) for c, w, b, off, h, _ in plan])
        rt.run(F, _inputs())
        assert any(not np.array_equal(p[4], seen[i]) for i, p in enumerate(plan))
    finally:
        rt.close()


def _raw(rt, entries):
    arr = (Probe * len(entries))(*entries)
    return rt.lib.v4rt_probe_table(rt.handle, rt.sched.function_index(F), len(entries), arr)


def test_bad_probes_are_refused_before_the_table_changes_and_graph_runs_refuse_probes():
    rt, fake = _runtime("hip", compute=False)
    try:
        plan = _plan(rt)
        c, w, b, off, host, _ = plan[0]
        size = rt.sched.buffer_bytes[b]
        rt.probe_table(F, [(c, w, b, off, host)])
        ncalls = len(rt.sched.functions[rt.sched.function_index(F)].calls)
        big = np.zeros(size + 1, np.uint8)
        for bad, msg in (((c, w, b, size - 4, host), "outside buffer"),
                         ((c, w, b, 0, big), "outside buffer"),
                         ((ncalls, w, b, off, host), f"call {ncalls} of {ncalls}"),
                         ((c, 2, b, off, host), "when 2"),
                         ((c, w, len(rt.sched.buffer_names), off, host), "does not exist")):
            with pytest.raises(DeviceError, match="bad argument") as e:
                rt.probe_table(F, [bad])
            assert msg in str(e.value) and "\n" not in str(e.value)
        for entry, msg in ((Probe(c, w, b, 1, off, 8, host.ctypes.data), "reserved 1"),
                           (Probe(c, w, b, 0, off, 8, None), "host NULL"),
                           (Probe(c, w, b, 0, off, 0, host.ctypes.data), "0 bytes")):
            assert _raw(rt, [entry]) == 1 and msg in rt.lib.v4rt_last_error().decode()
        rt.write(b, torch.full((len(host),), 7, dtype=torch.uint8), off)  # (this fake GPU does not compute)
        rt.run(F, _inputs())  # the first table still holds: its probe filled
        assert (host == 7).all()
        with pytest.raises(DeviceError, match="probes are made in runs launch by launch only"):
            rt.run(F, _inputs(), graph=True)
        assert fake.counts()["captures"] == 0  # refused before any capture began
        rt.probe_table(F, [])
        before = len(fake.trace())
        rt.run(F, _inputs(), graph=True)  # cleared: the graph is captured without any copy in it
        trace = fake.trace()[before:]
        cap = trace[trace.index("hipStreamBeginCapture"): trace.index("hipStreamEndCapture")]
        assert "hipModuleLaunchKernel" in cap and "hipMemcpyAsync" not in cap
    finally:
        rt.close()


@pytest.mark.parametrize("device", ["hip", "cuda"])
def test_a_probe_past_its_buffer_that_passed_the_core_is_refused_by_the_driver(device):
    """A runtime with the core's range check removed: the probe past its buffer reaches the driver, which refuses
    the copy outside its allocation as the real one does (INVALID_VALUE; the fake drivers' copy rules are tested
    in test_fake_driver_checks.py); the run fails with it, one line naming the probe."""
    edit = ("v4rt.c", "        v4rt_status st = check_range(rt, p->buffer, p->offset, p->nbytes, what);\n"
                      "        if (st) return st;\n", "")
    rt, _ = _runtime(device, load_library(runtime_variant(edit=edit)), compute=False)
    try:
        c, w, b, _, _, _ = _plan(rt)[0]
        rt.probe_table(F, [(c, w, b, rt.sched.buffer_bytes[b] - 4, np.zeros(64, np.uint8))])
        with pytest.raises(DeviceError) as e:
            rt.run(F, _inputs())
        err = "CUDA_ERROR_INVALID_VALUE" if device == "cuda" else "hipErrorInvalidValue"
        assert err in str(e.value) and "probe 0" in str(e.value) and "\n" not in str(e.value), str(e.value)
    finally:
        rt.close()
