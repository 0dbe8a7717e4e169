"""The IR: tracing, text round trip, verifier, interpreter against the reference model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import dense_weights, make_model
from v4compile.checkpoint import Checkpoint
from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.harness import IRRunner, Scenario, ir_logits, max_error, reference_logits
from v4compile.init_random import init_random
from v4compile.ir.core import Module
from v4compile.ir.text import parse_module, print_module
from v4compile.ir.verify import verify
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource, load_ir_weights

PRO = TraceOptions(batch=1, chunk=512, decode_batch=64, capacity=1 << 20, weights="released", dtype="bf16")


@pytest.fixture(scope="module")
def pro():
    return trace(preset("v4-pro"), PRO)


def roundtrip(m: Module) -> Module:
    verify(m)
    text = print_module(m)
    back = verify(parse_module(text))
    assert back.same_as(m)
    assert print_module(back) == text
    return back


@pytest.mark.parametrize("name, opts", [
    ("tiny", TraceOptions()), ("tiny-pro", TraceOptions(numerics="official", dtype="bf16")),
    ("tiny", TraceOptions(weights="released", batch=3, chunk=7, decode_batch=5)),
    ("v4-flash", TraceOptions(weights="released", capacity=4096, chunk=64)),
])
def test_trace_verifies_and_round_trips(name, opts):
    roundtrip(trace(preset(name), opts))


def test_v4_pro_shape_only_trace(pro):
    roundtrip(pro)
    dec = pro.functions["decode"]
    per_layer = Counter(op.loc.split(".")[1] for op in dec.ops if op.loc.startswith("layers."))
    assert len(per_layer) == 61 and max(per_layer.values()) <= 40  # a few dozen V4-level ops per layer
    assert dec.output("logits").type.shape == (64, 129280)
    w = pro.weights
    assert w["layers.3.ffn.experts.w1"].type.dtype == "fp4x2" and w["layers.3.ffn.experts.w1"].type.shape == (384, 3072, 3584)
    assert w["layers.3.ffn.experts.w1.scale"].type.shape == (384, 3072, 224)
    assert w["layers.3.attn.wq_a.weight"].type.dtype == "fp8e4m3"
    assert w["layers.3.attn.wq_a.scale"].type.shape == (12, 56)
    assert w["layers.3.ffn.experts.w1"].sources == ("layers.3.ffn.experts.{0..383}.w1.weight",)
    ops = Counter(op.name for op in dec.ops)
    assert ops["attention"] == 61 and ops["indexer_scores"] == 30 and ops["compress"] == 31 + 60
    # Provenance names the module each op came from.
    assert {op.loc for op in dec.ops if op.name == "topk"} == {f"layers.{i}.attn.indexer" for i in range(2, 61, 2)}


def test_interpreter_reproduces_the_reference_model():
    """Traced prefill (ragged batch, chunked) + 32 decode steps, caches carried, vs ReferenceModel."""
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(batch=3, chunk=16, decode_batch=3, capacity=160))
    sc = Scenario.make(cfg.vocab_size, 3, 100, 32, seed=1)
    expected = reference_logits(make_model("tiny"), sc, 16)
    got = ir_logits(IRRunner(m, load_ir_weights(m, DenseSource(dense_weights("tiny")))), sc)
    assert len(got) == 33
    assert max_error(expected, got) < 1e-5  # fp32 rounding level (logit scale ~1)
    assert max(float(t.abs().max()) for t in got) > 1


def test_interpreter_with_quantized_weights(tmp_path):
    """Released formats in the IR (FP8 / FP4 + E8M0 scales, dequantised inside the ops) equal the
    reference model that dequantised the same checkpoint at load time."""
    from v4compile import frontend
    from v4compile.model import ReferenceModel

    out = init_random(tmp_path / "q", preset("tiny-pro"), seed=2, quantized=True)
    fe = frontend.load(str(out), None, None, TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=140))
    m = fe.module
    assert m.weights["layers.2.ffn.experts.w2"].type.dtype == "fp4x2"
    assert m.weights["layers.2.attn.wo_b.weight"].type.dtype == "fp8e4m3"
    sc = Scenario.make(512, 2, 90, 32, seed=3)
    with Checkpoint.open(out) as ck:
        got = ir_logits(IRRunner(m, load_ir_weights(m, ck)), sc)
    expected = reference_logits(ReferenceModel.from_pretrained(out), sc, 16)
    assert max_error(expected, got) < 1e-5


def test_interpreter_rejects_wrong_tensors():
    m = trace(preset("tiny"), TraceOptions(batch=1, chunk=4, decode_batch=1, capacity=32))
    runner = IRRunner(m, load_ir_weights(m, DenseSource(dense_weights("tiny"))))
    with pytest.raises(IRError, match="does not match its IR type"):
        runner.call("decode", torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.long))


# ---- text errors -------------------------------------------------------------------------------

GOOD = """module @t
weight @w : fp32[4,4] from "w"
func @f(%x : fp32[1,4]) {
  %0 = linear(%x, @w, none) : fp32[1,4]
  %1 = rms_norm(%0, none) {eps = 1e-6} : fp32[1,4]
  return y = %1
}
"""


@pytest.mark.parametrize("bad, needle, where", [
    (GOOD.replace("linear(", "lineer("), "unknown op 'lineer'", "line 4:"),
    (GOOD.replace("{eps = 1e-6}", "{eps = 1e-6, beta = 2}"), "unknown attribute 'beta'", "line 5:"),
    (GOOD.replace("{eps = 1e-6}", "{eps = \"x\"}"), "attribute 'eps' of op 'rms_norm' must be float", "line 5:"),
    (GOOD.replace("{eps = 1e-6}", ""), "missing attribute 'eps'", "line 5:"),
    (GOOD.replace("rms_norm(%0,", "rms_norm(%7,"), "use of undefined value %7", "line 5:17"),
    (GOOD.replace("@w, none", "@q, none"), "unknown weight @q", "line 4:"),
    (GOOD.replace("fp32[1,4]\n  %1", "fp33[1,4]\n  %1"), "unknown dtype 'fp33'", "line 4:"),
    (GOOD.replace(": fp32[1,4]\n  %1", "\n  %1"), "expected ':'", "line 5:"),
    (GOOD.replace("  return y = %1\n", ""), "must end with 'return", "line 6:1"),
    (GOOD.replace("%1 = rms_norm", "%0 = rms_norm"), "value %0 defined twice", "line 5:"),
    (GOOD.replace("(%0, none)", "(%0)"), "takes 2 operands", "line 5:"),
    (GOOD + "$", "unexpected character '$'", "line 8:1"),
])
def test_parse_errors_name_line_and_column(bad, needle, where):
    with pytest.raises(IRError) as e:
        parse_module(bad)
    assert needle in str(e.value) and where in str(e.value), str(e.value)


@pytest.mark.parametrize("bad, needle", [
    (GOOD.replace(": fp32[1,4]\n  %1", ": fp32[1,5]\n  %1"), "result types do not match"),
    (GOOD.replace("weight @w : fp32[4,4]", "weight @w : fp32[4,3]"), "linear input width does not match the weight"),
    (GOOD.replace("weight @w : fp32[4,4]", "weight @w : i64[4,4]"), "unsupported weight dtype"),
])
def test_verifier_errors(bad, needle):
    m = parse_module(bad)
    with pytest.raises(IRError, match=needle) as e:
        verify(m)
    assert "@f op #" in str(e.value)


def test_verifier_catches_use_before_definition():
    m = parse_module(GOOD)
    fn = m.functions["f"]
    fn.ops.reverse()
    with pytest.raises(IRError, match="before its definition"):
        verify(m)
