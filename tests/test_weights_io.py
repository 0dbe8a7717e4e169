"""The weight shards of an artifact (`v4compile/weights_io.py`): streamed from a quantised checkpoint in
memory that does not grow with it, byte-reproducible, every tensor hashed, hashes checked as loaded.

The checkpoint here is written from random *stored* bytes (FP8 / FP4 / E8M0 / BF16 / F32 / I64 in the
released layout), not through `init-random`'s quantiser, so a 100 MB one takes a second. Expected
values come from `harness.load_ir_weights` (the per-tensor reader the writer replaced), never from the
writer itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from v4compile import weights_io
from v4compile.artifact import ArtifactError, Buckets, load_artifact
from v4compile.driver import trace_buckets, write_weights
from v4compile.checkpoint import Checkpoint
from v4compile.config import preset
from v4compile.errors import CheckpointError
from v4compile.harness import load_ir_weights
from v4compile.safetensors_io import write_file
from v4compile.trace import TraceOptions
from v4compile.weights import weight_specs


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


def mid_cfg():
    """tiny's structure (every layer kind, hash routing, MTP) at dims where tensors are MBs: ~110 MB in
    all, 13x its largest IR tensor (a stacked expert weight, 8 MB)."""
    from v4compile.config import CSA, HCA, SWA

    return preset("tiny").replace(dim=1024, moe_inter_dim=1024, vocab_size=1024, q_lora_rank=512, head_dim=128,
                                  rope_dim=64, index_head_dim=64, o_lora_rank=256, n_experts=16, n_layers=3,
                                  layer_kinds=(SWA, HCA, CSA), name="mid")


def gpu_module(ck: Checkpoint):
    from v4compile.passes import GPU_PIPELINE, PassManager

    opts = TraceOptions(numerics="official", dtype="bf16")
    m = trace_buckets(ck.cfg, opts, Buckets((2,), (16,)), ck.stored_formats())
    return PassManager(list(GPU_PIPELINE)).run(m).module


@pytest.fixture(scope="module")
def tiny_ck(tmp_path_factory):
    return stored_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", preset("tiny"))


def write(ck_dir: Path, out: Path, **kw) -> tuple[dict, dict, list]:
    with Checkpoint.open(ck_dir) as ck:
        m = gpu_module(ck)
        (out / "weights").mkdir(parents=True)
        entry, hashes = write_weights(m, ck, out / "weights", **kw)
        return entry, hashes, weights_io.plan_weights(m, ck)


def test_every_tensor_is_the_per_tensor_readers_bytes_and_hashed(tiny_ck, tmp_path):
    """Each written tensor equals `load_ir_weights` bit for bit; its sha256 and its shard's are in the
    entry, computed while writing; quantised tensors are copied as stored, norms converted to fp32."""
    entry, hashes, plans = write(tiny_ck, tmp_path / "a")
    with Checkpoint.open(tiny_ck) as ck:
        want = load_ir_weights(gpu_module(ck), ck)
    assert sorted(entry["tensors"]) == sorted(want)
    for rel in entry["shards"]:
        assert hashes[rel] == hashlib.sha256((tmp_path / "a" / rel).read_bytes()).hexdigest()
    shards = {rel: weights_io.map_shard(tmp_path / "a" / rel, ArtifactError) for rel in entry["shards"]}
    for n, t in entry["tensors"].items():
        got = bytes(shards[t["shard"]].bytes_of(n))
        assert got == want[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), n
        assert t["sha256"] == hashlib.sha256(got).hexdigest(), n
    path = {p.name: p.path for p in plans}
    dtype = {p.name: p.dtype for p in plans}
    assert all(path[n] == "copy" for n in path if dtype[n] in ("fp8e4m3", "fp4x2", "e8m0", "i64"))
    assert path["layers.0.attn_norm.weight"] == "convert" and dtype["layers.0.attn_norm.weight"] == "fp32"
    assert path["layers.0.ffn.experts.w1"] == "copy"  # a stack of 8 stored tensors, copied without decoding


def test_a_misordered_stack_is_caught_by_the_same_comparison(tiny_ck, tmp_path, monkeypatch):
    """The comparison above catches a stack of experts copied in the wrong order."""
    real = weights_io.plan_weights

    def reversed_stacks(m, source):
        plans = real(m, source)
        for p in plans:
            if ".experts." in p.name:
                p.pieces.reverse()
        return plans

    monkeypatch.setattr(weights_io, "plan_weights", reversed_stacks)
    entry, _, _ = write(tiny_ck, tmp_path / "a")
    with Checkpoint.open(tiny_ck) as ck:
        want = load_ir_weights(gpu_module(ck), ck)
    sh = weights_io.map_shard(tmp_path / "a" / entry["shards"][0], ArtifactError)
    n = "layers.0.ffn.experts.w1"
    assert bytes(sh.bytes_of(n)) != want[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_byte_reproducible_whatever_the_workers(tiny_ck, tmp_path, monkeypatch):
    """Two writes (1 and 4 workers; chunks, window and buffer pool far smaller than the tensors) give the
    same bytes."""
    a, ha, _ = write(tiny_ck, tmp_path / "a", workers=1)
    monkeypatch.setattr(weights_io, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(weights_io, "WINDOW_BYTES", 3 * 4096)
    monkeypatch.setattr(weights_io, "POOLED", 1024)  # most chunks go through the 5 reused buffers
    b, hb, _ = write(tiny_ck, tmp_path / "b", workers=4)
    assert a == b and ha == hb
    for rel in a["shards"]:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


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


def test_a_changed_shard_is_named_while_streaming(tiny_ck, tmp_path, monkeypatch):
    """`load_artifact(defer_weights=True)` leaves the shards to the streaming readers (mapped views, or
    chunks through reused buffers, which reassemble every tensor with its manifest hash), which hash them
    as they read them: a flipped byte is one ArtifactError naming the shard. The manifest here holds only
    the weights, so its schema check (tests/test_bad_artifact.py) is switched off."""
    from v4compile import artifact

    monkeypatch.setattr(artifact, "check_manifest", lambda m, verify: None)
    entry, hashes, _ = write(tiny_ck, tmp_path / "a")
    art_dir = tmp_path / "a"
    manifest = {"format_version": 1, "weights": entry, "files": hashes}
    from v4compile.artifact import manifest_digest

    manifest["manifest_sha256"] = manifest_digest(manifest)
    (art_dir / "manifest.json").write_text(json.dumps(manifest))
    art = load_artifact(art_dir, defer_weights=True)
    w = art.weights()
    assert sum(1 for _ in w.stream()) == len(entry["tensors"])
    got: dict[str, bytearray] = {}
    for n, off, buf, start, k in w.chunks(size=4096):  # the upload path: pieces of two reused buffers
        t = got.setdefault(n, bytearray())
        assert off == len(t)
        t += buf[start: start + k]
    assert {n: hashlib.sha256(b).hexdigest() for n, b in got.items()} == \
        {n: t["sha256"] for n, t in entry["tensors"].items() if math.prod(t["shape"])}
    w.close()
    shard = art_dir / entry["shards"][0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10
    shard.write_bytes(bytes(raw))
    art = load_artifact(art_dir, defer_weights=True)  # the shard is not read here ...
    with pytest.raises(ArtifactError, match=shard.name):
        for _ in art.weights().stream():  # ... but here
            pass
    with pytest.raises(ArtifactError, match=shard.name):
        for _ in art.weights().chunks(size=4096):  # and here
            pass
    with pytest.raises(ArtifactError, match=shard.name):
        load_artifact(art_dir)


CAPPED = textwrap.dedent('''
    import os, resource, sys, threading
    import torch
    torch.set_num_threads(1)
    threading.stack_size(1 << 20)
    from pathlib import Path
    sys.path.insert(0, os.environ["TESTS"])
    from v4compile import weights_io
    from v4compile.trace import TraceOptions, trace
    from v4compile.driver import write_weights
    from v4compile.checkpoint import Checkpoint
    from v4compile.harness import load_ir_weights
    weights_io.CHUNK_BYTES, weights_io.WINDOW_BYTES, weights_io.WRITE_BUFFER = 1 << 20, 4 << 20, 1 << 20
    ck = Checkpoint.open(sys.argv[1]).validate()  # as `compile` does, before any weight is written
    m = trace(ck.cfg, TraceOptions(decode_batch=1, dtype="bf16"), functions=("decode",), formats=ck.stored_formats())
    out = Path(sys.argv[2])
    out.mkdir()
    def status(key):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
    cap = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again from the RSS now
    rss = status("VmRSS")
    if sys.argv[4] == "whole":  # the broken variant: every weight in memory at once
        w = load_ir_weights(m, ck)
    else:
        write_weights(m, ck, out, workers=2)
    print(status("VmHWM") - rss)
''')


@pytest.fixture(scope="module")
def mid_ck(tmp_path_factory):
    return stored_checkpoint(tmp_path_factory.mktemp("ck") / "mid", mid_cfg())


@pytest.mark.parametrize("mode", ["streamed", "whole"])
def test_writing_needs_memory_for_the_largest_tensor_not_the_checkpoint(mid_ck, tmp_path, mode):
    """Under an address-space cap of 48 MB above the process's size before writing, the ~110 MB checkpoint
    (13x its largest IR tensor) is written, and the peak RSS grows by less than the cap (pages of a mapped
    checkpoint would count there); holding every weight at once breaks the same cap. (The writer's
    window is 4 MB here; its default only changes the constant.)"""
    d = mid_ck
    total = (d / "model.safetensors").stat().st_size
    cap = 48 << 20
    assert total > 2 * cap
    env = {**os.environ, "TESTS": str(Path(__file__).parent), "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CAPPED, str(d), str(tmp_path / "out"), str(cap), mode],
                       capture_output=True, text=True, env=env, timeout=300)
    if mode == "streamed":
        assert r.returncode == 0, r.stderr[-2000:]
        assert int(r.stdout) < cap, f"peak RSS grew by {int(r.stdout) >> 20} MB"
        written = sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
        assert written > 2 * cap
    else:
        assert r.returncode != 0 and ("MemoryError" in r.stderr or "alloc" in r.stderr.lower()), r.stderr[-2000:]


def test_the_copy_paths_nan_bit_test_is_isfinite_on_every_pattern():
    """Copied bytes are checked on their bits: the answer is torch's isfinite for every fp8 and bf16
    pattern, 20k random fp32 ones, and every E8M0 byte (0xFF is its NaN)."""
    for dt, bits, raw in ((torch.float8_e4m3fn, "fp8", torch.arange(256).to(torch.uint8)),
                          (torch.bfloat16, "bf16", torch.arange(-32768, 32768).to(torch.int16))):
        vals = raw.view(dt)
        bad = (~torch.isfinite(vals.float())).tolist()
        data = vals.view(torch.uint8).numpy().tobytes()
        k = vals.element_size()
        assert [weights_io._bits_bad(bytearray(data[i * k:(i + 1) * k]), k, bits) for i in range(len(bad))] == bad
    r = torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    r[:3] = torch.tensor([0x7F800000, -0x00400000, 0x7F7FFFFF], dtype=torch.int32)  # +Inf, a NaN, the largest finite
    data = r.numpy().tobytes()
    got = [weights_io._bits_bad(bytearray(data[4 * i: 4 * i + 4]), 4, "fp32") for i in range(len(r))]
    assert got == (~torch.isfinite(r.view(torch.float32))).tolist() and got[:3] == [True, True, False]
    assert [weights_io._bits_bad(bytearray([v]), 1, "e8m0") for v in range(256)] == [v == 255 for v in range(256)]
