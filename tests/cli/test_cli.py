"""The CLI end to end: init-random, generate, inspect."""

from __future__ import annotations

import json
import subprocess
import sys


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "v4compile", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_generate_default_preset_json():
    j = json.loads(cli("generate", "--ids", "0,5,9", "--max-new-tokens", "16", "--json").stdout)
    assert j["model"] == "tiny" and j["prompt"] == [0, 5, 9] and len(j["generated"]) == 16
    assert all(0 <= t < 512 for t in j["generated"])


def test_checkpoint_generates_like_the_in_memory_preset(tmp_path):
    out = tmp_path / "tiny"
    assert cli("init-random", "--preset", "tiny", "-o", str(out), "--seed", "3").stdout.strip() == str(out)
    a = cli("generate", str(out), "--ids", "7,8,9,10", "--max-new-tokens", "12").stdout
    b = cli("generate", "--preset", "tiny", "--seed", "3", "--ids", "7,8,9,10", "--max-new-tokens", "12").stdout
    assert a == b
    c = cli("generate", "--preset", "tiny", "--seed", "4", "--ids", "7,8,9,10", "--max-new-tokens", "12").stdout
    assert c != a  # the seed matters
    r = cli("init-random", "--preset", "tiny", "-o", str(out), check=False)
    assert r.returncode == 2 and "not empty" in r.stderr


def test_quantized_checkpoint_and_inspect(tmp_path):
    out = tmp_path / "q"
    cli("init-random", "--preset", "tiny-pro", "-o", str(out), "--quantized")
    j = json.loads(cli("inspect", str(out), "--json").stdout)
    assert j["config"].endswith("config.json") and j["n_tensors"] > 500
    assert len(cli("generate", str(out), "--ids", "1,2,3", "--max-new-tokens", "3").stdout.strip().split(",")) == 3


def test_checkpoint_errors_exit_2(tmp_path):
    r = cli("generate", str(tmp_path / "nope"), "--ids", "1", check=False)
    assert r.returncode == 2 and "checkpoint not found" in r.stderr and "Traceback" not in r.stderr
    r = cli("generate", "x", "--preset", "tiny", "--ids", "1", check=False)
    assert r.returncode == 2 and "not both" in r.stderr


def test_init_random_from_a_config_file_and_single_file_checkpoint(tmp_path):
    from v4compile.config import preset
    from v4compile.model import ReferenceModel

    cfg = preset("tiny").replace(n_layers=3, layer_kinds=("hca", "csa", "swa"), n_hash_layers=1, name="custom")
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_hf()))
    out = tmp_path / "ck"
    cli("init-random", "--config", str(tmp_path / "c.json"), "-o", str(out))
    shard = next(out.glob("*.safetensors"))
    (out / "model.safetensors.index.json").unlink()
    model = ReferenceModel.from_pretrained(shard)  # a single file; config.json beside it
    assert model.cfg.n_layers == 3 and model.cfg.layer_kinds == ("hca", "csa", "swa")
    assert len(model.generate([1, 2, 3], 3)) == 3
