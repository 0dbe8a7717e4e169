"""The cpu target: ONNX export of the cpu pipeline, the artifact directory, and the ONNX Runtime session.

Tolerances: logits within 1e-4 absolute of `ReferenceModel` (fp32, tiny: |logits| ~ 4, so ~3e-5 relative);
the ONNX graphs compute the same fp32 formulas in a different order (fused GEMMs, RMSNormalization, Gemm
sums), which moves logits by a few ulps (measured ~3e-6); greedy ids must be identical.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from v4compile import frontend
from v4compile.artifact import ArtifactError, Buckets, load_artifact
from v4compile.cli.driver import compile_artifact
from v4compile.errors import InputError
from v4compile.manifest import FORMAT_VERSION
from v4compile.trace import TraceOptions

TOL = 1e-4
BUCKETS = Buckets(decode=(1, 2, 4), prefill=(8, 16))


def _fe(numerics: str, capacity: int = 128):
    return frontend.load(None, "tiny", "random", TraceOptions(numerics=numerics, dtype="fp32", capacity=capacity))


_BUILT: dict = {}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny(numerics: str, tmp_path_factory):
    """(frontend, artifact dir, session, reference model), built once per numerics mode."""
    if numerics not in _BUILT:
        fe = _fe(numerics)
        out = compile_artifact(fe, tmp_path_factory.mktemp(f"art-{numerics}") / "tiny", BUCKETS)
        _BUILT[numerics] = (fe, out, _load(out), fe.reference())
    return _BUILT[numerics]


@pytest.fixture(scope="module", params=["hf", "official"])
def tiny(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return _tiny("hf", tmp_path_factory)


def _load(path):
    import v4compile
    return v4compile.load(path, device="cpu", threads=1)


def _tree_hash(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- numerics -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_greedy_ids_and_logits_match_the_reference(tiny):
    """32 greedy tokens through chunked prefill (a 21-token prompt: chunks 16 + 8) and decode; every
    step's logits within TOL of ReferenceModel's, teacher-forced on the reference's own ids."""
    fe, art, sess, ref = tiny
    prompt = torch.randint(0, fe.cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    # ReferenceModel.generate, step by step (prefill, then argmax and decode), keeping every step's logits
    cache, r = ref.prefill([prompt], capacity=64)
    want, r_logits = [], [r[0].numpy()]
    for i in range(32):
        want.append(int(r_logits[-1].argmax()))
        if i < 31:
            r_logits.append(ref.decode([want[-1]], cache)[0].numpy())
    assert sess.generate([prompt], 32)[0] == want
    seqs, s = sess.prefill([prompt])
    s_logits = [s[0]] + [sess.decode(seqs, [tok])[0] for tok in want[:-1]]
    err = max(float(np.abs(a - b).max()) for a, b in zip(s_logits, r_logits))
    assert err < TOL, err
    sess.release(seqs[0])
    held = sess.prefix_cache_stats()["cached_blocks"]  # the prompts' pieces the prefix cache keeps (evictable)
    assert sorted(sess.free_slots) == list(range(4))
    assert len(sess.free_blocks) + held == load_artifact(art).manifest["pool"]["n_blocks"]


@pytest.mark.slow
def test_ragged_batch_with_continuous_batching(tiny_hf):
    """Five prompts of different lengths through a pool of four slots: the fifth joins when a sequence
    finishes (a stop id ends one early); each one's ids equal the reference's greedy ids for its prompt."""
    fe, art, sess, ref = tiny_hf
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, fe.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9, 1, 12)]
    alone = [ref.generate(p, 6) for p in prompts]
    stop = alone[1][2]  # sequence 1 stops early at its 3rd token; others may too
    got = sess.generate(prompts, 6, stop_ids=[stop])
    for a, g_ in zip(alone, got):
        cut = a.index(stop) + 1 if stop in a else len(a)
        assert g_ == a[:cut]
    assert len(got[1]) == 3
    assert not sess.seqs and len(sess.free_slots) == 4


