"""Bad checkpoints and config files, class by class (issue 12): each is refused with one clear error from
the API (a documented V4Error subclass) and from every command that loads it (exit 2, one `error:`
line, no traceback), before anything outside the checkpoint is read and without blocking."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

import pytest
import torch

from bad_input_util import cli_error, run_main
from v4compile.checkpoint import INDEX_FILE, Checkpoint, write_checkpoint
from v4compile.config import LIMITS, MAX_TENSORS, V4Config, preset
from v4compile.errors import CheckpointError, ConfigError
from v4compile.init_random import random_source
from v4compile.model import ReferenceModel
from v4compile.safetensors_io import SafetensorsFile, write_file


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def index_of(d):
    return json.loads((d / INDEX_FILE).read_text())


def write_index(d, wm):
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": wm}))


def shard_of(d, name):
    return d / index_of(d)["weight_map"][name]


def rewrite(path, fn):
    with SafetensorsFile(path) as f:
        ts = {k: f.read(k) for k in f.tensors}
    write_file(path, fn(ts))


# Every command that reads a checkpoint; `inspect` reads headers only.
LOADERS = [("generate", "--ids", "1,2,3", "--max-new-tokens", "1"), ("compile", "--dtype", "fp32"),
           ("inspect",)]


def each_command(d, *needles, commands=LOADERS):
    for cmd in commands:
        cli_error(cmd[0], str(d), *cmd[1:], needles=needles)


# ---- security: nothing outside the checkpoint directory is read -------------------------------

@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "symlinked-dir"])
def test_shard_paths_leaving_the_checkpoint_are_refused(tiny_ckpt, tmp_path, how):
    d = copy(tiny_ckpt, tmp_path / "ck")
    wm = index_of(d)["weight_map"]
    victim = wm["embed.weight"]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(d / victim), outside / victim)  # a valid shard: followed, it would load fine
    if how == "dotdot":
        wm = {k: (f"../outside/{victim}" if v == victim else v) for k, v in wm.items()}
    elif how == "absolute":
        wm = {k: (str(outside / victim) if v == victim else v) for k, v in wm.items()}
    elif how == "symlink":
        os.symlink(outside / victim, d / victim)
    else:
        os.symlink(outside, d / "sub")
        wm = {k: (f"sub/{victim}" if v == victim else v) for k, v in wm.items()}
    write_index(d, wm)
    with pytest.raises(CheckpointError, match="checkpoint directory|outside") as e:
        Checkpoint.open(d)
    assert victim in str(e.value)
    each_command(d, victim)


def test_unindexed_shard_symlink_and_config_symlink_outside(tiny_ckpt, tmp_path):
    d = copy(tiny_ckpt, tmp_path / "ck")
    os.unlink(d / INDEX_FILE)
    shard = sorted(d.glob("*.safetensors"))[0]
    (tmp_path / "elsewhere.safetensors").write_bytes(shard.read_bytes())
    shard.unlink()
    os.symlink(tmp_path / "elsewhere.safetensors", shard)
    with pytest.raises(CheckpointError, match="outside"):
        Checkpoint.open(d)
    d2 = copy(tiny_ckpt, tmp_path / "ck2")
    (tmp_path / "cfg.json").write_text((d2 / "config.json").read_text())
    (d2 / "config.json").unlink()
    os.symlink(tmp_path / "cfg.json", d2 / "config.json")
    with pytest.raises(ConfigError, match="outside"):
        Checkpoint.open(d2)
    each_command(d2, "outside")


# ---- hangs: only regular files are opened ------------------------------------------------------

@pytest.mark.parametrize("what", ["shard", "unindexed-shard", "config", "index"])
def test_fifos_are_refused_without_blocking(tiny_ckpt, tmp_path, what):
    d = copy(tiny_ckpt, tmp_path / "ck")
    if what == "shard":
        target = shard_of(d, "embed.weight")
    elif what == "unindexed-shard":
        os.unlink(d / INDEX_FILE)
        target = d / "zz.safetensors"
    elif what == "config":
        target = d / "config.json"
    else:
        target = d / INDEX_FILE
    if target.exists():
        target.unlink()
    os.mkfifo(target)
    err = ConfigError if what == "config" else CheckpointError
    with pytest.raises(err, match="not a regular file") as e:
        Checkpoint.open(d)
    assert "FIFO" in str(e.value)
    each_command(d, "not a regular file")


def test_fifo_as_config_file_for_init_random(tmp_path):
    os.mkfifo(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="not a regular file"):
        V4Config.from_file(tmp_path / "c.json")
    cli_error("init-random", "--config", str(tmp_path / "c.json"), "-o", str(tmp_path / "o"),
              needles=("not a regular file",))
    assert not (tmp_path / "o").exists()


# ---- config values: one typed schema for both layouts -------------------------------------------

BAD_VALUES = {"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e400": "1e400", "4.7": "4.7",
              "string": '"4"', "null": "null", "list": "[4]", "object": '{"a": 4}', "true": "true",
              "2^70": str(2 ** 70), "negative": "-4"}
KEYS = {"official": ("n_heads", "route_scale", "compress_ratios"),
        "hf": ("num_attention_heads", "routed_scaling_factor", "layer_types")}


def config_text(layout: str, key: str, raw: str) -> str:
    d = preset("tiny").to_official() if layout == "official" else preset("tiny").to_hf()
    d[key] = "@@"
    return json.dumps(d).replace('"@@"', raw)


@pytest.mark.parametrize("layout", ["official", "hf"])
@pytest.mark.parametrize("bad", sorted(BAD_VALUES))
def test_config_values_of_the_wrong_kind(tmp_path, layout, bad):
    for key in KEYS[layout]:
        if bad == "4.7" and key in ("route_scale", "routed_scaling_factor"):
            continue  # a valid number there
        f = tmp_path / f"{key}.json"
        f.write_text(config_text(layout, key, BAD_VALUES[bad]))
        with pytest.raises(ConfigError) as e:
            V4Config.from_file(f)
        msg = str(e.value)
        assert str(f) in msg and (key in msg or "JSON" in msg or "layer" in msg), msg
    # the CLI, once per layout and value (the key that is an integer)
    f = tmp_path / "int.json"
    f.write_text(config_text(layout, KEYS[layout][0], BAD_VALUES[bad]))
    cli_error("init-random", "--config", str(f), "-o", str(tmp_path / "o"), needles=(str(f),))
    assert not (tmp_path / "o").exists()


# A value of the wrong kind inside a list or object: the error names its path, the kind expected and the value.
NESTED = {
    "official": [({"compress_ratios": [0, 16, 4, 16, "4", 0]}, '`compress_ratios[4]` must be an integer (found "4")'),
                 ({"compress_ratios": [0, 16, 4.5, 16, 4, 0]}, "`compress_ratios[2]` must be an integer (found 4.5)")],
    "hf": [({"compress_rates": [4]}, "`compress_rates` must be an object (found [4])"),
           ({"compress_rates": {"compressed_sparse_attention": "4"}},
            '`compress_rates.compressed_sparse_attention` must be an integer (found "4")'),
           ({"rope_parameters": "yarn"}, '`rope_parameters` must be an object (found "yarn")'),
           ({"rope_parameters": {"rope_type": "yarn", "factor": [16]}},
            "`rope_parameters.factor` must be a finite number (found [16])"),
           ({"quantization_config": 1}, "`quantization_config` must be an object (found 1)"),
           ({"quantization_config": {"quant_method": 8}},
            "`quantization_config.quant_method` must be a string (found 8)"),
           ({"mlp_layer_types": [1, 2, 3, 4, 5]}, "`mlp_layer_types` entries must be strings (found 1)"),
           ({"layer_types": ["sliding_attention", None] * 3},
            "unknown entry in `layer_types` (expected ['compressed_sparse_attention', 'heavily_compressed_attention', "
            "'sliding_attention'], found [None])"),
           ({"sliding_window": True}, "`sliding_window` must be an integer (found true)"),
           ({"partial_rotary_factor": 7, "qk_rope_head_dim": None},
            "`partial_rotary_factor` must be in (0, 1] (found 7.0)")],
}


def _base(layout):
    return preset("tiny").to_official() if layout == "official" else preset("tiny").to_hf()


def refused_with(base, change, message):
    with pytest.raises(ConfigError) as e:
        V4Config.from_dict({**base, **change})
    assert str(e.value) == f"config 'custom': {message}"


@pytest.mark.parametrize("layout", sorted(NESTED))
def test_nested_values_of_the_wrong_kind(layout):
    for change, message in NESTED[layout]:
        refused_with(_base(layout), change, message)


def test_nested_value_errors_are_told_apart():
    """Each bad value fails the check with its neighbour's message: another error does not pass for it."""
    rows = NESTED["hf"]
    for (change, _), (_, other) in zip(rows, rows[1:] + rows[:1]):
        with pytest.raises(AssertionError):
            refused_with(_base("hf"), change, other)


