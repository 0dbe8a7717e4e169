"""Rollback of the compiled pool (`runtime/undo.py`) on the C runtime's buffers (host device: the GPU's stand-in),
running the GPU targets' program (official numerics: FP8 main rows with UE8M0 scales and a RoPE plane, FP4
indexer rows; the cpu device's native planes are `tests/onnx/test_spec_rollback.py`'s). Three rejected tokens are decoded and
rolled back (`tests/onnx/test_spec_rollback.py` has the scenario); the logits and every pool / state byte must
equal a run that never saw them, and do not without the restore. The host runs the ops' reference kernels:
the rollback is row copies, the Triton kernels' agreement with the references is tested elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from v4compile.cli import main

from spec_rollback import run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gpu_art(tmp_path_factory):
    """The CLI's default artifact (cpu + both GPU targets; the README and test_gpu_artifact.py compile the same
    kernels, so the AOT cache makes this cheap)."""
    out = tmp_path_factory.mktemp("gpu") / "tiny"
    assert main(["compile", "--preset", "tiny", "-o", str(out)]) == 0
    return out


def test_the_host_device_restores_fp8_and_fp4_rows(gpu_art):
    path = gpu_art
    plain = run(path, rejected=False, device="host")
    assert {"pool.nope", "pool.nope_scale", "pool.rope", "pool.index", "pool.index_scale"} <= plain[1].keys()
    logits, state = run(path, rejected=True, device="host")
    assert np.array_equal(logits, plain[0])
    assert state.keys() == plain[1].keys()
    for k in state:
        assert np.array_equal(state[k], plain[1][k]), k
    logits, state = run(path, rejected=True, restore=False, device="host")
    assert any(not np.array_equal(state[k], plain[1][k]) for k in state)
