"""One step run launch by launch on two C runtimes (a GPU and the host device) from the same bytes: the
first launch whose results differ, named by op, family, kernels and parameters (`scripts/gpu_check.py`).

    first_difference(device_rt, host_rt, function, inputs) -> dict | None

Both runtimes hold the same program and were opened with `table=per_launch(function)`, which adds one
table function per launch of `function` (`<function>#<launch>`, its kernel calls). The arena, scratch and
outputs start poisoned alike on both (a kernel may leave part of a result unwritten). Each launch runs on
both; its results are compared (bit-exact for pool, state and integer values; float values within the
kernel tests' tolerance, tests/kernel_check.py: fp32 1e-5 x max|ref| + 1e-6 x |ref|, bf16 one ulp +
1e-5 x max|ref|), then the device's result bytes are copied into the host runtime so the next launch
starts from identical inputs on both: a difference is reported where it arises, not where it spreads.
"""

from __future__ import annotations

import dataclasses

import torch

from v4compile.program.execute import POISON, _typed

from .schedule import FunctionSchedule, Schedule

EXACT_KINDS = ("pool", "state")
FLOAT = ("fp32", "bf16")


def per_launch(fname: str):
    """A `table` for CRuntime: the schedule's bytes with one extra function per launch of `fname`."""
    def table(sched: Schedule) -> bytes:
        fs = sched.functions[sched.function_index(fname)]
        for li in range(len(fs.program.launches)):
            idx = [i for i, l in enumerate(fs.launch_of) if l == li]
            sched.functions.append(FunctionSchedule(f"{fname}#{li}", fs.program, [fs.calls[i] for i in idx],
                                                    [li] * len(idx)))
        return sched.to_bytes()
    return table


def _tolerance(ref: torch.Tensor) -> torch.Tensor:
    r = ref.float()
    scale = r.abs().max().clamp(min=1e-30)
    if ref.dtype == torch.bfloat16:
        ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp(min=2.0 ** -126))) - 7)
        return ulp + 1e-5 * scale
    return 1e-5 * scale + 1e-6 * r.abs()


def _region(rt, fname: str, a) -> tuple[int, int, int]:
    """(buffer index, first byte, byte count) of a value."""
    first, end = a.extent
    return rt.sched.buffer_index(fname, a.buffer), first, end - first


def first_difference(dev, host, fname: str, inputs) -> dict | None:
    """Run `fname` launch by launch on `dev` and `host` (CRuntimes opened with `per_launch(fname)`)."""
    for i, kind in enumerate(dev.sched.buffer_kinds):  # the same bytes everywhere a launch may leave unwritten
        if kind in ("arena", "scratch", "output"):
            fill = torch.full((dev.sched.buffer_bytes[i],), POISON, dtype=torch.uint8)
            dev.write(i, fill)
            host.write(i, fill)
    dev.upload(fname, inputs)
    host.upload(fname, inputs)
    fs = dev.sched.functions[dev.sched.function_index(fname)]
    kinds = {b.name: b.kind for b in fs.program.buffers}
    for li, l in enumerate(fs.program.launches):
        dev.launch(f"{fname}#{li}")
        host.launch(f"{fname}#{li}")
        for name, a in l.results:
            buf, first, n = _region(dev, fname, a)
            got, want = dev.read(buf, first, n), host.read(buf, first, n)
            local = dataclasses.replace(a, offset=0)
            exact = kinds.get(a.buffer) in EXACT_KINDS or a.type.dtype not in FLOAT
            if exact:
                bad = int((got != want).sum())
                worst = None
            else:
                g, w = _typed(got, local).float(), _typed(want, local)
                d = (g - w.float()).abs()
                over = ~(d <= _tolerance(w))  # a NaN on either side is a difference
                bad = int(over.sum())
                worst = float(d.nan_to_num(float("inf")).max()) if d.numel() else 0.0
            if bad:
                calls = [c for c, i in zip(fs.calls, fs.launch_of) if i == li]
                return {"function": fname, "launch": li, "op": l.op, "family": l.kernel, "result": name,
                        "buffer": a.buffer, "dtype": a.type.dtype, "exact": exact, "elements_differing": bad,
                        "max_abs_diff": worst,
                        "tolerance": "bit-exact" if exact else "kernel tests' (fp32 1e-5, bf16 1 ulp)",
                        "kernels": [{"symbol": c.symbol,
                                     "params": [p.role for p in c.params] if c.kernel is None else
                                     [p[0] for p in c.kernel.pointers]} for c in calls]}
            host.write(buf, got, first)  # the next launch starts from the device's bytes on both
    return None

