"""An artifact is untrusted input (issue 24, class 1): every path the runtime opens from an artifact is
relative, stays inside it after resolving symlinks, is listed and hashed in the manifest, and names a regular
file; the manifest itself is never opened through a symlink.

Per file kind (ONNX graph, weights shard, GPU program, kernel binary, kernel sidecar, the manifest) and per
attack (an absolute path, a `../` path, a symlink out), the artifact is edited as an attacker would: the
outside file is a faithful copy of the one it replaces and every hash in the manifest is recomputed, so the
edit would pass every integrity check and run. Each must be refused through the API (`ArtifactError`, an
`InputError`) and the CLI (exit 2, one `error:` line, no traceback), and no byte outside the artifact may be
read: the outside copies are sentinels whose access time would move on any read (by Python, ONNX Runtime,
the safetensors library or the C runtime) and whose Python-level opens are audited. A deliberately broken
loader (the confinement check removed) is shown to trip the sentinel.
"""

from __future__ import annotations

import os
import shutil

import pytest

import v4compile
from artifact_tamper import compile_cpu, restore_torch_threads, Sentinel, atime_works, copy, manifest, sha, write_manifest  # noqa: F401 (an autouse fixture)
from bad_input_util import run_main, assert_one_error
from v4compile.artifact import load_artifact
from v4compile.cli import main
from v4compile.errors import ArtifactError, InputError

ATTACKS = ("absolute", "dotdot", "symlink")


@pytest.fixture(scope="module")
def cpu_art(tmp_path_factory):
    return compile_cpu(tmp_path_factory.mktemp("sec") / "tiny", "1")


