"""The host device's interpreted Triton kernels against their op references, launch by launch, with the
official numerics (FP8 / FP4 rounding inside the kernels) that the hf-numerics tests never exercise.

A ragged prefill (every launch its reference) then one decode step of tiny, in which the chosen launches
run their Triton kernels: each kernel family's first decode launch, and every launch of the query prologue
(`qkv_norm_rope`, alone or with its layer's compressor: `QKV`; the kv latent's FP8 rounding, the FP8 window-ring
write and the indexer query's FP4 rounding). Each chosen
launch is rerun with its reference on the same input bytes (a snapshot), and its results compared (a CSR
result's indices row by row as sets: the kernels list a row's picks in another order, which the attention
does not depend on, and leave the unused tail past the last indptr as it was).

Why it exists: `run --device host` on tiny gave other ids than cpu because the host device ran the kernels
on Triton's interpreter WITHOUT `interpreter_fixes()`: its fp32 -> fp8 cast carries a rounded-up mantissa
into the wrong exponent bit (7.9 -> 4.0 instead of 8.0; a block's amax came out halved). The test starts
from an unfixed interpreter, as a fresh `run --device host` process does, and shows the fault is caught.

Tolerance: |kernel - reference| <= 1e-5 * max|reference| per result. The fp32 kernels sum in another order
than the references (measured ~3e-7 of the scale here); a value rounded to the wrong FP8 / FP4 neighbour is
off by at least 1/16 of itself, four orders above it.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime_helpers import PROMPTS, step_inputs, tiny  # noqa: E402
from v4compile.codegen.kernels import interpreter  # noqa: E402
from v4compile.program.execute import _typed, run_launch  # noqa: E402
from v4compile.runtime.c_backend import CRuntime  # noqa: E402
from v4compile.runtime.kernels import make_kernel_calls  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REL = 1e-5
QKV = ("qkv_norm_rope", "qkv_rope_compress", "qkv_rope_compress_pair")  # the query prologue's launches


@pytest.fixture
def unfixed_interpreter(monkeypatch):
    """Triton's interpreter as a fresh process has it: any fixes an earlier test applied are undone (and put
    back afterwards), so only the code under test can apply them."""
    for owner, name, original in interpreter.UNFIXED:
        monkeypatch.setattr(owner, name, original)
    monkeypatch.setattr(interpreter, "_FIXED", False)


def _mismatches(only: tuple[str, ...] = ()) -> tuple[list[str], int, int]:
    """(results of chosen launches that differ from their reference, number of chosen launches run, number
    chosen)."""
    m, prog, w = tiny(decode_batch=2, batch=2, numerics="official")
    decode = prog.functions["decode"].launches
    first: dict[str, int] = {}
    for i, l in enumerate(decode):
        first.setdefault(l.kernel, i)
    chosen = {id(l) for i, l in enumerate(decode)
              if (l.op in QKV or first[l.kernel] == i) and (not only or l.op in only)}
    real = make_kernel_calls()
    rt = CRuntime(prog, w, "host", kernel_calls=lambda l: real(l) if id(l) in chosen else None)
    writable = [k for k, kind in zip(rt.sched.buffer_names, rt.sched.buffer_kinds) if kind != "weight"]
    fs = rt.sched.functions[rt.sched.function_index("decode")]
    run_kernel, before, bad, ran = rt._run_kernel, {}, [], []

    def checked(launch, call, cidx, places):
        li = fs.launch_of[cidx]  # only decode launches run kernels here
        if cidx == 0 or fs.launch_of[cidx - 1] != li:
            before.clear()
            before.update({k: rt.views[k].clone() for k in writable})
        run_kernel(launch, call, cidx, places)
        if cidx + 1 < len(fs.calls) and fs.launch_of[cidx + 1] == li:
            return  # the launch's later calls still to come
        got = {k: rt.views[k].clone() for k in writable}
        for k, v in before.items():
            rt.views[k].copy_(v)
        named = lambda a: a and dataclasses.replace(a, buffer=rt.sched.buffer_names[rt.sched.buffer_index("decode", a.buffer)])
        ref = dataclasses.replace(launch, operands=tuple((n, named(a)) for n, a in launch.operands),
                                  results=tuple((n, named(a)) for n, a in launch.results))
        run_launch(ref, rt.views)  # the reference on the same bytes; the step goes on from its results
        ran.append(launch.op)
        res = dict(ref.results)
        for n, a in ref.results:
            k, r = _typed(got[a.buffer], a).float(), _typed(rt.views[a.buffer], a).float()
            if n == "indices" and "indptr" in res:  # CSR: each row's picks as a set, nothing past indptr[-1]
                ptr = _typed(rt.views[res["indptr"].buffer], res["indptr"]).tolist()
                k, r = (torch.cat([t[s:e].sort().values for s, e in zip(ptr, ptr[1:])]) for t in (k, r))
            if k.numel() == 0:
                continue
            same_nan = torch.equal(k.isnan(), r.isnan())
            k, r = k.nan_to_num(), r.nan_to_num()
            if not same_nan or (k - r).abs().max() > REL * r.abs().max():
                bad.append(f"L{li} {launch.op}.{n}")

    rt._run_kernel = checked
    try:
        for fname, inputs in step_inputs(m, PROMPTS[:2], 1):  # the prefill chunks, then one decode step
            rt.run(fname, inputs)
    finally:
        rt.close()
    return bad, len(ran), len(chosen)


def test_interpreted_kernels_equal_their_references_with_official_numerics(unfixed_interpreter):
    bad, ran, chosen = _mismatches()
    # tiny's decode: its 5 query-prologue launches (4 with their layer's compressor) and every other family's first
    # (14 today: the attention and wo_a run in out_proj's launch), every one run
    assert ran == chosen >= 14 and bad == []


def test_the_unfixed_interpreter_is_caught(unfixed_interpreter, monkeypatch):
    """The fault put back: the host device's kernels on the unfixed interpreter (its fp8 cast) differ."""
    monkeypatch.setattr(interpreter, "interpreter_fixes", lambda: None)
    bad, ran, _ = _mismatches(only=QKV)
    assert ran == 5 and any("kv_out" in b for b in bad), bad