def test_config_file_encoding_nesting_duplicates(tmp_path):
    cases = {"utf8": (b'{"dim": 64, "n_layers": 1, "x": "\xff"}', "not UTF-8"),
             "deep-list": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
             "deep-obj": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
             "dup": (json.dumps(preset("tiny").to_official()).replace('"dim": 64', '"dim": 64, "dim": 32').encode(),
                     "'dim' twice"),
             "not-object": (b"[1, 2]", "JSON object")}
    for name, (raw, needle) in cases.items():
        f = tmp_path / f"{name}.json"
        f.write_bytes(raw)
        with pytest.raises(ConfigError, match=needle):
            V4Config.from_file(f)
        cli_error("init-random", "--config", str(f), "-o", str(tmp_path / "o"), needles=(needle,))


def test_bool_is_not_int():
    d = preset("tiny").to_official()
    with pytest.raises(ConfigError, match="integer"):
        V4Config.from_dict({**d, "n_shared_experts": True})
    with pytest.raises(ConfigError, match="n_mtp_layers"):
        preset("tiny").replace(n_mtp_layers=True)


# ---- absurd sizes: bounded before anything is enumerated ----------------------------------------

@pytest.mark.parametrize("key, field, value", [
    ("n_routed_experts", "n_experts", 10 ** 9), ("vocab_size", "vocab_size", 10 ** 12),
    ("n_layers", "n_layers", 10 ** 6), ("dim", "dim", 2 ** 40), ("max_seq_len", "max_position", 2 ** 40),
])
def test_absurd_sizes_are_refused_with_the_limit(tmp_path, key, field, value):
    d = {**preset("tiny").to_official(), key: value}
    if key == "n_layers":
        d["compress_ratios"] = [0] * 10
    with pytest.raises(ConfigError) as e:
        V4Config.from_dict(d)
    msg = str(e.value)
    assert f"{LIMITS[field]:,}" in msg or str(LIMITS[field]) in msg, msg
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(d))
    for cmd in (("inspect", str(ck)), ("generate", str(ck), "--ids", "1"), ("compile", str(ck))):
        cli_error(*cmd, needles=("beyond" if key != "n_layers" else "n_layers",), timeout=30)