@pytest.fixture(scope="module")
def gpu_art(tmp_path_factory):
    """The README's default compile (gfx950 + sm_90a + cpu): the same kernels as test_gpu_artifact.py, so the
    AOT cache compiles them once per run."""
    out = tmp_path_factory.mktemp("secgpu") / "tiny"
    assert main(["compile", "--preset", "tiny", "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module", autouse=True)
def _atime(tmp_path_factory):
    assert atime_works(tmp_path_factory.mktemp("probe")), "this file system does not record reads (noatime)"


def _kind_rel(kind: str, art) -> str:
    m = manifest(art)
    if kind == "onnx":
        return m["targets"][0]["functions"]["decode_b1"]["file"] if m["targets"][0]["name"] == "cpu" else None
    if kind == "shard":
        return m["weights"]["shards"][0]
    if kind == "program":
        return "gpu/program.txt"
    if kind == "kernel binary":
        return m["kernels"][0]["path"]
    if kind == "sidecar":
        return m["kernels"][0]["sidecar"]
    raise AssertionError(kind)


def _replace(v, old: str, new: str):
    """Every string value equal to `old` (not keys) replaced by `new`."""
    if isinstance(v, dict):
        return {k: _replace(x, old, new) for k, x in v.items()}
    if isinstance(v, list):
        return [_replace(x, old, new) for x in v]
    return new if v == old else v


def _attack(src, tmp_path, kind: str, attack: str):
    """A copy of `src` whose `kind` file is reached outside it; returns (artifact, the outside sentinel)."""
    art = copy(src, tmp_path / "art")
    outside = tmp_path / "outside"
    outside.mkdir()
    if kind == "manifest":
        target = outside / "manifest.json"
        shutil.copyfile(art / "manifest.json", target)
        os.unlink(art / "manifest.json")
        if attack == "absolute":
            os.symlink(target, art / "manifest.json")
        elif attack == "dotdot":
            os.symlink("../outside/manifest.json", art / "manifest.json")
        else:  # a chain: an in-artifact symlink to a symlink leading out
            os.symlink(target, art / "inner.json")
            os.symlink("inner.json", art / "manifest.json")
        return art, target
    rel = _kind_rel(kind, art)
    target = outside / os.path.basename(rel)
    shutil.copyfile(art / rel, target)
    m = manifest(art)
    if attack == "symlink":
        os.unlink(art / rel)
        os.symlink(target, art / rel)
        m["files"][rel] = sha(target)
    else:
        new = str(target) if attack == "absolute" else "../outside/" + os.path.basename(rel)
        m = _replace(m, rel, new)
        m["files"].pop(rel)
        m["files"][new] = sha(target)
        os.unlink(art / rel)
    write_manifest(art, m)
    return art, target


CASES = [(k, a) for k in ("onnx", "shard", "manifest") for a in ATTACKS]
GPU_CASES = [(k, a) for k in ("program", "kernel binary", "sidecar") for a in ATTACKS]


def _check_refused(art, target, device: str) -> None:
    sentinel = Sentinel([target])
    with pytest.raises(ArtifactError) as e:
        v4compile.load(art, device=device)
    assert isinstance(e.value, InputError)
    rc, out, err = run_main("run", str(art), "--ids", "1,2,3", "--max-new-tokens", "2", "--device", device)
    assert_one_error(rc, err)
    assert out == ""
    assert sentinel.touched() == []


@pytest.mark.parametrize("kind,attack", CASES)
def test_a_path_out_of_a_cpu_artifact_is_refused_without_reading_outside(cpu_art, tmp_path, kind, attack):
    art, target = _attack(cpu_art, tmp_path, kind, attack)
    _check_refused(art, target, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("kind,attack", GPU_CASES)
def test_a_path_out_of_a_gpu_artifact_is_refused_without_reading_outside(gpu_art, tmp_path, kind, attack):
    art, target = _attack(gpu_art, tmp_path, kind, attack)
    _check_refused(art, target, "host")


def test_the_sentinel_catches_a_loader_without_confinement(cpu_art, tmp_path, monkeypatch):
    """The broken variant: with the confinement check removed, the same symlinked graph is read (its hash
    matches), and the sentinel reports it."""
    import v4compile.artifact as A

    art, target = _attack(cpu_art, tmp_path, "onnx", "symlink")
    monkeypatch.setattr(A, "confined", lambda root, rel, files, what="file": root / rel)
    sentinel = Sentinel([target])
    load_artifact(art)
    assert sentinel.touched()


def test_the_runtime_checks_again_at_open(cpu_art, tmp_path):
    """A file swapped for a symlink out after `load_artifact` checked it is refused where it is opened."""
    from v4compile.runtime.cpu_backend import OrtBackend

    art = copy(cpu_art, tmp_path / "art")
    loaded = load_artifact(art)
    backend = OrtBackend(loaded, threads=1)
    rel = manifest(art)["targets"][0]["functions"]["decode_b1"]["file"]
    target = tmp_path / "outside.onnx"
    shutil.copyfile(art / rel, target)
    os.unlink(art / rel)
    os.symlink(target, art / rel)
    sentinel = Sentinel([target])
    with pytest.raises(ArtifactError, match="outside the artifact"):
        backend.prepare(["decode_b1"])
    assert sentinel.touched() == []


def test_a_runtime_path_missing_from_files_is_refused(cpu_art, tmp_path):
    """A graph path inside the artifact but not listed (so not hashed) in `files`."""
    art = copy(cpu_art, tmp_path / "art")
    m = manifest(art)
    rel = m["targets"][0]["functions"]["decode_b1"]["file"]
    shutil.copyfile(art / rel, art / "onnx" / "other.onnx")
    m = _replace(m, rel, "onnx/other.onnx")
    write_manifest(art, m)
    with pytest.raises(ArtifactError, match="does not list"):
        load_artifact(art)


def test_a_fifo_in_place_of_a_listed_file_does_not_block(cpu_art, tmp_path):
    art = copy(cpu_art, tmp_path / "art")
    os.unlink(art / "module.ir")
    os.mkfifo(art / "module.ir")
    rc, _, err = run_main("run", str(art), "--ids", "1", "--max-new-tokens", "1", timeout=60)
    assert_one_error(rc, err, "module.ir", "not a regular file")


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["no grid", "huge shared", "garbage"])
def test_a_bad_sidecar_is_refused_on_any_device(gpu_art, tmp_path, edit):
    """Class 3 on the real artifact: a sidecar edited (its hashes recomputed) is one error, on the host device
    too (which launches no binary, but loads the artifact as a whole)."""
    import json

    art = copy(gpu_art, tmp_path / "art")
    m = manifest(art)
    k = m["kernels"][0]
    side = json.loads((art / k["sidecar"]).read_text())
    if edit == "no grid":
        side.pop("grid")
        raw = json.dumps(side).encode()
    elif edit == "huge shared":
        side["shared_bytes"] = 10 ** 9
        raw = json.dumps(side).encode()
    else:
        raw = b"\x00\xff{garbage"
    (art / k["sidecar"]).write_bytes(raw)
    m["files"][k["sidecar"]] = k["sidecar_sha256"] = sha(art / k["sidecar"])
    write_manifest(art, m)
    with pytest.raises(ArtifactError, match="sidecar"):
        v4compile.load(art, device="host")
    rc, out, err = run_main("run", str(art), "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "host")
    assert_one_error(rc, err, "sidecar")
