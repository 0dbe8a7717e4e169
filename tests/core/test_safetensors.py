"""The strict safetensors reader: interoperability, and one clear error for every kind of damage."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.errors import CheckpointError
from v4compile.safetensors_io import SafetensorsFile, parse_header, write_file


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 4, generator=g), "b": torch.arange(5, dtype=torch.int64),
            "c": torch.randn(2, 8, generator=g).to(torch.bfloat16),
            "d": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
            "e": torch.tensor([127, 128], dtype=torch.uint8).view(torch.float8_e8m0fnu),
            "f": torch.tensor([1, -2], dtype=torch.int8), "s": torch.tensor(3.5)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


def test_round_trip_and_interop_with_the_reference_library(tmp_path):
    from safetensors.torch import load_file, save_file

    ts = tensors()
    write_file(tmp_path / "ours.safetensors", ts, {"format": "pt"})
    theirs = load_file(tmp_path / "ours.safetensors")
    for k, t in ts.items():
        assert same(theirs[k], t), k
    save_file(ts, tmp_path / "theirs.safetensors")
    with SafetensorsFile(tmp_path / "theirs.safetensors") as f:
        for k, t in ts.items():
            assert same(f.read(k), t), k


def good_file(tmp_path):
    p = tmp_path / "x.safetensors"
    write_file(p, {"w": torch.randn(8, 8), "v": torch.randn(4)})
    return p, p.read_bytes()


def damaged(tmp_path, raw: bytes):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(raw)
    return p


def test_truncated_files(tmp_path):
    p, raw = good_file(tmp_path)
    with pytest.raises(CheckpointError, match="shorter than the 8-byte"):
        SafetensorsFile(damaged(tmp_path, raw[:5]))
    with pytest.raises(CheckpointError, match="truncated inside its header"):
        SafetensorsFile(damaged(tmp_path, raw[:20]))
    with pytest.raises(CheckpointError, match="run past the end of the file") as e:
        SafetensorsFile(damaged(tmp_path, raw[:-3]))
    assert "bad.safetensors" in str(e.value) and "tensor '" in str(e.value)


def header_file(tmp_path, header: bytes, data: bytes = b""):
    return damaged(tmp_path, struct.pack("<Q", len(header)) + header + data)


def test_corrupt_and_oversized_headers(tmp_path):
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(header_file(tmp_path, b'{"a": {'))
    with pytest.raises(CheckpointError, match="implausibly large"):
        SafetensorsFile(damaged(tmp_path, struct.pack("<Q", 1 << 40) + b"{}"))
    with pytest.raises(CheckpointError, match="must be a JSON object"):
        SafetensorsFile(header_file(tmp_path, b"[1, 2]"))
    with pytest.raises(CheckpointError, match="not UTF-8"):
        SafetensorsFile(header_file(tmp_path, b"\xff\xfe"))


@pytest.mark.parametrize("entry, needle", [
    ({"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "non-negative"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "byte size does not match"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "not ordered"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets must be"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "run past the end"),
])
def test_bad_entries(tmp_path, entry, needle):
    with pytest.raises(CheckpointError, match=needle):
        SafetensorsFile(header_file(tmp_path, json.dumps({"t": entry}).encode(), b"\0" * 8))


def test_overlapping_tensors(tmp_path):
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    with pytest.raises(CheckpointError, match="overlap"):
        SafetensorsFile(header_file(tmp_path, json.dumps(h).encode(), b"\0" * 12))


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                           max_leaves=12)
entries = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "BF16", "I64", "U8", "F8_E4M3", "X"]) | json_values,
                                 "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
                                 "data_offsets": st.lists(st.integers(-4, 200), min_size=0, max_size=3) | json_values})


@fuzz_settings(300)
@given(st.dictionaries(st.text(max_size=5), entries | json_values, max_size=4), st.integers(0, 256))
def test_fuzz_structured_headers(header, data_len):
    try:
        infos, _ = parse_header(json.dumps(header).encode(), data_len, "fuzz")
    except CheckpointError:
        return
    for i in infos.values():  # whatever is accepted is consistent
        assert 0 <= i.begin <= i.end <= data_len


@fuzz_settings(300)
@given(st.binary(max_size=300))
def test_fuzz_raw_bytes(raw):
    try:
        parse_header(raw, 64, "fuzz")
    except CheckpointError:
        pass


@fuzz_settings(100)
@given(st.binary(max_size=120))
def test_fuzz_whole_files(tmp_path, raw):
    p = tmp_path / "f.safetensors"
    p.write_bytes(raw)
    try:
        with SafetensorsFile(p) as f:
            for k in f.tensors:
                f.read(k)
    except CheckpointError:
        pass


def test_why_headers_are_checked_before_the_library(tmp_path):
    """The strict header layer exists because the `safetensors` package accepts what we must refuse, and
    names no tensor in some of its errors. If a library upgrade changes this, revisit `parse_header`."""
    from safetensors import SafetensorError, safe_open

    ent = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    accepted_by_library = {
        "name given twice": (f'{{"t": {ent}, "t": {ent}}}', "'t' twice"),
        "null metadata": (f'{{"__metadata__": null, "t": {ent}}}', "__metadata__"),
    }
    for what, (head, needle) in accepted_by_library.items():
        p = header_file(tmp_path, head.encode(), b"\0" * 4)
        with safe_open(str(p), framework="pt") as f:
            assert list(f.keys()) == ["t"], what
        with pytest.raises(CheckpointError, match=needle):
            SafetensorsFile(p)
    p = header_file(tmp_path, b'{"weight": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', b"\0" * 8)
    with pytest.raises(SafetensorError) as lib:
        safe_open(str(p), framework="pt")
    assert "weight" not in str(lib.value)
    with pytest.raises(CheckpointError, match="tensor 'weight'"):
        SafetensorsFile(p)


def test_library_refusals_are_reported_with_the_file(tmp_path):
    """What our header check lets through but the library refuses (a gap between tensors) is one
    CheckpointError naming the file when the tensor is read."""
    p = header_file(tmp_path, b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8)
    with SafetensorsFile(p) as f:
        with pytest.raises(CheckpointError, match="bad.safetensors"):
            f.read("t")