def _overlap_halves_swapped(monkeypatch):
    """`compress_paged` (overlapping windows) pooling each slot from the other half of its row."""
    from v4compile.codegen.onnx import compress

    real = compress._compress_index

    def swapped(g, pos, m, overlap, B, T):
        ix = real(g, pos, m, overlap, B, T)
        return {**ix, "src": g.op("BitwiseXor", ix["src"], g.iscalar(1))} if overlap else ix

    monkeypatch.setattr(compress, "_compress_index", swapped)


@pytest.mark.parametrize("fault", ["norm_linear", "compress_halves"])
def test_a_wrong_lowering_is_caught(tmp_path, monkeypatch, fault):
    """The comparison can fail: a lowering that drops the RMSNorm of `norm_linear`, or a `compress_paged`
    that reads the overlapping windows' half-rows swapped, breaks the logits."""
    from v4compile.codegen.onnx import gemm, linear

    if fault == "norm_linear":
        monkeypatch.setattr(gemm, "lower_norm_linear",
                            lambda g, o, a, r: linear.linear(g, o.x, o.types["x"], o.w, o.types["w"]))
    else:
        _overlap_halves_swapped(monkeypatch)
    fe = _fe("hf", capacity=64)
    art = compile_artifact(fe, tmp_path / "bad", Buckets(decode=(1,), prefill=(8,)))
    prompt = [1, 2, 3, 4, 5, 6, 7]  # closes the first CSA window (4 tokens)
    _, r = fe.reference().prefill([prompt])
    _, s = _load(art).prefill([prompt])
    monkeypatch.undo()
    assert float(np.abs(s[0] - r[0].numpy()).max()) > 10 * TOL


# ---- the exported graphs ----------------------------------------------------------------------------

def test_graphs_check_and_never_copy_the_pool(tiny):
    """onnx.checker passes; weights are graph inputs (no weight bytes in the files); a pool plane or state
    tensor only ever feeds Gather nodes (rows the step reads), and a step outputs only rows it wrote."""
    fe, art = tiny[:2]
    m = load_artifact(art).manifest
    weights = set(m["weights"]["tensors"])
    for fname, spec in m["targets"][0]["functions"].items():
        model = onnx.load(str(art / spec["file"]))
        onnx.checker.check_model(model, full_check=True)
        inputs = {i.name for i in model.graph.input}
        assert set(spec["weights"]) <= weights and set(spec["weights"]) <= inputs
        assert not weights & {t.name for t in model.graph.initializer}
        planes = [n for n in inputs if n.startswith(("pool.", "state."))]
        assert planes
        for node in model.graph.node:
            for x in node.input:
                if x in planes:
                    assert node.op_type == "Gather" and node.input[0] == x, (fname, node.op_type, x)
        outs = {o.name for o in model.graph.output}
        assert "logits" in outs and all(o == "logits" or o.endswith((".rows", ".vals")) for o in outs)
        assert any(o.startswith("pool.") for o in outs)


def test_every_op_of_the_cpu_pipeline_has_an_onnx_lowering(tiny):
    fe, art = tiny[:2]
    from v4compile.codegen.onnx import lowering
    from v4compile.ir.registry import get_op
    from v4compile.ir.text import parse_module

    module = parse_module((art / "module.ir").read_text())
    names = {op.name for f in module.functions.values() for op in f.ops}
    assert names and all(lowering(get_op(n)) is not None for n in names)


# ---- the artifact -----------------------------------------------------------------------------------

