"""The C runtime's collective entry on a GPU driver: a partitioned program (tiny, tp 2, ep 2) on the fake
CUDA driver with the fake NCCL (tests/fake_driver/fake_nccl.c, which launches each collective as a kernel
on the runtime's stream, as NCCL does). The collectives NCCL receives are exactly the program's collective
launches (op, element count, data type, operand and result addresses, group), in program order; a decode
step captured as a graph records them once, inside the capture, and every replay runs them again in their
places among the kernels. Each check is shown to catch a schedule that swaps a collective's operand and
result."""

from __future__ import annotations

import ctypes
import functools
import sys

import pytest
import torch

from conftest import dense_weights
from runtime_helpers import Fake, fake_nccl, fake_table
from v4compile.config import preset
from v4compile.errors import DeviceError
from v4compile.ir.registry import get_op
from v4compile.runtime.c_backend import CRuntime, comm_unique_id
from v4compile.weights_convert import DenseSource, load_ir_weights

NCCL_TYPE = {"fp32": 7, "bf16": 9}


@functools.lru_cache(maxsize=None)
def partitioned():
    """(program, rank 0's weights) of tiny partitioned over tp 2, ep 2 (hf numerics, decode batch 2), its
    all-reduces left on NCCL (`--allreduce nccl`: no oneshot_allreduce pass)."""
    from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
    from v4compile.program.build import build_program
    from v4compile.program.verify import verify_program
    from v4compile.trace import TraceOptions, trace

    m = trace(preset("tiny"), TraceOptions(numerics="hf", batch=1, chunk=16, decode_batch=2, capacity=64))
    pipeline = [p for p in DEFAULT_PIPELINE if p != "oneshot_allreduce"]
    m = PassManager(["partition{tp=2,ep=2}", *pipeline], PipelineOptions()).run(m).module
    return verify_program(build_program(m)), load_ir_weights(m, DenseSource(dense_weights("tiny")), rank=0)


class Nccl:
    def __init__(self):
        self.path = str(fake_nccl())
        self.lib = ctypes.CDLL(self.path)
        self.lib.fake_nccl_call.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)]
        self.lib.fake_nccl_comm.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_long), ctypes.c_char_p]
        self.lib.fake_nccl_reset()

    def calls(self) -> list[tuple]:
        op, v, out = ctypes.create_string_buffer(16), (ctypes.c_uint64 * 5)(), []
        for i in range(self.lib.fake_nccl_calls()):
            assert self.lib.fake_nccl_call(i, op, v) == 0
            out.append((op.value.decode(), *v))
        return out

    def comms(self) -> list[tuple]:
        v, idb, out = (ctypes.c_long * 2)(), ctypes.create_string_buffer(8), []
        for i in range(self.lib.fake_nccl_comms()):
            assert self.lib.fake_nccl_comm(i, v, idb) == 0
            out.append((v[0], v[1], idb.raw))
        return out


def _inputs(prog, fname, seed):
    g = torch.Generator().manual_seed(seed)
    return {b.name: torch.randint(0, 4, b.type.shape, generator=g) for b in prog.functions[fname].buffers
            if b.kind == "input"}


def expected(rt, prog, fname, kernel_calls=None):
    """From the program alone: each communicator launch as NCCL must get it (op, count, dtype, send, recv,
    group), and the kernel-or-collective sequence of a step ("nccl" for a collective; a launch's kernel
    calls from `kernel_calls` when given, else its one placeholder call: a one-shot all-reduce is kernels)."""
    def addr(a):
        return rt.addr[rt.sched.buffer_index(fname, a.buffer)] + a.offset

    colls, seq = [], []
    for l in prog.functions[fname].launches:
        if get_op(l.op).communicator:
            (_, x), = l.operands
            (_, y), = l.results
            colls.append((l.op, x.type.numel, NCCL_TYPE[x.type.dtype], addr(x), addr(y), l.attrs["group"]))
            seq.append(("nccl", (addr(x), addr(y))))
        else:
            kcs = kernel_calls(l) if kernel_calls is not None else None
            seq += [(l.specialisation, None)] if kcs is None else [(k.name, None) for k in kcs if 0 not in k.grid]
    return colls, seq


