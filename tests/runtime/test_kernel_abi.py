"""The GPU's kernel ABI on the host device: every call packs its pointers in the order its kernel declares
them, and the host device binds the packed 64-bit values BY POSITION, so a wrong order cannot pass.

* The packed order of every call of tiny's and tiny-pro's programs is the kernel's declared order, read
  here from the Python function itself (`inspect.signature`), not from anything the schedule computed.
* A call that disagrees with its kernel (a pointer the kernel lacks, a parameter bound twice or not at
  all) is refused when it is made; a compiled sidecar that disagrees is refused at load.
* The host device bounds-checks every interpreted load and store (a read one element past its allocation
  is refused).
* For EVERY kernel family launched by tiny's and tiny-pro's decode and prefill programs, one call with two
  pointer parameters swapped in the launch table is refused by the host device (an extent or an illegal
  address) or changes the bytes it writes; the same call unswapped reproduces them exactly (the control).
  The old orders of mhc (post), moe_down (with the combine) and the fused MoE (moe_fused: the up, router and
  down calls' pointers gathered) are shown wrong the same way.

Cheap by construction: everything before the chosen call runs the op references (placeholders); only the
chosen launch runs its Triton kernels (interpreted), and each trial reruns that one call from a snapshot.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime_helpers import tiny  # noqa: E402
from runtime_helpers import PROMPTS, step_inputs  # noqa: E402
from v4compile.codegen import kernels  # noqa: E402
from v4compile.codegen.kernels import call as kernel_call  # noqa: E402
from v4compile.codegen.kernels import KernelCall  # noqa: E402
from v4compile.errors import CodegenError, DeviceError  # noqa: E402
from v4compile.runtime.c_backend import CRuntime  # noqa: E402
from v4compile.runtime.kernels import make_kernel_calls  # noqa: E402
from v4compile.runtime.schedule import FunctionSchedule, build_schedule, compiled_params  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PRESETS = ("tiny", "tiny-pro")
# Every family tiny's and tiny-pro's decode and prefill programs launch (checked below against the programs).
# (inv_rope_quant is no longer among them: fuse_inv_rope_wo_a folds it into grouped_gemm's loader; nor is
# grouped_gemm: fuse_out_proj runs it in wo_b's launch, out_proj. qkv_norm_rope and compress stay for prefill and
# for decode's sliding-window layer; decode's compressed layers run rope_compress.)
FAMILIES = ("attn_front", "compress", "csr", "embed", "gemm", "indexer", "last_token", "mhc", "moe_router",
            "out_proj", "pool_write", "qkv_norm_rope", "rope_compress", "sparse_attention")


def _declared_pointers(kc) -> list[str]:
    """The kernel's parameters in declaration order, constexprs left out (what Triton packs)."""
    py = getattr(kc.fn, "fn", kc.fn)
    return [a for a in inspect.signature(py).parameters if a not in kc.constexprs]


@functools.lru_cache(maxsize=None)
def _program(preset):
    return tiny(preset_name=preset)


def test_the_families_are_every_family_the_programs_launch():
    got = {l.kernel for p in PRESETS for f in _program(p)[1].functions.values() for l in f.launches}
    assert got == set(FAMILIES)


def test_semaphores_are_one_zeroed_buffer_shared_by_the_calls():
    """Calls that finish a reduction in their last-arriving program (codegen/kernels/arrival.py) get their
    counters in the schedule's one `semaphores` buffer, at offset 0 (each call leaves them zero): a
    "state" buffer, which the C runtime zeroes at load; it holds the largest call's counters."""
    _, prog, _ = _program("tiny-pro")
    sched = build_schedule(prog, make_kernel_calls())
    i = sched.index["semaphores"]
    assert sched.buffer_kinds[i] == "state"
    sems = [(p, c.kernel) for f in sched.functions for c in f.calls for p in c.params if p.role.startswith("semaphore:")]
    assert {kc.kernel_name for _, kc in sems} >= {"moe_fused_kernel", "indexer_select_kernel"}
    assert all(p.buffer == i and p.offset == 0 for p, _ in sems)
    assert sched.buffer_bytes[i] >= max(kc.scratch_bytes[p.role.split(":", 1)[1]] for p, kc in sems)


