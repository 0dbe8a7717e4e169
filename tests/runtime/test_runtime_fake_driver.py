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
from v4compile.runtime.build import ASAN_FLAGS, SOURCE_DIR, SOURCES, compile_shared
from v4compile.runtime.c_backend import CRuntime

DRIVERS = ("cuda", "hip")


def _inputs(prog, fname, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in prog.functions[fname].buffers:
        if b.kind == "input":
            out[b.name] = torch.randint(0, 4, b.type.shape, generator=g)
    return out


def _expected(rt, prog, fname):
    """The launches of `fname` from the program alone (not the schedule under test): each launch's
    placeholder symbol, grid and block (1, 1, 1), no shared bytes, and its operands then results as
    buffer base + the program's byte offset (NULL for an absent optional)."""
    def addr(a):
        return 0 if a is None else rt.addr[rt.sched.buffer_index(fname, a.buffer)] + a.offset

    return [(l.specialisation, (1, 1, 1, 1, 1, 1, 0), tuple(addr(a) for _, a in (*l.operands, *l.results)))
            for l in prog.functions[fname].launches]


def _differences(got, want):
    """(launch, what, got, want) for each launch field that differs; lengths first."""
    if len(got) != len(want):
        return [("count", len(got), len(want))]
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        for what, a, b in (("symbol", g[0], w[0]), ("geometry", g[1], w[1]), ("param count", len(g[2]), len(w[2]))):
            if a != b:
                out.append((i, what, a, b))
        out += [(i, f"param {j}", a, b) for j, (a, b) in enumerate(zip(g[2], w[2])) if a != b]
    return out


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
    want = _expected(rt, prog, "decode") + _expected(rt, prog, "prefill")
    assert _differences([(n, g, a) for n, g, a, _ in log], want) == []
    # weights and step inputs really are at those addresses
    wname = prog.functions["decode"].launches[0].operands[1][1].buffer
    assert torch.equal(rt.buffer("decode", wname), w[wname].contiguous().reshape(-1).view(torch.uint8))
    # graphs: capture once per function, replay after that; the replayed launches are the same calls
    for step in range(3):
        rt.run("decode", _inputs(prog, "decode", step), graph=True)
    c = fake.counts()
    assert c["captures"] == 1 and c["graph_launches"] == 3
    replayed = [(n, g, a) for n, g, a, r in fake.log() if r]
    assert _differences(replayed, _expected(rt, prog, "decode") * 3) == []
    rt.run("prefill", _inputs(prog, "prefill"), graph=True)
    assert fake.counts()["captures"] == 2
    assert rt.stats()["captures"] == 2 and rt.stats()["replays"] == 4
    rt.close()
    c = fake.counts()
    assert c["live"] == 0 and c["frees"] == c["allocs"] and c["unloads"] == c["loads"] == 1
    assert c["streams"] == 0 and c["graphs"] == 0 and c["execs"] == 0


# a fault in one call of the table -> (the field the comparison reports, got - want)
FAULTS = {
    "offset": (lambda c: dataclasses.replace(c, params=(dataclasses.replace(c.params[0], offset=c.params[0].offset + 4),
                                                        *c.params[1:])), "param 0", 4),
    "swap": (lambda c: dataclasses.replace(c, params=c.params[1:2] + c.params[:1] + c.params[2:]), "param 0", None),
    "grid": (lambda c: dataclasses.replace(c, grid=(2, 1, 1)), "geometry", None),
    "block": (lambda c: dataclasses.replace(c, block=(32, 1, 1)), "geometry", None),
    "shared": (lambda c: dataclasses.replace(c, shared=16), "geometry", None),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_launch_check_catches_a_wrong_call(fault):
    """The launch check above can fail: one call of the table changed (a parameter moved 4 bytes, two
    parameters swapped, another grid, block or shared size) is what the same comparison reports (the
    expectation comes from the program, not from the edited schedule)."""
    m, prog, w = tiny()
    fake = Fake("cuda")
    change, field, delta = FAULTS[fault]

    def faulty(sched):
        f = sched.functions[sched.function_index("decode")]
        f.calls[5] = change(f.calls[5])
        return fake_table()(sched)

    rt = CRuntime(prog, w, "cuda", driver_lib=fake.path, table=faulty)
    rt.run("decode", _inputs(prog, "decode"))
    got = [(n, g, a) for n, g, a, _ in fake.log()]
    diff = _differences(got, _expected(rt, prog, "decode"))
    assert diff and {(i, what) for i, what, *_ in diff} <= {(5, field), (5, "param 1")} and diff[0][:2] == (5, field)
    if delta is not None:
        assert [d[2] - d[3] for d in diff] == [delta]
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
    """Success and failure paths of the C runtime (host and both fake drivers: open, runs, failed runs, probes,
    a large-shared-memory opt-in and its refusal, writes through small pinned staging buffers read back, a
    symmetric region exported and mapped by a second runtime, or refused where CUDA refuses it)
    under ASan + UBSan + LeakSanitizer, in a C driver program (tests/fake_driver/asan_main.c)."""
    m, prog, w = tiny()
    sched_rt = CRuntime(prog, w, "host")
    s = sched_rt.sched  # with a symmetric buffer last (the one-shot all-reduce's region: exported, mapped)
    s.buffer_names.append("symmetric"), s.buffer_kinds.append("symmetric"), s.buffer_bytes.append(4096)
    s.buffer_align.append(256)
    (tmp_path / "host.tbl").write_bytes(s.to_bytes())
    (tmp_path / "fake.tbl").write_bytes(fake_table()(sched_rt.sched))
    f = sched_rt.sched.functions[0]
    f.calls[0] = dataclasses.replace(f.calls[0], shared=100 * 1024)  # above both drivers' default
    (tmp_path / "shared.tbl").write_bytes(fake_table()(sched_rt.sched))
    sched_rt.close()
    exe = tmp_path / "asan_main"
    flags = ("-std=c11", "-Wall", "-Wextra", "-Werror", "-DV4RT_STAGE_BYTES=4096", "-DV4RT_STAGE_MIN=1024") + ASAN_FLAGS
    compile_shared([FAKE_DIR / "asan_main.c"] + [SOURCE_DIR / s for s in SOURCES], exe, flags)
    r = subprocess.run([str(exe), str(tmp_path / "host.tbl"), str(tmp_path / "fake.tbl"), str(fake_driver("cuda")),
                        str(fake_driver("hip")), str(tmp_path / "shared.tbl")], capture_output=True, text=True, timeout=120,
                       env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "halt_on_error=1",
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "asan_main: ok" in r.stdout
    n = sum(len(f.launches) for f in prog.functions.values())
    assert f"({3 * n + 3 * len(f.calls)} host kernel calls)" in r.stdout  # 3 runs each, 3 more of function 0 (probes)
