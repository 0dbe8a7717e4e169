"""The last-level cache in the cost model (codegen/roofline.py, `hbm_bytes`): a launch's declared re-reads
(`KernelCall.reread_bytes`) are cache hits only when its footprint fits `CACHE_SHARE` of the target's cache,
and every declared re-read is one the kernel really makes. The last is measured: the kernel runs under the
interpreter with its loads and stores recorded (per access, the distinct bytes it touches), and the measured
re-reads (bytes touched again) must cover the declared ones while the distinct bytes stay within the
declared footprint. Cases: split-KV decode attention (rows read by 2 head blocks, q by 4 splits, partials read
back by the merge) and a split-K GEMM (x read by every split, partials read back)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kernel_check as kc  # noqa: E402
from v4compile.codegen import kernels  # noqa: E402
from v4compile.codegen.kernels import interpreter  # noqa: E402
from v4compile.codegen.kernels import gemm, sparse_attention as sa  # noqa: E402
from v4compile.codegen.roofline import CACHE_SHARE, hbm_bytes  # noqa: E402
from v4compile.formats import fp8_block_quant  # noqa: E402
from v4compile.targets import TARGETS  # noqa: E402


def measured(op, args, attrs, outs, regions):
    """Run `op` under the interpreter; per region name (of `args` / `outs`, plus "scratch": any address of
    no named tensor) the bytes its loads and stores touch, each access's distinct bytes counted once
    ("touched"), and the distinct bytes over the whole launch ("distinct"). Atomics are not counted."""
    spans = [(n, t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes())
             for n, t in {**args, **outs}.items() if t is not None]
    seen: dict[str, list[np.ndarray]] = {}

    def record(what, ptrs, mask, nbytes):
        if what == "atomic":
            return
        p = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)]
        b = np.unique((p[:, None] + np.arange(nbytes, dtype=np.uint64)[None, :]).reshape(-1))
        for n, lo, hi in spans:
            inside = (b >= lo) & (b < hi)
            if inside.any():
                seen.setdefault(n, []).append(b[inside])
                b = b[~inside]
        if b.size:
            seen.setdefault("scratch", []).append(b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_check_access", record)
        with kernels.memory_guard([(0, 1 << 63)]):
            calls = kernels.launch(op, args, attrs, outs)
    got = {n: {"touched": sum(a.size for a in v), "distinct": np.unique(np.concatenate(v)).size}
           for n, v in seen.items() if n in regions}
    return calls, got


def reuse_distance(op, args, attrs, outs, programs: range) -> tuple[list, int]:
    """Run `op` (a ticketed launch: each program's first atomic is its ticket) under the interpreter, programs
    one after another in ticket order; (its calls, the largest LRU stack distance of a load by a program in
    `programs` of a byte touched before: the distinct bytes touched since that byte's previous touch)."""
    log: list[tuple[int, str, np.ndarray]] = []
    at = {"ticket": None, "program": -1}

    def record(what, ptrs, mask, nbytes):
        p = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).reshape(-1)]
        if what == "atomic":
            if at["ticket"] is None:
                at["ticket"] = int(p[0])
            at["program"] += int(p.size == 1 and int(p[0]) == at["ticket"])
        elif p.size:
            log.append((at["program"], what, (p[:, None] + np.arange(nbytes, dtype=np.uint64)).reshape(-1)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_check_access", record)
        with kernels.memory_guard([(0, 1 << 63)]):
            calls = kernels.launch(op, args, attrs, outs)
    every = np.unique(np.concatenate([b for *_, b in log]))
    last = np.full(every.size, -1, dtype=np.int64)
    worst = 0
    for i, (v, what, b) in enumerate(log):
        idx = np.searchsorted(every, b)
        before = last[idx][last[idx] >= 0]
        if what == "load" and v in programs and before.size:
            worst = max(worst, int(np.count_nonzero(last > before.min())))
        last[idx] = i
    return calls, worst


def check_declared(call, got):
    """Every declared re-read is made by the kernel, and the bytes it touches fit the declared footprint (the
    arrival counters' resets aside: 4 bytes per group, in no byte count)."""
    rereads = sum(v["touched"] - v["distinct"] for v in got.values())
    distinct = sum(v["distinct"] for v in got.values())
    counters = sum(call.scratch_bytes[n] for _, kind, n, _ in call.pointers if kind == "semaphore")
    assert call.reread_bytes <= rereads, f"{call.name}: declares {call.reread_bytes} B of re-reads, makes {rereads}"
    assert distinct <= call.bytes_moved - call.reread_bytes + counters, \
        f"{call.name}: touches {distinct} distinct bytes, footprint {call.bytes_moved - call.reread_bytes}"


def _attention():
    """HCA decode, 2 lanes at position 255 (every lane's row list full: 7 window + 64 compressed rows, its
    static capacity), 20 heads in 2 blocks of 16, 4 splits of 18 rows."""
    from test_kernels_sparse_attention import _operands

    args, attrs = _operands("hca", "native", "fp32", [255, 255], [1, 1], 1, 20, 24, 8, seed=1)
    out = kc.poisoned((2, 1, 20, 24), torch.float32)[0]
    assert torch.equal(args["win_indptr"], torch.tensor([0, 7, 14], dtype=torch.int32))
    assert torch.equal(args["comp_indptr"], torch.tensor([0, 64, 128], dtype=torch.int32))
    return args, attrs, {"out": out}, ("q", "kv", "p0", "out", "scratch")


def _gemm():
    """A float GEMM, 4 x 512 by 256 x 512: 2 columns of 128-wide output tiles, K split in 2 (each split's
    slice of x read by both tile columns)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 512, generator=g).to(torch.bfloat16)
    w = (torch.randn(256, 512, generator=g) * 0.05).to(torch.bfloat16)
    y = kc.poisoned((1, 4, 256), torch.bfloat16)[0]
    return {"x": x, "w": w, "scale": None}, {"block": 128}, {"y": y}, ("x", "w", "y", "scratch")


CASES = {"sparse_attention": (_attention, 4), "linear": (_gemm, 2)}


@pytest.mark.parametrize("op", list(CASES))
def test_declared_rereads_are_made_by_the_kernel(op, monkeypatch):
    make, splits = CASES[op]
    monkeypatch.setattr(sa, "MIN_SPLIT_ROWS", 16)
    monkeypatch.setattr(gemm, "TARGET_PROGRAMS", 4)
    args, attrs, outs, regions = make()
    calls, got = measured(op, args, attrs, outs, regions)
    (call,) = calls
    assert call.grid[2] == splits and call.reread_bytes > 0, (call.grid, call.reread_bytes)
    check_declared(call, got)
    assert {n: v["touched"] > v["distinct"] for n, v in got.items()} == {n: n not in ("out", "w", "y") for n in regions}
    # a model that called a first read a re-read (the rows of the first head block, the first read of the
    # weights) is caught, and so is a footprint that leaves out what the kernel touches (the partials)
    first = got["p0"]["distinct"] if op == "sparse_attention" else got["w"]["distinct"]
    with pytest.raises(AssertionError, match="declares"):
        check_declared(dataclasses.replace(call, reread_bytes=call.reread_bytes + first), got)
    with pytest.raises(AssertionError, match="footprint"):
        check_declared(dataclasses.replace(call, bytes_moved=call.bytes_moved - got["scratch"]["distinct"]), got)


def test_rereads_hit_the_cache_only_when_the_launch_fits():
    """Footprint within CACHE_SHARE of the target's last-level cache: its HBM bytes; past it: every byte, unless
    the launch declares its re-reads' reuse distance within the share (`KernelCall.reuse_bytes`).
    40 MB fits gfx950's share (256 MB Infinity Cache) and not sm_90a's (50 MB L2)."""
    call = gemm.specialise("linear", {"x": kernels.TensorArg.of(torch.zeros(1, 8, 256, dtype=torch.bfloat16)),
                                              "w": kernels.TensorArg.of(fp8_block_quant(torch.randn(128, 256), 128)[0]),
                                              "scale": kernels.TensorArg.of(torch.zeros(1, 2))},
                                   {"y": kernels.TensorArg.of(torch.zeros(1, 8, 128, dtype=torch.bfloat16))},
                                   {"block": 128, "act": "fp8"})[0]
    mb = 1 << 20
    big = dataclasses.replace(call, bytes_moved=50 * mb, reread_bytes=10 * mb)
    assert 40 * mb <= CACHE_SHARE * TARGETS["gfx950"].llc_bytes and 40 * mb > CACHE_SHARE * TARGETS["sm_90a"].llc_bytes
    assert hbm_bytes(big, "gfx950") == 40 * mb and hbm_bytes(big, "sm_90a") == 50 * mb
    small = dataclasses.replace(call, bytes_moved=5 * mb, reread_bytes=4 * mb)
    assert hbm_bytes(small, "gfx950") == hbm_bytes(small, "sm_90a") == mb
    with pytest.raises(ValueError, match="reread_bytes"):
        dataclasses.replace(call, reread_bytes=call.bytes_moved + 1)
    # a declared reuse distance within the share makes the re-reads hits however large the launch; one past it,
    # or none declared (None), leaves the footprint to decide
    assert hbm_bytes(dataclasses.replace(big, reuse_bytes=(2 * mb,)), "sm_90a") == 40 * mb
    assert hbm_bytes(dataclasses.replace(big, reuse_bytes=(30 * mb,)), "sm_90a") == 50 * mb
    assert hbm_bytes(dataclasses.replace(big, reuse_bytes=(None,)), "sm_90a") == 50 * mb
    phased = dataclasses.replace(big, phases=((40 * mb, 8 * mb), (10 * mb, 2 * mb)), reuse_bytes=(mb,))
    assert hbm_bytes(phased, "sm_90a") == 32 * mb + 8 * mb  # the first phase by its reuse, the second fits
    assert hbm_bytes(dataclasses.replace(phased, reuse_bytes=()), "sm_90a") == 40 * mb + 8 * mb
    with pytest.raises(ValueError, match="reuse_bytes"):
        dataclasses.replace(big, reuse_bytes=(mb, mb))
