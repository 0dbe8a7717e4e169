"""Fuzz the config parser (both layouts): any JSON value anywhere gives a valid, bounded config or one
ConfigError; never another exception."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.config import LIMITS, MAX_INT, V4Config, preset
from v4compile.errors import ConfigError

json_leaf = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 300)
             | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
             | st.sampled_from(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                "hash_moe", "moe", "yarn", "fp8", "e4m3", "bf16", "fp4", "deepseek_v4"]))
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=4), max_leaves=16)
BASES = {"official": preset("tiny").to_official(), "hf": preset("tiny").to_hf(),
         "official-pro": preset("v4-pro").to_official(), "hf-flash": preset("v4-flash").to_hf()}


def check(d) -> None:
    try:
        cfg = V4Config.from_dict(d)
    except ConfigError:
        return
    cfg.validate()
    for f, hi in LIMITS.items():  # whatever is accepted is bounded
        assert 0 <= getattr(cfg, f) <= hi, f


@fuzz_settings(250)
@given(st.sampled_from(sorted(BASES)), st.lists(st.tuples(st.text(max_size=3) | st.sampled_from(
    sorted({k for b in BASES.values() for k in b})), json_values), min_size=1, max_size=4),
    st.lists(st.sampled_from(sorted({k for b in BASES.values() for k in b})), max_size=3))
def test_fuzz_config_fields(layout, changes, dropped):
    d = json.loads(json.dumps(BASES[layout]))
    for k, v in changes:
        d[k] = v
    for k in dropped:
        d.pop(k, None)
    check(d)


@fuzz_settings(100)
@given(st.sampled_from(sorted(BASES)), st.data())
def test_fuzz_config_nested(layout, data):
    """Change one entry inside a list or object value (schedules, rope parameters, quantization)."""
    d = json.loads(json.dumps(BASES[layout]))
    nested = sorted(k for k, v in d.items() if isinstance(v, (list, dict)) and v)
    k = data.draw(st.sampled_from(nested))
    if isinstance(d[k], list):
        d[k][data.draw(st.integers(0, len(d[k]) - 1))] = data.draw(json_values)
    else:
        d[k][data.draw(st.sampled_from(sorted(d[k])))] = data.draw(json_values)
    check(d)


@fuzz_settings(150)
@given(st.sampled_from(["official", "hf"]), st.binary(max_size=40), st.integers(0, 10 ** 6))
def test_fuzz_config_file_bytes(tmp_path, layout, junk, at):
    """Bytes spliced into a config file: one ConfigError naming the file, or a valid config."""
    raw = json.dumps(BASES[layout]).encode()
    at %= len(raw) + 1
    p = tmp_path / "config.json"
    p.write_bytes(raw[:at] + junk + raw[at:])
    try:
        cfg = V4Config.from_file(p)
    except ConfigError as e:
        assert str(p) in str(e)
        return
    assert abs(cfg.dim) <= MAX_INT
