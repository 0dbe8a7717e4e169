"""Editing a compiled artifact as an attacker would: change the manifest, then recompute every hash so that
only the loader's structural checks stand between the edit and the runtime; and sentinel files outside the
artifact that show whether anything outside was opened or read; the cpu artifact those tests tamper with."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from v4compile.manifest import canonical, manifest_digest


def copy(art: Path, dest: Path) -> Path:
    shutil.copytree(art, dest, symlinks=True)
    return dest


def sha(path: Path) -> str:
    """The hash the manifest's `files` gives this file (a weights shard's is its `shard_digest`)."""
    if Path(path).suffix == ".safetensors":
        from v4compile.errors import ArtifactError
        from v4compile.weights_map import shard_file_digest

        return shard_file_digest(Path(path), ArtifactError)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def manifest(art: Path) -> dict:
    return json.loads((art / "manifest.json").read_text())


def write_manifest(art: Path, m: dict) -> None:
    """Write `m` with its own digest recomputed (the attacker's last step)."""
    m["manifest_sha256"] = manifest_digest(m)
    (art / "manifest.json").write_text(canonical(m))


class Sentinel:
    """Files outside the artifact that must never be read: their access times are set far in the past, so
    that a read by anyone (Python, ONNX Runtime, the safetensors library, the C runtime) moves them (ext4's
    relatime records the first read after a change), and every Python-level open is audited."""

    opened: list[str] = []
    recording = False  # audit hooks cannot be removed: this one records only between set-up and `touched`
    _hooked = False
    OLD = 1_000_000_000  # ns: 1970

    def __init__(self, paths):
        self.paths = [Path(p).resolve() for p in paths]
        for p in self.paths:
            os.utime(p, ns=(self.OLD, p.stat().st_mtime_ns))
        if not Sentinel._hooked:
            sys.addaudithook(Sentinel._audit)
            Sentinel._hooked = True
        Sentinel.opened = []
        Sentinel.recording = True

    @staticmethod
    def _audit(event: str, args) -> None:
        if Sentinel.recording and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            Sentinel.opened.append(os.fsdecode(args[0]))

    def touched(self) -> list[str]:
        """The sentinels read (atime moved) or opened from Python since they were set up."""
        Sentinel.recording = False
        read = [str(p) for p in self.paths if p.stat().st_atime_ns != self.OLD]
        opened = [o for o in Sentinel.opened if Path(o).resolve() in self.paths]
        return read + opened


def atime_works(tmp: Path) -> bool:
    """Whether this file system records reads in atime (the sentinel's premise)."""
    p = tmp / "atime-probe"
    p.write_bytes(b"x")
    os.utime(p, ns=(Sentinel.OLD, p.stat().st_mtime_ns))
    p.read_bytes()
    return p.stat().st_atime_ns != Sentinel.OLD


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """The host device sets torch's threads process-wide: put them back after each test (autouse where a
    test module imports it)."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def compile_cpu(out: Path, decode_buckets: str = "1") -> Path:
    """A tiny artifact with the cpu target only (the cheapest to compile and run)."""
    from v4compile.cli import main

    assert main(["compile", "--preset", "tiny", "-o", str(out), "--target", "cpu", "--decode-buckets",
                 decode_buckets, "--prefill-buckets", "16"]) == 0
    return out
