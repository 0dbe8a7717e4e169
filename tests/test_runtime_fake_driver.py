"""The C runtime on the fake HIP and CUDA drivers (tests/fake_driver): every call recorded. It loads each
code object once, launches exactly the program's launches in order with the right grid, block, shared
bytes and argument bytes (buffer base + offset), captures once per function and replays, frees everything;
each failure (module load, missing symbol, out of memory, ABI version, tampered table, no driver) is one
clear error with nothing leaked. The whole runtime is also driven under AddressSanitizer."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch

from runtime_helpers import FAKE_DIR, Fake, fake_driver, fake_table, tiny
from v4compile.errors import DeviceError
from v4compile.runtime.build import ASAN_FLAGS, SOURCE_DIR, SOURCES, cache_dir, compile_shared
from v4compile.runtime.c_backend import CRuntime

DRIVERS = ("cuda", "hip")


def _inputs(prog, fname, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in prog.functions[fname].buffers:
        if b.kind == "input":
            out[b.name] = torch.randint(0, 4, b.type.shape, generator=g)
    return out


def _expected(rt, fname):
    fs = rt.sched.functions[rt.sched.function_index(fname)]
    want = []
    for c in fs.calls:
        args = tuple(0 if p.buffer < 0 else rt.addr[p.buffer] + p.offset for p in c.params)
        want.append((c.symbol, (*c.grid, *c.block, c.shared), args))
    return want


@pytest.mark.parametrize("driver", DRIVERS)
def test_launches_captures_and_frees_exactly(driver):
    m, prog, w = tiny()
    fake = Fake(driver)
    rt = CRuntime(prog, w, driver, driver_lib=fake.path, table=fake_table())
    c = fake.counts()
    assert c["loads"] == 1 and c["streams"] == 1
    assert c["allocs"] == len(rt.sched.buffer_names) and c["live"] == c["allocs"]
    # every launch of the program, in order, with its pointers = buffer base + byte offset
    rt.run("decode", _inputs(prog, "decode"))
    rt.run("prefill", _inputs(prog, "prefill"))
    log = fake.log()
    want = _expected(rt, "decode") + _expected(rt, "prefill")
    assert len(want) == len(prog.functions["decode"].launches) + len(prog.functions["prefill"].launches)
    assert [(n, g, a) for n, g, a, _ in log] == want
    assert [n for n, *_ in log[: len(prog.functions["decode"].launches)]] == \
        [l.specialisation for l in prog.functions["decode"].launches]
    # weights and step inputs really are at those addresses
    wname = prog.functions["decode"].launches[0].operands[1][1].buffer
    assert torch.equal(rt.buffer("decode", wname), w[wname].contiguous().reshape(-1).view(torch.uint8))
    # graphs: capture once per function, replay after that; the replayed launches are the same calls
    for step in range(3):
        rt.run("decode", _inputs(prog, "decode", step), graph=True)
    c = fake.counts()
    assert c["captures"] == 1 and c["graph_launches"] == 3
    replayed = [(n, g, a) for n, g, a, r in fake.log() if r]
    assert replayed == _expected(rt, "decode") * 3
    rt.run("prefill", _inputs(prog, "prefill"), graph=True)
    assert fake.counts()["captures"] == 2
    assert rt.stats()["captures"] == 2 and rt.stats()["replays"] == 4
    rt.close()
    c = fake.counts()
    assert c["live"] == 0 and c["frees"] == c["allocs"] and c["unloads"] == c["loads"] == 1
    assert c["streams"] == 0 and c["graphs"] == 0 and c["execs"] == 0


def test_the_fake_driver_record_catches_a_wrong_offset():
    """The argument check can fail: shift one parameter's offset in the table and the log differs."""
    m, prog, w = tiny()
    fake = Fake("cuda")

    def shifted(sched):
        import dataclasses
        f = sched.functions[sched.function_index("decode")]
        c = f.calls[5]
        p = c.params[0]
        f.calls[5] = dataclasses.replace(c, params=(dataclasses.replace(p, offset=p.offset + 4),) + c.params[1:])
        return fake_table()(sched)

    rt = CRuntime(prog, w, "cuda", driver_lib=fake.path, table=shifted)
    rt.run("decode", _inputs(prog, "decode"))
    good = CRuntime.__new__(CRuntime)
    got = [(n, g, a) for n, g, a, _ in fake.log()]
    want = _expected(rt, "decode")
    assert got == want  # the runtime passes what its table says ...
    base = rt.addr[rt.sched.functions[rt.sched.function_index("decode")].calls[5].params[0].buffer]
    assert got[5][2][0] - base == prog.functions["decode"].launches[5].operands[0][1].offset + 4  # ... the wrong one
    del good
    rt.close()


