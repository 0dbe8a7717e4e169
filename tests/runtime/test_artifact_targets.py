"""Which targets `compile -o` writes and how (fast: the ahead-of-time compiler is replaced by a recorder that
writes placeholder binaries; the real one is tested in test_aot.py and, end to end, test_gpu_artifact.py).

* the default is both GPU targets, plus the cpu target for a small model with weights;
* `--weights none` gives a shape-only GPU artifact (bf16, the released FP8 / FP4 weight formats, no weight
  data) that loads its manifest but refuses to run, in one clear error;
* the GPU targets get one decode and one prefill bucket by default, `--gpu-*-buckets` to choose.
"""

from __future__ import annotations

import json

import pytest

from bad_input_util import cli_error
from fake_aot import placeholder_compile_calls
from v4compile.artifact import load_artifact
from v4compile.cli import main
from v4compile.codegen import aot

GPU = ["gfx950", "sm_90a"]


@pytest.fixture
def fake_aot(monkeypatch):
    """Record the calls; write a placeholder binary and sidecar per (call, target) as the real one lays them out."""
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(aot, "compile_calls", placeholder_compile_calls(seen))
    return seen


def _manifest(out) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_default_targets_of_a_small_model(tmp_path, fake_aot):
    out = tmp_path / "a"
    assert main(["compile", "--preset", "tiny", "-o", str(out), "--decode-buckets", "1,2", "--prefill-buckets", "8"]) == 0
    m = _manifest(out)
    assert [t["name"] for t in m["targets"]] == ["cpu", *GPU] and m["dtype"] == "fp32"
    assert m["buckets"]["gpu"] == {"decode_batch": [2], "prefill_chunk": [8]}
    assert set(m["pipelines"]) == {"cpu", "gpu"} and m["pipelines"]["gpu"][-1] == "lower_to_program"
    names = {n for n, _ in fake_aot}
    assert {(k["name"], k["target"]) for k in m["kernels"]} == {(n, t) for n in names for t in GPU}
    assert all(k["path"] in m["files"] and m["files"][k["path"]] == k["sha256"] for k in m["kernels"])
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["decode_step"]) == set(GPU) and set(rep["decode_step"]["gfx950"]) == {"decode_b2"}
    assert all("compile_s" not in r and "cached" not in r for r in rep["kernels"])
    load_artifact(out)


def test_explicit_targets_and_gpu_buckets(tmp_path, fake_aot):
    out = tmp_path / "b"
    assert main(["compile", "--preset", "tiny", "-o", str(out), "--target", "sm_90a", "--decode-buckets", "1,4",
                 "--prefill-buckets", "8", "--gpu-decode-buckets", "1,4", "--dtype", "fp32"]) == 0
    m = _manifest(out)
    assert [t["name"] for t in m["targets"]] == ["sm_90a"]  # no cpu without being asked, once --target is given
    assert set(m["targets"][0]["functions"]) == {"decode_b1", "decode_b4", "prefill_c8"}
    assert {t for _, t in fake_aot} == {"sm_90a"}
    seen = list(fake_aot)
    # The largest GPU decode bucket must be the pool's (the largest decode bucket, 8 by default).
    cli_error("compile", "--preset", "tiny", "-o", str(tmp_path / "c"), "--target", "sm_90a", "--gpu-decode-buckets",
              "4", needles=(LARGEST_GPU_BUCKET,))
    assert not (tmp_path / "c").exists() and not fake_aot[len(seen):]


LARGEST_GPU_BUCKET = "error: the largest GPU decode bucket must be the largest decode bucket (expected 8, found 4)"


def test_another_bucket_error_does_not_pass_for_it(tmp_path, fake_aot):
    """The same check fails when the command is refused for another reason (here: a bucket that is no integer)."""
    with pytest.raises(AssertionError):
        cli_error("compile", "--preset", "tiny", "-o", str(tmp_path / "c"), "--target", "sm_90a",
                  "--gpu-decode-buckets", "4x", needles=(LARGEST_GPU_BUCKET,))


