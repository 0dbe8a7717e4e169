"""bf16 artifacts on the cpu device (issue 22): a tiny model traced in bf16 (hf numerics) compiles for
`--target cpu` and runs on ONNX Runtime to `ReferenceModel`'s greedy ids in bf16.

The graphs compute in fp32 (ONNX Runtime's cpu kernels have no bf16 arithmetic): each bf16 weight is
upcast once at load (exact), and every value the IR holds in bf16 (an op's result, a pool row written) is
rounded to bf16 (to nearest even, as torch). Inside an op the arithmetic is fp32 where the reference's is
partly bf16, so logits differ by a few bf16 ulps. Measured (6 prompts x 16 teacher-forced steps): error /
logit scale median 1.2e-2, and 93 of 96 argmaxes agree (the other 3: top-2 logits within those ulps);
bf16's own step at the logit scale is 2^-7 ~ 7.8e-3 of it. So: greedy ids identical on this prompt up to
the reference's first near-tie (its top-2 logits closer than that one bf16 step: either id is within the
error, and which one comes out changed with the fp32 summation order of the Sinkhorn, issue 22), and the
median teacher-forced error within 3e-2 of the scale (a few ulps); a wrong upcast of the embedding table
is > 2x that (caught below). Measured too: the same graphs without the bf16 roundings (fp32 all
through) are as close (median 1.0e-2, 93 / 96): the roundings keep the IR's stored values, the reference's
in-op bf16 arithmetic is what the error is made of, and no tolerance here tells the two apart.

FP8 activation rounding of a bf16 activation and the "dtype" statistics of DeepSeek's norms (official
numerics) are refused at compile time with one error: the e4m3 grid's midpoints are bf16 values, so the
quantiser would flip on any last-bit difference from the reference's bf16 arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import v4compile
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.cli.driver import compile_artifact
from v4compile.errors import IRError
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 16
TOL = 3e-2
BUCKETS = Buckets(decode=(1,), prefill=(16,))


def _fe(numerics: str):
    return frontend.load(None, "tiny", "random", TraceOptions(numerics=numerics, dtype="bf16", capacity=64))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    fe = _fe("hf")
    art = compile_artifact(fe, tmp_path_factory.mktemp("art") / "bf16", BUCKETS)
    return fe, art


def _reference(fe):
    """(prompt, the reference's greedy ids, its logits at each step, its first near-tie step: top-2 logits
    within one bf16 step of the scale, or NEW) for the first seeded prompt whose first near-tie comes at step
    NEW // 4 or later with more than one id before it. Where the near-ties fall depends on the machine's
    bf16 arithmetic in torch: seed 0 tied at step 4 or later on the CPUs CI ran on before, at step 3 on a
    2-core AVX-512 EPYC (its AVX-512 and AVX2 kernels alike; seed 1 there: step 5, and 15 under the portable
    kernels), so the prompt is picked, not fixed, and the check below always compares at least NEW // 4
    steps clear of a near-tie."""
    ref = fe.reference()
    for seed in range(16):
        prompt = torch.randint(0, fe.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(seed)).tolist()
        cache, r = ref.prefill([prompt], capacity=64)
        want, r_logits = [], [r[0].float().numpy()]
        for i in range(NEW):
            want.append(int(r_logits[-1].argmax()))
            if i < NEW - 1:
                r_logits.append(ref.decode([want[-1]], cache)[0].float().numpy())
        scale = max(float(np.abs(x).max()) for x in r_logits)
        gaps = [float(np.diff(np.sort(x)[-2:])[0]) for x in r_logits]
        tie = next((i for i, d in enumerate(gaps) if d < 2.0 ** -7 * scale), NEW)
        if tie >= NEW // 4 and len(set(want[:tie])) > 1:
            return prompt, want, r_logits, tie
    raise AssertionError("no seeded prompt of 16 keeps the reference clear of near-ties for NEW // 4 steps")


def _errors(fe, sess):
    """(greedy ids, the reference's, median teacher-forced logit error / logit scale, the reference's first
    near-tie step)."""
    prompt, want, r_logits, tie = _reference(fe)
    seqs, s = sess.prefill([prompt])
    s_logits = [s[0]] + [sess.decode(seqs, [tok])[0] for tok in want[:-1]]
    sess.release(seqs[0])
    got = sess.generate([prompt], NEW)[0]
    scale = max(float(np.abs(x).max()) for x in r_logits)
    return got, want, float(np.median([np.abs(a - b).max() for a, b in zip(s_logits, r_logits)])) / scale, tie


def test_bf16_artifact_gives_the_reference_ids(bf16):
    fe, art = bf16
    sess = v4compile.load(art, device="cpu", threads=1)
    m = sess.art.manifest
    tensors = m["weights"]["tensors"]
    spec = m["targets"][0]["functions"]["decode_b1"]
    assert not [n for n in spec["weights"] if tensors[n]["dtype"] == "bf16"]  # none read as stored
    assert spec["derived"]["embed.weight#f32"]["of"] == "embed.weight"  # a table Gather reads: upcast too
    got, want, err, tie = _errors(fe, sess)
    assert tie >= NEW // 4 and len(set(want[:tie])) > 1, (want, tie)
    assert got[:tie] == want[:tie] and err <= TOL, (got, want, tie, err)


def test_wrong_table_upcast_is_caught(bf16, monkeypatch):
    """The same check fails when the upcast of a bf16 tensor the graph reads as it is (the embedding
    table) is wrong: here its bf16 bits are read as a truncated fp32 mantissa (each value rounded toward
    zero to 4 significant bits)."""
    import v4compile.runtime.cpu_backend as cb

    fe, art = bf16
    real = cb.materialise

    def broken(d, stored):
        a = real(d, stored)
        return (a.view(np.uint32) & np.uint32(0xFFF00000)).view(np.float32) if d["of"] == "embed.weight" else a

    monkeypatch.setattr(cb, "materialise", broken)
    err = _errors(fe, v4compile.load(art, device="cpu", threads=1))[2]
    assert err > 2 * TOL, err


def test_official_bf16_is_refused_with_one_error(tmp_path):
    with pytest.raises(IRError, match="no ONNX lowering for this use of"):
        compile_artifact(_fe("official"), tmp_path / "off", BUCKETS)
    assert not (tmp_path / "off").exists()


def test_cli_refuses_official_bf16_for_cpu_before_writing(tmp_path):
    from bad_input_util import cli_error

    out = tmp_path / "art"
    cli_error("compile", "--weights", "random", "--numerics", "official", "--dtype", "bf16", "--target", "cpu",
              "-o", str(out), needles=("bf16 with hf numerics only", "--numerics hf"))
    assert not out.exists()
