"""The launch-by-launch comparison of scripts/gpu_check.py (runtime/launch_check.py), exercised on the host
device: two runtimes of tiny's program from the same inputs agree on every launch; with one pointer of one
call moved in the "device" runtime's table, the first difference reported is exactly that launch, with its
op, family, kernel and parameter names (later launches would differ too: the copy of the device's bytes
into the host keeps them from being blamed)."""

from __future__ import annotations

import dataclasses

import pytest

from runtime_helpers import tiny
from runtime_helpers import PROMPTS, step_inputs
from v4compile.runtime.c_backend import CRuntime
from v4compile.runtime.launch_check import first_difference, per_launch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _moved(fname, li):
    """The table with the first pointer of launch `li`'s call read 4 bytes (one fp32) off, split per launch."""
    def table(sched):
        f = sched.functions[sched.function_index(fname)]
        i = f.launch_of.index(li)
        c = f.calls[i]
        p = c.params[0]
        f.calls[i] = dataclasses.replace(c, params=(dataclasses.replace(p, offset=p.offset + 4),) + c.params[1:])
        return per_launch(fname)(sched)
    return table


OP = "pair_norm_linear"  # a later layer's attention input GEMMs (fuse_attn_front): its first pointer is x


@pytest.mark.parametrize("fault", [False, True])
def test_the_first_differing_launch_is_named(fault):
    m, prog, w = tiny()
    fname, inputs = next((f, i) for f, i in step_inputs(m, PROMPTS, 1) if f == "decode")
    launches = prog.functions[fname].launches
    li = next(i for i, l in enumerate(launches) if l.op == OP and i > 10)
    dev = CRuntime(prog, w, "host", table=_moved(fname, li) if fault else per_launch(fname))
    host = CRuntime(prog, w, "host", table=per_launch(fname))
    try:
        diff = first_difference(dev, host, fname, inputs)
    finally:
        dev.close()
        host.close()
    if not fault:
        assert diff is None
        return
    l = launches[li]
    assert diff is not None and (diff["launch"], diff["op"], diff["family"]) == (li, OP, l.kernel)
    assert diff["result"] == l.results[0][0] and diff["elements_differing"] > 0 and not diff["exact"]
    assert diff["kernels"] == [{"symbol": l.specialisation,
                                "params": [f"operand:{n}" for n, _ in l.operands] + [f"result:{n}" for n, _ in l.results]}]
