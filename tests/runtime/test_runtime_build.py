"""Building the C runtime: warning-free under -Werror (the flags), cached by source hash and compiler,
a compile failure is one clear error, and the library has no link-time dependency on a GPU library."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from v4compile.errors import DeviceError
from v4compile.runtime import build


def test_cached_by_source_hash_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path))
    a = build.library()
    assert a.is_file() and a.parent.parent == tmp_path / "runtime"
    mtime = a.stat().st_mtime_ns
    assert build.library() == a and a.stat().st_mtime_ns == mtime  # no rebuild
    monkeypatch.setenv("CC", "cc -DV4RT_UNUSED_KNOB=1")  # another compiler command: another build
    b = build.library()
    assert b != a and b.is_file()


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_no_gpu_library_at_link_time():
    lib = build.library()
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "cuda" not in needed and "hip" not in needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
    assert not any(s in undefined for s in ("cuLaunchKernel", "hipModuleLaunchKernel", "cuMemAlloc", "hipMalloc"))
    syms = {t.split("@")[0] for t in undefined.split()}
    assert "dlopen" in syms and not syms & {"exit", "_exit", "abort"}  # never ends the process


def test_a_compile_failure_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("V4COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "cc -DV4RT_ABI_VERSION=")  # breaks the header's macro
    with pytest.raises(DeviceError, match="the C runtime failed to compile"):
        build.library()
    assert not list((tmp_path / "runtime").rglob("*.so"))  # no partial library left
