"""Checkpoint reading and writing: layouts, formats, sharding, header-only access, and every defect."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import dense_weights, make_model, prompt
from v4compile.checkpoint import Checkpoint, write_checkpoint
from v4compile.config import preset
from v4compile.errors import CheckpointError
from v4compile.init_random import random_source
from v4compile.safetensors_io import SafetensorsFile, write_file
from v4compile.weights import spec_table


def test_fp32_round_trip_is_exact(tiny_ckpt):
    dense = dense_weights("tiny")
    for layer in range(preset("tiny").n_hash_layers):
        table = dense[f"layers.{layer}.ffn.gate.tid2eid"]
        assert all(len(set(row)) == len(row) for row in table.tolist())  # no expert twice for a token
        assert len(torch.unique(table)) == preset("tiny").n_experts  # and every expert is used
    with Checkpoint.open(tiny_ckpt) as ck:
        ck.validate()
        assert set(ck.entries) == set(dense)
        for name, t in dense.items():
            assert torch.equal(ck.dense(name), t.float() if t.is_floating_point() else t), name


# ---- the released formats against hand-made bytes (spec 14.2 - 14.3) ------------------------------------

def _hand_made() -> dict[str, tuple[torch.Tensor, dict[tuple[int, int], int], list[int] | int, int]]:
    """name -> (dense value, {(row, byte column): byte} of the weight (all other bytes 0), its scale bytes,
    the weight's bytes per row). Values are on their grids, so the bytes follow from the spec alone."""
    fp8 = torch.zeros(48, 64)  # one (partial) 128 x 128 block; amax 896 -> scale 2 (E8M0 byte 128)
    fp8[0, 0], fp8[0, 1], fp8[0, 2], fp8[1, 0] = 1.0, -2.0, 3.0, 896.0  # / 2: 0.5, -1, 1.5, 448
    fp4 = torch.zeros(64, 32)  # one 32-group per row
    fp4[0, :4] = torch.tensor([0.5, 1.0, 6.0, -6.0])  # amax 6 -> scale 1 (127); codes 1, 2, 7, 15
    fp4[1, :2] = torch.tensor([3.0, -0.5])  # amax 3 -> scale 1/2 (126); codes 7 (6), 10 (-1)
    bf16 = torch.zeros(32, 64)
    bf16[0, 0], bf16[0, 1] = 1.0, 1.0 / 3.0  # 0x3F80; 1/3 = 0x3EAAAAAB rounds up to 0x3EAB
    # A zero fp4 group gets the writer's floor scale 2^-126 (byte 1).
    return {"layers.1.attn.wq_a.weight": (fp8, {(0, 0): 0x30, (0, 1): 0xB8, (0, 2): 0x3C, (1, 0): 0x7E}, 128, 64),
            "layers.1.ffn.experts.3.w2.weight": (fp4, {(0, 0): 0x21, (0, 1): 0xF7, (1, 0): 0xA7},
                                                 [127, 126] + [1] * 62, 16),
            "layers.1.attn.compressor.wkv.weight": (bf16, {(0, 0): 0x80, (0, 1): 0x3F, (0, 2): 0xAB, (0, 3): 0x3E},
                                                    [], 128)}


FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _spec_dequant(fmt: str, w: torch.Tensor, s: torch.Tensor | None, shape) -> torch.Tensor:
    """Spec 14.2 / 14.3 written out here (not the package's codec): raw bytes -> float values."""
    if fmt == "bf16":
        return w.float()
    o, i = shape
    if fmt == "fp8":
        scale = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
        return w.view(torch.float8_e4m3fn).float() * scale[:o, :i]
    if fmt == "fp4":
        b = w.view(torch.uint8).long()
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).view(o, i)  # element 2k: the low nibble
        values = torch.tensor(FP4_VALUES + [-v for v in FP4_VALUES])[codes]
        return values * torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, 1)
    raise ValueError(fmt)