def test_too_many_tensors_within_each_limit():
    cfg = preset("tiny")
    with pytest.raises(ConfigError, match=f"{MAX_TENSORS:,}"):
        cfg.replace(n_experts=LIMITS["n_experts"], n_layers=200, layer_kinds=("swa",) * 200)


# ---- checkpoint contents ------------------------------------------------------------------------

@pytest.mark.parametrize("bad_id", [-1, 8, 2 ** 40])
def test_hash_table_ids_outside_the_expert_range(tiny_ckpt, tmp_path, bad_id):
    d = copy(tiny_ckpt, tmp_path / "ck")
    name = "layers.1.ffn.gate.tid2eid"

    def change(ts):
        t = ts[name].clone()
        t[17, 1] = bad_id
        return {**ts, name: t}

    rewrite(shard_of(d, name), change)
    with pytest.raises(CheckpointError, match=r"expert that does not exist") as e:
        Checkpoint.open(d).validate()
    assert name in str(e.value) and "[0, 8)" in str(e.value) and "[17, 1]" in str(e.value)
    with pytest.raises(CheckpointError, match=name):
        ReferenceModel.from_pretrained(d)
    each_command(d, name, commands=LOADERS[:2])


def stack_experts(d, layer: int, cfg, damage: str | None = None):
    """Replace layer `layer`'s per-expert tensors by HF's stacked `gate_up_proj` / `down_proj`."""
    p = f"layers.{layer}.ffn.experts."
    wm = index_of(d)["weight_map"]
    shards = sorted({wm[k] for k in wm if k.startswith(p)})
    ws: dict[str, torch.Tensor] = {}
    for s in shards:
        def drop(ts):
            for k in [k for k in ts if k.startswith(p)]:
                ws[k] = ts.pop(k)
            return ts
        rewrite(d / s, drop)
    E = cfg.n_experts
    gate_up = torch.stack([torch.cat([ws[f"{p}{e}.w1.weight"], ws[f"{p}{e}.w3.weight"]]) for e in range(E)])
    down = torch.stack([ws[f"{p}{e}.w2.weight"] for e in range(E)])
    if damage == "experts":
        gate_up = gate_up[:-1].contiguous()
    elif damage == "rows":
        gate_up = gate_up[:, :-1].contiguous()
    stacked = {f"layers.{layer}.mlp.experts.gate_up_proj": gate_up, f"layers.{layer}.mlp.experts.down_proj": down}
    write_file(d / "stacked.safetensors", stacked)
    wm = {k: v for k, v in wm.items() if not k.startswith(p)}
    wm.update({k: "stacked.safetensors" for k in stacked})
    write_index(d, wm)
    return ws


