"""The report per layout (`codegen/layout_model.py`): V4-Pro's TP8/EP8 and DP8/EP8 figures against an
independent count from the checkpoint's tensor table, the issue's capacity claim read off the table, and
each figure shown to move when the fact it rests on is broken."""

from __future__ import annotations

import functools

import pytest

from v4compile.codegen import layout_model as lm
from v4compile.config import preset
from v4compile.weights import spec_table


@functools.cache
def pro():
    return preset("v4-pro")


@functools.cache
def specs():
    return spec_table(pro())


@functools.cache
def table():
    return lm.layout_table(pro(), ("gfx950", "sm_90a"), batch=8, calls_per_step=406)


def row(t, device, layout):
    return next(r for r in t["rows"] if r["device"] == device and r["layout"] == layout)


def test_per_rank_weights_and_fits_follow_the_layout():
    t = table()
    tp, dp = row(t, "MI355X", "TP8/EP8"), row(t, "MI355X", "DP8/EP8")
    # independent: the routed experts are 1/8 a rank either way; the rest differs by the TP-split attention
    # weights (7/8 of them are another rank's under TP, every rank's under DP)
    experts = sum(s.data_bytes for s in specs().values() if s.category == "routed_experts")
    assert tp["weights_per_rank"] > experts / 8 and dp["weights_per_rank"] > tp["weights_per_rank"]
    split = sum(s.data_bytes for n, s in specs().items() if any(k in n for k in lm.TP_SPLIT))
    assert dp["weights_per_rank"] - tp["weights_per_rank"] == pytest.approx(split * 7 / 8, rel=0.02)
    # the capacity rule: (HBM - weights - workspace) // per-sequence bytes, x 8 ranks under DP
    for r, ranks in ((tp, 1), (dp, 8)):
        for ctx in lm.CONTEXTS:
            free = 288e9 - r["weights_per_rank"] - lm.WORKSPACE_BYTES
            assert r["fits_sequences"][ctx] == int(free // r["kv_state_per_sequence"][ctx]) * ranks
    # the issue's goal, from the table: DP8/EP8 holds >= 7x TP8/EP8's sequences at 64k on 8x MI355X
    assert lm.fits_ratio(t, "gfx950", 65536) >= 7
    text = lm.render_layout_table(t)
    assert "DP8/EP8 fits 7.3x the concurrent sequences of TP8/EP8 at 64k on 8x MI355X" in text
    assert "modeled" in text and "measured (ATOM" in text and "4,290 tokens/s" in text


def test_step_and_tokens_follow_their_model():
    t = table()
    for r in t["rows"]:
        st = r["step"]
        assert st["step_us"] == pytest.approx(st["bandwidth_us"] + st["compute_us"] + st["launch_us"]
                                              + st["collectives_us"])
        assert st["collectives"]["count"] == 2 * pro().n_layers
        for conc, v in r["system"].items():
            assert v["tokens_s"] == pytest.approx(conc / (v["step_us"] * 1e-6))
            assert v["batch_per_rank"] == (conc if r["layout"] == "TP8/EP8" else -(-conc // 8))
    # TP: the all-reduce of b tokens, ring 2 (n-1)/n; DP: the gather of the group's 8 b tokens, (n-1)/n
    tp, dp = row(t, "MI355X", "TP8/EP8")["step"]["collectives"], row(t, "MI355X", "DP8/EP8")["step"]["collectives"]
    assert tp["moved_per_rank_each"] == 2 * 7 / 8 * 8 * pro().dim * 2
    assert dp["moved_per_rank_each"] == 7 / 8 * 64 * pro().dim * 2


def test_a_replicated_kv_under_dp_is_caught():
    """Counting DP's KV as TP's (every rank holding every sequence) loses the capacity claim."""
    import copy
    t = copy.deepcopy(table())
    for r in t["rows"]:
        if r["layout"] == "DP8/EP8":
            r["fits_sequences"] = {c: n // 8 for c, n in r["fits_sequences"].items()}
    assert lm.fits_ratio(table(), "gfx950", 65536) >= 7 > lm.fits_ratio(t, "gfx950", 65536)


def test_the_compiled_calls_stand_for_their_own_layout_alone():
    """Given the compiled program's calls for one layout, the other layout's row carries the bar (7 a layer + 5),
    named as not compiled; an int (legacy) stands for both."""
    t = lm.layout_table(pro(), ("gfx950",), batch=8, calls_per_step={"DP8/EP8": 450})
    dp, tp = row(t, "MI355X", "DP8/EP8")["step"], row(t, "MI355X", "TP8/EP8")["step"]
    assert (dp["calls"], dp["calls_source"]) == (450, "the compiled program")
    assert tp["calls"] == 7 * pro().n_layers + 5 and tp["calls_source"].startswith("not compiled here")
    assert row(table(), "MI355X", "TP8/EP8")["step"]["calls"] == row(table(), "MI355X", "DP8/EP8")["step"]["calls"] == 406


def test_the_moe_all_reduces_folded_into_their_launch_hide_behind_the_shared_expert():
    """The compiled TP8/EP8 program's routed experts' all-reduces (half of its 2 a layer) trail the MoE's launch
    (`passes/fuse_oneshot_producer.py`): each exposed only past the shared expert's bytes at the HBM roofline,
    max(0, its time - bytes / HBM); the wo_b ones and DP8/EP8's collectives as they were. Against the
    unhidden table, term by term."""
    from v4compile.targets import TARGETS

    shared = sum(s.data_bytes for s in specs().values() if s.category == "shared_experts") / pro().n_layers
    calls = {"TP8/EP8": 286}
    plain = lm.layout_table(pro(), ("gfx950", "sm_90a"), batch=8, calls_per_step=calls, oneshot=True)
    hidden = lm.layout_table(pro(), ("gfx950", "sm_90a"), batch=8, calls_per_step=calls, oneshot=True,
                             hidden_bytes=int(shared))
    for device, target in (("MI355X", "gfx950"), ("H200", "sm_90a")):
        a, b = row(plain, device, "TP8/EP8")["step"], row(hidden, device, "TP8/EP8")["step"]
        n, each = a["collectives"]["count"], a["collectives_us"] / a["collectives"]["count"]
        exposed = max(0.0, each - shared / TARGETS[target].hbm_bytes_s * 1e6)
        assert b["collectives_us"] == pytest.approx(n / 2 * (each + exposed)) and exposed < each
        assert "hidden behind the shared expert's" in b["collectives"]["what"]
        assert row(hidden, device, "DP8/EP8")["step"] == row(plain, device, "DP8/EP8")["step"]