def check_released_formats(out):
    cfg = preset("tiny")
    specs = spec_table(cfg)
    dense = dense_weights("tiny")
    made = _hand_made()
    with Checkpoint.open(out) as ck:
        ck.validate()
        dtypes = {n: e.dtype for n, e in ck.entries.items()}
        assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3"
        assert dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
        assert dtypes["layers.1.ffn.experts.3.w2.weight"] == "I8"
        assert ck.entries["layers.1.ffn.experts.3.w2.weight"].shape == (cfg.dim, cfg.moe_inter_dim // 2)
        assert dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
        assert dtypes["layers.1.hc_attn_fn"] == "F32" and dtypes["layers.0.ffn.gate.tid2eid"] == "I64"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, (value, nonzero, scale, row_bytes) in made.items():
        with SafetensorsFile(out / index[name]) as f:
            raw = f.read(name).contiguous().view(torch.uint8).view(value.shape[0], row_bytes)
            sname = name.replace(".weight", ".scale")
            raw_scale = f.read(sname).contiguous().view(torch.uint8).flatten().tolist() if scale != [] else []
        want = torch.zeros_like(raw)
        for (r, c), b in nonzero.items():
            want[r, c] = b
        assert torch.equal(raw, want), f"{name}: bytes {raw[:2, :4].tolist()} != {want[:2, :4].tolist()}"
        assert raw_scale == (scale if isinstance(scale, list) else [scale]), (name, raw_scale[:4])
    # Every tensor: the loader's dequantised values are the spec's reading of the stored bytes, and within
    # the format's rounding of the dense source (e4m3: half a step, 2^-4 relative, or 2^-10 x the scale in
    # the subnormals; e2m1: half the step at that magnitude <= 0.2 |w| + 0.25 x the scale; bf16: 2^-8 relative).
    src = {**dense, **{n: v[0] for n, v in made.items()}}
    with Checkpoint.open(out) as ck:
        for name, sp in specs.items():
            got = ck.dense(name)
            if sp.fmt not in ("fp8", "fp4", "bf16"):
                assert torch.equal(got, src[name]), name
                continue
            with SafetensorsFile(out / index[name]) as f:
                w = f.read(name)
                s = f.read(name.replace(".weight", ".scale")) if sp.fmt != "bf16" else None
            assert torch.equal(got, _spec_dequant(sp.fmt, w, s, sp.shape)), name
            d, a = (got - src[name]).abs(), src[name].abs()
            if sp.fmt == "fp8":
                blocks = _spec_dequant("fp8", torch.ones(sp.shape, dtype=torch.float8_e4m3fn), s, sp.shape)
                assert (d <= 2.0 ** -4 * a + 2.0 ** -10 * blocks).all(), name
            elif sp.fmt == "fp4":
                groups = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, 1)
                assert (d <= 0.2 * a + 0.25 * groups).all(), name
            else:
                assert (d <= 2.0 ** -8 * a).all(), name


def _write_released(path):
    cfg = preset("tiny")
    made, src = _hand_made(), random_source(cfg, 0)
    return write_checkpoint(path, cfg, lambda sp: made[sp.name][0] if sp.name in made else src(sp), dtype="released")


def test_released_formats_on_disk_and_dequantised_values(tmp_path):
    out = _write_released(tmp_path / "q")
    check_released_formats(out)
    # A quantized checkpoint runs.
    from v4compile.model import ReferenceModel

    model = ReferenceModel.from_pretrained(out)
    assert len(model.generate([1, 2, 3], 4)) == 4


def _high_nibble_first(codes):
    c = codes.to(torch.int64)
    return ((c[..., 1::2] & 0x0F) | ((c[..., 0::2] & 0x0F) << 4)).to(torch.uint8).view(torch.int8)


@pytest.mark.parametrize("fault", ["fp4-high-nibble-first", "scale-one-binade-up"])
def test_a_broken_writer_is_caught(tmp_path, monkeypatch, fault):
    from v4compile import formats

    if fault == "fp4-high-nibble-first":
        monkeypatch.setattr(formats, "fp4_pack", _high_nibble_first)
    else:
        real = formats.pow2_scale
        monkeypatch.setattr(formats, "pow2_scale", lambda amax, qmax, floor: 2 * real(amax, qmax, floor))
    out = _write_released(tmp_path / "q")
    monkeypatch.undo()  # the reader is the real one
    with pytest.raises(AssertionError):
        check_released_formats(out)


def test_sharding_with_index(tmp_path):
    cfg = preset("tiny")
    out = write_checkpoint(tmp_path / "sharded", cfg, random_source(cfg, 0), dtype="fp32", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((out / s).is_file() for s in shards)
    assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in shards)
    with Checkpoint.open(out) as ck:
        ck.validate()
        assert torch.equal(ck.dense("layers.3.attn.wo_b.weight"), dense_weights("tiny")["layers.3.attn.wo_b.weight"])


def test_open_and_validate_read_no_tensor_data_but_hash_tables(tiny_ckpt, monkeypatch):
    """`validate` reads the (small, integer) hash-routing tables to range-check their ids; nothing else."""
    read = []
    real = SafetensorsFile.read

    def only_tables(self, name):
        if not name.endswith("tid2eid"):
            raise AssertionError(f"tensor data read: {name}")
        read.append(name)
        return real(self, name)

    monkeypatch.setattr(SafetensorsFile, "read", only_tables)
    with Checkpoint.open(tiny_ckpt) as ck:
        ck.validate()
        ck.header_specs()
    assert sorted(read) == [f"layers.{i}.ffn.gate.tid2eid" for i in range(preset("tiny").n_hash_layers)]


