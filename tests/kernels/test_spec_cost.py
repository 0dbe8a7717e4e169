"""The modeled verify step (`codegen/spec_cost.py`): what it counts, and the gain arithmetic."""

from __future__ import annotations

import pytest

from v4compile.codegen import spec_cost
from v4compile.codegen.spec_cost import function_us, render, step_gain, tokens_per_step, verify_models
from v4compile.config import preset
from v4compile.errors import InputError
from v4compile.trace import TraceOptions
from v4compile.trace_verify import trace_verify


@pytest.fixture(scope="module")
def traced():
    return {k: trace_verify(preset("tiny"), k, TraceOptions(decode_batch=1, weights="released", dtype="bf16"))
            for k in (1, 3)}


def test_tokens_per_step():
    assert tokens_per_step([]) == 1.0
    assert tokens_per_step([0.5, 0.5]) == pytest.approx(1.75)
    assert tokens_per_step([1.0] * 3) == 4.0


def test_verify_reads_the_mtp_block_and_costs_more_with_more_drafts(traced):
    ver = traced[3].functions["verify"]
    shapes = {n: tuple(v.type.shape) for n, v in ver.outputs}
    assert shapes["logits"] == (1, 4, 512)  # every lane's logits
    assert [shapes[f"draft_logits.{j}"] for j in range(3)] == [(1, 512)] * 3  # one per draft
    assert "cache.layers.5.win" in shapes  # the MTP block's own ring
    mtp_weights = sum(v.type.nbytes for n, v in traced[1].weights.items() if n.startswith("mtp."))
    assert mtp_weights > 0
    _, dec, _ = function_us(traced[1].functions["decode"], "sm_90a")
    _, ver1, _ = function_us(traced[1].functions["verify"], "sm_90a")
    _, ver3, _ = function_us(traced[3].functions["verify"], "sm_90a")
    assert ver1 - dec >= mtp_weights  # the block's own weights at least
    assert ver3 > ver1


def test_gain_is_tokens_per_step_over_the_cost_ratio(traced):
    m = step_gain(traced[3], 3, "gfx950", 1, [1.0, 1.0, 1.0])
    assert m["gain_measured"]["tokens_per_step"] == 4.0
    assert m["gain_measured"]["tokens_s_gain"] == pytest.approx(4 / m["cost_ratio"], rel=1e-2)
    assert m["gain_v3_85%"]["tokens_per_step"] == pytest.approx(1 + 0.85 + 0.85 ** 2 + 0.85 ** 3, abs=1e-3)
    assert "k=3" in render(m) and "measured acceptance 1.00/1.00/1.00" in render(m)


def test_both_targets_and_the_refusals(monkeypatch):
    out = verify_models(preset("tiny"), (1,), ("sm_90a", "gfx950"), rates={1: [0.5]})
    assert [m["draft_tokens"] for ms in out.values() for m in ms] == [1, 1]
    assert out["gfx950"][0]["gain_measured"]["acceptance"] == [0.5]
    with pytest.raises(InputError, match="draft_tokens"):
        trace_verify(preset("tiny"), 0)
    assert spec_cost.V3_ACCEPTANCE == 0.85


def test_gain_by_batch_beside_the_measured_figure(monkeypatch):
    """The report's sweep: a modeled gain per batch 1, 4, 8, 32 (tokens per step over that batch's cost ratio)
    labelled "modeled", then ATOM's V4-Pro MTP-3 figure labelled "measured" (19.66 / 7.25 = 2.71x); a gain
    that forgets the acceptance is caught."""
    def sweep():
        rep = spec_cost.by_batch(preset("tiny"), 3, ("gfx950",), rates=[0.9, 0.8, 0.7])
        return rep, "\n".join(spec_cost.render_by_batch(rep, "tiny"))
    rep, text = sweep()
    ms = rep["models"]["gfx950"]
    assert [m["batch"] for m in ms] == [1, 4, 8, 32]
    want = tokens_per_step([0.9, 0.8, 0.7])
    assert all(m["gain_measured"]["tokens_s_gain"] == pytest.approx(want / m["cost_ratio"], rel=1e-2) for m in ms)
    assert "modeled tiny MTP-3 gain by batch" in text and "batch 32" in text
    assert "measured (AMD ATOM, 8x MI355X, DeepSeek-V4-Pro" in text and "19.66 -> 7.25" in text and "2.71x" in text
    monkeypatch.setattr(spec_cost, "tokens_per_step", lambda rates: 1.0)
    rep, _ = sweep()
    assert not all(m["gain_measured"]["tokens_s_gain"] == pytest.approx(want / m["cost_ratio"], rel=1e-2)
                   for m in rep["models"]["gfx950"])
