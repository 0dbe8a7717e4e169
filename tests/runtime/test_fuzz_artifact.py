"""Byte-flip fuzz of a small artifact: every damaged file, the manifest included, is reported by name when the
artifact is loaded (`load_artifact` checks every file's sha256, and the manifest its own)."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.artifact import ArtifactError, load_artifact
from v4compile.errors import InputError


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from v4compile.cli import main

    out = tmp_path_factory.mktemp("art") / "tiny"
    assert main(["compile", "-o", str(out), "--decode-buckets", "1", "--prefill-buckets", "16", "--target", "cpu"]) == 0
    load_artifact(out)  # the undamaged artifact loads
    return out


@given(data=st.data())
@fuzz_settings(40)
def test_a_flipped_byte_is_reported_by_file_name(artifact, tmp_path_factory, data):
    files = sorted(p for p in artifact.rglob("*") if p.is_file())
    victim = data.draw(st.sampled_from(files))
    size = victim.stat().st_size
    offset = data.draw(st.integers(0, size - 1))
    mask = data.draw(st.integers(1, 255))
    copy = tmp_path_factory.mktemp("flip") / "tiny"
    shutil.copytree(artifact, copy)
    target = copy / victim.relative_to(artifact)
    raw = bytearray(target.read_bytes())
    raw[offset] ^= mask
    target.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError) as e:
        load_artifact(copy)
    assert str(victim.relative_to(artifact)) in str(e.value) or "manifest.json" in str(e.value)
    if victim.name != "manifest.json":
        assert str(victim.relative_to(artifact)) in str(e.value)
    shutil.rmtree(copy.parent)


# ---- the manifest, field by field ----------------------------------------------------------------
# An attacker recomputes the hashes: each mutation below is written with the manifest's own digest updated,
# so only the schema and the cross-checks stand between it and the runtime. Every outcome must be an
# InputError (ArtifactError is one) or a run that works; never another exception, never a hang.

ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
    st.sampled_from([0, -1, 1, 2, 3, 10 ** 12, 2 ** 31, 2 ** 63, 2 ** 64, 1.5, 1e300, 1e-300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["/etc/passwd", "../manifest.json", "onnx/../manifest.json", "", "weights/", "cpu", "gfx950",
                     "decode", "prefill", "fp32", "bf16", "native", "decode_b1", "a" * 5000, "manifest.json",
                     "module.ir", "report.json"]),
    st.lists(st.integers(-3, 2 ** 40), max_size=3), st.lists(st.text(max_size=4), max_size=2),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(v, prefix=()):
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v[:3]):  # the first entries stand for the rest
            yield from _paths(x, prefix + (i,))


@pytest.fixture(scope="module")
def manifest_paths(artifact):
    import json

    m = json.loads((artifact / "manifest.json").read_text())
    return [p for p in _paths(m) if p and p != ("manifest_sha256",)]


@pytest.fixture(scope="module")
def scratch(artifact, tmp_path_factory):
    copy = tmp_path_factory.mktemp("mutate") / "tiny"
    shutil.copytree(artifact, copy)
    return copy


def _run_mutated(art, m) -> str:
    """'ok' or 'refused' (an InputError); anything else propagates and fails the test."""
    import signal

    import v4compile
    from v4compile.errors import InputError
    from v4compile.manifest import canonical, manifest_digest

    m["manifest_sha256"] = manifest_digest(m)
    (art / "manifest.json").write_text(canonical(m))

    def hang(*_):
        raise TimeoutError("the mutated artifact made the runtime hang")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(120)
    try:
        s = v4compile.load(art, device="cpu", threads=1)
        try:
            out = s.generate([[1, 2, 3]], 1)
            assert len(out) == 1 and len(out[0]) == 1
        finally:
            s.close()
        return "ok"
    except InputError:
        return "refused"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@given(data=st.data())
@fuzz_settings(40)
def test_a_mutated_manifest_with_recomputed_hashes_is_refused_or_runs(artifact, scratch, manifest_paths, data):
    import copy
    import json

    base = json.loads((artifact / "manifest.json").read_text())
    m = copy.deepcopy(base)
    for _ in range(data.draw(st.integers(1, 2))):
        path = data.draw(st.sampled_from(manifest_paths))
        parent = m
        try:
            for k in path[:-1]:
                parent = parent[k]
            old = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
        how = data.draw(st.sampled_from(["value", "value", "delete", "nudge"]))
        if how == "delete":
            if isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        elif how == "nudge" and isinstance(old, int) and not isinstance(old, bool):
            parent[path[-1]] = old + data.draw(st.sampled_from([-old, -1, 1, old, 10 ** 9, -(10 ** 9)]))
        else:
            parent[path[-1]] = data.draw(ODD_VALUES)
    _run_mutated(scratch, m)


def test_the_unmutated_manifest_runs(artifact, scratch):
    import json

    assert _run_mutated(scratch, json.loads((artifact / "manifest.json").read_text())) == "ok"


def test_the_manifest_fuzz_catches_an_unchecked_field(artifact, scratch, monkeypatch):
    """The broken variant: without the schema, a pool of 10^12 blocks reaches the session's allocations (a
    multi-TiB free list: MemoryError), which the fuzz reports as a failure."""
    import json

    import v4compile.artifact as A

    monkeypatch.setattr(A, "check_manifest", lambda m, verify=True: None)
    m = json.loads((artifact / "manifest.json").read_text())
    m["pool"]["n_blocks"] = 10 ** 12
    with pytest.raises(Exception) as e:
        _run_mutated(scratch, m)
    assert not isinstance(e.value, InputError)