def test_hf_parameter_layout(tmp_path):
    """HF in-memory names (stacked experts, `self_attn.*`, `weight_scale_inv`) load as the same tensors."""
    from hf_oracle import hf_model

    cfg = preset("tiny")
    hf = hf_model(cfg, dense_weights("tiny"))
    d = tmp_path / "hfnames"
    d.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    write_file(d / "model.safetensors", state)
    (d / "config.json").write_text(json.dumps(cfg.to_hf()))
    with Checkpoint.open(d) as ck:
        ck.validate(include_mtp=False)
        for name, t in dense_weights("tiny").items():
            if not name.startswith("mtp."):
                assert torch.equal(ck.dense(name), t.float() if t.is_floating_point() else t), name


def test_official_layout_loads_into_hf(tiny_ckpt, tmp_path):
    """Our writer's names are the official ones: HF's own loader (its conversion mapping) accepts them."""
    from transformers import DeepseekV4ForCausalLM

    d = tmp_path / "for-hf"
    shutil.copytree(tiny_ckpt, d)
    cfg = preset("tiny")
    hf_cfg = {k: v for k, v in cfg.to_hf().items() if k != "quantization_config"}
    (d / "config.json").write_text(json.dumps(hf_cfg))
    hf = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = prompt(40, cfg.vocab_size)
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(make_model("tiny").forward(ids), theirs, atol=1e-4, rtol=0)


# ---- defects ----------------------------------------------------------------------------------

def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite(path, fn):
    """Rewrite the shard holding tensors with `fn(dict) -> dict`."""
    with SafetensorsFile(path) as f:
        ts = {k: f.read(k) for k in f.tensors}
    write_file(path, fn(ts))


def shard_of(ckdir, name):
    wm = json.loads((ckdir / "model.safetensors.index.json").read_text())["weight_map"]
    return ckdir / wm[name], wm


@pytest.mark.parametrize("defect, needle", [
    ("missing", "missing tensor"),
    ("unexpected", "unexpected tensor"),
    ("shape", "wrong shape"),
    ("dtype", "wrong dtype"),
])
def test_tensor_defects(tiny_ckpt, tmp_path, defect, needle):
    d = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    name = "layers.2.attn.wkv.weight"
    path, wm = shard_of(d, name)

    def change(ts):
        if defect == "missing":
            del ts[name]
        elif defect == "unexpected":
            ts["layers.2.attn.bogus.weight"] = torch.zeros(2)
        elif defect == "shape":
            ts[name] = ts[name][:, :-1].contiguous()
        elif defect == "dtype":
            ts[name] = ts[name].to(torch.int32)
        return ts

    rewrite(path, change)
    if defect == "missing":
        wm.pop(name)
    if defect == "unexpected":
        wm["layers.2.attn.bogus.weight"] = path.name
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d).validate()
    msg = str(e.value)
    assert needle in msg and (str(d) if defect == "missing" else path.name) in msg, msg
    if defect == "missing":
        assert name in msg
    if defect == "shape":
        assert "expected [32, 64]" in msg and "found [32, 63]" in msg


def test_scale_grid_mismatch(tiny_quant_ckpt, tmp_path):
    d = copy_ckpt(tiny_quant_ckpt, tmp_path / "badscale")
    name = "layers.2.attn.wq_b.scale"
    path, _ = shard_of(d, name)
    rewrite(path, lambda ts: {**ts, name: torch.cat([ts[name], ts[name]])})
    with pytest.raises(CheckpointError, match="scale grid does not match") as e:
        Checkpoint.open(d).validate()
    assert "expected [1, 1]" in str(e.value) and "found [2, 1]" in str(e.value)


def test_index_points_at_missing_shard(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "noshard")
    path, _ = shard_of(d, "embed.weight")
    os.unlink(path)
    with pytest.raises(CheckpointError, match="missing shard") as e:
        Checkpoint.open(d)
    assert path.name in str(e.value)


def test_index_names_a_tensor_the_shard_lacks(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "lying-index")
    path, wm = shard_of(d, "embed.weight")
    wm["layers.0.attn.phantom.weight"] = path.name
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="does not hold"):
        Checkpoint.open(d)


def test_truncated_shard_is_named(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt, tmp_path / "trunc")
    path, _ = shard_of(d, "head.weight")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CheckpointError, match="run past the end") as e:
        Checkpoint.open(d)
    assert path.name in str(e.value)


def test_writer_is_atomic(tmp_path):
    cfg = preset("tiny")
    src = random_source(cfg, 0)

    def failing(spec):
        if spec.name == "layers.3.attn.wo_a.weight":
            raise RuntimeError("disk on fire")
        return src(spec)

    with pytest.raises(RuntimeError):
        write_checkpoint(tmp_path / "out", cfg, failing)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind either
