"""The deployment self-check (issue 35): `compile -o` writes the golden (`v4compile/golden.py`), every device
checks it (`Session.self_check`, `run --self-check`, `serve` before it listens). Each planted fault below is
caught, named by its step and lane, while the same artifact without the fault passes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import v4compile
import v4compile.artifact
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.cli import main
from v4compile.cli.driver import compile_artifact
from v4compile.errors import ArtifactError
from v4compile.golden import plan, read_golden, tolerance
from v4compile.trace import TraceOptions

from artifact_tamper import copy, manifest, sha, write_manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    return compile_artifact(fe, tmp_path_factory.mktemp("golden") / "tiny", Buckets(decode=(1, 2), prefill=(16,)),
                            golden=True)


@pytest.fixture(scope="module")
def clean(art):
    return v4compile.load(art, device="cpu", threads=1).self_check()


def _rewrite(a, rel: str, data: bytes) -> None:
    """A file of the artifact replaced, its hash (and the manifest's own) recomputed: a forged artifact."""
    (a / rel).write_bytes(data)
    m = manifest(a)
    m["files"][rel] = sha(a / rel)
    write_manifest(a, m)


def test_compile_writes_the_golden_unless_told_not_to(monkeypatch):
    """The command line's default is on (the suite's conftest turns it off for its own compiles)."""
    import v4compile.cli.compile as C
    from v4compile.cli import build_parser

    monkeypatch.setattr(C, "GOLDEN_BY_DEFAULT", True)
    assert build_parser().parse_args(["compile", "-o", "x"]).golden is True
    assert build_parser().parse_args(["compile", "-o", "x", "--no-golden"]).golden is False


def test_the_golden_is_listed_hashed_and_covers_the_scenario(art):
    from v4compile.config import preset

    m = manifest(art)
    assert m["golden"] == {"facts": "golden/golden.json", "tensors": "golden/golden.safetensors"}
    assert set(m["golden"].values()) <= set(m["files"])
    g = read_golden(v4compile.artifact.load_artifact(art))
    f = g.facts
    # prompt 0 is longer than the one prefill chunk (16): chunked prefill; the short one decodes past the
    # largest ratio's first block (16) and the CSA indexer's first index_topk + 1 blocks (4 x 5 = 20)
    assert [len(p) for p in f["prompts"]] == [19, 5] and f["new_tokens"] == 16
    assert f["covers"] == {"compressed_first_block": True, "indexer_picks": True}
    assert plan(preset("tiny"), (16,), 64).new_tokens == 16
    assert g.tensors["logits"].shape == (2, 16, 512) and g.tensors["fingerprint"].shape == (6, 16, 8)
    assert (f["numerics"], f["dtype"]) == ("hf", "fp32")
    assert json.loads((art / "report.json").read_text())["golden"]["new_tokens"] == 16
    top2 = np.sort(g.tensors["logits"], axis=-1)[..., -2:]  # the stored margins are the rows' top-2 gaps
    np.testing.assert_allclose(g.tensors["margin"], top2[..., 1] - top2[..., 0], rtol=0, atol=1e-6)
    assert g.facts["ids"] == g.tensors["logits"].argmax(-1).tolist()  # greedy


def test_a_clean_artifact_passes_on_cpu_with_its_error_beside_the_tolerance(art, clean, capsys):
    assert clean.passed and 0 < clean.max_error <= clean.tolerance == tolerance("hf", "fp32", manifest(art)["config"],
                                                                                 "cpu")[0]
    assert [c.name for c in clean.checks] == ["numerics", "logits", "choices", "greedy ids", "layers"]
    assert not clean.checks[-1].measured and "not measured" in clean.checks[-1].line()  # on a failure only
    capsys.readouterr()
    assert main(["run", str(art), "--self-check", "--device", "cpu", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "self-check: passed" and any(ln.strip().startswith("logits") and "tolerance" in ln for ln in out)
    assert main(["run", str(art), "--self-check", "--device", "cpu", "--threads", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "forged-weight"])
def test_a_weight_one_scale_step_off_with_every_hash_recomputed_fails(art, tmp_path, clean, fault):
    """One block of a weight doubled (one E8M0 scale step) and every hash recomputed: the loader cannot tell,
    the self-check does, at the first prefill step of prompt 0."""
    a = _forged(art, tmp_path / "a") if fault else art
    r = v4compile.load(a, device="cpu", threads=1).self_check() if fault else clean  # clean: the same artifact
    assert r.passed is not fault
    if fault:
        # the router of layer 2 (after the forged weight) departs first: its scores, before any logits row
        assert (r.first_step, r.first_lane, r.first_layer) == (0, 0, 2) and "router departs" in r.reason
        assert r.checks[-1].name == "layers" and not r.checks[-1].passed


def test_the_clean_artifacts_streams_agree_with_the_fingerprint_layer_by_layer(art):
    """The layer statistics (run on a failure) on the clean artifact: every stream the cpu graph shows (the
    embedding and layers 0-3; tiny's fused head takes layer 4's) within the tolerance."""
    from v4compile.runtime.self_check import layer_check

    sess = v4compile.load(art, device="cpu", threads=1)
    c, layer = layer_check(sess, read_golden(sess.art), tolerance("hf", "fp32", manifest(art)["config"], "cpu")[0])
    assert c.passed and 0 < c.error <= c.tolerance and layer == 4 and "the 5 streams" in c.note
    assert not sess.seqs  # its sequence released


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "golden-numerics"])
def test_a_golden_of_another_numerics_mode_fails(art, tmp_path, clean, fault):
    a = copy(art, tmp_path / "a")
    if fault:
        facts = json.loads((a / "golden/golden.json").read_text())
        facts["numerics"] = "official"
        _rewrite(a, "golden/golden.json", json.dumps(facts).encode())
    r = v4compile.load(a, device="cpu", threads=1).self_check() if fault else clean
    assert r.passed is not fault
    if fault:
        assert r.checks[0].name == "numerics" and not r.checks[0].passed and "official" in r.reason


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "swapped-graph"])
def test_a_cpu_graph_swapped_for_another_buckets_fails(art, tmp_path, fault):
    """decode_b1's graph replaced by decode_b2's with its batch dimensions edited to 1 (hashes recomputed):
    the loader's interface checks pass, the computation is another bucket's."""
    import onnx

    a = copy(art, tmp_path / "a")
    if fault:
        g = onnx.load(str(a / "onnx/decode_b2.onnx"))
        for v in [*g.graph.input, *g.graph.output]:
            d = v.type.tensor_type.shape.dim
            if len(d) and d[0].dim_value == 2 and v.name in ("ids", "pos", "block_table", "slot", "logits"):
                d[0].dim_value = 1
        _rewrite(a, "onnx/decode_b1.onnx", g.SerializeToString())
    sess = v4compile.load(a, device="cpu", threads=1)
    sess.decode_fns = [(1, "decode_b1")]  # the golden's two sequences then decode one at a time, through b1
    r = sess.self_check()
    assert r.passed is not fault
    if fault:  # ONNX Runtime refuses the other bucket's inner shapes at the first decode step (0: prefill)
        assert r.first_step == 1 and r.checks[-1].name == "run" and "failed to run the golden" in r.reason


