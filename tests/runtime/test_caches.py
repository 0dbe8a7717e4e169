"""The caches are not trusted (issue 24, class 5): the AOT kernel cache (`codegen/aot.py`) and the C runtime
library cache (`runtime/build.py`) record a sha256 when an entry is written and check it before every use;
a flipped, truncated or missing entry is rebuilt, and what comes out of a damaged cache is byte-identical to
what comes out of a clean one. A truncated cached `libv4rt.so` is never dlopened (that would die of SIGBUS).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from v4compile.runtime import build


def _tree(d):
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _flip(p, offset: int = 100) -> None:
    raw = bytearray(p.read_bytes())
    raw[offset % len(raw)] ^= 0x40
    p.write_bytes(bytes(raw))


# ---- the C runtime library ------------------------------------------------------------------------

def _damage(lib, clean: bytes, damage: str) -> None:
    record = lib.with_name(lib.name + ".sha256")
    if damage == "flip":
        _flip(lib, len(clean) // 2)
    elif damage == "truncate":
        lib.write_bytes(clean[:4096])
    elif damage == "no record":
        record.unlink()
    else:
        lib.unlink()


def _check_rebuilt(lib, clean: bytes) -> None:
    """The cached library is the clean build's bytes again (the build is reproducible: no -g, same flags), and
    its record their hash. Bytes, not lengths: a flipped byte keeps the length."""
    assert build.library() == lib and build.verified(lib)
    assert hashlib.sha256(lib.read_bytes()).digest() == hashlib.sha256(clean).digest(), \
        "the cached library is not the clean build's bytes"


@pytest.mark.parametrize("damage", ["flip", "truncate", "no record", "no library"])
def test_a_damaged_cached_runtime_library_is_rebuilt(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path))
    lib = build.library()
    clean = lib.read_bytes()
    record = lib.with_name(lib.name + ".sha256")
    assert record.read_text().strip() == hashlib.sha256(clean).hexdigest()
    _damage(lib, clean, damage)
    assert not build.verified(lib)
    _check_rebuilt(lib, clean)


def test_a_cache_that_records_the_damaged_librarys_hash_is_caught(tmp_path, monkeypatch):
    """The planted fault: a "rebuild" that keeps the flipped library and records its hash (the compiler
    replaced by a copy of the damaged file). `verified` then holds, the length is the clean one's, and
    `_check_rebuilt`'s byte comparison fails."""
    import shutil

    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path))
    lib = build.library()
    clean = lib.read_bytes()
    _damage(lib, clean, "flip")
    damaged = tmp_path / "damaged.so"
    shutil.copyfile(lib, damaged)
    monkeypatch.setattr(build, "compile_shared", lambda sources, out, flags=build.CFLAGS: shutil.copyfile(damaged, out))
    assert len(damaged.read_bytes()) == len(clean)
    with pytest.raises(AssertionError, match="not the clean build's bytes"):
        _check_rebuilt(lib, clean)


def test_a_truncated_cached_library_is_never_dlopened(tmp_path):
    """In a child process (a dlopen of the truncated file would kill it with SIGBUS): the library loads and
    runs after the cache was truncated under it."""
    code = textwrap.dedent("""
        from v4compile.runtime import build
        from v4compile.runtime.c_backend import load_library
        lib = build.library()
        lib.write_bytes(lib.read_bytes()[:3000])
        print(load_library().v4rt_abi_version())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "V4COMPILE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "1"


def test_an_interrupted_build_leaves_no_temporary_files(tmp_path):
    """A compiler that writes a temporary file and hangs; SIGTERM (handled as the CLI does) ends the build:
    the compiler's process group is killed and nothing is left in the system temp directory or the cache."""
    cc = tmp_path / "slowcc"
    cc.write_text('#!/bin/sh\necho partial > "$TMPDIR/cc-temp.o"\ntouch "$MARK"\nsleep 60\n')
    cc.chmod(0o755)
    sysdir, cache = tmp_path / "systmp", tmp_path / "cache"
    sysdir.mkdir()
    code = textwrap.dedent("""
        import signal
        def stop(*_):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, stop)
        from v4compile.runtime import build
        try:
            build.library()
        except KeyboardInterrupt:
            print("interrupted")
    """)
    env = {**os.environ, "V4COMPILE_CACHE": str(cache), "CC": str(cc), "TMPDIR": str(sysdir),
           "MARK": str(tmp_path / "started")}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    for _ in range(600):
        if (tmp_path / "started").exists():
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert out.strip() == "interrupted"
    assert list(sysdir.iterdir()) == []
    left = [x for x in cache.rglob("*") if x.is_file()]
    assert left == [], left


def test_a_killed_build_is_cleaned_up_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path))
    lib = build.library()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = lib.parent / f".build-{dead.pid}-abc"
    stale.mkdir()
    (stale / "cc-temp.o").write_text("left by a killed build")
    lib.unlink()
    build.library()
    assert not stale.exists()