def _misordered(sched) -> set[str]:
    """Kernels of calls whose packed parameters are not in the order the kernel declares them."""
    bad = set()
    for f in sched.functions:
        for c in f.calls:
            role = {p[0]: f"{p[1]}:{p[2]}" for p in c.kernel.pointers}
            if [p.role for p in c.params] != [role[a] for a in _declared_pointers(c.kernel)]:
                bad.add(c.kernel.kernel_name)
    return bad


@pytest.mark.parametrize("preset", PRESETS)
def test_every_call_packs_its_pointers_in_the_kernels_declared_order(preset):
    _, prog, _ = _program(preset)
    sched = build_schedule(prog, make_kernel_calls())
    assert sum(len(f.calls) for f in sched.functions) > 100
    assert _misordered(sched) == set()


OLD = {"mhc": ("hc_post", "mhc_post_pre", "mhc_post_head"), "moe": ("moe_router_experts_shared",)}


def test_the_same_check_fails_on_the_old_orders(monkeypatch):
    """Packing pointers as each family lists them (the schedule before the fix) fails the check above for
    exactly the kernels that are listed out of order: mhc with post, moe_down with the combine (prefill), the
    fused MoE (decode: its pointers gathered from the up, router and down calls), the query prologue with its
    compressor or compressor pair (decode, `rope_compress`: the parts' pointers one part after the other) and the
    attention tail (`out_proj` and, at decode, `attn_out_proj`: their phases' pointers one call after the other)."""
    monkeypatch.setattr(kernel_call, "in_kernel_order", lambda name, fn, pointers, constexprs: list(pointers))
    _, prog, _ = _program("tiny")
    assert _misordered(build_schedule(prog, make_kernel_calls())) == {
        "mhc_kernel", "moe_down_kernel", "moe_fused_kernel", "rope_compress_kernel", "rope_compress_pair_kernel",
        "out_proj_kernel", "attn_out_proj_kernel"}


def _fn(*names):
    import triton

    src = "def k(" + ", ".join(names) + "):\n    pass\n"
    ns: dict = {}
    exec(src, ns)
    return triton.jit(ns["k"])


@pytest.mark.parametrize("case, message", [
    ("extra", "pointer 'z_ptr' is not a parameter of k"),
    ("twice", "parameter 'y_ptr' of k is bound twice"),
    ("missing", "parameter 'y_ptr' of k is bound to nothing"),
    ("constexpr", "constexpr 'Q' is not a parameter of k"),
])
def test_a_call_that_disagrees_with_its_kernel_is_refused(case, message):
    x, y, z = ("x_ptr", "operand", "x", "*fp32"), ("y_ptr", "result", "y", "*fp32"), ("z_ptr", "operand", "z", "*fp32")
    pointers, ce = {"extra": ([x, y, z], {"N": 1}), "twice": ([x, y], {"N": 1, "y_ptr": None}),
                    "missing": ([x], {"N": 1}), "constexpr": ([y, x], {"N": 1, "Q": 2})}[case]
    with pytest.raises(CodegenError) as e:
        KernelCall("call_1", _fn("x_ptr", "y_ptr", "N"), ce, pointers, (1, 1, 1))
    assert message in str(e.value) and "call_1" in str(e.value)
    good = KernelCall("call_1", _fn("x_ptr", "y_ptr", "N"), {"N": 1}, [y, x], (1, 1, 1))
    assert [p[0] for p in good.pointers] == ["x_ptr", "y_ptr"]  # listed in any order, kept in the kernel's


def _side(*params):
    return {"symbol": "k_sym", "params": [{"name": n, "type": t} for n, t in params]
            + [{"name": "global_scratch", "type": "*u8", "kind": "triton_scratch", "size_per_program": 0}]}