FAILURES = {
    "module": (dict(table=lambda s: (setattr(s, "code_objects", [b"not a code object\0"]), s.to_bytes())[1]),
               "code object 0 (18 bytes) failed to load"),
    "symbol": (dict(table=fake_table(drop="@first")), "kernel symbol"),
    "oom": (dict(table=fake_table(), fail=("alloc", 4)), "allocating buffer 3"),
    "abi": (dict(table=fake_table(), abi=2), "ABI version mismatch: the caller expects 2, this library is 1"),
    "tampered": (dict(table=fake_table(tamper=True)), "checksum mismatch (the file was changed or damaged)"),
    "no driver": (dict(table=fake_table(), driver_lib="/nonexistent/libdriver.so"), "cannot open the driver library"),
}


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("case", list(FAILURES))
def test_each_failure_is_one_clear_error_with_nothing_leaked(driver, case):
    m, prog, w = tiny()
    fake = Fake(driver)
    kw, msg = FAILURES[case]
    kw = dict(kw)
    if "fail" in kw:
        fake.fail(kw.pop("fail")[0], 4)
    if kw.get("table") is not None and case == "symbol":
        first = prog.functions["prefill"].launches[0].specialisation
        kw["table"] = fake_table(drop=first)
        msg = f"kernel symbol '{first}' not found in code object 0 (function 0 call 0)"
    kw.setdefault("driver_lib", fake.path)
    with pytest.raises(DeviceError) as e:
        CRuntime(prog, w, driver, **kw)
    assert msg in str(e.value), str(e.value)
    assert str(e.value).count("\n") == 0
    c = fake.counts()
    assert c["live"] == 0 and c["frees"] == c["allocs"] and c["unloads"] == c["loads"]
    assert c["streams"] == 0 and c["graphs"] == 0


def test_the_runtime_under_address_sanitizer(tmp_path):
    """Success and failure paths of the C runtime (host and both fake drivers: open, runs, failed runs,
    a large-shared-memory opt-in and its refusal) under ASan + UBSan + LeakSanitizer, in a C driver program
    (tests/fake_driver/asan_main.c)."""
    m, prog, w = tiny()
    sched_rt = CRuntime(prog, w, "host")
    (tmp_path / "host.tbl").write_bytes(sched_rt.table)
    (tmp_path / "fake.tbl").write_bytes(fake_table()(sched_rt.sched))
    f = sched_rt.sched.functions[0]
    f.calls[0] = dataclasses.replace(f.calls[0], shared=100 * 1024)  # above both drivers' default
    (tmp_path / "shared.tbl").write_bytes(fake_table()(sched_rt.sched))
    sched_rt.close()
    exe = tmp_path / "asan_main"
    flags = ("-std=c11", "-Wall", "-Wextra", "-Werror") + ASAN_FLAGS
    compile_shared([FAKE_DIR / "asan_main.c"] + [SOURCE_DIR / s for s in SOURCES], exe, flags)
    r = subprocess.run([str(exe), str(tmp_path / "host.tbl"), str(tmp_path / "fake.tbl"), str(fake_driver("cuda")),
                        str(fake_driver("hip")), str(tmp_path / "shared.tbl")], capture_output=True, text=True, timeout=120,
                       env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1",
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "asan_main: ok" in r.stdout
    n = sum(len(f.launches) for f in prog.functions.values())
    assert f"({3 * n} host kernel calls)" in r.stdout
