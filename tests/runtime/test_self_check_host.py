"""The self-check's device cases (issue 35), as suite tests: a kernel with one deliberate fault on the host
device (its Triton kernel interpreted: the golden is cut to its prefill, `--golden-new-tokens 1`, recorded in
golden.json), a forged weight named by its layer on the host device and on a (fake, computing) GPU through the
C runtime's probe table, and a partitioned artifact whose rank 1 loads rank 0's weights. Each shows the same
artifact passing without the fault."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import v4compile
from v4compile import frontend
from v4compile.artifact import Buckets
from v4compile.cli.driver import compile_buckets, write_artifact
from v4compile.trace import TraceOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def host_art(tmp_path_factory):
    """tiny (hf, fp32), one prefill chunk bucket of 8 and decode 2, its golden the prefill only: prompts of 11
    (two chunks) and 5 tokens, three host steps."""
    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=32))
    ci = replace(compile_buckets(fe, Buckets(decode=(2,), prefill=(8,))), golden=True, golden_new_tokens=1)
    return write_artifact(ci, tmp_path_factory.mktemp("hostgold") / "tiny")


def test_the_golden_records_its_step_count_knob(host_art):
    f = json.loads((host_art / "golden/golden.json").read_text())
    assert f["new_tokens"] == 1 and f["new_tokens_from"] == "--golden-new-tokens"
    assert [len(p) for p in f["prompts"]] == [11, 5]


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "broken-kernel"])
def test_a_broken_kernel_on_the_host_device_fails(host_art, tmp_path, monkeypatch, fault):
    """`hc_expand_kernel` (the embedding's mHC expansion) storing x * 1.001: FAILED at step 0. The expansion is
    the one launch run as its Triton kernel (interpreted, through the C runtime's callback, as the host device
    runs every kernel); the others run their ops' references (the whole program interpreted costs ~25 s a run
    here, and the host device's Triton kernels are held to the reference launch by launch elsewhere)."""
    from kernel_check import install_broken_kernel
    from v4compile.codegen.kernels import mhc
    from v4compile.codegen.program_kernels import calls_of
    from v4compile.runtime import kernels, program_backend

    if fault:
        install_broken_kernel(monkeypatch, tmp_path, mhc, "hc_expand_kernel", "out_ptr + t * O_S + k * O_SN + c, x,",
                              "out_ptr + t * O_S + k * O_SN + c, x * 1.001,")
    expanded = []

    def only_the_expansion(mode, device):
        kernels.kernel_calls_for("auto", device)  # the interpreter switch, as for every host run

        def calls(launch):
            if launch.op != "hc_expand":
                return None  # the op's reference in the callback
            expanded.append(launch.op)
            return calls_of(launch)
        return calls
    monkeypatch.setattr(program_backend, "kernel_calls_for", only_the_expansion)
    sess = v4compile.load(host_art, device="host")
    try:
        r = sess.self_check()
    finally:
        sess.close()
    assert expanded, "the expansion never ran as its Triton kernel"
    assert r.passed is not fault, r.lines()
    if fault:  # the embedding's expansion: the layer statistics name the embedding (-1)
        assert r.first_step == 0 and r.max_error > 10 * r.tolerance and r.first_layer == -1


def test_a_forged_weight_is_named_by_its_layer_on_the_host_device(host_art, tmp_path):
    """`layers.2.attn.wo_b` one block doubled, every hash recomputed: the host device's layer statistics (the
    C runtime's check-mode launch hook) name layer 2, as the cpu device's do. The ops' reference kernels (the
    same C runtime, launches and callback; the Triton interpreter would add ~30 s): the hook is what is tested."""
    from test_self_check import _forged

    sess = v4compile.load(_forged(host_art, tmp_path / "f"), device="host", kernels="reference")
    try:
        r = sess.self_check()
        assert sess.backend.rt.after_call is None  # the hook is gone after the check
    finally:
        sess.close()
    assert not r.passed and (r.first_step, r.first_lane, r.first_layer) == (0, 0, 2), r.lines()
    layers = next(c for c in r.checks if c.name == "layers")
    assert layers.measured and not layers.passed and "layer 2 departs first" in layers.note


@pytest.mark.slow  # partitioned compiles and two gloo ranks (their start-up: seconds each on a busy machine)
def test_a_rank_that_loads_rank_0s_weights_fails(tmp_path, monkeypatch):
    """tiny (hf, fp32) at tp 2 / ep 2, its golden the layout's reference, checked at 2 gloo ranks: as compiled
    every rank passes; with rank 1 mapping rank 0's weights (its heads and experts the wrong ones) FAILED, on
    both ranks' results (rank 0 reports the worst rank's); on the host device each rank names the layer.
    The same launch checks each rank's router picks (`ChoiceReader`; before: not read on a partitioned artifact):
    tiny-pro bf16 at tp 2 (bf16 on the cpu target lowers no expert-parallel MoE), whose near ties on random
    weights left no row judged, and tiny fp32 at dp 2 / ep 2, whose routers route both replicas' gathered rows."""
    import sys
    from pathlib import Path

    from dist_launch import launch
    from v4compile import golden
    from v4compile.cli import main

    def compile_(name, *args):
        assert main(["-q", "compile", *args, "--target", "cpu", "--decode-buckets", "2", "--prefill-buckets", "16",
                     "--max-context", "64", "--golden", "--golden-new-tokens", "4", "-o", str(tmp_path / name)]) == 0
        return str(tmp_path / name)

    art = compile_("tp2", "--preset", "tiny", "--numerics", "hf", "--dtype", "fp32", "--tp", "2", "--ep", "2")
    dp = compile_("dp2", "--preset", "tiny", "--numerics", "hf", "--dtype", "fp32", "--dp", "2", "--ep", "2")
    monkeypatch.setattr(golden, "CANDIDATES", 1)  # bf16 on random weights: no candidate is free of near ties
    picks = compile_("bf16", "--preset", "tiny-pro", "--numerics", "hf", "--dtype", "bf16", "--tp", "2")
    worker = Path(__file__).resolve().parents[1] / "self_check_worker.py"
    runs = launch([sys.executable, str(worker), str(tmp_path), art, picks, dp], 2, timeout_s=300)
    for r, (code, _, err) in enumerate(runs):
        assert code == 0, f"rank {r}: {err[-2000:]}"
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        clean, bad, host, *_ = got[r]
        assert clean["passed"] and 0 < clean["max_error"] <= clean["tolerance"], clean
        # every rank's router input departs (rank 1's heads enter the all-reduce): named by the picks (before: by
        # the logits, the picks not read)
        assert not bad["passed"] and bad["first_rank"] is not None and "router departs from the golden at layer 2" in \
            bad["reason"], bad
        # the host device's ranks run the first chunk together and each localises its streams (probes): layer 0,
        # whose heads and experts rank 1 computes with rank 0's weights (before: not measured, no layer)
        layers = next(c for c in host["checks"] if c["name"] == "layers")
        assert not host["passed"] and host["first_layer"] == 0 and layers["measured"], host
        assert layers["note"] == "layer 0 departs first"
        _each_rank_reads_its_router_picks(r, *got[r][3:])


def _each_rank_reads_its_router_picks(rank, cpu, unread, host, dp, swapped):
    """Rank `rank`'s checks of the bf16 artifact (cpu; cpu with its picks unread; host) and of the data-parallel
    one (cpu; cpu reading the other replica's block of the gathered rows)."""
    import re

    def judged(res):
        note = next(c for c in res["checks"] if c["name"] == "logits")["note"]
        return int(re.match(r"(\d+) of 8 rows", note).group(1))

    def choices(res):
        return next(c for c in res["checks"] if c["name"] == "choices")

    # the picks decide which near ties excuse rows: some rows judged on each rank (cpu 2, host 6 of 8 here), and
    # the choices measured; unread, a lane's steps end at its first near tie: none judged
    for res in (cpu, host):
        assert res["passed"] and judged(res) > 0 and choices(res)["measured"], (rank, res)
    assert unread["passed"] and judged(unread) == 0 and not choices(unread)["measured"], (rank, unread)
    assert "a partitioned artifact" not in choices(unread)["note"]
    # data parallel: each rank's scores compared on its own replica's lane (rank r holds golden lane r); read at
    # the other replica's rows, the picks are another sequence's: a router choice no rounding explains
    assert dp["passed"] and choices(dp)["measured"] and 0 < choices(dp)["error"] < 1, (rank, dp)
    assert f"lane {rank};" in choices(dp)["note"], (rank, dp)
    assert not swapped["passed"] and "router departs" in swapped["reason"], (rank, swapped)


@pytest.mark.parametrize("forged", [False, True], ids=["clean", "forged"])
def test_a_gpu_device_names_the_forged_layer_through_the_probe_table(host_art, tmp_path, forged):
    """hip (the fake HIP driver made to compute: each launch runs its op's reference on the fake's memory when the
    GPU would run it, `Fake.compute`): the run never comes back to Python launch by launch as the host device's
    does, so the layer statistics come from the C runtime's probe table (each layer's last launch result copied on
    the stream after that launch). The clean artifact passes; the forged weight fails, named at layer 2 (before:
    "layers not measured" on hip / cuda)."""
    from runtime_helpers import Fake
    from test_self_check import _forged

    art = _forged(host_art, tmp_path / "f") if forged else host_art
    sess = v4compile.load(art, device="host", kernels="reference")
    be = sess.backend
    try:
        fake = Fake.computing_hip(sess)
        r = sess.self_check()
        assert fake.counts()["logged"] > 0 and not be.rt._probes.get("prefill_c8")  # ran there; probes cleared
        if forged:  # broken variant: probes never set, the streams read as the buffers' zeros: not layer 2
            be.rt.probe_table = lambda fname, probes: None
            assert sess.self_check().first_layer != 2
    finally:
        sess.close()
    assert r.device == "hip" and r.passed is not forged, r.lines()
    if forged:
        assert (r.first_step, r.first_lane, r.first_layer) == (0, 0, 2), r.lines()
        layers = next(c for c in r.checks if c.name == "layers")
        assert layers.measured and "layer 2 departs first" in layers.note
