"""AOT scheduling and statistics without compiling anything: jobs run longest first (static estimate from the
kernel's source and its @triton.jit helpers, sm_90a weighted above gfx950), and nvdisasm (~1 s a call) is
only asked for a kernel whose PTX holds a matrix instruction."""

from __future__ import annotations

import kernel_check  # noqa: F401  (TRITON_INTERPRET=1 before kernel modules load)
from v4compile.codegen import aot

MODS = "v4compile.codegen.kernels."


def _job(mod, fn, target):
    return {"module": MODS + mod, "fn": fn, "target": target, "name": f"{fn}/{target}"}


def test_longest_first_orders_by_estimate():
    jobs = [_job("last_token", "last_token_kernel", "gfx950"), _job("mhc", "mhc_kernel", "gfx950"),
            _job("last_token", "last_token_kernel", "sm_90a"), _job("mhc", "mhc_kernel", "sm_90a")]
    names = [j["name"] for j in aot.longest_first(jobs)]
    assert names == ["mhc_kernel/sm_90a", "mhc_kernel/gfx950", "last_token_kernel/sm_90a", "last_token_kernel/gfx950"]
    # helpers count: mhc_kernel calls _post_chunk and _dot_fp32_weight
    import inspect
    from v4compile.codegen.kernels import mhc
    own = len(inspect.getsource(mhc.mhc_kernel.fn))
    assert aot._source_size(MODS + "mhc", "mhc_kernel") > own


def test_nvdisasm_only_for_mma_kernels(monkeypatch):
    asked = []
    monkeypatch.setattr(aot, "_nvdisasm", lambda cubin: asked.append(cubin) or "HGMMA.64x16x16.F32.BF16 R0\n" * 3)
    log = "ptxas info    : Used 40 registers, 0 bytes spill stores, 0 bytes spill loads"
    scalar = aot._nv_stats(b"a", "\tfma.rn.f32 %f1, %f2, %f3, %f4;\n", log, 0, 4)
    assert asked == [] and scalar["mma_instructions"] == 0 and scalar["regs"] == 40
    mma = aot._nv_stats(b"b", "\t@%p1 wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%f1}, ...;\n", log, 0, 4)
    assert asked == [b"b"] and mma["mma_instructions"] == 3 and mma["mma_source"] == "sass"