# ---- the AOT kernel cache -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_damaged_kernel_cache_entry_is_rebuilt_to_the_same_bytes(tmp_path, monkeypatch):
    """One small GEMM for gfx950: compiled into an empty cache (a missing entry), then each damage (a flipped
    binary byte, a truncated sidecar, a missing record) is compiled again; the output is byte-identical."""
    from kernel_check import small_gemm_calls  # (TRITON_INTERPRET=1 before kernel modules load)
    from v4compile.codegen import aot

    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path / "cache"))
    calls = small_gemm_calls()
    rows = aot.compile_calls(calls, ["gfx950"], tmp_path / "clean", jobs=1)
    clean = _tree(tmp_path / "clean")
    entry = tmp_path / "cache" / "aot" / aot.job_of(calls[0], "gfx950")["key"]
    assert aot.read_entry(entry) is not None and not rows[0]["cached"]

    def damage(kind: str) -> None:
        if kind == "flip":
            _flip(entry / "binary")
        elif kind == "truncate":
            (entry / "sidecar.json").write_bytes((entry / "sidecar.json").read_bytes()[:40])
        else:
            (entry / aot.DIGEST).unlink()

    for kind in ("flip", "truncate", "no record"):
        damage(kind)
        assert aot.read_entry(entry) is None
        out = tmp_path / kind.replace(" ", "_")
        rows = aot.compile_calls(calls, ["gfx950"], out, jobs=1)
        assert not rows[0]["cached"], kind  # compiled again, not copied
        assert _tree(out) == clean, kind
        assert aot.read_entry(entry) is not None
    rows = aot.compile_calls(calls, ["gfx950"], tmp_path / "warm", jobs=1)
    assert rows[0]["cached"] and _tree(tmp_path / "warm") == clean


def test_the_cache_check_catches_a_flipped_byte(tmp_path):
    """read_entry itself, on a hand-made entry (no compile): intact -> the bytes; any change -> None."""
    import json

    from v4compile.codegen import aot

    files = {"binary": b"\x7fELF" + bytes(range(200)), "sidecar.json": b"{}\n", "stats.json": b"{}"}
    for n, b in files.items():
        (tmp_path / n).write_bytes(b)
    (tmp_path / aot.DIGEST).write_text(json.dumps({n: hashlib.sha256(b).hexdigest() for n, b in files.items()}))
    assert aot.read_entry(tmp_path) == files
    _flip(tmp_path / "binary", 7)
    assert aot.read_entry(tmp_path) is None


@pytest.mark.slow
def test_an_artifact_from_a_damaged_cache_is_byte_identical(tmp_path):
    """The README's default compile twice (the same kernels as test_gpu_artifact.py, so usually a warm cache):
    between the two, one gfx950 entry of the cache gets a flipped byte and another loses its record; the
    second artifact is byte for byte the first."""
    import json

    from v4compile.cli import main
    from v4compile.codegen import aot

    assert main(["compile", "--preset", "tiny", "-o", str(tmp_path / "a")]) == 0
    # (a set: calls that differ only in their launch share a binary, so a key)
    keys = sorted({json.loads(p.read_text())["key"] for p in (tmp_path / "a" / "kernels" / "gfx950").glob("*.json")})
    cache = aot.cache_root() / "aot"
    flipped, unrecorded = cache / keys[0], cache / keys[1]
    _flip(flipped / "binary")
    (unrecorded / aot.DIGEST).unlink()
    assert aot.read_entry(flipped) is None and aot.read_entry(unrecorded) is None
    assert main(["compile", "--preset", "tiny", "-o", str(tmp_path / "b")]) == 0
    assert _tree(tmp_path / "b") == _tree(tmp_path / "a")
    assert aot.read_entry(flipped) is not None and aot.read_entry(unrecorded) is not None