def test_shape_only_gpu_artifact(tmp_path, fake_aot, capsys):
    out = tmp_path / "s"
    assert main(["compile", "--preset", "tiny-pro", "--weights", "none", "-o", str(out), "--decode-buckets", "2",
                 "--prefill-buckets", "8"]) == 0
    m = _manifest(out)
    assert [t["name"] for t in m["targets"]] == GPU and m["dtype"] == "bf16"
    assert m["allow_spills"] is False and json.loads((out / "report.json").read_text())["spilling"] == []
    assert m["weights"]["shape_only"] and m["weights"]["shards"] == [] and not list((out / "weights").glob("*"))
    experts = {n: t["dtype"] for n, t in m["weights"]["tensors"].items() if n.endswith("ffn.experts.w1")}
    assert experts and set(experts.values()) == {"fp4x2"}  # the released formats, as the kernels read them
    capsys.readouterr()
    assert main(["run", str(out), "--ids", "1,2"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "shape-only" in err[0]
    # the cpu target cannot be asked for without weights
    assert main(["compile", "--preset", "tiny", "--weights", "none", "-o", str(tmp_path / "x"), "--target",
                 "cpu"]) == 2
    assert "the cpu target needs weights" in capsys.readouterr().err


def _spilling_aot(monkeypatch, spills: int):
    """The placeholder compiler with `spills` on the first sm_90a row (0: none)."""
    inner = placeholder_compile_calls()

    def compile_calls(calls, targets, out_dir, jobs=None):
        rows = inner(calls, targets, out_dir, jobs)
        next(r for r in rows if r["target"] == "sm_90a")["spills"] = spills
        return rows
    monkeypatch.setattr(aot, "compile_calls", compile_calls)


def _tree(d) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_spills_fail_a_compile_unless_allowed(tmp_path, monkeypatch, capsys):
    """A bf16 GPU compile whose kernels spill lists them (the log, the text report) and exits 1 with nothing
    written: no directory, and a `--force` target left byte for byte as it was, no temporary sibling left (the
    verdict is taken before the artifact is renamed into place); `--allow-spills` writes it with status 0, the
    spills in report.json `spilling`, and the manifest says so (without spills: test_shape_only_gpu_artifact,
    `allow_spills` false, nothing listed). fp32 GPU programs (the cpu target's dtype) are check builds, whose
    FMA dots spill on sm_90a by design: listed, not refused."""
    _spilling_aot(monkeypatch, 40)
    argv = ["compile", "--preset", "tiny", "--decode-buckets", "2", "--prefill-buckets", "8"]
    gpu = [*argv, "--weights", "none", "--target", "sm_90a"]
    capsys.readouterr()
    assert main([*gpu, "--report", "-o", str(tmp_path / "a")]) == 1
    out, err = capsys.readouterr()
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())
    name = next(ln.split()[0] for ln in out.splitlines() if ln.strip().endswith("(sm_90a): 40 bytes"))
    assert "kernel spills: 1 of" in out and f"spills: {name} (sm_90a): 40 bytes" in err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        f"error: 1 kernel specialisation(s) spill registers (listed above); nothing written to {tmp_path / 'a'}: "
        "--allow-spills writes such an artifact without failing"]
    assert main([*gpu, "-o", str(tmp_path / "b"), "--allow-spills"]) == 0
    assert _manifest(tmp_path / "b")["allow_spills"] is True
    assert [(s["name"], s["spills"], s["unit"]) for s in json.loads((tmp_path / "b" / "report.json").read_text())[
        "spilling"]] == [(name, 40, "bytes")]
    load_artifact(tmp_path / "b")  # the manifest's schema takes the knob
    before = _tree(tmp_path / "b")
    assert main([*gpu, "--decode-buckets", "4", "-o", str(tmp_path / "b"), "--force"]) == 1  # refused: b as it was
    assert _tree(tmp_path / "b") == before and sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert main([*gpu, "--dtype", "fp32", "-o", str(tmp_path / "c")]) == 0
    assert _manifest(tmp_path / "c")["dtype"] == "fp32"
    assert [s["spills"] for s in json.loads((tmp_path / "c" / "report.json").read_text())["spilling"]] == [40]


def test_failed_numerics_check_writes_nothing(tmp_path, monkeypatch, fake_aot):
    """A compile whose numerics check fails exits 1 with no artifact (its verdict is known before the writing:
    none starts); forced here by a failing outcome over the real pipeline run."""
    from types import SimpleNamespace

    from v4compile.cli import compile as cli_compile

    real = cli_compile.run_pipeline
    monkeypatch.setattr(cli_compile, "run_pipeline",
                        lambda args, fe: (real(args, fe)[0], SimpleNamespace(ok=False, summary="forced")))
    argv = ["compile", "--preset", "tiny", "--decode-buckets", "2", "--prefill-buckets", "8", "--report"]
    assert main([*argv, "--target", "sm_90a", "-o", str(tmp_path / "a")]) == 1
    assert not list(tmp_path.iterdir()) and not fake_aot


def test_failed_write_leaves_the_old_artifact(tmp_path, monkeypatch):
    """`write_artifact_dir`: a `fill` that raises, or a failed rename of the new artifact into place after the old
    one was moved aside, leaves the directory it was to replace as it was and no temporary sibling."""
    import os

    from v4compile import artifact

    out = tmp_path / "a"
    out.mkdir()
    (out / "x").write_text("old")

    def fill(tmp):
        (tmp / "x").write_text("new")
        raise RuntimeError("refused")
    with pytest.raises(RuntimeError, match="refused"):
        artifact.write_artifact_dir(out, fill, force=True)
    assert _tree(out) == {"x": b"old"} and [p.name for p in tmp_path.iterdir()] == ["a"]
    real = os.replace

    def replace(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        real(src, dst)
    monkeypatch.setattr(artifact.os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        artifact.write_artifact_dir(out, lambda tmp: ({}, {}), force=True)
    assert _tree(out) == {"x": b"old"} and [p.name for p in tmp_path.iterdir()] == ["a"]
