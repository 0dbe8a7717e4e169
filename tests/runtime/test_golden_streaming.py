"""The streaming golden (issue 35 item 2): one decoder layer's weights resident at a time, read from the checkpoint
as the reference reaches the layer, gives the in-memory golden bit for bit (tiny-pro as released: FP8 / FP4
weights, both numerics modes)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from v4compile import frontend, golden
from v4compile.config import preset
from v4compile.model.reference import StreamedWeights
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pro_ckpt(tmp_path_factory):
    from v4compile.init_random import init_random

    return init_random(tmp_path_factory.mktemp("ckp") / "tiny-pro-q", preset("tiny-pro"), seed=0, quantized=True)


def _same(a, b) -> bool:
    return a.facts["ids"] == b.facts["ids"] and all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


@pytest.mark.parametrize("numerics", ["hf", "official"])
def test_the_streaming_golden_is_the_in_memory_one_bit_for_bit(pro_ckpt, numerics, monkeypatch):
    fe = frontend.load(str(pro_ckpt), None, None, TraceOptions(numerics=numerics, dtype="fp32", capacity=64))
    ref = fe.reference()
    whole = golden.make_golden(ref, numerics, "fp32", (16,), 64, candidates=1)
    loads = []
    model = fe.reference(streaming=True, on_load=lambda i, n: loads.append(i))
    streamed = golden.make_golden(model, numerics, "fp32", (16,), 64, candidates=1)
    assert isinstance(model.weights, StreamedWeights) and _same(whole, streamed)
    # every model step reads the layers in order, each once: the checkpoint read once per step
    steps = golden.model_steps(golden.plan(fe.cfg, (16,), 64), (16,))
    assert loads == list(range(fe.cfg.n_layers)) * steps
    # at most one layer resident: the rest (embedding, head) plus the largest layer
    rest = sum(t.numel() * t.element_size() for t in model.weights.rest.values())
    assert model.weights.resident_bytes() <= rest + model.weights.largest
    assert rest + model.weights.largest < sum(t.numel() * t.element_size() for t in ref.weights.values()) / 2
    if numerics == "hf":  # the broken variant: layer 4 streamed with layer 2's weights (both CSA) is caught
        real = StreamedWeights.__getitem__

        def shifted(self, name):
            if name.startswith("layers.4."):
                name = "layers.2." + name[len("layers.4."):]
            return real(self, name)

        monkeypatch.setattr(StreamedWeights, "__getitem__", shifted)
        bad = golden.make_golden(fe.reference(streaming=True), numerics, "fp32", (16,), 64, candidates=1, new_tokens=2)
        assert not _same(golden.make_golden(ref, numerics, "fp32", (16,), 64, candidates=1, new_tokens=2), bad)


def test_the_streaming_progress_states_the_reads_and_the_time_left(caplog):
    from v4compile.cli.driver import GoldenProgress

    log = logging.getLogger("v4compile.test")
    p = GoldenProgress(log, 5)
    with caplog.at_level(logging.INFO, logger="v4compile.test"):
        p.expect(20)
        for k in range(1, 101):
            p(k % 5, k)
    lines = [r.getMessage() for r in caplog.records]
    assert "100 layer reads" in lines[0] and len(lines) == 12 and all("s left" in ln for ln in lines[1:])
    assert "layer read 100 of 100" in lines[-1] and "about 0.0 s left" in lines[-1]


def test_the_golden_knobs_are_typed_flags(capsys):
    """`--golden-streaming` (default None: by the weights' size against this machine's memory) and
    `--golden-new-tokens` (1..64; out of range: one error line, exit 2)."""
    from v4compile.cli import build_parser, main

    p = build_parser()
    assert p.parse_args(["compile", "-o", "x"]).golden_streaming is None
    assert p.parse_args(["compile", "-o", "x", "--golden-streaming"]).golden_streaming is True
    assert p.parse_args(["compile", "-o", "x", "--no-golden-streaming"]).golden_streaming is False
    assert p.parse_args(["compile", "-o", "x", "--golden-new-tokens", "3"]).golden_new_tokens == 3
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse's refusal
        main(["compile", "-o", "x", "--golden-new-tokens", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--golden-new-tokens" in err and "Traceback" not in err