def test_artifact_is_reproducible_and_hash_checked(tmp_path):
    fe = _fe("hf", capacity=64)
    b = Buckets(decode=(1,), prefill=(8,))
    a1 = compile_artifact(fe, tmp_path / "a", b)
    a2 = compile_artifact(_fe("hf", capacity=64), tmp_path / "b", b)
    h1, h2 = _tree_hash(a1), _tree_hash(a2)
    assert h1 == h2 and {"manifest.json", "module.ir", "report.json", "onnx/decode_b1.onnx"} <= set(h1)
    man = load_artifact(a1).manifest
    assert man["format_version"] == FORMAT_VERSION and man["targets"][0]["name"] == "cpu" and man["kernels"] == []
    assert set(man["files"]) == set(h1) - {"manifest.json"}
    shard = a1 / man["weights"]["shards"][0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=man["weights"]["shards"][0]):
        load_artifact(a1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary siblings left


def test_failed_compile_leaves_nothing(tmp_path, monkeypatch):
    import v4compile.cli.driver as A

    def boom(*a, **k):
        raise RuntimeError("export failed")
    monkeypatch.setattr(A, "_write_onnx", boom)
    with pytest.raises(RuntimeError):
        compile_artifact(_fe("hf", capacity=64), tmp_path / "x", Buckets(decode=(1,), prefill=(8,)))
    assert list(tmp_path.iterdir()) == []


# ---- bad input ----------------------------------------------------------------------------------------

def refused(call, what, where=None, expected=None, found=None):
    """`call()` raises InputError saying exactly what, where, expected and found (not just any InputError)."""
    with pytest.raises(InputError) as e:
        call()
    got = (e.value.what, e.value.where, e.value.expected, e.value.found)
    assert got == (what, where, expected, found), f"{got} != {(what, where, expected, found)}"


def _bad_calls(tiny_hf):
    import v4compile

    fe, art, sess, _ = tiny_hf
    V, M = fe.cfg.vocab_size, sess.max_context
    return [
        (lambda: sess.generate([[]], 2), ("empty prompt", "prompt 0", "at least one token id", None)),
        (lambda: sess.generate([[1, 2], [1, V]], 2),
         ("token id outside the vocabulary", "prompt 1", f"0 <= id < {V}", V)),
        (lambda: sess.generate([[1, 2, 3]], M - 2),
         ("prompt + max_new_tokens exceed the compiled maximum context", "prompt 0", f"<= {M} tokens", M + 1)),
        (lambda: v4compile.load(art, device="gpu"),
         ("unknown device 'gpu'", None, "auto, cpu, host, hip, cuda", None)),
    ]


def test_bad_input_gets_one_clear_error(tiny_hf):
    for call, message in _bad_calls(tiny_hf):
        refused(call, *message)
    assert not tiny_hf[2].seqs


def test_another_error_does_not_pass_for_the_expected_one(tiny_hf):
    """The check tells the errors apart: each bad call fails `refused` with any other row's message."""
    rows = _bad_calls(tiny_hf)
    for i, (call, _) in enumerate(rows):
        for j, (_, message) in enumerate(rows):
            if i != j:
                with pytest.raises(AssertionError):
                    refused(call, *message)


@pytest.mark.slow
def test_cli_compile_then_run_matches_generate(tmp_path):
    """The issue's done-when, at the CLI (default numerics / dtype / seed of both commands agree)."""
    def cli(*args, check=True):
        r = subprocess.run([sys.executable, "-m", "v4compile", *args], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert not check or r.returncode == 0, r.stderr
        return r
    out = tmp_path / "tiny"
    cli("compile", "--preset", "tiny", "-o", str(out), "--decode-buckets", "1", "--prefill-buckets", "16", "--target",
        "cpu", "--no-golden")  # the golden is tests/runtime/test_self_check.py's
    ran = cli("run", str(out), "--device", "cpu", "--ids", "1,2,3", "--max-new-tokens", "16").stdout.strip()
    gen = cli("generate", "--preset", "tiny", "--ids", "1,2,3", "--max-new-tokens", "16").stdout.strip()
    assert ran == gen and len(ran.split(",")) == 16
    r = cli("run", str(out), "--ids", "1,9999", check=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "vocabulary" in errors[0] and "Traceback" not in r.stderr