def test_an_artifact_without_a_golden_is_one_clear_error(art, tmp_path, capsys):
    """As `compile --no-golden` writes it: no `golden` entry, no files."""
    import shutil

    a = copy(art, tmp_path / "ng")
    shutil.rmtree(a / "golden")
    m = manifest(a)
    del m["golden"], m["files"]["golden/golden.json"], m["files"]["golden/golden.safetensors"]
    write_manifest(a, m)
    with pytest.raises(ArtifactError, match="no golden"):
        v4compile.load(a, device="cpu", threads=1).self_check()
    capsys.readouterr()
    assert main(["run", str(a), "--self-check", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--no-golden" in err


@pytest.mark.parametrize("edit, words", [
    (lambda f: f.update(ids=[[1]]), "`ids`"),
    (lambda f: f.update(scale=float("nan")), "`scale`"),
    (lambda f: f.update(version=7), "version"),
])
def test_a_tampered_golden_is_one_clear_error(art, tmp_path, edit, words):
    a = copy(art, tmp_path / "a")
    facts = json.loads((a / "golden/golden.json").read_text())
    edit(facts)
    _rewrite(a, "golden/golden.json", json.dumps(facts).encode())
    with pytest.raises(ArtifactError, match=words):
        v4compile.load(a, device="cpu", threads=1).self_check()


def _forged(art, dest):
    """`art` with one block of a weight doubled (one E8M0 scale step), every hash recomputed."""
    from v4compile.safetensors_io import SafetensorsFile, write_file
    from v4compile.shard_digest import tree_digest

    a = copy(art, dest)
    name = "layers.2.attn.wo_b.weight"
    m = manifest(a)
    rel = m["weights"]["tensors"][name]["shard"]
    with SafetensorsFile(a / rel) as f:
        ts = {k: f.read(k).clone() for k in f.tensors}
    ts[name][:32] *= 2
    write_file(a / rel, ts)
    m["weights"]["tensors"][name]["sha256"] = tree_digest(ts[name].reshape(-1).view(torch.uint8).numpy()).hexdigest()
    m["files"][rel] = sha(a / rel)
    write_manifest(a, m)
    return a


def test_serve_refuses_a_faulty_artifact_with_one_line_and_shows_a_good_ones_check(art, tmp_path, capsys):
    """Before it listens: the forged artifact is refused (exit 2, one `error:` line, no socket opened); the
    good one's figures are /health's `self_check`."""
    import socket

    from starlette.testclient import TestClient

    from v4compile.cli.serve import Server, startup_self_check

    opened = []
    real = socket.create_server
    try:
        socket.create_server = lambda *a, **k: opened.append(a) or real(*a, **k)
        capsys.readouterr()
        assert main(["serve", str(_forged(art, tmp_path / "bad")), "--port", "0", "--device", "cpu",
                     "--threads", "1"]) == 2
    finally:
        socket.create_server = real
    err = capsys.readouterr().err
    assert opened == [] and err.count("error:") == 1 and "self-check FAILED" in err and "step 0" in err
    sess = v4compile.load(art, device="cpu", threads=1)
    server = Server(sess, "tiny")
    server.self_check = startup_self_check(sess)
    h = TestClient(server.app(), base_url="http://127.0.0.1").get("/health").json()  # no lifespan: no scheduler
    assert h["self_check"]["passed"] is True and set(h["self_check"]) == {"passed", "max_error", "tolerance", "seconds"}
    assert 0 < h["self_check"]["max_error"] <= h["self_check"]["tolerance"]


def test_a_fault_fails_on_the_judged_lane_when_the_other_has_a_near_tie(art, tmp_path, monkeypatch):
    """The golden with lane 0 marked near-tie from step 0 (a router / indexer choice within its rounding bound;
    hashes recomputed), on a device whose router picks are not read (the margins' rule): the forged weight,
    which departs first at lane 0, is named on lane 1, still judged; the same artifact without the forged
    weight passes."""
    import hashlib

    from safetensors.numpy import load, save

    from v4compile.golden import TENSORS
    from v4compile.runtime import self_check as sc

    monkeypatch.setattr(sc.ChoiceReader, "attach", classmethod(lambda cls, s, g: None))

    a = copy(art, tmp_path / "b")
    t = load((a / TENSORS).read_bytes())
    assert np.isinf(t["choice_margin"]).any() or t["choice_margin"].min() > 1  # the clean golden: no near tie
    t["choice_margin"][0, :] = 0.5
    (a / TENSORS).write_bytes(save(t))
    m = manifest(a)
    m["files"][TENSORS] = hashlib.sha256((a / TENSORS).read_bytes()).hexdigest()
    write_manifest(a, m)
    for path, fault in ((a, False), (_forged(a, tmp_path / "c"), True)):
        r = v4compile.load(path, device="cpu", threads=1).self_check()
        assert r.passed is not fault
        logits = next(c for c in r.checks if c.name == "logits")
        assert "16 of 32 rows" in logits.note and "lane 0 steps 0-15" in logits.note
        if fault:
            assert (r.first_step, r.first_lane) == (0, 1)
