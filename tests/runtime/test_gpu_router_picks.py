"""The router picks of a GPU-target program's fused MoE launches (issue 35): the router phase hands its expert ids to
the experts phase through scratch (`route_indices`, `moe_router.route_ids_at`), which still holds them after the
launch; the self-check copies them to host memory there (the C runtime's probe table, `self_check.route_reads`).
On the host device with the fused launch's Triton kernel interpreted, the probed ids are the router reference's
top-k on that launch's input; on a (fake, computing) hip device the golden run reads them, judges the rows no
differing pick reaches and fails a forged weight at layer 2 through a pick swapped clear of its near tie."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

import v4compile
from v4compile.runtime import self_check as sc
from v4compile.runtime.c_backend import PROBE_AFTER, CRuntime

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SEAM = "layers.3.attn_hc"  # decode's `mhc_moe_mhc` holding layer 2's learned router (its ids carved past the seam's)


def test_the_probed_route_indices_are_the_routers_top_k(monkeypatch):
    """tiny-pro's decode step on the host device, the `mhc_moe_mhc` launch of layer 2's router run as its Triton
    kernel (interpreted; the other launches their ops' references): the probe after its last call holds the
    reference router's top-k of that launch's input (`_router_part`, computed from its operand bytes before its
    first call), row by row, and the host device's reader (`HostChoiceReader`) takes the same ids from the
    scratch. Broken variant: a probe one id further into the scratch reads other ids."""
    from runtime_helpers import PROMPTS, step_inputs, tiny
    from v4compile.codegen.program_kernels import calls_of
    from v4compile.runtime import kernels

    m, prog, w = tiny(preset_name="tiny-pro")
    kernels.kernel_calls_for("auto", "host")  # the interpreter switch, as for every host run
    rt = CRuntime(prog, w, "host", kernel_calls=lambda l: calls_of(l) if l.loc == SEAM else None)
    try:
        fs = rt.sched.functions[rt.sched.function_index("decode")]
        (call, layer, buf, off, rows, k), = sc.route_reads(fs)
        assert fs.program.launches[fs.launch_of[call]].loc == SEAM and layer == 2 and off > 0  # past the seam's
        want = []
        inputs = next(i for f, i in step_inputs(m, PROMPTS, 1) if f == "decode")
        # the host device's own reader (its check-mode hooks) in the same run: it reads the kernel's ids there too
        be = type("Be", (), {"rt": rt, "run_outputs": lambda self, f, i: rt.run(f, i)})()
        reader = sc.HostChoiceReader.attach_host(be)
        theirs = rt.before_call

        def before(f, c, launch):
            if launch.loc == SEAM:
                want.append(sc._router_part(rt, launch))
            theirs(f, c, launch)
        rt.before_call = before

        def probed(at):
            host = np.zeros((rows, k), np.int64)
            rt.probe_table("decode", [(call, PROBE_AFTER, buf, at, host)])
            want.clear()
            be.run_outputs("decode", inputs)
            (got_layer, ids, _, _), = want
            assert got_layer == 2
            return host, np.array_equal(np.sort(host, -1), np.sort(ids.reshape(rows, k), -1))

        host, same = probed(off)
        assert same and np.array_equal(reader.seen[0][2][2][0], host)
        assert not probed(off + 8)[1]
    finally:
        rt.close()


@pytest.fixture(scope="module")
def gpu_art(tmp_path_factory):
    """tiny-pro (hf, bf16) for gfx950 (placeholder binaries: `fake_aot`; the program is the GPU pipeline's, its
    routers fused into the MoE launches), its golden 4 steps, and the same with one block of `layers.2.attn.wo_b`
    doubled (`_forged`)."""
    from fake_aot import placeholder_compile_calls
    from test_self_check import _forged
    from v4compile import frontend, golden
    from v4compile.artifact import Buckets
    from v4compile.cli.driver import compile_buckets, write_artifact
    from v4compile.codegen import aot
    from v4compile.trace import TraceOptions

    import torch

    mp = pytest.MonkeyPatch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as `one_torch_thread`, which a module fixture runs before)
    try:
        mp.setattr(aot, "compile_calls", placeholder_compile_calls(loadable=True))
        mp.setattr(golden, "CANDIDATES", 1)  # bf16 on random weights: no candidate is free of near ties
        fe = frontend.load(None, "tiny-pro", "random", TraceOptions(numerics="hf", dtype="bf16", capacity=96))
        ci = replace(compile_buckets(fe, Buckets(decode=(2,), prefill=(16,)), targets=("gfx950",)), golden=True,
                     golden_new_tokens=4)
        d = tmp_path_factory.mktemp("gpupicks")
        art = write_artifact(ci, d / "a")
    finally:
        mp.undo()
        torch.set_num_threads(threads)
    return art, _forged(art, d / "f")


def _on_fake_hip(art):
    """The self-check of `art` on the fake HIP driver made to compute (`Fake.compute`; its fused MoE launches'
    calls hold their scratch and write the reference router's ids there, `Fake.route_by_reference`)."""
    from runtime_helpers import Fake
    from v4compile.codegen.program_kernels import calls_of

    sess = v4compile.load(art, device="host", kernels="reference")
    be = sess.backend
    try:
        Fake.computing_hip(sess, kernel_calls=lambda l: calls_of(l) if "gate" in dict(l.operands) else None)
        Fake.route_by_reference(be.rt)
        r = sess.self_check()
        assert be.graphs and not any(be.rt._probes.values())  # the golden run's probes gone, graphs back
        assert be.rt.stats()["replays"] > 0  # the golden ran on the users' captured graphs too (first)
        return r
    finally:
        sess.close()


def test_a_gpu_device_judges_rows_by_its_router_picks(gpu_art, monkeypatch):
    """The golden runs twice: on the captured graphs, then launch by launch with the probes. Clean: the picks are
    read and 6 of the 8 rows are judged (before: "choices not measured", none judged on
    bf16: every lane's steps ended at its first near tie); the forged weight FAILS at layer 2, step 0 through a pick
    swapped clear of its near tie (the scores are not read there). With the probes off (the reader not attached)
    the forged artifact passes: each lane's rows end at its first near tie."""
    art, forged = gpu_art
    r = _on_fake_hip(art)
    logits = next(c for c in r.checks if c.name == "logits")
    choices = next(c for c in r.checks if c.name == "choices")
    judged = int(re.match(r"(\d+) of 8 rows", logits.note).group(1))
    assert r.passed and choices.measured and "scores are not read" in choices.note and judged >= 4, r.lines()
    bad = _on_fake_hip(forged)
    assert not bad.passed and (bad.first_step, bad.first_layer) == (0, 2), bad.lines()
    assert "router departs" in bad.reason
    assert "clear of the tie" in bad.reason
    monkeypatch.setattr(sc.ProbeChoiceReader, "attach_probes", classmethod(lambda cls, be: None))
    off = _on_fake_hip(forged)
    assert off.passed and "not measured" in next(c for c in off.checks if c.name == "choices").line(), off.lines()
