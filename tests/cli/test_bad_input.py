"""Bad input: one clear error each, from the API (a V4Error) and from the CLI (exit 2, no traceback)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from bad_input_util import cli_in_process
from conftest import make_model
from v4compile.config import V4Config, preset
from v4compile.errors import ConfigError, InputError


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """In-process (`bad_input_util.cli_in_process`): the exit status and stderr are the user's view, the same
    from `main` as from a fresh interpreter (an exception escaping main, the traceback case, fails the test);
    the start-up (~3 s a command) checks nothing here. The CLI in a fresh process: tests/cli/test_cli.py."""
    return cli_in_process(*args, timeout=300)


def assert_clean_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_unknown_model_type(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        V4Config.from_dict({**preset("tiny").to_hf(), "model_type": "llama"})
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**preset("tiny").to_official(), "model_type": "llama"}))
    assert_clean_error(run_cli("generate", str(d), "--ids", "1,2"), "model_type", "deepseek_v4", "llama")


def test_layer_types_length_mismatch():
    d = preset("tiny").to_hf()
    d["layer_types"] = d["layer_types"][:-1]
    with pytest.raises(ConfigError, match="layer kind list length") as e:
        V4Config.from_dict(d)
    assert "expected 5" in str(e.value) and "found 4" in str(e.value)


def test_topk_larger_than_expert_count():
    d = preset("tiny").to_official()
    d["n_activated_experts"] = d["n_routed_experts"] + 1
    with pytest.raises(ConfigError, match="exceeds the expert count"):
        V4Config.from_dict(d)


def test_ids_out_of_vocab():
    model = make_model("tiny")
    with pytest.raises(InputError, match="vocabulary"):
        model.forward(torch.tensor([1, 512]))
    with pytest.raises(InputError, match="vocabulary"):
        model.generate([-1, 3], 2)
    assert_clean_error(run_cli("generate", "--ids", "0,5,512"), "vocabulary", "512")


def test_empty_prompt():
    model = make_model("tiny")
    with pytest.raises(InputError, match="empty prompt"):
        model.forward(torch.tensor([], dtype=torch.long))
    with pytest.raises(InputError, match="empty prompt"):
        model.prefill([[1, 2], []])
    assert_clean_error(run_cli("generate", "--ids", ""), "empty prompt")


def test_context_beyond_max_position():
    model = make_model("tiny")
    with pytest.raises(InputError, match="maximum position"):
        model.generate([1, 2, 3], 4094)
    assert_clean_error(run_cli("generate", "--ids", "1,2,3", "--max-new-tokens", "5000"), "maximum position", "4096")


def test_cache_overflow():
    model = make_model("tiny")
    cache, _ = model.prefill([[1, 2, 3]], capacity=4)
    model.decode([4], cache)
    with pytest.raises(InputError, match="cache is full"):
        model.decode([5], cache)


def test_cli_rejects_bad_ids_text():
    assert_clean_error(run_cli("generate", "--ids", "1,x"), "--ids")
