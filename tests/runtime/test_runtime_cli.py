"""`v4compile compile -o` then `v4compile run --device host` (the issue's done-when) and the clear error of
a GPU device that cannot run (the GPU artifact itself: tests/runtime/test_gpu_artifact.py). In-process (`cli.main`): the subprocess start-up dominates otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from v4compile.cli import main


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["compile", "--preset", "tiny", "-o", str(out), "--target", "cpu"]) == 0
    return out


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_compile_then_run_on_host_prints_the_reference_ids(art, capsys):
    # 6 new tokens: the decode steps (positions 3-7) close two CSA blocks (ratio 4), as 8 did; each further
    # step of interpreted kernels would cost seconds and reach no new block.
    capsys.readouterr()
    assert main(["run", str(art), "--ids", "1,2,3", "--max-new-tokens", "6", "--device", "host"]) == 0
    ran = capsys.readouterr()
    assert main(["generate", "--preset", "tiny", "--ids", "1,2,3", "--max-new-tokens", "6"]) == 0
    ref = capsys.readouterr().out.strip()
    assert ran.out.strip() == ref and len(ref.split(",")) == 6
    assert "on host" in ran.err
    ttft = re.search(r"time to first token ([\d.]+) s: load ([\d.]+) s \(weights ([\d.]+) s\), warmup ([\d.]+) s, "
                     r"prefill ([\d.]+) s", ran.err)
    total, load, weights, warmup, prefill = map(float, ttft.groups())
    assert 0 < weights <= load and prefill > 0 and abs(total - (load + warmup + prefill)) < 0.01


@pytest.mark.slow
def test_run_on_host_in_a_fresh_process_as_a_user_starts_it(art, capsys):
    """The tests' own environment sets TRITON_INTERPRET=1 before anything loads; a user's does not. Then
    only the host device chooses the interpreter, so importing the CLI and the runtime must load no kernel
    module (one imported for compiling would fix the choice: the run would refuse, as it did when the PDL
    flag's facts lived in a @triton.jit module every runtime import loaded)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "v4compile", "run", str(art), "--ids", "1,2,3", "--max-new-tokens",
                        "2", "--device", "host"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    capsys.readouterr()
    assert main(["run", str(art), "--ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert r.stdout.strip() == capsys.readouterr().out.strip()


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cuda", "hip"])
def test_a_gpu_device_that_cannot_run_is_one_clear_error(art, device, capsys):
    """No GPU here: the driver library cannot be opened (or, with one, this cpu-only artifact has no GPU
    target); either way one error line and exit status 2."""
    capsys.readouterr()
    assert main(["run", str(art), "--ids", "1,2,3", "--max-new-tokens", "2", "--device", device]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(err) == 1
    assert "cannot open the driver library" in err[0] or "has no 'sm_90a' target" in err[0] or \
        "has no 'gfx950' target" in err[0], err