def differences(rt, prog, nccl, fake, steps: int, fname: str = "decode", kernel_calls=None) -> list:
    colls, seq = expected(rt, prog, fname, kernel_calls)
    out = []
    if nccl.calls() != colls:  # recorded once: at the capture
        out.append(("collectives", nccl.calls()[:2], colls[:2]))
    log = fake.log()
    if any(r for n, _, _, r in log if n.startswith("nccl")) != bool(steps and colls) or any(
            not r for n, _, _, r in log if n.startswith("nccl")):
        out.append(("collectives outside the graph",))
    got = [("nccl", a[:2]) if n.startswith("nccl") else (n, None) for n, _, a, r in log if r]
    if got != seq * steps:
        out.append(("replayed", len(got), len(seq) * steps))
    return out


def run_steps(monkeypatch=None, steps: int = 3):
    prog, w = partitioned()
    fake, nccl = Fake("cuda"), Nccl()
    monkeypatch.setenv("FAKE_NCCL_DRIVER", fake.path)
    rt = CRuntime(prog, w, "cuda", driver_lib=fake.path, table=fake_table())
    ids = {2: comm_unique_id("cuda", nccl.path)}
    rt.comm_init(1, ids, nccl.path)
    assert nccl.comms() == [(2, 1, b"fake-ncc")]
    for s in range(steps):
        rt.run("decode", _inputs(prog, "decode", s), graph=True)
    assert fake.counts()["captures"] == 1 and fake.counts()["graph_launches"] == steps
    out = differences(rt, prog, nccl, fake, steps)
    rt.close()
    return out, len(expected(rt, prog, "decode")[0])


def test_collectives_are_the_programs_inside_the_graph(monkeypatch):
    diffs, n = run_steps(monkeypatch)
    assert diffs == [] and n == 10  # 2 all-reduces a layer (wo_b, the MoE) x 5 layers


def test_a_swapped_collective_is_caught(monkeypatch):
    import v4compile.runtime.schedule as sched

    keep = sched._collective

    def swapped(l, slot):
        c = keep(l, slot)
        return sched.Call(c.code, c.symbol, c.grid, c.block, c.shared, c.params[::-1])

    monkeypatch.setattr(sched, "_collective", swapped)
    diffs, _ = run_steps(monkeypatch)
    assert {d[0] for d in diffs} == {"collectives", "replayed"}


def test_collectives_need_the_communicators(monkeypatch):
    """Running before v4rt_comm_init, or with a library lacking NCCL's symbols, is one clear error."""
    prog, w = partitioned()
    fake = Fake("cuda")
    monkeypatch.setenv("FAKE_NCCL_DRIVER", fake.path)
    rt = CRuntime(prog, w, "cuda", driver_lib=fake.path, table=fake_table())
    with pytest.raises(DeviceError, match="no communicator for groups of 2 ranks"):
        rt.run("decode", _inputs(prog, "decode", 0))
    with pytest.raises(DeviceError, match="symbol ncclGetUniqueId missing"):
        rt.comm_init(0, {2: comm_unique_id("cuda", fake.path)}, fake.path)
    rt.close()


def test_communicator_ids_go_through_the_store(monkeypatch):
    """`Ranks.comm_ids`: the first rank of each group makes the id, every rank of the group reads the same
    one from torch.distributed's store (here one rank, tp 1 / ep 1: one group of 1)."""
    from dist_launch import free_port
    from v4compile.parallel import ParallelLayout
    from v4compile.runtime.distributed import join

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    ranks = join(ParallelLayout(1, 1), timeout_s=10)
    try:
        made = []
        ids = ranks.comm_ids(lambda: made.append(bytes([len(made) + 1]) * 128) or made[-1])
        assert ids == {1: b"\x01" * 128} and len(made) == 1
    finally:
        ranks.close()


