"""The kernel-family hook: where a family has `specialise`, its KernelCalls replace the placeholder call,
the launch table carries their name, grid, block (num_warps x warp) and pointers, and the host driver runs
the Triton kernel on the C buffers under TRITON_INTERPRET=1. Uses a fake `embed` family (the real
families are written in parallel, issue 9); a wrong fake kernel is caught by the same comparison."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from runtime_helpers import (PROMPTS, Fake, compare_buffers, executed_step, fake_table, poison_buffers,  # noqa: E402
                             step_inputs, tiny)
from v4compile.codegen.kernels import KernelCall  # noqa: E402
from v4compile.runtime.c_backend import CRuntime  # noqa: E402
from v4compile.runtime.kernels import make_kernel_calls  # noqa: E402


@triton.jit
def _embed_rows(ids, table, out, D: tl.constexpr, ROW: tl.constexpr, SHIFT: tl.constexpr):
    r = tl.program_id(0)
    i = tl.maximum(tl.load(ids + r), 0) + SHIFT
    cols = tl.arange(0, D)
    tl.store(out + r * ROW + cols, tl.load(table + i * D + cols))


def fake_embed(shift: int = 0):
    def specialise(op, operands, results, attrs):
        assert op == "embed"
        ids, table, x = operands["ids"], operands["table"], results["x"]
        n = 1
        for d in ids.type.shape:
            n *= d
        D = table.type.shape[1]
        return [KernelCall(f"fake_embed_n{n}_d{D}_s{shift}", _embed_rows, {"D": D, "ROW": x.strides[-2], "SHIFT": shift},
                           [("ids", "operand", "ids", "*i64"), ("table", "operand", "table", "*fp32"),
                            ("out", "result", "x", "*fp32")], (n, 1, 1), num_warps=2)]
    return lambda family: specialise if family == "embed" else None


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("shift", [0, 1])
def test_a_family_kernel_replaces_the_placeholder_and_runs_interpreted(shift):
    m, prog, w = tiny()
    rt = CRuntime(prog, w, "host", kernel_calls=make_kernel_calls(fake_embed(shift)))
    f = rt.sched.functions[rt.sched.function_index("prefill")]
    kinds = [(f.program.launches[f.launch_of[i]].op, c.kernel is not None) for i, c in enumerate(f.calls)]
    assert kinds[0] == ("embed", True) and all(not k for op, k in kinds if op != "embed")
    assert f.calls[0].grid == (48, 1, 1) and f.calls[0].block == (64, 1, 1)
    fname, inputs = next(step_inputs(m, PROMPTS, 0))
    bufs = executed_step(prog, w, fname, inputs)
    poison_buffers(rt, fname)
    rt.run(fname, inputs)
    bad = compare_buffers(rt, bufs, fname)
    if shift == 0:
        assert bad == []  # a row copy: bit-exact
    else:
        assert "logits" in bad  # the wrong kernel (rows shifted by one) is caught
    rt.close()


def test_the_table_carries_the_kernel_call_to_the_driver():
    m, prog, w = tiny()
    fake = Fake("cuda")
    rt = CRuntime(prog, w, "cuda", driver_lib=fake.path, table=fake_table(),
                  kernel_calls=make_kernel_calls(fake_embed()))
    rt.run("decode", {b.name: torch.zeros(b.type.shape, dtype=torch.long) for b in prog.functions["decode"].buffers
                      if b.kind == "input"})
    name, geom, args, _ = fake.log()[0]
    l = prog.functions["decode"].launches[0]
    assert name == "fake_embed_n3_d64_s0" and geom == (3, 1, 1, 64, 1, 1, 0)
    idx = rt.sched.buffer_index
    assert args == (rt.addr[idx("decode", "ids")], rt.addr[idx("decode", "embed.weight")],
                    rt.addr[idx("decode", "arena")] + l.results[0][1].offset)
    rt.close()


def test_compiled_kernels_get_their_own_code_object_symbol_block_shared_and_triton_scratch():
    """With binaries (a GPU target: cubin / hsaco + sidecar from codegen.aot), a kernel call launches the
    compiled symbol from its own code object, with the sidecar's block and shared bytes and Triton's two
    trailing scratch pointers (a per-program region of the scratch buffer, or NULL when it needs none)."""
    from v4compile.runtime.schedule import HOST_CODE_OBJECT
    from runtime_helpers import fake_code_object

    m, prog, w = tiny()
    fake = Fake("cuda")
    sidecar = {"symbol": "embed_kernel_0d1d2d", "block": [128, 1, 1], "shared_bytes": 4096,
               "params": [{"name": "ids", "type": "*i64"}, {"name": "table", "type": "*fp32"}, {"name": "out", "type": "*fp32"},
                          {"name": "global_scratch", "kind": "triton_scratch", "size_per_program": 32},
                          {"name": "profile_scratch", "kind": "triton_scratch", "size_per_program": 0}]}

    def binaries(kcs):
        return {kc.name: (b"FAKE\nembed_kernel_0d1d2d 5\n\0", sidecar) for kc in kcs}

    def table(sched):  # the placeholder object becomes a fake one holding the placeholder symbols
        sched.code_objects = [fake_code_object(sched) if c == HOST_CODE_OBJECT else c for c in sched.code_objects]
        return sched.to_bytes()

    rt = CRuntime(prog, w, "cuda", driver_lib=fake.path, table=table, kernel_calls=make_kernel_calls(fake_embed()),
                  binaries=binaries)
    assert fake.counts()["loads"] == len(rt.sched.code_objects) == 3  # placeholders + the two embed shapes
    rt.run("decode", {b.name: torch.zeros(b.type.shape, dtype=torch.long) for b in prog.functions["decode"].buffers
                      if b.kind == "input"})
    name, geom, args, _ = fake.log()[0]
    assert name == "embed_kernel_0d1d2d" and geom == (3, 1, 1, 128, 1, 1, 4096)
    scratch = rt.addr[rt.sched.buffer_index("decode", "scratch")]
    assert len(args) == 5 and scratch <= args[3] < scratch + rt.sched.buffer_bytes[0] and args[4] == 0
    assert rt.sched.buffer_bytes[rt.sched.buffer_index("decode", "scratch")] >= 3 * 32
    rt.close()


def test_the_host_device_after_a_compile_in_the_same_process_is_one_clear_error(monkeypatch):
    """Kernel modules imported without the interpreter (an AOT compile earlier in this process) cannot run on
    the host device: one DeviceError naming the module, not Triton's "0 active drivers" at the first launch."""
    from v4compile.errors import DeviceError
    from v4compile.runtime.kernels import kernel_calls_for

    import v4compile.codegen.kernels.gemm  # noqa: F401  (a family module in sys.modules, as after a compile)
    monkeypatch.delenv("TRITON_INTERPRET")  # as if they had been imported for compiling
    with pytest.raises(DeviceError, match="interpreter.*imported them for compiling"):
        kernel_calls_for("auto", "host")
    kernel_calls_for("auto", "cuda")  # a GPU device runs the compiled binaries: no objection
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_calls_for("auto", "host") is not None


SUPPORT_ONLY = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)  # as a compile leaves it: Triton not switched to its interpreter
from v4compile.codegen import kernels
from v4compile.runtime.kernels import kernel_calls_for
families = [m for m in sys.modules if m.startswith("v4compile.codegen.kernels.")
            and m.rpartition(".")[2] not in kernels.SUPPORT]
assert not families, families  # the case under test: only the support modules loaded
if {fault!r}:
    kernels.SUPPORT = ()
kernel_calls_for("auto", "host")
"""


def _host_after_support_only(fault: bool = False) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SUPPORT_ONLY.format(fault=fault)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_support_modules_alone_leave_the_host_device_free():
    """The kernels package's support modules (`kernels.SUPPORT`: KernelCall, the flags, the dtype tables,
    torch execution, the interpreter fixes) define no @triton.jit kernel, and every compile loads them: a
    process that loaded only them may still choose the interpreter for the host device."""
    _host_after_support_only()


def test_support_modules_taken_for_kernel_modules_are_caught():
    """The fault: the support modules counted as kernel modules (`SUPPORT` emptied) refuse the host device
    in that same process."""
    with pytest.raises(AssertionError, match="imported them for compiling"):
        _host_after_support_only(fault=True)