def test_a_compiled_kernel_that_disagrees_with_its_call_is_refused_at_load():
    kc = KernelCall("call_1", _fn("x_ptr", "y_ptr", "N"), {"N": 1},
                    [("x_ptr", "operand", "x", "*fp32"), ("y_ptr", "result", "y", "*bf16")], (1, 1, 1))
    ok = compiled_params(kc, _side(("x_ptr", "*fp32"), ("y_ptr", "*bf16")), "k.json")
    assert [p[0] for p in ok] == ["x_ptr", "y_ptr"]
    for side, msg in [(_side(("x_ptr", "*fp32")), "the call binds 'y_ptr', which compiled kernel k_sym declares 0"),
                      (_side(("x_ptr", "*fp32"), ("y_ptr", "*bf16"), ("w_ptr", "*fp32")),
                       "compiled kernel k_sym has a parameter 'w_ptr' the call does not bind"),
                      (_side(("x_ptr", "*fp32"), ("y_ptr", "*fp32")),
                       "parameter 'y_ptr' of compiled kernel k_sym is *fp32, the call passes *bf16"),
                      (_side(("x_ptr", "*fp32"), ("x_ptr", "*fp32"), ("y_ptr", "*bf16")),
                       "the call binds 'x_ptr', which compiled kernel k_sym declares 2")]:
        with pytest.raises(DeviceError) as e:
            compiled_params(kc, side, "k.json")
        assert str(e.value).startswith("k.json: ") and msg in str(e.value)


# ---- the swap test ----------------------------------------------------------------------------------------

def _swap_pair(call):
    """Two pointer parameters of the call that point at different places."""
    live = [i for i, p in enumerate(call.params) if p.buffer >= 0]
    for a in live:
        for b in live:
            if b > a and (call.params[a].buffer, call.params[a].offset) != (call.params[b].buffer, call.params[b].offset):
                return a, b
    raise AssertionError(f"{call.symbol}: no two distinct pointers to swap")


class _Trials:
    """One host runtime per preset in which only the chosen launches run their Triton kernels (each
    family's first launch, and the first mhc-with-post and moe-with-shared-experts launch), every other
    launch its reference. Running a prefill then a decode step once records the writable buffers before and after
    each chosen call (a family's first call; the old-order trials: the launch's last call, mhc's only one
    and moe's fused launch). Each trial is a one-call function appended to the same table (`<key>:good`, the
    call as scheduled; `<key>:bad`, two pointers swapped or the old order), run from the `before` snapshot."""

    FUNCS = ("decode", "prefill")

    def __init__(self, preset):
        _, prog, w = _program(preset)
        real = make_kernel_calls()
        chosen: dict[str, tuple[str, int]] = {}
        for fname in self.FUNCS:
            for li, l in enumerate(prog.functions[fname].launches):
                chosen.setdefault(l.kernel, (fname, li))
                for fam, ops in OLD.items():
                    if l.op in ops:
                        chosen.setdefault(f"{fam}:old", (fname, li))
        listed = {}  # the pointer order the family lists (what the schedule packed before the fix)
        orig = kernel_call.in_kernel_order
        try:
            kernel_call.in_kernel_order = lambda name, fn, pointers, constexprs: list(pointers)
            for key, (fname, li) in chosen.items():
                if key.endswith(":old"):
                    listed[key] = [p[0] for p in real(prog.functions[fname].launches[li])[-1].pointers]
        finally:
            kernel_call.in_kernel_order = orig
        launches = {id(prog.functions[f].launches[i]) for f, i in chosen.values()}
        self.calls, self.pairs = {}, {}

        def table(sched):
            for key, (fname, li) in chosen.items():
                fs = sched.functions[sched.function_index(fname)]
                cis = [ci for ci, l in enumerate(fs.launch_of) if l == li]
                c = fs.calls[cis[-1] if key.endswith(":old") else cis[0]]
                self.calls[key] = c
                if key.endswith(":old"):
                    by_param = dict(zip((p[0] for p in c.kernel.pointers), c.params))
                    bad = tuple(by_param[q] for q in listed[key])
                    assert bad != c.params, key
                else:
                    a, b = self.pairs[key] = _swap_pair(c)
                    bad = list(c.params)
                    bad[a], bad[b] = bad[b], bad[a]
                for kind, params in (("good", c.params), ("bad", tuple(bad))):
                    sched.functions.append(FunctionSchedule(f"{key}:{kind}", fs.program,
                                                            [dataclasses.replace(c, params=params)], [li]))
            return sched.to_bytes()

        self.rt = CRuntime(prog, w, "host", table=table,
                           kernel_calls=lambda l: real(l) if id(l) in launches else None)
        self.writable = [k for k, kind in zip(self.rt.sched.buffer_names, self.rt.sched.buffer_kinds) if kind != "weight"]
        self.before, self.after = {}, {}
        watched: dict[int, list[str]] = {}
        for key, c in self.calls.items():
            watched.setdefault(id(c), []).append(key)
        run_kernel = self.rt._run_kernel

        def hooked(launch, call, cidx, places):
            for key in watched.get(id(call), ()):
                self.before[key] = self.snapshot()
            run_kernel(launch, call, cidx, places)
            for key in watched.get(id(call), ()):
                self.after[key] = self.snapshot()
        self.rt._run_kernel = hooked
        m = _program(preset)[0]
        steps = {}
        for fname, inputs in step_inputs(m, PROMPTS, 1):  # real step inputs (slots, block tables) of a ragged batch
            steps.setdefault(fname, inputs)
        try:
            for fname in ("prefill", "decode"):
                self.rt.run(fname, steps[fname])
        except BaseException:
            self.rt.close()
            raise
        assert set(self.after) == set(chosen)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: self.rt.views[k].clone() for k in self.writable}

    def outcome(self, key: str, kind: str) -> list[str] | str:
        """The writable buffers whose bytes differ from the scheduled call's, or the host device's refusal."""
        for k, v in self.before[key].items():
            self.rt.views[k].copy_(v)
        try:
            self.rt.launch(f"{key}:{kind}")
        except DeviceError as e:
            return str(e)
        got = self.snapshot()
        return [k for k in self.writable if not torch.equal(got[k], self.after[key][k])]