_LATE_READER = """
import os, sys, time
from v4compile.parallel import ParallelLayout
from v4compile.runtime.distributed import join
ranks = join(ParallelLayout(2, 2), timeout_s=20)
if ranks.rank == 1:
    time.sleep(3)  # the reader comes late (a loaded machine)
ids = ranks.comm_ids(lambda: b"\\x07" * 128)
print(ids[2].hex()[:8], flush=True)
os._exit(0)  # no goodbye: rank 0, the store's host, leaves as soon as comm_ids returns
"""


def test_communicator_ids_reach_a_late_rank_after_the_first_rank_is_done():
    """Rank 0 hosts the store and makes the id; it must not return from `comm_ids` (and so may not exit)
    before every rank has read its id, or a late rank reads from a closed store (a race CI met: rank 0's
    fake NCCL waits for no peer). Without the barrier in `comm_ids`, rank 1 fails here."""
    from dist_launch import launch

    runs = launch([sys.executable, "-c", _LATE_READER], 2, timeout_s=60)
    assert [r[0] for r in runs] == [0, 0], [r[2][-800:] for r in runs]
    assert [r[1].strip() for r in runs] == ["07070707"] * 2


@pytest.mark.parametrize("where", ["standalone", "folded", "producer"])
def test_a_late_peer_is_one_error_after_the_step(monkeypatch, where):
    """The one-shot all-reduce in the C runtime (host device, its kernels interpreted, every other launch its
    reference, their collectives a stand-in): rank 0 of a group of 2 whose peer never arrives. The 'peer' is rank
    0's own region mapped a second time (the exchange handing back this rank's handle twice), so no one sets rank
    1's flags: the kernel gives up after its bound (64 polls here) and the step ends with the status error naming
    the late peer, in bounded time. `standalone`: the one-shot launches run their kernel (layer 0's is the first
    to wait); `folded`: only the launches it is folded into (`fuse_oneshot_consumer`; layer 1's MoE the first),
    whose leading phase gives up the same way; `producer`: only the launches it is a trailing part of
    (`fuse_oneshot_producer`; layer 0's MoE), whose gathering programs give up the same way. With the flags set the step would not wait: the runtime's read of
    the status words is what makes the failure visible (the outputs are left unwritten, not wrong-but-plausible)."""
    import time

    from v4compile.codegen.kernels import allreduce
    from v4compile.codegen.program_kernels import calls_of
    from v4compile.ops.fused_allreduce import consumer_of, producer_of
    from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
    from v4compile.program.build import build_program
    from v4compile.program.verify import verify_program
    from v4compile.trace import TraceOptions, trace

    m = trace(preset("tiny"), TraceOptions(numerics="hf", batch=1, chunk=16, decode_batch=2, capacity=64))
    m = PassManager(["partition{tp=2,ep=2}", *DEFAULT_PIPELINE], PipelineOptions()).run(m).module
    prog = verify_program(build_program(m))
    w = load_ir_weights(m, DenseSource(dense_weights("tiny")), rank=0)
    monkeypatch.setattr(allreduce.oneshot_call, "__defaults__", (("x", "y"), 64, allreduce.GRID_MAX))
    runs = {"standalone": lambda op: op == "all_reduce_oneshot", "folded": consumer_of, "producer": producer_of}[where]
    calls = lambda l: calls_of(l) if runs(l.op) else None  # noqa: E731
    seen = []

    def exchange(group, handle):
        seen.append((group, len(handle)))
        return [handle, handle], 0

    rt = CRuntime(prog, w, "host", kernel_calls=calls, exchange=exchange,
                  collective=lambda op, x, group, tp=1: x.clone())  # (the placeholders' sums: not checked here)
    assert seen == [(2, 64)] and rt.sched.region.group == 2
    step = {b.name: torch.zeros(b.type.shape, dtype=torch.int64) for b in prog.functions["decode"].buffers
            if b.kind == "input"}  # every sequence at position 0 of slot 0's first block
    t0 = time.monotonic()
    with pytest.raises(DeviceError) as e:
        rt.run("decode", step)
    assert str(e.value) == "rank 0: peer rank 1 of its group of 2 did not reach one-shot all-reduce 1 within 64 polls"
    assert time.monotonic() - t0 < 30
    rt.close()
    with pytest.raises(DeviceError, match="need the process group"):
        CRuntime(prog, w, "host", kernel_calls=calls)
