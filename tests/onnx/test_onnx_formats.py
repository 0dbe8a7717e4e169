"""The cpu target on every checkpoint format (issue 22): a quantised checkpoint (`init-random --quantized`:
FP8 128x128 dense weights, FP4 1x32 experts, E8M0 scales) compiled with official numerics runs on ONNX
Runtime to `ReferenceModel(numerics="official")`'s greedy ids.

The runtime dequantises each FP8 / FP4 weight once at load with the reference's own function
(`codegen/onnx_weights.py`), so the weights are bit for bit the reference's; the FP8 activation rounding
(`formats.act_qdq`) is the same arithmetic in ONNX, and each GEMM op on the reference's own inputs gives
its output exactly (measured: 0 error). What is not exact is the fp32 arithmetic between the roundings
(reductions in attention, norms, mHC summed in another order than torch's: activations differ by a few
ulps), and where a quantiser's input lies within such a distance of an e4m3 rounding midpoint, it rounds
the other way. On this checkpoint that happens once: layer 2's `wo_b` input at prefill token 0, channel 26.

Why no lowering can round it like the reference (measured, issue 22): the midpoint is 0.12109375. The
exact (fp64) `wo_a` product of the reference's own input is 0.1210937456, 0.6 fp32 ulp below it; torch's
fp32 sum of that same product is 0.1210937053 (6 ulps below; ONNX Runtime's Gemm gives the same bits on
that input). The cpu graph's `wo_a` input differs from the reference's by up to 4.8e-7 (the upstream
reductions), which moves even the exact product to 0.1210938513, 14 ulps above the midpoint. So the
flip is decided upstream of the GEMM, by the fp32 summation order of every reduction since the embedding,
which torch does not specify (it follows its vectorisation and BLAS blocking); no summation order or
precision chosen for the quantiser's own GEMM changes it. The rounding goes on to move the tiny model's
logits by 1.6e-2 of their scale, the same greedy ids. So: ids identical, logits within 3e-2 of the scale;
without the FP8 activation rounding the error is >= 6e-2 (caught below). The issue's 1e-4 would need
torch's reduction order in every fp32 op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.cli.driver import compile_artifact
from v4compile.config import preset
from v4compile.init_random import init_random
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 16
TOL = 3e-2


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    import v4compile

    ck = init_random(tmp_path_factory.mktemp("ck") / "tiny", preset("tiny"), seed=1, quantized=True)
    fe = frontend.load(str(ck), None, None, TraceOptions(numerics="official", dtype="fp32", capacity=64))
    art = compile_artifact(fe, tmp_path_factory.mktemp("art") / "q", Buckets(decode=(1,), prefill=(16,)))
    return fe, art, v4compile.load(art, device="cpu", threads=1)


def _errors(fe, sess):
    """(ONNX Runtime's greedy ids, the reference's, teacher-forced logit error / logit scale)."""
    ref = fe.reference()
    prompt = torch.randint(0, fe.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    cache, r = ref.prefill([prompt], capacity=64)
    want, r_logits = [], [r[0].numpy()]
    for i in range(NEW):
        want.append(int(r_logits[-1].argmax()))
        if i < NEW - 1:
            r_logits.append(ref.decode([want[-1]], cache)[0].numpy())
    seqs, s = sess.prefill([prompt])
    s_logits = [s[0]] + [sess.decode(seqs, [tok])[0] for tok in want[:-1]]
    sess.release(seqs[0])
    got = sess.generate([prompt], NEW)[0]
    scale = max(float(np.abs(x).max()) for x in r_logits)
    return got, want, max(float(np.abs(a - b).max()) for a, b in zip(s_logits, r_logits)) / scale


def test_quantised_checkpoint_gives_the_official_ids(quantised):
    fe, art, sess = quantised
    m = sess.art.manifest
    spec = m["targets"][0]["functions"]["decode_b1"]
    kinds = {m["weights"]["tensors"][d["of"]]["dtype"] for d in spec["derived"].values() if d["scale"]}
    assert kinds == {"fp8e4m3", "fp4x2"}  # both released formats reach the graph, dequantised once
    got, want, err = _errors(fe, sess)
    assert len(set(want)) > 1 and got == want and err <= TOL, (got, want, err)


def test_missing_activation_rounding_is_caught(quantised, monkeypatch):
    """The same check fails on graphs that skip the FP8 activation rounding of the official GEMMs."""
    import v4compile
    from v4compile.codegen.onnx import quant

    fe, art, _ = quantised
    monkeypatch.setattr(quant, "act_qdq", lambda g, x, xt, block=128: x)
    bad = compile_artifact(fe, art.parent / "no-act", Buckets(decode=(1,), prefill=(16,)))
    got, want, err = _errors(fe, v4compile.load(bad, device="cpu", threads=1))
    assert err > 2 * TOL
