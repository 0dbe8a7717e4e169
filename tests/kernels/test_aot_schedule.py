"""AOT scheduling and statistics without compiling anything: jobs run longest first (static estimate from the
kernel's source and its @triton.jit helpers, sm_90a weighted above gfx950); an sm_90a kernel's matrix
instructions are counted from its cubin's code (nvdisasm, ~0.6 CPU s a call, only where the cubin does not
decode), and neither is asked for a kernel whose PTX holds no matrix instruction. The worker process imports
no torch and leaves at once when its input ends."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

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


def test_worker_imports_no_torch_and_exits(tmp_path):
    """What a worker imports (the AOT module, then each kernel family it compiles) holds no torch: ~1.6 CPU s
    of its ~2 s start-up, twice in every cold compile (the families import it where they run kernels: on first
    use). A worker given no job exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as `_run_workers` starts it
    code = ("import importlib, sys; from pathlib import Path; from v4compile.codegen import aot, kernels\n"
            "for f in sorted(Path(kernels.__file__).parent.glob('*.py')):\n"
            "    if f.stem not in kernels.SUPPORT + ('__init__',):\n"
            "        importlib.import_module(f'{kernels.__name__}.{f.stem}')\n"
            "print(len([m for m in sys.modules if m.startswith(kernels.__name__ + '.')]),"
            " sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    n, torch_modules = r.stdout.split(" ", 1)
    assert int(n) > 25 and torch_modules.strip() == "[]", r.stdout
    r = subprocess.run([sys.executable, "-m", "v4compile.codegen.aot", "--worker", str(tmp_path)], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r.stderr[-2000:]


def cubin_of(sections: dict[str, list[int]]) -> bytes:
    """A minimal ELF64 with one code section per name, each instruction 128 bits whose first word is the given
    value (as an sm_90 cubin lays out its `.text.<function>` sections)."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    body = [b"".join(struct.pack("<QQ", w, 0) for w in ws) for ws in sections.values()]
    data_at = 64
    offs, at = [], data_at + len(names)
    for b in body:
        offs.append(at)
        at += len(b)
    heads = [bytes(64), struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, data_at, len(names), 0, 0, 1, 0)]
    name_at = len(b"\0.shstrtab\0")
    for n, off, b in zip(sections, offs, body):
        heads.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 6, 0, off, len(b), 0, 0, 16, 0))
        name_at += len(n) + 1
    ehdr = bytearray(64)
    ehdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", ehdr, 0x28, at)
    struct.pack_into("<HHH", ehdr, 0x3A, 64, len(heads), 1)
    return bytes(ehdr) + names + b"".join(body) + b"".join(heads)


# first words as nvdisasm -hex shows them: QGMMA (A in shared memory), HGMMA (A in registers), HMMA, CS2R, SGXT
QGMMA, HGMMA_R, HMMA, CS2R, SGXT = 0x00200000042079F3, 0x0000000004180DF0, 0x000000140404723C, 0x2A7805, 0x50808781A


def test_sass_mma_count_decodes_code_sections():
    cubin = cubin_of({".text.moe_fused_kernel": [CS2R, QGMMA, QGMMA, SGXT, HGMMA_R],
                      ".text._route_phase": [HMMA, CS2R], ".nv.info": [QGMMA] * 4})
    assert aot.sass_mma_count(cubin) == 4  # the called function's too; no data section's bytes
    assert aot.sass_mma_count(b"not an ELF") is None
    assert aot.sass_mma_count(cubin[:200]) is None  # cut short


def test_nvdisasm_only_where_the_cubin_does_not_decode(monkeypatch):
    asked = []
    monkeypatch.setattr(aot, "_nvdisasm", lambda cubin: asked.append(cubin) or "HGMMA.64x16x16.F32.BF16 R0\n" * 3)
    log = "ptxas info    : Used 40 registers, 0 bytes spill stores, 0 bytes spill loads"
    wgmma = "\t@%p1 wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%f1}, ...;\n"
    scalar = aot._nv_stats(b"a", "\tfma.rn.f32 %f1, %f2, %f3, %f4;\n", log, 0, 4)
    assert asked == [] and scalar["mma_instructions"] == 0 and scalar["regs"] == 40
    decoded = aot._nv_stats(cubin_of({".text.k": [QGMMA, CS2R, QGMMA]}), wgmma, log, 0, 4)
    assert asked == [] and decoded["mma_instructions"] == 2 and decoded["mma_source"] == "sass"
    mma = aot._nv_stats(b"b", wgmma, log, 0, 4)
    assert asked == [b"b"] and mma["mma_instructions"] == 3 and mma["mma_source"] == "sass"
