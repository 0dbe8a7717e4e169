"""An artifact is untrusted input (issue 24, class 1): every path the runtime opens from an artifact is
relative, stays inside it after resolving symlinks, is listed and hashed in the manifest, and names a regular
file; the manifest itself is never opened through a symlink.

Per file kind (ONNX graph, weights shard, tokenizer, the host device's `program.txt`, GPU program, kernel
binary, kernel sidecar, the manifest, and an ONNX graph's external data) and per attack (an absolute path, a
`../` path, a symlink out), the artifact is edited as an attacker would: the outside file is a faithful copy
of the one it replaces and every hash in the manifest is recomputed, so the edit would pass every integrity
check and run. Each must be refused through the API (`ArtifactError`, an
`InputError`) and the CLI (exit 2, one `error:` line, no traceback), and no byte outside the artifact may be
read: the outside copies are sentinels whose access time would move on any read (by Python, ONNX Runtime,
the safetensors library or the C runtime) and whose Python-level opens are audited. A deliberately broken
loader (the confinement check removed) is shown to trip the sentinel. A file the runtime opens after
`load_artifact` (graph, shard, tokenizer, host program; GPU program, sidecar, kernel binary), swapped then
for a symlink out, is refused where it is opened, and the same loader with the confinement check removed
trips the sentinel there too.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import v4compile
from pathlib import Path
from artifact_tamper import compile_cpu, restore_torch_threads, Sentinel, atime_works, copy, manifest, sha, write_manifest  # noqa: F401 (an autouse fixture)
from bad_input_util import run_main, assert_one_error
from v4compile.artifact import load_artifact
from v4compile.cli import main
from v4compile.errors import ArtifactError, InputError

ATTACKS = ("absolute", "dotdot", "symlink")


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"


@pytest.fixture(scope="module")
def cpu_art(tmp_path_factory):
    """The tiny cpu artifact, given the example's tokenizer (listed and hashed as `compile` does) so that the
    tokenizer is one of the file kinds attacked (the tiny preset has none; both vocabularies are 512)."""
    art = compile_cpu(tmp_path_factory.mktemp("sec") / "tiny", "1")
    (art / "tokenizer").mkdir()
    m = manifest(art)
    m["tokenizer"] = {}
    for key, name in (("json", "tokenizer.json"), ("config", "tokenizer_config.json")):
        shutil.copyfile(EXAMPLE / name, art / "tokenizer" / name)
        m["tokenizer"][key] = f"tokenizer/{name}"
        m["files"][f"tokenizer/{name}"] = sha(art / "tokenizer" / name)
    write_manifest(art, m)
    return art


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
    if kind == "tokenizer":
        return m["tokenizer"]["json"]
    if kind == "host program":  # what the host device runs from a cpu artifact
        return m["targets"][0]["program"]
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


CASES = [(k, a, "cpu") for k in ("onnx", "shard", "tokenizer", "manifest") for a in ATTACKS] + [
    ("host program", a, "host") for a in ATTACKS]
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


@pytest.mark.parametrize("kind,attack,device", CASES)
def test_a_path_out_of_a_cpu_artifact_is_refused_without_reading_outside(cpu_art, tmp_path, kind, attack, device):
    art, target = _attack(cpu_art, tmp_path, kind, attack)
    _check_refused(art, target, device)


def _external_data_attack(src, tmp_path, attack: str):
    """A copy of `src` whose decode graph keeps one of its constants (a float initializer a node uses) in an
    external file outside the artifact, a faithful copy of its data (the graph's hash recomputed); returns
    (artifact, the outside sentinel)."""
    import onnx
    from onnx import numpy_helper

    art = copy(src, tmp_path / "art")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "data.bin"
    rel = _kind_rel("onnx", art)
    if attack == "absolute":
        location = str(target)
    elif attack == "dotdot":
        location = os.path.relpath(target, (art / rel).parent)
    else:  # a file next to the graph, not listed in `files`, that is a symlink out
        location = "data.bin"
        os.symlink(target, (art / rel).parent / location)
    model = onnx.load_from_string((art / rel).read_bytes())
    t = next(t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and
             numpy_helper.to_array(t).size >= 4)
    raw = numpy_helper.to_array(t).astype(np.float32).tobytes()
    target.write_bytes(raw)
    t.ClearField("float_data")
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
        e = t.external_data.add()
        e.key, e.value = k, v
    (art / rel).write_bytes(model.SerializeToString())
    m = manifest(art)
    m["files"][rel] = sha(art / rel)
    write_manifest(art, m)
    return art, target


def _run_graphs(art) -> None:
    """Load and generate: the graphs are opened on first use, not at load."""
    v4compile.load(art, device="cpu", threads=1).generate([[1, 2, 3]], 2)


def _check_external_refused(art, target) -> None:
    """Refused by the runtime's own check (`artifact_checks._external`, "external file"), through the API and
    the CLI, with the outside file unread."""
    sentinel = Sentinel([target])
    with pytest.raises(ArtifactError, match="external file"):
        _run_graphs(art)
    rc, out, err = run_main("run", str(art), "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu")
    assert_one_error(rc, err, "external file")
    assert out == ""
    assert sentinel.touched() == []


@pytest.mark.parametrize("attack", ATTACKS)
def test_onnx_external_data_out_of_the_artifact_is_refused_without_reading_outside(cpu_art, tmp_path, attack):
    art, target = _external_data_attack(cpu_art, tmp_path, attack)
    _check_external_refused(art, target)


def test_a_loader_without_the_external_data_check_fails_the_same_test(cpu_art, tmp_path, monkeypatch):
    """The broken variant: `artifact_checks._external` removed. The graph then reaches ONNX Runtime, which
    happens to refuse the absolute location itself (so the sentinel stays unread), but with its own message:
    `_check_external_refused`'s `match="external file"` fails. The refusal must be ours, not a dependency's
    (the `onnx` package and ONNX Runtime each validate external paths in their own, version-dependent way)."""
    from v4compile.runtime import artifact_checks

    art, target = _external_data_attack(cpu_art, tmp_path, "absolute")
    monkeypatch.setattr(artifact_checks, "_external", lambda g: None)
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        _check_external_refused(art, target)


def test_the_sentinel_catches_a_loader_without_confinement(cpu_art, tmp_path, monkeypatch):
    """The broken variant: with the confinement check removed, the same symlinked graph is read (its hash
    matches), and the sentinel reports it."""
    import v4compile.artifact as A

    art, target = _attack(cpu_art, tmp_path, "onnx", "symlink")
    monkeypatch.setattr(A, "confined", lambda root, rel, files, what="file": root / rel)
    sentinel = Sentinel([target])
    load_artifact(art)
    assert sentinel.touched()


def _load_then_open(kind: str, art):
    """Loads `art` (every file confined and hashed) and returns what the runtime does later that opens its
    file of `kind`."""
    if kind == "tokenizer":  # read on the session's first use of it
        s = v4compile.load(art, device="cpu", threads=1)
        return lambda: s.tokenizer
    loaded = load_artifact(art, defer_weights=True)
    if kind == "onnx":
        from v4compile.runtime.cpu_backend import OrtBackend

        backend = OrtBackend(loaded, threads=1)
        return lambda: backend.prepare(["decode_b1"])
    if kind == "shard":  # mapped (and hashed) by the backend it is handed to
        return lambda: dict(loaded.weights().stream())
    from v4compile.runtime.program_backend import artifact_program, read_sidecar

    k = loaded.manifest["kernels"][0] if loaded.manifest["kernels"] else None
    if kind == "sidecar":
        return lambda: read_sidecar(loaded, k)
    if kind == "kernel binary":  # as the GPU backend reads each binary it loads (`program_backend`)
        return lambda: loaded.read_bytes(k["path"], "kernel binary")
    return lambda: artifact_program(loaded)  # the host program, or a GPU artifact's


@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken"])
@pytest.mark.parametrize("kind", ["onnx", "shard", "tokenizer", "host program"])
def test_the_runtime_checks_again_at_open(cpu_art, tmp_path, monkeypatch, kind, broken):
    """A file swapped for a symlink out (a faithful copy: same hash) after `load_artifact` checked it is
    refused where it is opened, the outside copy unread. The broken variant: `confined` reduced to the path
    join (no check at open) lets the same open read the outside copy, and the sentinel assertion fails."""
    _check_swapped_after_load(cpu_art, tmp_path, monkeypatch, kind, broken)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken"])
@pytest.mark.parametrize("kind", ["program", "sidecar", "kernel binary"])
def test_the_runtime_checks_gpu_files_again_at_open(gpu_art, tmp_path, monkeypatch, kind, broken):
    """The same for the GPU artifact's files: its program, a sidecar, a kernel binary."""
    _check_swapped_after_load(gpu_art, tmp_path, monkeypatch, kind, broken)


def _check_swapped_after_load(src, tmp_path, monkeypatch, kind: str, broken: bool) -> None:
    import v4compile.artifact as A

    art = copy(src, tmp_path / "art")
    open_it = _load_then_open(kind, art)
    rel = _kind_rel(kind, art)
    target = tmp_path / ("outside-" + os.path.basename(rel))
    shutil.copyfile(art / rel, target)
    os.unlink(art / rel)
    os.symlink(target, art / rel)
    if broken:
        monkeypatch.setattr(A, "confined", lambda root, rel, files, what="file": root / rel)
    sentinel = Sentinel([target])
    try:
        open_it()
    except ArtifactError as e:
        assert not broken and "outside the artifact" in str(e), e
    else:
        assert broken, "the swapped file was opened"
    touched = sentinel.touched()
    if broken:
        with pytest.raises(AssertionError):
            assert touched == []
    else:
        assert touched == []


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
