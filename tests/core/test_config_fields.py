"""Every config key the parsers read (issue 42, item 4), from the layouts' own tables (`OFFICIAL_FIELDS`,
`HF_FIELDS`): a new key is covered as soon as it is in its table, and the parser reads no key outside it.

* a required key absent or `null`: one ConfigError naming it;
* a key with a default given as `null`: refused naming it, unless upstream types it optional (`HF_NULLABLE`),
  where `null` parses exactly as the key left out;
* each HF default is the one `transformers`' DeepseekV4Config documents (the oracle);
* `inspect` states every default it applied.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest

from bad_input_util import cli_error, run_main
from v4compile import config
from v4compile.config import HF_FIELDS, HF_NULLABLE, OFFICIAL_FIELDS, REQUIRED, YARN, Derived, V4Config, preset
from v4compile.errors import ConfigError

LAYOUTS = {"official": (OFFICIAL_FIELDS, frozenset()), "hf": (HF_FIELDS, HF_NULLABLE)}


def _base(layout: str) -> dict:
    cfg = preset("tiny")
    return json.loads(json.dumps(cfg.to_official() if layout == "official" else cfg.to_hf()))


def _path(key: str) -> list[str]:
    """Where a table key sits in tiny's config (the HF YaRN block: `rope_parameters`, as `to_hf` writes it)."""
    if key.startswith(YARN):
        return ["rope_parameters", key[len(YARN):]]
    return key.split(".")


def _shown(key: str) -> str:
    return ".".join(_path(key))


def _with(d: dict, key: str, value) -> dict:
    """`d` with `key` set to `value` (DROP: removed), its parent objects created as needed."""
    d = json.loads(json.dumps(d))
    *parents, last = _path(key)
    at = d
    for p in parents:
        at = at.setdefault(p, {})
    if value is DROP:
        at.pop(last, None)
    else:
        at[last] = value
    return d


DROP = object()


def _keys(pick) -> list:
    return [pytest.param(layout, key, id=f"{layout}:{key}") for layout, (fields, nullable) in LAYOUTS.items()
            for key, default in fields.items() if pick(default, key in nullable)]


def _parse(layout: str, d: dict) -> V4Config:
    return V4Config.from_official(d) if layout == "official" else V4Config.from_hf(d)


def _outcome(layout: str, d: dict):
    try:
        return _parse(layout, d)
    except ConfigError as e:
        return str(e)


# ---- required keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, key", _keys(lambda default, nullable: default is REQUIRED))
def test_a_required_key_left_out_or_null_is_refused_naming_it(layout, key):
    d = _base(layout)
    with pytest.raises(ConfigError, match=f"missing required field `{_shown(key)}`"):
        _parse(layout, _with(d, key, DROP))
    with pytest.raises(ConfigError, match=f"`{_shown(key)}` is null"):
        _parse(layout, _with(d, key, None))


# ---- keys with a default: null is no way to ask for it ---------------------------------------------

def _null_is_refused(layout: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"`{_shown(key)}` is null"):
        _parse(layout, _with(_base(layout), key, None))


@pytest.mark.parametrize("layout, key", _keys(lambda default, nullable: default is not REQUIRED and not nullable))
def test_null_for_a_key_with_a_default_is_refused_naming_it(layout, key):
    _null_is_refused(layout, key)


def test_null_read_as_absent_is_caught(monkeypatch):
    """The broken variant of the test above: the issue's case (`max_position_embeddings: null`, silently
    1048576) with the old reading planted (null = absent). `pytest.raises(ConfigError)` fails: it parses."""
    def old(self, key):
        self._table(key)
        return self.d.get(key)

    monkeypatch.setattr(config._Getter, "_present", old)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        _null_is_refused("hf", "max_position_embeddings")
    assert _parse("hf", _with(_base("hf"), "max_position_embeddings", None)).max_position == 1048576


@pytest.mark.parametrize("layout, key", _keys(lambda default, nullable: nullable))
def test_null_where_upstream_types_the_key_optional_is_the_key_left_out(layout, key):
    d = _base(layout)
    assert _outcome(layout, _with(d, key, None)) == _outcome(layout, _with(d, key, DROP))


def test_the_parser_reads_no_key_outside_its_table(monkeypatch):
    """A key read but missing from the table would escape every test above: the getter refuses it (the
    planted variant: `max_position_embeddings` dropped from the HF table)."""
    monkeypatch.delitem(HF_FIELDS, "max_position_embeddings")
    with pytest.raises(AssertionError, match="`max_position_embeddings` is read but not in its layout's table"):
        _parse("hf", _base("hf"))


