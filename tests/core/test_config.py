"""V4Config from both layouts, presets, and validation errors."""

from __future__ import annotations

import json

import pytest

from v4compile.config import CSA, HCA, PRESETS, SWA, V4Config, preset
from v4compile.errors import ConfigError


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_layout_round_trips(name):
    cfg = preset(name)
    assert V4Config.from_official(json.loads(json.dumps(cfg.to_official())), name=name) == cfg
    assert V4Config.from_hf(json.loads(json.dumps(cfg.to_hf())), name=name) == cfg


def test_released_schedules():
    pro, flash = preset("v4-pro"), preset("v4-flash")
    assert pro.compress_ratios == [128, 128] + [4, 128] * 29 + [4] + [0]
    assert flash.compress_ratios == [0, 0] + [4, 128] * 20 + [4] + [0]
    assert (pro.count(HCA), pro.count(CSA), pro.count(SWA)) == (31, 30, 0)
    assert (flash.count(HCA), flash.count(CSA), flash.count(SWA)) == (20, 21, 2)
    assert [pro.is_hash(i) for i in range(4)] == [True, True, True, False]


def test_hf_hub_config_with_official_field_names():
    """The hub's config.json keeps `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`."""
    cfg = preset("v4-flash")
    d = {k: v for k, v in cfg.to_hf().items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                           "rope_parameters")}
    d.update(compress_ratios=cfg.compress_ratios, num_hash_layers=3, qk_rope_head_dim=64,
             rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                           "beta_fast": 32, "beta_slow": 1})
    assert V4Config.from_dict(d, name="v4-flash") == cfg


def test_from_dir_finds_official_inference_config(tmp_path):
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "config.json").write_text(preset("tiny").to_json())
    assert V4Config.from_dir(tmp_path) == preset("tiny")


@pytest.mark.parametrize("change, needle", [
    ({"n_layers": 0}, "n_layers"),
    ({"compress_ratios": [0, 16, 4, 16]}, "compress_ratios"),
    ({"n_activated_experts": 9}, "exceeds the expert count"),
    ({"n_hash_layers": 9}, "n_hash_layers"),
    ({"n_heads": 3}, "o_groups"),
    ({"rope_head_dim": 15}, "rope_dim"),
    ({"score_func": "softmax"}, "sqrtsoftplus"),
    ({"dim": "64"}, "integer"),
    ({"compress_ratios": [0, 4, 16, 8, 4, 0]}, "at most two distinct"),
])
def test_invalid_official_configs(change, needle):
    d = {**preset("tiny").to_official(), **change}
    with pytest.raises(ConfigError) as e:
        V4Config.from_dict(d)
    assert needle in str(e.value)


def test_missing_field_and_bad_json(tmp_path):
    d = preset("tiny").to_official()
    del d["n_heads"]
    with pytest.raises(ConfigError, match="missing required field `n_heads`"):
        V4Config.from_official(d)
    f = tmp_path / "config.json"
    f.write_text('{"dim": 64,\n "n_layers": }')
    with pytest.raises(ConfigError, match="line 2 column"):
        V4Config.from_file(f)
    with pytest.raises(ConfigError, match="no config.json"):
        V4Config.from_dir(tmp_path / "nowhere")


def test_hf_config_without_schedule_is_rejected():
    d = preset("tiny").to_hf()
    del d["layer_types"]
    with pytest.raises(ConfigError, match="neither `layer_types` nor `compress_ratios`"):
        V4Config.from_dict(d)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("v5")