def test_stacked_hf_experts_control_and_damage(tiny_ckpt, tmp_path):
    cfg = preset("tiny")
    d = copy(tiny_ckpt, tmp_path / "good")
    ws = stack_experts(d, 2, cfg)
    with Checkpoint.open(d) as ck:  # the control: stacked experts load as the same tensors
        ck.validate()
        assert torch.equal(ck.dense("layers.2.ffn.experts.5.w3.weight"), ws["layers.2.ffn.experts.5.w3.weight"])
    for damage, needle in (("experts", "one slice per expert"), ("rows", "gate and up rows")):
        d = copy(tiny_ckpt, tmp_path / damage)
        stack_experts(d, 2, cfg, damage)
        with pytest.raises(CheckpointError, match=needle) as e:
            Checkpoint.open(d)
        assert "gate_up_proj" in str(e.value)
        each_command(d, "gate_up_proj")


def header_file(path, header: bytes, data: bytes):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("meta", ["[]", "null", "0", '""', '{"a": 1}', '{"a": null}'])
def test_non_object_metadata(tmp_path, meta):
    p = tmp_path / "m.safetensors"
    header_file(p, ('{"__metadata__": %s, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
                    % meta).encode(), b"\0" * 4)
    with pytest.raises(CheckpointError, match="__metadata__"):
        SafetensorsFile(p)


def test_duplicate_tensor_names_in_one_header(tiny_ckpt, tmp_path):
    ent = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    p = tmp_path / "dup.safetensors"
    header_file(p, f'{{"t": {ent}, "t": {ent}}}'.encode(), b"\0" * 4)
    with pytest.raises(CheckpointError, match="'t' twice"):
        SafetensorsFile(p)
    # in a real checkpoint, through every command
    d = copy(tiny_ckpt, tmp_path / "ck")
    shard = shard_of(d, "norm.weight")
    raw = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8: 8 + hlen])
    entry = json.dumps(head["norm.weight"], separators=(",", ":"))
    text = raw[8: 8 + hlen].decode().rstrip()
    assert text.endswith("}")
    text = text[:-1] + f',"norm.weight":{entry}}}'
    text += " " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + hlen:])
    each_command(d, "'norm.weight' twice")


# ---- non-finite weights ------------------------------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_weights_refused_when_read(tiny_ckpt, tmp_path, value):
    d = copy(tiny_ckpt, tmp_path / "ck")
    name = "layers.3.attn.wo_b.weight"

    def change(ts):
        t = ts[name].clone()
        t[5, 7] = value
        return {**ts, name: t}

    rewrite(shard_of(d, name), change)
    with Checkpoint.open(d) as ck:
        ck.validate()  # headers are fine
        with pytest.raises(CheckpointError, match="non-finite") as e:
            ck.dense(name)
        assert name in str(e.value) and "[5, 7]" in str(e.value)
    with pytest.raises(CheckpointError, match=name):
        ReferenceModel.from_pretrained(d)
    cli_error("generate", str(d), "--ids", "1,2", "--max-new-tokens", "1", needles=(name, "--allow-nonfinite"))
    rc, out, err = run_main("generate", str(d), "--ids", "1,2", "--max-new-tokens", "1", "--allow-nonfinite")
    assert rc == 0, err


def test_e8m0_nan_scale_and_fp8_nan_refused(tiny_quant_ckpt, tmp_path):
    d = copy(tiny_quant_ckpt, tmp_path / "ck")
    scale = "layers.2.attn.wq_b.scale"
    weight = "layers.4.attn.wo_a.weight"

    def change(ts):
        s = ts[scale].view(torch.uint8).clone()
        s.view(-1)[0] = 255
        w = ts[weight].view(torch.uint8).clone()
        w[3, 3] = 0x7F  # e4m3fn NaN
        return {**ts, scale: s.view(torch.float8_e8m0fnu), weight: w.view(torch.float8_e4m3fn)}

    for n in (scale, weight):
        path = shard_of(d, n)
        rewrite(path, lambda ts: change(ts) if scale in ts and weight in ts else ts)
    with Checkpoint.open(d) as ck:
        ck.validate()
        with pytest.raises(CheckpointError, match="0xFF"):
            ck.dense("layers.2.attn.wq_b.weight")
        with pytest.raises(CheckpointError, match="NaN or Inf"):
            ck.raw(weight)
    cli_error("generate", str(d), "--ids", "1", "--max-new-tokens", "1", needles=("non-finite",))


def test_writer_refuses_nonfinite_values(tmp_path):
    cfg = preset("tiny")
    src = random_source(cfg, 0)

    def poisoned(spec):
        t = src(spec)
        if spec.name == "layers.0.attn.wq_a.weight":
            t = t.clone()
            t[0, 0] = math.nan
        return t

    with pytest.raises(CheckpointError, match="layers.0.attn.wq_a.weight"):
        write_checkpoint(tmp_path / "out", cfg, poisoned)
    assert list(tmp_path.iterdir()) == []