# ---- the defaults: upstream's, and stated --------------------------------------------------------

def _upstream_default(key: str):
    """The default `transformers`' DeepseekV4Config (5.23) documents for an HF key."""
    from transformers import DeepseekV4Config

    if key.startswith("compress_rates."):
        return DeepseekV4Config.default_compress_rates[key.split(".", 1)[1]]
    if key.startswith(YARN):  # YaRN's optional parameters: what the rope code uses when a block leaves them out
        return _yarn_default(key[len(YARN):])
    if hasattr(DeepseekV4Config, "default_" + key):  # the ones it folds in at __post_init__
        return getattr(DeepseekV4Config, "default_" + key)
    return getattr(DeepseekV4Config(), key)


def _yarn_default(name: str) -> float:
    """The value of `name` for which an explicit block gives the same frequencies as a block without it."""
    import torch
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def freqs(extra: dict) -> torch.Tensor:
        cfg = DeepseekV4Config(rope_parameters={"rope_type": "yarn", "factor": 16.0,
                                                "original_max_position_embeddings": 65536, **extra})
        cfg.rope_parameters = cfg.rope_parameters["compress"]
        return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")[0]

    left_out = freqs({})
    found = [v for v in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0) if torch.equal(freqs({name: v}), left_out)]
    assert len(found) == 1, (name, found)
    return found[0]


SCALAR_DEFAULTS = [k for k, v in HF_FIELDS.items() if v is not REQUIRED and not isinstance(v, (Derived, dict))]


@pytest.mark.parametrize("key", SCALAR_DEFAULTS)
def test_each_hf_default_is_the_one_upstream_documents(key):
    assert HF_FIELDS[key] == _upstream_default(key)


def test_a_default_other_than_upstreams_is_caught(monkeypatch):
    """The broken variant of the test above: a default of our own (the 4096 positions of a small model)."""
    monkeypatch.setitem(HF_FIELDS, "max_position_embeddings", 4096)
    with pytest.raises(AssertionError, match="4096 == 1048576"):
        test_each_hf_default_is_the_one_upstream_documents("max_position_embeddings")


@pytest.fixture
def ckpt_without(tiny_ckpt, tmp_path):
    """tiny's checkpoint, its config without a few keys that have defaults (drawn with a seed)."""
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d)
    raw = json.loads((d / "config.json").read_text())
    # keys whose default is tiny's own value (the checkpoint's tensors stay right), and `max_seq_len` (tiny's
    # 4096 becomes the default's 1048576: nothing inspect counts depends on it)
    same = sorted(k for k, v in OFFICIAL_FIELDS.items() if not isinstance(v, Derived) and raw.get(k) == v)
    left_out = random.Random(4).sample(same, 2) + ["max_seq_len"]
    (d / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in left_out}))
    return d, {k: OFFICIAL_FIELDS[k] for k in left_out}


def _inspect_states(ckpt, left_out) -> None:
    rc, out, err = run_main("inspect", str(ckpt))
    assert rc == 0, err
    stated = [line for line in out.splitlines() if "defaults (left out of the config)" in line]
    assert len(stated) == 1 and all(f"{k} = {v}" in stated[0] for k, v in left_out.items()), out
    rc, out, err = run_main("inspect", str(ckpt), "--json")
    assert rc == 0 and json.loads(out)["defaults"] == left_out, err


@pytest.mark.parametrize("broken", [False, True], ids=["fixed", "broken-default-not-stated"])
def test_inspect_states_each_default_it_applied(ckpt_without, monkeypatch, broken):
    """Catches a default applied silently (the planted variant drops `V4Config.defaults`: `len(stated) == 1`
    fails)."""
    ckpt, left_out = ckpt_without
    if broken:
        real = V4Config.validate
        monkeypatch.setattr(V4Config, "validate", lambda self: dataclasses.replace(real(self), defaults=()))
        with pytest.raises(AssertionError, match="len"):
            _inspect_states(ckpt, left_out)
        return
    _inspect_states(ckpt, left_out)


@pytest.mark.parametrize("layout, key", [("official", "max_seq_len"), ("hf", "max_position_embeddings")])
def test_inspect_refuses_a_null_field_with_one_line(tiny_ckpt, tmp_path, layout, key):
    """The issue's case: exit 2, one `error:` line naming the key (the config is read before any tensor)."""
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d)
    (d / "config.json").write_text(json.dumps(_with(_base(layout), key, None)))
    cli_error("inspect", str(d), needles=(f"`{key}` is null", str(d / "config.json")))
