"""Byte-flip fuzz of a small artifact: every damaged file, the manifest included, is reported by name when the
artifact is loaded (`load_artifact` checks every file's sha256, and the manifest its own)."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.artifact import ArtifactError, load_artifact


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
