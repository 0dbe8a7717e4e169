"""The weight shards of an artifact (planned: `v4compile/weights_plan.py`, written: `weights_write.py`, mapped
at load: `weights_map.py`): streamed from a quantised checkpoint in memory that does not grow with it,
byte-reproducible, every tensor hashed, hashes checked as loaded.

The checkpoint here is written from random *stored* bytes (FP8 / FP4 / E8M0 / BF16 / F32 / I64 in the
released layout), not through `init-random`'s quantiser, so a 100 MB one takes a second. Expected
values come from `weights_convert.load_ir_weights` (the per-tensor reader the writer replaced), never from the
writer itself.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from v4compile import weights_disk, weights_map, weights_plan, weights_write
from v4compile.artifact import ArtifactError, Buckets, load_artifact
from v4compile.cli.driver import RANK_WRITERS, trace_buckets, write_weights
from v4compile.checkpoint import Checkpoint
from v4compile.config import preset
from v4compile.errors import CheckpointError
from v4compile.manifest import FORMAT_VERSION
from v4compile.safetensors_io import write_file
from v4compile.shard_digest import PIECE_BYTES, TAG, TREE_TAG
from v4compile.trace import TraceOptions
from v4compile.weights import weight_specs
from v4compile.weights_convert import load_ir_weights


def stored_checkpoint(d: Path, cfg, seed: int = 0) -> Path:
    """A valid checkpoint in the released formats, from random stored bytes (no NaN / Inf patterns)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in weight_specs(cfg):
        if s.fmt == "i64":
            out[s.name] = torch.randint(0, cfg.n_experts, s.shape, generator=g, dtype=torch.int64)
        elif s.fmt in ("fp8", "fp4"):
            b = torch.randint(0, 256, s.stored_shape, generator=g, dtype=torch.uint8)
            if s.fmt == "fp8":  # 0x7F / 0xFF are e4m3 NaN: an even byte never is
                b &= 0xFE
            out[s.name] = b.view(torch.float8_e4m3fn if s.fmt == "fp8" else torch.int8)
            grid = s.scale_shape(cfg.quant_block, cfg.expert_scale_block)
            out[s.scale_key] = torch.randint(120, 131, grid, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        else:
            out[s.name] = torch.randn(s.shape, generator=g).to(torch.bfloat16 if s.fmt == "bf16" else torch.float32)
    d.mkdir(parents=True)
    write_file(d / "model.safetensors", out)
    (d / "config.json").write_text(cfg.to_json())
    return d


def tree(b: bytes, piece: int = PIECE_BYTES) -> bytes:
    """A segment's digest as `v4compile/shard_digest.py` defines it ("sha256-tree-8MiB"): the sha256 of each
    8 MiB piece in order, after the tree's tag."""
    return hashlib.sha256(TREE_TAG + b"".join(hashlib.sha256(b[i:i + piece]).digest()
                                              for i in range(0, len(b), piece))).digest()


def digest_of_bytes(raw: bytes) -> str:
    """A shard's digest from its bytes alone, as `v4compile/shard_digest.py` defines it: the file cut at the
    header's end and at every tensor's bounds, each segment's tree digest in file order, after the tag."""
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:start])
    cuts = sorted({0, start, len(raw)} | {start + o for k, v in head.items() if k != "__metadata__"
                                          for o in v["data_offsets"]})
    segs = [raw[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    return hashlib.sha256(TAG + b"".join(tree(p) for p in segs)).hexdigest()


def mid_cfg():
    """tiny's structure (every layer kind, hash routing, MTP) at dims where tensors are MBs: ~110 MB in
    all, 13x its largest IR tensor (a stacked expert weight, 8 MB)."""
    from v4compile.config import CSA, HCA, SWA

    return preset("tiny").replace(dim=1024, moe_inter_dim=1024, vocab_size=1024, q_lora_rank=512, head_dim=128,
                                  rope_dim=64, index_head_dim=64, o_lora_rank=256, n_experts=16, n_layers=3,
                                  layer_kinds=(SWA, HCA, CSA), name="mid")


_MODULES: dict[tuple[str, str], object] = {}  # (config, stored formats) -> its module: nothing here changes one


def gpu_module(ck: Checkpoint):
    """The GPU pipeline's module for this checkpoint's config (traced once per config and formats)."""
    from v4compile.passes import GPU_PIPELINE, PassManager

    key = (ck.cfg.to_json(), json.dumps(ck.stored_formats(), sort_keys=True, default=str))
    if key not in _MODULES:
        opts = TraceOptions(numerics="official", dtype="bf16")
        m = trace_buckets(ck.cfg, opts, Buckets((2,), (16,)), ck.stored_formats())
        _MODULES[key] = PassManager(list(GPU_PIPELINE)).run(m).module
    return _MODULES[key]


@pytest.fixture(scope="module")
def tiny_ck(tmp_path_factory):
    return stored_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", preset("tiny"))


def write(ck_dir: Path, out: Path, **kw) -> tuple[dict, dict, list]:
    with Checkpoint.open(ck_dir) as ck:
        m = gpu_module(ck)
        (out / "weights").mkdir(parents=True)
        entry, hashes = write_weights(m, ck, out / "weights", **kw)
        return entry, hashes, weights_plan.plan_weights(m, ck)


def test_every_tensor_is_the_per_tensor_readers_bytes_and_hashed(tiny_ck, tmp_path):
    """Each written tensor equals `load_ir_weights` bit for bit; its digest (`tree`) and its shard's (made of
    its header's and tensors' digests) are in the entry, computed while writing; quantised tensors are copied
    as stored, norms converted to fp32."""
    entry, hashes, plans = write(tiny_ck, tmp_path / "a")
    with Checkpoint.open(tiny_ck) as ck:
        want = load_ir_weights(gpu_module(ck), ck)
    assert sorted(entry["tensors"]) == sorted(want)
    for rel in entry["shards"]:
        assert hashes[rel] == digest_of_bytes((tmp_path / "a" / rel).read_bytes())
    shards = {rel: weights_map.map_shard(tmp_path / "a" / rel, ArtifactError) for rel in entry["shards"]}
    for n, t in entry["tensors"].items():
        got = bytes(shards[t["shard"]].bytes_of(n))
        assert got == want[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), n
        assert t["sha256"] == tree(got).hex(), n
    path = {p.name: p.path for p in plans}
    dtype = {p.name: p.dtype for p in plans}
    assert all(path[n] == "copy" for n in path if dtype[n] in ("fp8e4m3", "fp4x2", "e8m0", "i64"))
    assert path["layers.0.attn_norm.weight"] == "convert" and dtype["layers.0.attn_norm.weight"] == "fp32"
    assert path["layers.0.ffn.experts.w1"] == "copy"  # a stack of 8 stored tensors, copied without decoding


@pytest.mark.parametrize("fault", [None, "hashed before assembled", "never pruned"])
def test_shards_overlap_and_each_is_whole_and_hashed(tiny_ck, tmp_path, monkeypatch, fault):
    """The writer's blocks run as one stream over all the shards (no drain at a shard's end): with shards of
    64 KiB, 4 KiB blocks and 4 of them filled at once, a shard's first blocks are filled before the one
    before it is finished (cut, flushed, closed, digested) — and still every tensor is `load_ir_weights`'s
    bytes, its sha256 the tree digest of those bytes and every shard's digest that of its bytes (cut back to
    its size: O_DIRECT writes whole units). A block's bytes go to the hash lanes once it is assembled, while
    it is written; a fault, a block handed to the lanes before it is assembled (the buffer still holding
    an older block), gives some tensors a digest that is not their bytes'. The lanes' record of updates in
    flight stays a few blocks' worth, whatever the model's size; the other fault, a writer that never forgets
    the updates that are done, keeps one per update."""
    import time

    from v4compile.cli import driver

    monkeypatch.setattr(driver, "SHARD_BYTES", 64 << 10)
    monkeypatch.setattr(weights_write, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(weights_write, "WINDOW_BYTES", 8 * 4096)
    monkeypatch.setattr(weights_disk, "DIRECT_BYTES", 0)
    events, shard_of = [], {}  # what the writer's own thread hands over, in order: (block filled | shard finished)
    held = []  # the lanes' updates on record after each one is handed over
    real_create, real_fill, real_init = weights_write._create, weights_write._fill, weights_write._ShardWriter.__init__

    def create(path, direct):
        fd, d = real_create(path, direct)
        shard_of[fd] = path.name
        return fd, d

    def init(self, *a):
        real_init(self, *a)
        fills, finishes = self.pool.submit, self.syncer.submit
        self.pool.submit = lambda fn, k, parts, buf, size, fd, *x: (
            events.append(("fill", shard_of[fd], k)) or fills(fn, k, parts, buf, size, fd, *x))
        self.syncer.submit = lambda fn, *x: (
            events.append(("finish", x[0].path.name, 0)) if fn == self._finish else None) or finishes(fn, *x)
        hashes = self.lanes.submit
        self.lanes.submit = lambda *x: (hashes(*x), held.append(len(self.lanes.pending)))[0]
        if fault == "never pruned":
            self.lanes.prune = lambda: None

    def fill(k, parts, buf, size, fd, direct, w, ready=None):
        if fault == "hashed before assembled" and ready is not None:
            ready.set_result(None)
            time.sleep(0.002)  # the lanes take the buffer's bytes now
            ready = None
        real_fill(k, parts, buf, size, fd, direct, w, ready)
    monkeypatch.setattr(weights_write, "_create", create)
    monkeypatch.setattr(weights_write._ShardWriter, "__init__", init)
    monkeypatch.setattr(weights_write, "_fill", fill)
    entry, hashes, _ = write(tiny_ck, tmp_path / "a", workers=2)
    names = sorted(Path(r).name for r in entry["shards"])
    assert len(names) > 6
    at = {e: i for i, e in enumerate(events)}
    overlapped = sum(at[("fill", b, 0)] < at[("finish", a, 0)] for a, b in zip(names, names[1:]))
    with Checkpoint.open(tiny_ck) as ck:
        want = load_ir_weights(gpu_module(ck), ck)
    shards = {rel: weights_map.map_shard(tmp_path / "a" / rel, ArtifactError) for rel in entry["shards"]}
    assert all(bytes(shards[t["shard"]].bytes_of(n)) == want[n].contiguous().reshape(-1).view(torch.uint8).numpy()
               .tobytes() for n, t in entry["tensors"].items())  # the bytes are right either way
    wrong = [n for n, t in entry["tensors"].items() if t["sha256"] != tree(bytes(shards[t["shard"]].bytes_of(n))).hex()]
    wrong += [rel for rel in entry["shards"] if hashes[rel] != digest_of_bytes((tmp_path / "a" / rel).read_bytes())]
    assert overlapped == len(names) - 1
    assert (wrong == []) == (fault != "hashed before assembled"), wrong
    assert (max(held) < len(held) // 4) == (fault != "never pruned"), (max(held), len(held))


def test_a_misordered_stack_is_caught_by_the_same_comparison(tiny_ck, tmp_path, monkeypatch):
    """The comparison above catches a stack of experts copied in the wrong order."""
    real = weights_plan.plan_weights

    def reversed_stacks(m, source):
        plans = real(m, source)
        for p in plans:
            if ".experts." in p.name:
                p.pieces.reverse()
        return plans

    monkeypatch.setattr(weights_plan, "plan_weights", reversed_stacks)
    entry, _, _ = write(tiny_ck, tmp_path / "a")
    with Checkpoint.open(tiny_ck) as ck:
        want = load_ir_weights(gpu_module(ck), ck)
    sh = weights_map.map_shard(tmp_path / "a" / entry["shards"][0], ArtifactError)
    n = "layers.0.ffn.experts.w1"
    assert bytes(sh.bytes_of(n)) != want[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def direct_writes_work(d: Path) -> bool:
    """Whether the file system under `d` takes O_DIRECT (tmpfs before Linux 6.6 does not)."""
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False


def need_direct(d: Path, mode: str) -> None:
    """Skips (visibly) a case that exists to exercise O_DIRECT where the file system under `d` refuses it: the
    writer would go through the page cache, the fault below would never run, and the case would pass."""
    if mode in ("direct", "direct reads refused") and not direct_writes_work(d):
        pytest.skip(f"the file system under {d} refuses O_DIRECT: the '{mode}' case would not exercise it")


def test_a_direct_case_is_skipped_where_o_direct_is_refused(tmp_path, monkeypatch):
    """The planted fault: a file system refusing O_DIRECT (EINVAL at open, as tmpfs before Linux 6.6). The
    `direct` cases must report a skip, not pass without writing a shard with O_DIRECT; the cases that do not
    depend on it still run."""
    real_open = os.open

    def refusing(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", refusing)
    for mode in ("direct", "direct reads refused"):
        with pytest.raises(pytest.skip.Exception, match="refuses O_DIRECT"):
            need_direct(tmp_path, mode)
    need_direct(tmp_path, "direct refused")


@pytest.mark.parametrize("mode, fault", [("cached", None), ("direct", None), ("direct", "not cut to size"),
                                         ("direct refused", None), ("direct reads refused", None),
                                         ("odd blocks", None)])
def test_byte_reproducible_whatever_the_workers(tiny_ck, tmp_path, monkeypatch, mode, fault):
    """Two writes give the same bytes and hashes: 1 worker through the page cache (the tiny shards are below
    DIRECT_BYTES), then 4 workers in blocks and buffers far smaller than the tensors, every shard written
    with O_DIRECT (`direct`: whole 4 KiB units, the last one cut back to the shard's size) or through the
    page cache in blocks of an odd size (every piece, and many bf16 / fp32 elements, cut at block bounds).
    Where the file system refuses O_DIRECT (`direct refused`: EINVAL, as tmpfs before Linux 6.6), the shards
    go through the page cache. The checkpoint is read with O_DIRECT too (whole units through a buffer per
    thread, the wanted bytes copied out) with 4 KiB and odd blocks, and through the page cache where refused
    (at open, or at its first read).
    The fault, O_DIRECT shards not cut back to their size, leaves the padding there. Where this machine's
    file system refuses O_DIRECT the `direct` cases are skipped (`need_direct`), not passed unexercised."""
    need_direct(tmp_path, mode)
    a, ha, _ = write(tiny_ck, tmp_path / "a", workers=1)
    monkeypatch.setattr(weights_write, "BLOCK_BYTES", 4097 if mode == "odd blocks" else 4096)
    monkeypatch.setattr(weights_write, "WINDOW_BYTES", 3 * 4096)
    used, real_create = [], weights_write._create

    def create(*x):  # records whether each shard was opened with O_DIRECT
        fd, direct = real_create(*x)
        used.append(direct)
        return fd, direct
    monkeypatch.setattr(weights_write, "_create", create)
    if mode.startswith("direct") or mode == "odd blocks":  # the checkpoint read with O_DIRECT too
        monkeypatch.setattr(weights_disk, "DIRECT_BYTES", 0)
    read_direct, real_direct = [], weights_disk.open_direct
    monkeypatch.setattr(weights_disk, "page_cached", lambda fd, n: False)  # a cold checkpoint (it was just written)
    monkeypatch.setattr(weights_disk, "open_direct", lambda *x: read_direct.append(real_direct(*x)) or read_direct[-1])
    if mode == "direct refused":
        real_open = os.open

        def refusing(path, flags, *a):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            return real_open(path, flags, *a)
        monkeypatch.setattr(weights_write.os, "open", refusing)
    if mode == "direct reads refused":  # opened with O_DIRECT, its reads refused (EINVAL): the page cache's
        import fcntl

        real_preadv = os.preadv

        def preadv(fd, bufs, pos):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_preadv(fd, bufs, pos)
        monkeypatch.setattr(weights_write.os, "preadv", preadv)
    if fault:
        monkeypatch.setattr(weights_write.os, "ftruncate", lambda fd, n: None)
    b, hb, _ = write(tiny_ck, tmp_path / "b", workers=4)
    direct = mode in ("direct", "direct reads refused")
    assert used == [direct] * len(a["shards"])
    read_too = direct or mode == "odd blocks" and direct_writes_work(tmp_path)
    assert read_direct and (None not in read_direct) == read_too
    same = a == b and ha == hb and all((tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
                                       for rel in a["shards"])
    assert same == (fault is None)  # the fault ran: `need_direct` and `used` say the shards went through O_DIRECT


def test_a_nan_in_a_copied_fp8_weight_is_refused_by_name(tmp_path):
    cfg = preset("tiny")
    d = stored_checkpoint(tmp_path / "ck", cfg)
    from v4compile.safetensors_io import SafetensorsFile

    with SafetensorsFile(d / "model.safetensors") as f:
        ts = {k: f.read(k) for k in f.tensors}
    ts["layers.1.attn.wo_b.weight"].view(torch.uint8)[3, 5] = 0x7F
    write_file(d / "model.safetensors", ts)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wo_b\.weight.*\n?.*non-finite|non-finite"):
        write(d, tmp_path / "a")
    with Checkpoint.open(d, allow_nonfinite=True) as ck:
        (tmp_path / "b" / "weights").mkdir(parents=True)
        write_weights(gpu_module(ck), ck, tmp_path / "b" / "weights")


@pytest.mark.parametrize("fault", [None, "cut element not read again"])
def test_a_nan_cut_by_a_block_bound_is_refused(tmp_path, monkeypatch, fault):
    """A copied fp32 weight's NaN whose bytes a block bound cuts in two (the block size chosen so) is found:
    the block where the element starts reads its 4 bytes again whole. The fault, the element's bytes not
    read again (left zero), lets the NaN through."""
    d = stored_checkpoint(tmp_path / "ck", preset("tiny"))
    from v4compile.safetensors_io import SafetensorsFile

    name, index = "layers.4.hc_attn_fn", (3, 5)
    with SafetensorsFile(d / "model.safetensors") as f:
        ts = {k: f.read(k) for k in f.tensors}
    ts[name][index] = float("nan")
    write_file(d / "model.safetensors", ts)
    with Checkpoint.open(d, allow_nonfinite=True) as ck:  # where the element lies in its shard
        (tmp_path / "free" / "weights").mkdir(parents=True)
        entry, _ = write_weights(gpu_module(ck), ck, tmp_path / "free" / "weights")
    sh = weights_map.map_shard(tmp_path / "free" / entry["tensors"][name]["shard"], ArtifactError)
    at = sh.data_start + sh.tensors[name].begin + 4 * (index[0] * 256 + index[1]) + 2
    sh.close()
    monkeypatch.setattr(weights_write, "BLOCK_BYTES", at)  # a block ends 2 bytes into the NaN
    monkeypatch.setattr(weights_write, "WINDOW_BYTES", 4 * at)
    if fault:
        real = weights_write._Reader.read_into
        monkeypatch.setattr(weights_write._Reader, "read_into",
                            lambda self, path, off, view: None if len(view) <= 4 else real(self, path, off, view))
    if fault:
        write(d, tmp_path / "a")
    else:
        with pytest.raises(CheckpointError, match=r"layers\.4\.hc_attn_fn"):
            write(d, tmp_path / "a")


def weights_artifact(ck_dir: Path, out: Path, monkeypatch) -> dict:
    """An artifact directory holding only weights and a manifest (its schema check, tests/runtime/test_bad_artifact.py,
    switched off); returns the manifest's `weights` entry."""
    from v4compile import artifact

    monkeypatch.setattr(artifact, "check_manifest", lambda m, verify: None)
    entry, hashes, _ = write(ck_dir, out)
    manifest = {"format_version": FORMAT_VERSION, "weights": entry, "files": hashes}
    manifest["manifest_sha256"] = artifact.manifest_digest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return entry


def read_all(art_dir: Path, how: str) -> None:
    w = load_artifact(art_dir, defer_weights=True).weights()  # the shards are not hashed here ...
    try:
        for _ in (w.stream() if how == "stream" else w.chunks(size=4096)):  # ... but here, as they are read
            pass
    finally:
        w.close()


def test_a_file_in_the_page_cache_is_read_through_it(tmp_path, monkeypatch):
    """A large file mostly in the page cache (a checkpoint just downloaded, an artifact just written) is read
    through the cache, not with O_DIRECT from the disk again; once its pages are dropped, with O_DIRECT. The
    probe (`_cached`, mincore) reads nothing: the dropped file stays out of the cache after it."""
    f = tmp_path / "big"
    f.write_bytes(os.urandom(1 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.read(fd, 1 << 20)
        assert weights_disk.page_cached(fd, 1 << 20)
        monkeypatch.setattr(weights_disk, "DIRECT_BYTES", 0)
        assert weights_disk.open_direct(f, fd, 1 << 20, 4096) is None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if weights_disk.page_cached(fd, 1 << 20):
            pytest.skip("this file system keeps the pages (tmpfs)")
        assert not weights_disk.page_cached(fd, 1 << 20)  # the probe itself brought nothing in
        d = weights_disk.open_direct(f, fd, 1 << 20, 4096)
        if d is None and not direct_writes_work(tmp_path):
            pytest.skip("this file system refuses O_DIRECT")
        assert d is not None
        os.close(d)
    finally:
        os.close(fd)


@pytest.mark.parametrize("read", ["cached", "direct"])
def test_the_streaming_readers_give_every_tensor_with_its_hash(tiny_ck, tmp_path, monkeypatch, read):
    """`load_artifact(defer_weights=True)` leaves the shards to the streaming readers (mapped views, or
    chunks through reused buffers, here far smaller than the tensors, hashed on parallel lanes); the
    chunks reassemble every tensor with its manifest sha256. `direct`: the chunks read with O_DIRECT (as
    a large shard is), the shard's last unit past its end."""
    entry = weights_artifact(tiny_ck, tmp_path / "a", monkeypatch)
    if read == "direct":
        opened = []
        real = weights_disk.open_direct
        monkeypatch.setattr(weights_disk, "DIRECT_BYTES", 0)
        monkeypatch.setattr(weights_disk, "page_cached", lambda fd, n: False)  # as if the shards had left the cache
        monkeypatch.setattr(weights_disk, "open_direct", lambda *a: opened.append(real(*a)) or opened[-1])
    w = load_artifact(tmp_path / "a", defer_weights=True).weights()
    assert [n for n, _ in w.stream()] == sorted(entry["tensors"], key=lambda n: w.shards[w.shard_of[n]].tensors[n].begin)
    got: dict[str, bytearray] = {}
    for n, off, buf, start, k in w.chunks(size=4096):  # the upload path: pieces of reused buffers
        t = got.setdefault(n, bytearray())
        assert off == len(t)
        t += buf[start: start + k]
    assert {n: tree(bytes(b)).hex() for n, b in got.items()} == \
        {n: t["sha256"] for n, t in entry["tensors"].items() if math.prod(t["shape"])}
    w.close()
    if read == "direct":
        if opened == [None] * len(opened):
            pytest.skip("this file system refuses O_DIRECT")
        assert None not in opened and any(os.path.getsize(tmp_path / "a" / r) % 4096 for r in entry["shards"])


@pytest.mark.parametrize("shards, fault", [("one", None), ("many", None), ("many", "one region"),
                                           ("one", "regions in turn")])
def test_the_shards_regions_are_read_in_turn_and_hashed_on_their_own_lanes(tiny_ck, tmp_path, monkeypatch, shards,
                                                                           fault):
    """One sha256 stream runs on one core (slower than a fast disk), so the shards are cut
    into a region per hash lane (inside one shard, or across shards of a tensor or two each) and the regions'
    chunks are read in turn: every lane hashes about its share of the bytes (at most a share plus the
    largest tensor) and, until a region is done, no lane runs more than two chunks ahead of another (all
    hash at once). Both faults, one region or the regions one after the other, break that; the tensors and
    their hashes stay right either way."""
    from v4compile.cli import driver

    lanes, size = 3, 4096
    if shards == "many":
        monkeypatch.setattr(driver, "SHARD_BYTES", 64 << 10)
    entry = weights_artifact(tiny_ck, tmp_path / "a", monkeypatch)
    assert (len(entry["shards"]) > 6) == (shards == "many")
    if fault == "one region":
        monkeypatch.setattr(weights_map, "_regions", lambda units, sizes, k: [units])
    elif fault == "regions in turn":
        monkeypatch.setattr(weights_map, "_interleave", lambda per: [(r, *c) for r, cs in enumerate(per) for c in cs])
    monkeypatch.setattr(weights_disk, "default_workers", lambda: lanes)
    w = load_artifact(tmp_path / "a", defer_weights=True).weights()
    fed: list[tuple[int, int]] = []  # (lane, bytes) of every hash update, in the order they were handed over
    real = weights_map.Lanes.submit

    def submit(self, stream, data, done=None):
        fed.append((self.pools.index(stream[1]), memoryview(data).nbytes))
        return real(self, stream, data, done)
    monkeypatch.setattr(weights_map.Lanes, "submit", submit)
    got: dict[str, bytearray] = {}
    for n, off, buf, start, k in w.chunks(size=size):
        t = got.setdefault(n, bytearray())
        assert off == len(t)
        t += buf[start: start + k]
    w.close()
    assert {n: tree(bytes(b)).hex() for n, b in got.items()} == \
        {n: t["sha256"] for n, t in entry["tensors"].items() if math.prod(t["shape"])}
    total = sum(os.path.getsize(tmp_path / "a" / rel) for rel in entry["shards"])
    largest = max(math.prod(t["shape"]) * {"fp32": 4, "bf16": 2, "i64": 8}.get(t["dtype"], 1)
                  for t in entry["tensors"].values())
    per = [sum(n for i, n in fed if i == lane) for lane in range(lanes)]
    assert sum(per) == total and total > 2 * lanes * largest  # every byte hashed once; a share is tensors
    balanced = all(p <= total / lanes + largest for p in per)
    sums, gap = [0] * lanes, 0
    for lane, n in fed:
        if any(s == p for s, p in zip(sums, per)):
            break  # a region is done: the others go on without it
        sums[lane] += n
        gap = max(gap, max(sums) - min(sums))
    assert (balanced and gap <= 2 * size) == (fault is None), (per, gap)


def test_a_flipped_byte_in_any_tensor_is_named(tiny_ck, tmp_path, monkeypatch):
    """A flipped byte in a tensor (the first, the largest and two random ones, at a random place) is one
    ArtifactError naming the tensor and its shard, from both streaming readers, and naming the shard from
    a load that checks every file first."""
    entry = weights_artifact(tiny_ck, tmp_path / "a", monkeypatch)
    shard = tmp_path / "a" / entry["shards"][0]
    sh = weights_map.map_shard(shard, ArtifactError)
    spans = {n: (sh.data_start + i.begin, sh.data_start + i.end) for n, i in sh.tensors.items() if i.end > i.begin}
    sh.close()
    g = torch.Generator().manual_seed(1)
    names = sorted(spans)
    picks = [min(spans, key=lambda n: spans[n][0]), max(spans, key=lambda n: spans[n][1] - spans[n][0])]
    picks += [names[int(torch.randint(len(names), (1,), generator=g))] for _ in range(2)]
    good = shard.read_bytes()
    for n in picks:
        lo, hi = spans[n]
        raw = bytearray(good)
        raw[lo + int(torch.randint(hi - lo, (1,), generator=g))] ^= 0x10
        shard.write_bytes(bytes(raw))
        for how in ("stream", "chunks"):
            with pytest.raises(ArtifactError, match=rf"{shard.name}: '{re.escape(n)}'.*sha256"):
                read_all(tmp_path / "a", how)
        with pytest.raises(ArtifactError, match=shard.name):
            load_artifact(tmp_path / "a")
    shard.write_bytes(good)
    load_artifact(tmp_path / "a")
    for how in ("stream", "chunks"):
        read_all(tmp_path / "a", how)


@pytest.mark.parametrize("digest", ["sound", "broken"])
def test_a_changed_header_is_caught_by_the_shard_digest(tiny_ck, tmp_path, monkeypatch, digest):
    """A header byte changed while every tensor stays the same (in the metadata, which no reader checks) is
    caught by the shard's digest. The same check with a digest of the
    tensors alone (the broken variant, its digests recomputed) lets it through."""
    entry = weights_artifact(tiny_ck, tmp_path / "a", monkeypatch)
    shard = tmp_path / "a" / entry["shards"][0]
    if digest == "broken":
        real = weights_map.segments
        monkeypatch.setattr(weights_map, "segments", lambda *a: [s for s in real(*a) if s[2] is not None])
        m = json.loads((tmp_path / "a" / "manifest.json").read_text())
        m["files"][entry["shards"][0]] = weights_map.shard_file_digest(shard, ArtifactError)
        from v4compile.artifact import manifest_digest

        m["manifest_sha256"] = manifest_digest(m)
        (tmp_path / "a" / "manifest.json").write_text(json.dumps(m))
    raw = shard.read_bytes()
    assert raw.count(b'"v4compile-ir-weights"') == 1
    shard.write_bytes(raw.replace(b'"v4compile-ir-weights"', b'"v4compile-ir-weighTs"'))
    for how in ("stream", "chunks"):
        if digest == "sound":
            with pytest.raises(ArtifactError, match=rf"{shard.name}\b.*does not match its hash"):
                read_all(tmp_path / "a", how)
        else:
            read_all(tmp_path / "a", how)


def test_the_lanes_tree_digest_is_the_definitions_whatever_the_cuts():
    """`Lanes` gives a segment's tree digest ("sha256-tree-8MiB", the real piece size) from updates cut
    anywhere (across and inside pieces), its pieces dealt to every lane; a one-piece and an empty segment too."""
    from v4compile.shard_digest import Lanes, tree_digest

    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (2 * PIECE_BYTES + 12345,), generator=g, dtype=torch.uint8).numpy().tobytes()
    cuts = sorted({0, len(data), PIECE_BYTES, PIECE_BYTES - 1, *(int(x) for x in torch.randint(len(data), (6,),
                                                                                             generator=g))})
    ls = Lanes(3, 1 << 62)
    try:
        big, small, empty = ls.stream(), ls.stream(), ls.stream()
        for a, b in zip(cuts, cuts[1:]):
            ls.submit(big, memoryview(data)[a:b])
        ls.submit(small, data[:1000])
        ls.submit(empty, b"")
        ls.drain()
    finally:
        ls.close()
    assert big[0].digest() == tree(data) == tree_digest(data).digest() != hashlib.sha256(data).digest()
    assert len(big[0].pieces) == 3 and small[0].digest() == tree(data[:1000]) and empty[0].digest() == tree(b"")


@pytest.mark.parametrize("fault", [None, "one lane per tensor"])
def test_a_large_tensor_is_hashed_in_pieces_on_every_lane(tiny_ck, tmp_path, monkeypatch, fault):
    """With pieces far smaller than the tensors (4 KiB here, 8 MiB in the format), every tensor's manifest
    digest is the tree of its bytes, and the largest tensor's pieces are hashed on all the writer's lanes, so
    one large tensor is not hashed at one core's speed. The fault, a tensor's pieces all on one lane (as a
    whole-tensor sha256 is), is caught."""
    from v4compile import shard_digest

    monkeypatch.setattr(shard_digest, "PIECE_BYTES", 4096)
    lanes_of: dict[int, set] = {}  # id(tree) -> the lanes its pieces went to
    real = shard_digest.Lanes.submit

    def submit(self, stream, data, done=None):
        tree_ = stream[0]
        before = tree_.pos
        fut = real(self, stream, data, done)
        if tree_.pos > before:
            lanes_of.setdefault(id(tree_), set()).add(self.pools.index(tree_.piece_lane))
        return fut
    monkeypatch.setattr(shard_digest.Lanes, "submit", submit)
    if fault:
        stream = shard_digest.Lanes.stream
        monkeypatch.setattr(shard_digest.Lanes, "stream", lambda self, lane=None: stream(self, 0))

    entry, _, _ = write(tiny_ck, tmp_path / "a", workers=3)
    shards = {rel: weights_map.map_shard(tmp_path / "a" / rel, ArtifactError) for rel in entry["shards"]}
    sizes = {}
    for n, t in entry["tensors"].items():
        got = bytes(shards[t["shard"]].bytes_of(n))
        assert t["sha256"] == tree(got, 4096).hex(), n
        sizes[n] = len(got)
    assert max(sizes.values()) > 3 * 4096
    assert len(max(lanes_of.values(), key=len)) == (1 if fault else 3)


@pytest.mark.parametrize("check", ["sound", "first piece only"])
def test_a_changed_piece_of_a_large_tensor_is_caught_at_load(tiny_ck, tmp_path, monkeypatch, check):
    """A byte changed in a later piece (neither the first nor the last) of the largest tensor is one
    ArtifactError naming the tensor from both streaming readers, and naming the shard from a load that checks
    every file first. A tree that digests its first piece alone (the broken variant, at write and load) lets
    the change through."""
    from v4compile import shard_digest

    monkeypatch.setattr(shard_digest, "PIECE_BYTES", 4096)
    if check != "sound":
        def first_piece_only(self):
            h = hashlib.sha256(TREE_TAG)
            for p in self.pieces[:1]:
                h.update(p.digest())
            return h.digest()
        monkeypatch.setattr(shard_digest.Tree, "digest", first_piece_only)
    entry = weights_artifact(tiny_ck, tmp_path / "a", monkeypatch)
    shard = tmp_path / "a" / entry["shards"][0]
    sh = weights_map.map_shard(shard, ArtifactError)
    n, i = max(sh.tensors.items(), key=lambda kv: kv[1].end - kv[1].begin)
    lo, hi = sh.data_start + i.begin, sh.data_start + i.end
    sh.close()
    assert hi - lo > 3 * 4096
    raw = bytearray(shard.read_bytes())
    raw[lo + 2 * 4096 + 77] ^= 0x01  # in the tensor's third piece
    shard.write_bytes(bytes(raw))
    for how in ("stream", "chunks"):
        if check == "sound":
            with pytest.raises(ArtifactError, match=rf"{shard.name}: '{re.escape(n)}'.*sha256"):
                read_all(tmp_path / "a", how)
        else:
            read_all(tmp_path / "a", how)
    if check == "sound":
        with pytest.raises(ArtifactError, match=shard.name):
            load_artifact(tmp_path / "a")
    else:
        load_artifact(tmp_path / "a")


CAPPED = textwrap.dedent('''
    import os, resource, sys, threading
    import torch
    torch.set_num_threads(1)
    threading.stack_size(1 << 20)
    from pathlib import Path
    from v4compile import weights_disk, weights_map, weights_write
    from v4compile.trace import TraceOptions, trace
    from v4compile.cli.driver import write_weights
    from v4compile.checkpoint import Checkpoint
    from v4compile.errors import ArtifactError
    weights_write.BLOCK_BYTES, weights_write.WINDOW_BYTES = 1 << 20, 4 << 20
    weights_disk.DIRECT_BYTES = 0  # a large checkpoint's paths: O_DIRECT reads (a buffer per thread) and writes
    weights_disk.page_cached = lambda fd, n: False  # (the checkpoint was just written: as if it had left the cache)
    ck = Checkpoint.open(sys.argv[1]).validate()  # as `compile` does, before any weight is written
    m = trace(ck.cfg, TraceOptions(decode_batch=1, dtype="bf16"), functions=("decode",), formats=ck.stored_formats())
    out = Path(sys.argv[2]) / "weights"
    out.mkdir(parents=True)
    cap, mode = int(sys.argv[3]), sys.argv[4]
    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
    def capped(limit, key):  # the cap above the process's size now; the peak RSS starts again from the RSS now
        resource.setrlimit(limit, (status(key) + cap, resource.getrlimit(limit)[1]))
        open("/proc/self/clear_refs", "w").write("5")
        return status("VmRSS")
    held = []  # what a broken writer or reader keeps
    if mode == "holding writer":  # every block the writer assembles kept
        real = weights_write._fill
        def holding(k, parts, buf, *a):
            real(k, parts, buf, *a)
            held.append(bytes(buf))
        weights_write._fill = holding
    rss = capped(resource.RLIMIT_AS, "VmSize")
    entry, hashes = write_weights(m, ck, out, workers=2)
    print(status("VmHWM") - rss)
    # Loading: the shards are mapped read-only and shared (their pages are the page cache's, and outside
    # RLIMIT_DATA); the reader's own memory is what is capped.
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    rss = capped(resource.RLIMIT_DATA, "VmData")
    w = weights_map.MappedWeights(out.parent, entry["tensors"], ArtifactError, expected=hashes)
    for name, off, buf, start, k in w.chunks(size=1 << 20):  # the upload path, hashed as read
        if mode == "holding reader":
            held.append(bytes(buf[start:start + k]))
    w.close()
    print(status("VmHWM") - rss)
''')


@pytest.fixture(scope="module")
def mid_ck(tmp_path_factory):
    return stored_checkpoint(tmp_path_factory.mktemp("ck") / "mid", mid_cfg())


@pytest.mark.parametrize("mode", ["streamed", "holding writer", "holding reader"])
def test_writing_and_loading_need_memory_for_a_chunk_not_the_checkpoint(mid_ck, tmp_path, mode):
    """Under a cap of 48 MB above the process's size (address space while writing, data while loading), the
    ~110 MB checkpoint (13x its largest IR tensor) is written and its shards read back and hashed, the peak
    RSS growing by less than the cap each time (pages of a mapped checkpoint would count there). The
    broken variants, a writer or a reader that keeps what it has handled, break the same caps. (The writer's
    window is 4 MB here, the reader's chunks 1 MB; the defaults only change the constant.)"""
    d = mid_ck
    total = (d / "model.safetensors").stat().st_size
    cap = 48 << 20
    assert total > 2 * cap
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CAPPED, str(d), str(tmp_path / "out"), str(cap), mode],
                       capture_output=True, text=True, env=env, timeout=300)
    if mode == "streamed":
        assert r.returncode == 0, r.stderr[-2000:]
        grew = [int(x) for x in r.stdout.split()]
        assert len(grew) == 2 and max(grew) < cap, f"peak RSS grew by {[g >> 20 for g in grew]} MB"
        written = sum(p.stat().st_size for p in (tmp_path / "out" / "weights").iterdir())
        assert written > 2 * cap
    else:
        assert r.returncode != 0 and "MemoryError" in r.stderr, r.stderr[-2000:]
        assert len(r.stdout.split()) == (0 if mode == "holding writer" else 1)  # it broke in the step it broke


def ep2_module(ck_dir: Path):
    """(the checkpoint, its decode module partitioned over ep 2): two ranks' weights to write."""
    from v4compile.passes.base import get_pass
    from v4compile.trace import trace

    ck = Checkpoint.open(ck_dir)
    m = trace(ck.cfg, TraceOptions(decode_batch=1, dtype="bf16"), functions=("decode",), formats=ck.stored_formats())
    return ck, get_pass("partition", {"tp": 1, "ep": 2}).run(m).module


@pytest.mark.parametrize("fault", [None, "one rank at a time", "bytes depend on the writer"])
def test_each_rank_is_written_by_its_own_worker_and_the_bytes_do_not_depend_on_them(tiny_ck, tmp_path, monkeypatch,
                                                                                       fault):
    """tiny partitioned over ep 2: with 2 writers the two ranks' shards are written at once (each
    rank's writer waits at a barrier for the other's), and every file and manifest entry is the same with 1
    writer as with 2. Faults: writers that take the ranks one after the other never meet at the barrier; a
    writer whose shards record which worker wrote them gives other bytes."""
    import threading

    from v4compile.cli import driver

    ck, m = ep2_module(tiny_ck)
    real_write, real_header = driver.write_weights, weights_write.shard_header
    met = threading.Barrier(2, timeout=1 if fault == "one rank at a time" else 60)
    if fault == "one rank at a time":
        monkeypatch.setattr(driver, "RANK_WRITERS", 1)
    if fault == "bytes depend on the writer":
        monkeypatch.setattr(weights_write, "shard_header", lambda g: real_header(g)[:-1] + threading.current_thread().name[-1:].encode())
    out = {}
    for writers in (2, 1):
        def meeting(*a, **k):
            if writers == 2:
                met.wait()  # both ranks' writers are running
            return real_write(*a, **k)
        monkeypatch.setattr(driver, "write_weights", meeting)
        d = tmp_path / f"w{writers}"
        if fault == "one rank at a time" and writers == 2:
            with pytest.raises(threading.BrokenBarrierError):
                driver.write_rank_weights(m, ck, d)
            return
        got = driver.write_rank_weights(m, ck, d, writers=None if writers == 2 else 1)
        out[writers] = got, {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*.safetensors"))}
    (w2, files2), (w1, files1) = out[2], out[1]
    assert len(files2) >= 2 and {p.parts[1] for p in files2} == {"rank-0", "rank-1"}
    assert (w2 == w1 and files2 == files1) == (fault is None)


@pytest.mark.parametrize("fault", [None, "errors in rank order"])
def test_a_rank_writer_that_fails_stops_the_others_and_its_error_is_the_one_raised(tiny_ck, monkeypatch, tmp_path,
                                                                                      fault):
    """Rank 1's source fails on its first tensor while rank 0 is still writing: rank 0's writer stops at
    its next chunk, and the error raised is rank 1's own (naming its tensor), not rank 0's stop. The fault,
    reporting the writers' outcomes in rank order, raises rank 0's stop instead."""
    import threading

    from v4compile import rank_weights
    from v4compile.cli import driver

    ck, m = ep2_module(tiny_ck)
    real, rank1_failed = rank_weights.RankTensors.__getitem__, threading.Event()

    def get(self, name):
        if self.rank == 1:
            rank1_failed.set()
            raise CheckpointError("unreadable", where=name)
        assert rank1_failed.wait(60)  # rank 0 is mid-way when rank 1 fails
        return real(self, name)
    monkeypatch.setattr(rank_weights.RankTensors, "__getitem__", get)
    if fault:
        monkeypatch.setattr(driver, "WriteStopped", type("NeverRaised", (Exception,), {}))
    with pytest.raises(Exception) as e:
        driver.write_rank_weights(m, ck, tmp_path)
    assert (type(e.value) is CheckpointError and "unreadable" in str(e.value)) == (fault is None), repr(e.value)


RANKS = textwrap.dedent('''
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from pathlib import Path
    from v4compile import weights_write
    from v4compile.cli import driver
    from v4compile.checkpoint import Checkpoint
    from v4compile.passes.base import get_pass
    from v4compile.trace import TraceOptions, trace
    weights_write.BLOCK_BYTES, weights_write.WINDOW_BYTES = 1 << 20, 8 << 20  # a whole writer: 8 blocks, 4 filled at once
    os.fdatasync = lambda fd: None  # flushing to the disk is not this test's subject (and slow on a shared disk)
    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
    ck = Checkpoint.open(sys.argv[1]).validate()
    m = trace(ck.cfg, TraceOptions(decode_batch=1, dtype="bf16"), functions=("decode",), formats=ck.stored_formats())
    grew = {}
    for run in ("warm-up ep2", "ep2", "ep4", "ep4 unshared"):  # the first run's arena growth is no rank's
        pm = get_pass("partition", {"tp": 1, "ep": int(run.split("ep")[1][0])}).run(m).module
        writers, real = None, driver.write_weights
        if run.endswith("unshared"):  # broken: every rank at once, each with a whole writer's memory
            driver.write_weights, writers = (lambda *a, share=1, **k: real(*a, **k)), 4
        rss = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again from here
        driver.write_rank_weights(pm, ck, Path(sys.argv[2]) / run, writers=writers)
        grew[run] = status("VmHWM") - rss
        driver.write_weights = real
    print(json.dumps(grew))
''')


def test_rank_writers_need_the_memory_of_one_whatever_the_ranks(tmp_path):
    """Each rank's shards are written by its own worker, RANK_WRITERS at a time sharing one writer's blocks
    (its window) and threads: writing 4 ranks' shards (ep 4) grows the peak RSS as much as 2 ranks' (ep 2), give
    or take one stacked expert weight (8 MB: a conversion holds it whole, and which conversions overlap is
    timing), and the same 4 ranks written by 4 writers that each take a whole writer's memory (the broken
    variant) grow it by three such weights more, with the same bytes. "Give or take": RANK_WRITERS writers
    each hold at most one stacked weight in conversion, and whether those overlap is timing, so ep 4 may
    exceed ep 2 by up to RANK_WRITERS such weights (seen: 1.2 of them under load 12). Freed blocks of 1 MiB and more go
    back to the system at once (glibc's threshold fixed), so the peak is what the writers hold, not what
    the allocator keeps after raising its threshold (measured: 23-32 MB at ep 2 and ep 4, 74-84 MB broken)."""
    from v4compile.config import CSA

    ck = stored_checkpoint(tmp_path / "ck", mid_cfg().replace(n_layers=1, layer_kinds=(CSA,), n_hash_layers=0,
                                                                n_experts=8))
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", RANKS, str(ck), str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grew = json.loads(r.stdout)
    cfg = json.loads((ck / "config.json").read_text())
    stack = cfg["n_routed_experts"] * cfg["dim"] * cfg["moe_inter_dim"]  # FP8: a byte per weight
    slack = RANK_WRITERS * stack
    assert grew["ep4"] <= grew["ep2"] + slack and grew["ep4 unshared"] > grew["ep4"] + 3 * stack, (grew, stack)
    shared, unshared = (sorted(p.relative_to(tmp_path / "out" / run) for p in (tmp_path / "out" / run).rglob("*.safetensors"))
                        for run in ("ep4", "ep4 unshared"))
    assert shared == unshared and len({p.parts[1] for p in shared}) == 4
    assert all((tmp_path / "out" / "ep4" / p).read_bytes() == (tmp_path / "out" / "ep4 unshared" / p).read_bytes()
               for p in shared)


def test_the_copy_paths_nan_bit_test_is_isfinite_on_every_pattern():
    """Copied bytes are checked on their bits: the answer is torch's isfinite for every fp8 and bf16
    pattern, 20k random fp32 ones, and every E8M0 byte (0xFF is its NaN)."""
    for dt, bits, raw in ((torch.float8_e4m3fn, "fp8", torch.arange(256).to(torch.uint8)),
                          (torch.bfloat16, "bf16", torch.arange(-32768, 32768).to(torch.int16))):
        vals = raw.view(dt)
        bad = (~torch.isfinite(vals.float())).tolist()
        data = vals.view(torch.uint8).numpy().tobytes()
        k = vals.element_size()
        assert [weights_write._bits_bad(data, i * k, (i + 1) * k, bits) for i in range(len(bad))] == bad
    r = torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    r[:3] = torch.tensor([0x7F800000, -0x00400000, 0x7F7FFFFF], dtype=torch.int32)  # +Inf, a NaN, the largest finite
    data = r.numpy().tobytes()
    got = [weights_write._bits_bad(data, 4 * i, 4 * i + 4, "fp32") for i in range(len(r))]
    assert got == (~torch.isfinite(r.view(torch.float32))).tolist() and got[:3] == [True, True, False]
    assert [weights_write._bits_bad(bytes(range(256)), v, v + 1, "e8m0") for v in range(256)] == \
        [v == 255 for v in range(256)]


@pytest.mark.parametrize("fault", [None, "first scratch piece only"])
def test_a_non_finite_element_is_found_in_any_scratch_piece(monkeypatch, fault):
    """bf16 / fp32 magnitudes are masked in scratch-sized pieces (64 bytes here): a NaN / Inf in the first,
    a middle, a piece's first or last, or the very last element of a range (starting at an odd element) is
    found, and finite bytes pass. The fault, only the first piece looked at, misses the later ones."""
    monkeypatch.setattr(weights_write, "SCRATCH_BYTES", 64)
    monkeypatch.setattr(weights_write, "_SCRATCH", threading.local())
    if fault:
        real = weights_write._bits_bad
        monkeypatch.setattr(weights_write, "_bits_bad", lambda buf, lo, hi, bits: real(buf, lo, min(hi, lo + 64), bits))
    for dt, bits, k, n in ((torch.bfloat16, "bf16", 2, 1001), (torch.float32, "fp32", 4, 333)):
        good = torch.randn(n, generator=torch.Generator().manual_seed(k)).to(dt)
        lo = k  # ranges start one element in
        assert not weights_write._bits_bad(good.view(torch.uint8).numpy().tobytes(), lo, n * k, bits)
        found = []
        for i in (1, 2, 64 // k, 64 // k + 1, 3 * 64 // k, n - 1):
            t = good.clone()
            t[i] = float("nan") if i % 2 else float("-inf")
            found.append(weights_write._bits_bad(t.view(torch.uint8).numpy().tobytes(), lo, n * k, bits))
        assert all(found) == (fault is None), (bits, found)


def test_a_progress_line_gives_bytes_rate_and_eta(tiny_ck, tmp_path, monkeypatch, caplog):
    """Writing and reading log a progress line (GB done of the total, %, MB/s, ETA) at most every
    PROGRESS_S seconds (here every chunk), the bytes growing to the total; at the default, none for a
    write of a fraction of a second."""
    import logging

    line = re.compile(r"(weights|weights read): ([\d.]+) of ([\d.]+) GB \((\d+)%\), (\d+) MB/s, ETA (\d+) s")
    with caplog.at_level(logging.INFO, logger="v4compile"):
        write(tiny_ck, tmp_path / "quiet")
    assert not [r for r in caplog.records if line.fullmatch(r.getMessage())]
    caplog.clear()
    monkeypatch.setattr(weights_disk, "PROGRESS_S", 0.0)
    monkeypatch.setattr(weights_write, "BLOCK_BYTES", 64 << 10)
    with caplog.at_level(logging.INFO, logger="v4compile"):
        entry = weights_artifact(tiny_ck, tmp_path / "a", monkeypatch)
        read_all(tmp_path / "a", "chunks")
    got = [line.fullmatch(r.getMessage()) for r in caplog.records]
    for what in ("weights", "weights read"):
        done = [float(m[2]) for m in got if m and m[1] == what]
        assert len(done) > 3 and done == sorted(done), (what, done)
        total = {float(m[3]) for m in got if m and m[1] == what}
        assert len(total) == 1 and done[-1] <= total.pop()
    assert entry["tensors"]
