"""The artifact's GPU targets (issue 9): `v4compile compile --preset tiny -o DIR` (the README's default) holds,
for gfx950 and sm_90a, the program and one binary + sidecar per kernel specialisation it launches, hashed in
the manifest and checked at load; report.json has the static kernel report and the modeled decode step; a
second compile (warm cache) gives the same bytes; the C runtime launches exactly those binaries (fake CUDA
driver), and the host device runs the same program with the same kernels, interpreted, to the reference's
tokens.

The artifact is compiled with the CLI defaults on purpose: the README's block and
test_debugtool.py compile the same kernels, so the AOT cache (locked per kernel) compiles them once per run.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from runtime_helpers import Fake
from v4compile.artifact import ArtifactError, load_artifact
from v4compile.cli import main
from v4compile.codegen.program_kernels import program_kernels
from v4compile.runtime.c_backend import CRuntime
from v4compile.runtime.kernels import make_kernel_calls
from v4compile.runtime.program_backend import artifact_binaries, artifact_program, artifact_weights

pytestmark = pytest.mark.slow
GPU = ("gfx950", "sm_90a")
ROW_KEYS = ("name", "target", "regs", "spills", "shared_bytes", "mma_instructions", "occupancy", "modeled_us",
            "bandwidth_us", "flops", "bytes")


def _compile(out) -> None:
    assert main(["compile", "--preset", "tiny", "-o", str(out)]) == 0


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "tiny"
    _compile(out)
    return load_artifact(out)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _tree(path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_both_gpu_targets_hold_every_kernel_the_program_launches(art):
    m = art.manifest
    assert [t["name"] for t in m["targets"]] == ["cpu", *GPU]
    prog = artifact_program(art)
    assert set(prog.functions) == {"decode_b8", "prefill_c64"}  # the GPU buckets: the largest of each
    need = set(program_kernels(prog).unique)
    for t in GPU:
        entry = art.target(t)
        assert entry["format"] == "triton-aot" and entry["program"] == "gpu/program.txt"
        have = {k["name"]: k for k in m["kernels"] if k["target"] == t}
        assert set(have) == need, sorted(set(have) ^ need)[:5]
        for k in have.values():
            binary = art.file(k["path"]).read_bytes()
            assert hashlib.sha256(binary).hexdigest() == k["sha256"] == m["files"][k["path"]]
            side = json.loads(art.file(k["sidecar"]).read_text())
            assert side["target"] == t and side["symbol"] and side["binary_sha256"] == k["sha256"]
            assert [p["kind"] for p in side["params"][-2:]] == ["triton_scratch", "triton_scratch"]
            assert side["block"][0] == side["num_warps"] * (64 if t == "gfx950" else 32)
        assert binary[:4] == b"\x7fELF"  # hsaco and cubin are both ELF images


def test_report_has_the_static_kernel_report_and_the_modeled_decode_step(art):
    rep = json.loads(art.file("report.json").read_text())
    rows = rep["kernels"]
    assert len(rows) == len(art.manifest["kernels"])
    for r in rows:
        assert all(k in r for k in ROW_KEYS) and isinstance(r["spills"], int)
        assert "compile_s" not in r and "cached" not in r  # per-machine facts would break reproducibility
    assert not [r["name"] for r in rows if r["target"] == "gfx950" and r["spills"]]  # the goal: 0 on gfx950
    for t in GPU:
        step = rep["decode_step"][t]["decode_b8"]
        assert step["modeled_us"] > step["roofline_us"] > 0 and step["kernel_bytes"] > 0
        decode = {c.name for per in program_kernels(artifact_program(art)).calls["decode_b8"] for c in per}
        assert step["kernels"] == len(decode)
        assert step["kernels_spilling"] == sorted(r["name"] for r in rows if r["target"] == t and r["spills"]
                                                  and r["name"] in decode)
    # gfx950 has fp32 MMA: every GEMM-like kernel of this fp32 artifact uses it.
    assert rep["decode_step"]["gfx950"]["decode_b8"]["mma_missing"] == []


def test_a_changed_byte_in_a_kernel_is_reported_by_name(art, tmp_path):
    copy = tmp_path / "a"
    shutil.copytree(art.path, copy)
    k = next(k for k in art.manifest["kernels"] if k["target"] == "sm_90a")
    raw = bytearray((copy / k["path"]).read_bytes())
    raw[len(raw) // 2] ^= 1
    (copy / k["path"]).write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=k["path"].split("/")[-1]):
        load_artifact(copy)


def test_compiling_twice_gives_the_same_bytes(art, tmp_path):
    _compile(tmp_path / "again")  # warm cache: the kernels come from it
    assert _tree(tmp_path / "again") == _tree(art.path)


@pytest.mark.parametrize("device, fault", [("cuda", None), ("hip", None), ("cuda", "binaries swapped")])
def test_the_c_runtime_launches_the_artifacts_binaries(art, device, fault):
    """The schedule's code objects are the artifact's binaries for the device's target, each call with its
    sidecar's symbol, block and shared bytes; the fake driver loads those binaries themselves and sees
    exactly those launches, each from the module loaded from ITS kernel's binary (the driver tags each
    module with a hash of its image; Triton names every symbol after its function, so a symbol alone
    cannot tell the binaries apart).
    `binaries swapped`: two kernels' binaries exchanged in the table, caught by the same check."""
    from v4compile.runtime.schedule import build_schedule

    prog = artifact_program(art)
    target = {"cuda": "sm_90a", "hip": "gfx950"}[device]
    mine = [k for k in art.manifest["kernels"] if k["target"] == target]
    files = {k["name"]: art.file(k["path"]).read_bytes() for k in mine}
    sides = {k["name"]: json.loads(art.file(k["sidecar"]).read_text()) for k in mine}
    sched = build_schedule(prog, make_kernel_calls(), warp=64 if device == "hip" else 32,
                           binaries=artifact_binaries(art, device))
    used = {c.kernel.name for f in sched.functions for c in f.calls}
    assert set(sched.code_objects) == {files[n] for n in used} and used == set(files)
    for f in sched.functions:
        for c in f.calls:
            side = sides[c.kernel.name]
            assert sched.code_objects[c.code] == files[c.kernel.name]
            assert (c.symbol, list(c.block), c.shared) == (side["symbol"], side["block"], side["shared_bytes"])

    def swapped(sched) -> bytes:
        """The fault: the binaries of two kernels of one symbol (so both still load) exchanged in the table."""
        codes = {}
        for f in sched.functions:
            for c in f.calls:
                codes.setdefault(c.symbol, set()).add(c.code)
        i, j = sorted(next(v for v in codes.values() if len(v) > 1))[:2]
        sched.code_objects[i], sched.code_objects[j] = sched.code_objects[j], sched.code_objects[i]
        return sched.to_bytes()

    # The fake driver loads the real binaries (it reads each kernel's parameters and thread limit from the
    # ELF, as the real driver does) and tags each module with a hash of the image it was loaded from.
    fake = Fake(device)
    rt = CRuntime(prog, artifact_weights(art), device, driver_lib=fake.path, kernel_calls=make_kernel_calls(),
                  binaries=artifact_binaries(art, device), table=swapped if fault else None)
    try:
        g = torch.Generator().manual_seed(0)
        inputs = {b.name: torch.randint(0, 4, b.type.shape, generator=g)
                  for b in prog.functions["decode_b8"].buffers if b.kind == "input"}
        rt.run("decode_b8", inputs)
        # the kernels the program launches, from the program itself, and the tag of each one's binary
        want = [kc.name for l in prog.functions["decode_b8"].launches for kc in make_kernel_calls()(l)
                if 0 not in kc.grid]
        tag = {n: _image_tag(b) for n, b in files.items()}
        got = fake.modules()
        assert len(got) == len(want)
        wrong = [n for n, t in zip(want, got) if t != tag[n]]
        if fault:
            assert wrong, "two kernels' binaries exchanged, and every launch still came from its own binary"
        else:
            assert wrong == []
            fs = rt.sched.functions[rt.sched.function_index("decode_b8")]
            assert [n for n, *_ in fake.log()] == [sides[n]["symbol"] for n in want] == [c.symbol for c in fs.calls]
    finally:
        rt.close()


def _image_tag(image: bytes) -> str:
    """The fake driver's module tag (tests/fake_driver/fake_driver.c): FNV-1a 64 of the ELF image up to
    the end of its section header table."""
    import struct

    from v4compile.runtime.schedule import fnv1a64

    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3a)
    return f"{fnv1a64(image[: shoff + shnum * shentsize]):016x}"


def test_the_host_device_runs_the_gpu_program_to_the_cpu_devices_tokens(art):
    from v4compile.runtime.session import load

    host = load(art.path, device="host")
    try:
        got = host.generate([[1, 2, 3]], max_new_tokens=2)
    finally:
        host.close()
    cpu = load(art.path, device="cpu")
    try:
        want = cpu.generate([[1, 2, 3]], max_new_tokens=2)
    finally:
        cpu.close()
    assert got == want and len(want[0]) == 2