@functools.lru_cache(maxsize=None)
def _trials(preset) -> _Trials:
    return _Trials(preset)


REFUSALS = ("bytes are read or written from there", "illegal address")


def _caught(outcome) -> bool:
    """Refused (an extent past its buffer, or an access outside every buffer) or different bytes written."""
    if isinstance(outcome, str):
        assert "a host kernel failed" in outcome and any(r in outcome for r in REFUSALS), outcome
        return True
    return outcome != []


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_swapped_pair_of_pointers_is_refused_or_changes_the_output(preset, family):
    t = _trials(preset)
    assert t.outcome(family, "good") == []  # the control: the call rerun from its snapshot writes the same bytes
    assert _caught(t.outcome(family, "bad")), f"{family}: swapping parameters {t.pairs[family]} changed nothing"


@pytest.mark.parametrize("family", list(OLD))
def test_the_old_order_is_caught_by_the_host_device(family):
    t = _trials("tiny")
    assert t.outcome(f"{family}:old", "good") == []
    assert _caught(t.outcome(f"{family}:old", "bad"))


def test_the_memory_guard_catches_an_access_outside_every_allocation():
    """The host device's guard (`memory_guard`): the same copy kernel passes reading its own 8 floats and
    is refused reading one element past them (the interpreter itself would read whatever lies there)."""
    import triton
    import triton.language as tl

    @triton.jit
    def shifted_copy(x_ptr, y_ptr, N: tl.constexpr, SHIFT: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs + SHIFT))

    kernels.interpreter_fixes()
    base, y = torch.arange(16, dtype=torch.float32), torch.zeros(8)
    x = base[:8]  # the live allocation: 8 floats; the memory after it is readable, but not x's
    live = [(x.data_ptr(), x.data_ptr() + 32), (y.data_ptr(), y.data_ptr() + 32)]
    with kernels.memory_guard(live):
        shifted_copy[(1,)](x, y, N=8, SHIFT=0)
    assert torch.equal(y, x)
    with pytest.raises(Exception, match="illegal address: a load of 4 bytes at .* lies outside every live "
                                        "allocation \\(1 of 8 lanes\\)"):
        with kernels.memory_guard(live):
            shifted_copy[(1,)](x, y, N=8, SHIFT=1)
