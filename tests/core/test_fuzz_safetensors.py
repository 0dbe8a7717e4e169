"""Fuzz the checkpoint index and safetensors headers beyond `test_safetensors.py`: any index opens a
checkpoint whose every file lies inside its directory, or raises one CheckpointError; any header with
repeated names or odd `__metadata__` is refused or read consistently with the `safetensors` package."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.checkpoint import INDEX_FILE, Checkpoint
from v4compile.config import preset
from v4compile.errors import CheckpointError, ConfigError
from v4compile.init_random import init_random
from v4compile.safetensors_io import SafetensorsFile


@pytest.fixture(scope="module")
def ckdir(tmp_path_factory):
    """A 3-shard checkpoint, an exact copy of its shards outside it (followed, they would load fine), a
    symlink to that copy inside it, and a sub-directory."""
    root = tmp_path_factory.mktemp("fuzzck")
    from v4compile.checkpoint import write_checkpoint
    from v4compile.init_random import random_source

    cfg = preset("tiny")
    d = write_checkpoint(root / "ck", cfg, random_source(cfg, 0), dtype="fp32", max_shard_bytes=1 << 20)
    (root / "outside").mkdir()
    for f in d.glob("*.safetensors"):
        shutil.copy(f, root / "outside" / f.name)
    (d / "sub").mkdir()
    (d / "link").symlink_to(root / "outside")
    return d


def redirects(ckdir_name_holder=None):
    return st.sampled_from(["same", "dotdot", "absolute", "symlinked", "dot", "sub-dotdot", "ck-dotdot"])


def where(kind: str, shard: str, d) -> str:
    return {"same": shard, "dotdot": f"../outside/{shard}", "absolute": str(d.parent / "outside" / shard),
            "symlinked": f"link/{shard}", "dot": f"./{shard}", "sub-dotdot": f"sub/../{shard}",
            "ck-dotdot": f"../{d.name}/{shard}"}[kind]


names = st.sampled_from(["embed.weight", "head.weight", "norm.weight", "layers.0.ffn.gate.tid2eid", "x", ""])
files = st.sampled_from(["model-00001-of-00003.safetensors", "../outside/model-00001-of-00003.safetensors",
                         "/etc/passwd", "sub", "", ".", "config.json", "model.safetensors.index.json", "\x00",
                         "C:\\x", "link"]) | st.text(max_size=6) | st.integers() | st.none() \
    | st.lists(st.text(max_size=2), max_size=2)


@fuzz_settings(120)
@given(st.lists(redirects(), min_size=3, max_size=3), st.dictionaries(names, files, max_size=3),
       st.sampled_from([None, None, None, [], "x", 3]))
def test_fuzz_index(ckdir, kinds, wm_extra, top):
    """Shards redirected through `..`, absolute paths or symlinks (to exact copies), junk entries: the
    checkpoint opens with every file inside its directory, or one CheckpointError."""
    saved = (ckdir / INDEX_FILE).read_text()
    good = json.loads(saved)["weight_map"]
    shards = sorted(set(good.values()))
    moved = dict(zip(shards, kinds))
    wm = {**{k: where(moved[v], v, ckdir) for k, v in good.items()}, **wm_extra}
    index = {"weight_map": wm} if top is None else {"weight_map": top}
    try:
        (ckdir / INDEX_FILE).write_text(json.dumps(index))
        try:
            ck = Checkpoint.open(ckdir)
        except (CheckpointError, ConfigError):
            return
        with ck:
            base = ckdir.resolve()
            for f in ck._files:
                assert base in f.resolve().parents, f
    finally:
        (ckdir / INDEX_FILE).write_text(saved)


entry = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "U8"]), "shape": st.lists(st.integers(0, 3),
                                                                                           max_size=2)})
meta = st.none() | st.just("absent") | st.dictionaries(st.text(max_size=3), st.text(max_size=3) | st.integers(),
                                                      max_size=2) | st.lists(st.integers(), max_size=2) | st.integers()


@fuzz_settings(150)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), entry), min_size=1, max_size=4), meta, st.integers(0, 8))
def test_fuzz_header_repeats_and_metadata(tmp_path, ents, md, slack):
    """Contiguous tensors, maybe repeated names, maybe bad metadata, maybe trailing bytes."""
    from safetensors import safe_open

    parts, off = [], 0
    if md != "absent":
        parts.append(f'"__metadata__": {json.dumps(md)}')
    for name, e in ents:
        n = (e["shape"][0] if e["shape"] else 1) * (e["shape"][1] if len(e["shape"]) > 1 else 1)
        n *= 4 if e["dtype"] == "F32" else 1
        parts.append(f'"{name}": {json.dumps({**e, "data_offsets": [off, off + n]})}')
        off += n
    head = ("{" + ", ".join(parts) + "}").encode()
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head + bytes(range(256))[: off + slack] + b"\0" * (off + slack - 256
                                                                                                   if off + slack > 256
                                                                                                   else 0))
    try:
        with SafetensorsFile(p) as f:
            got = {k: f.read(k) for k in f.tensors}
    except CheckpointError:
        return
    assert len({n for n, _ in ents}) == len(ents)  # never accepted with a name given twice
    with safe_open(str(p), framework="pt") as lib:
        assert sorted(lib.keys()) == sorted(got)
