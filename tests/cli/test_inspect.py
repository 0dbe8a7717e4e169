"""`v4compile inspect`: the seed's accounting of V4-Pro (section 4), to its printed precision."""

from __future__ import annotations

import json

import pytest

from v4compile.accounting import account, render
from v4compile.checkpoint import Checkpoint
from v4compile.config import preset
from v4compile.init_random import init_random

PRO_FIGURES = [
    "1598.84 B", "activated per token     49.78 B", "routed_experts        24.18 B", "attention             19.47 B",
    "shared_experts        4.03 B", "embed_head            1.85 B", "gate                  0.17 B",
    "mhc                   0.08 B", "805.32 GiB", "145,116",
    "BF16 main 7928", "FP8 main 4955", "index FP4 510 / FP8 990", "5465 B/token, 5.09 GiB",
    "7808 rows = 4.77 MiB FP8 / 7.63 MiB BF16", "17.8 MiB", "HCA 15.5 MiB", "envelope 1982 rows",
]
PRO_ROWS = [  # category, params, share, disk (seed table)
    ("routed_experts", "1547.40 B", "96.78%", "765.60 GiB"), ("mtp", "25.84 B", "1.62%", "13.00 GiB"),
    ("attention", "18.29 B", "1.14%", "17.04 GiB"), ("shared_experts", "4.03 B", "0.25%", "3.75 GiB"),
    ("embed_head", "1.85 B", "0.12%", "3.45 GiB"), ("compressor", "0.67 B", "0.04%", "1.25 GiB"),
    ("indexer", "0.50 B", "0.03%", "0.58 GiB"), ("gate", "0.17 B", "0.01%", "0.31 GiB"),
    ("mhc", "0.08 B", "0.01%", "0.31 GiB"), ("hash", "0.00 B", "0.00%", "0.02 GiB"),
]


def test_v4_pro_text():
    cfg = preset("v4-pro")
    text = render(cfg, account(cfg))
    for fig in PRO_FIGURES:
        assert fig in text, fig
    table = text.split("  category")[1]
    for row in PRO_ROWS:
        line = next(ln for ln in table.splitlines() if ln.strip().startswith(row[0] + " "))
        assert line.split() == [row[0], *row[1].split(), row[2], *row[3].split()], line


def test_v4_pro_json_via_cli():
    from bad_input_util import cli_in_process  # the output is the point, not a fresh interpreter's start-up

    r = cli_in_process("inspect", "--preset", "v4-pro", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    for key in ("logical_params", "activated_params", "disk_bytes", "n_tensors", "kv_bytes_per_token", "categories"):
        assert key in j
    assert round(j["logical_params"] / 1e9, 2) == 1598.84
    assert round(j["activated_params"] / 1e9, 2) == 49.78
    assert j["n_tensors"] == 145116
    assert round(j["disk_bytes"] / 2 ** 30, 2) == 805.32
    assert round(j["kv_bytes_per_token"]["fp8+fp4"]) == 5465
    assert round(j["kv_bytes_per_token"]["bf16"]) == 7928
    assert j["categories"]["routed_experts"]["params"] == 384 * 61 * 3 * 3072 * 7168


def test_v4_flash_table():
    cfg = preset("v4-flash")
    a = account(cfg)
    assert a.n_tensors == 6 + 43 * (13 + 8 + 2 + 256 * 6 + 6) + 21 * 11 + 20 * 4 + (13 + 8 + 2 + 256 * 6 + 6 + 10)
    text = render(cfg, a)
    assert "v4-flash" in text and "43 (20 HCA, 21 CSA, 2 SWA)" in text


@pytest.mark.parametrize("quantized", [False, True])
def test_inspect_checkpoint_headers_match_config(tmp_path, quantized):
    cfg = preset("tiny")
    out = init_random(tmp_path / "ck", cfg, quantized=quantized)
    with Checkpoint.open(out) as ck:
        a = account(ck.cfg, ck.header_specs())
        stored = sum(e.info.nbytes for e in ck.entries.values())
        n_stored = len(ck.entries)
    b = account(cfg)
    assert a.logical_params == b.logical_params and a.n_tensors == n_stored
    if quantized:  # the released formats: exactly what the config-only accounting predicts
        assert a.disk_bytes == b.disk_bytes and a.n_tensors == b.n_tensors
    assert a.disk_bytes == stored
    # The files hold exactly that many data bytes (+ headers).
    files = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert a.disk_bytes < files < a.disk_bytes + 200_000
