"""The GPU program of a partitioned module (issue 18): `compile --target gfx950,sm_90a --tp 2 --ep 2 -o DIR`
writes one program (collective launches among the kernels, `local_experts` as a kernel of its own), one
kernel set and per-rank weights. Its ranks, under torchrun's environment:

* on the host device (the same program, the ops' reference kernels: the Triton interpreter would take
  minutes; the `local_experts` kernel itself is checked in tests/kernels/test_kernels_local_experts.py),
  collectives through the C runtime's callback on gloo: a ragged batch of three prompts, 32 new tokens,
  ids equal to the unpartitioned GPU program's single-process run, logits within
  test_parallel_artifact.TOL of the logit scale (official numerics: 2e-3, for the reason given there);
* on the fake CUDA driver with the fake NCCL (device cuda, the real `ProgramBackend` path): each rank
  joins its communicator with the unique id rank 0 made, through the store; NCCL receives exactly the
  program's collectives in order, inside the captured graph, re-run by every replay.

The kernels are placeholders (`fake_aot`, loadable sidecars): what is checked is the program, the
artifact and the runtime's collective path; the real AOT compile of these kernels is what
`scripts/parallel_matrix --aot` and the compile tests of each family cover.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dist_launch import launch
from v4compile.cli import main

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]
NEW, PROMPTS = 32, [[5, 17, 3, 99, 42], [7 + i for i in range(20)], [311]]
TOL = 2e-3  # official numerics (test_parallel_artifact.TOL)
FLAGS = ["--preset", "tiny", "--numerics", "official", "--dtype", "fp32", "--target", "gfx950,sm_90a",
         "--decode-buckets", "2", "--prefill-buckets", "16"]


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """(partitioned tp 2 / ep 2, unpartitioned) GPU-target artifacts of tiny, placeholder kernels."""
    from fake_aot import placeholder_compile_calls
    from v4compile.codegen import aot

    d = tmp_path_factory.mktemp("pgpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "compile_calls", placeholder_compile_calls(loadable=True))
        assert main(["-q", "compile", *FLAGS, "--tp", "2", "--ep", "2", "-o", str(d / "p")]) == 0
        assert main(["-q", "compile", *FLAGS, "-o", str(d / "u")]) == 0
    return d / "p", d / "u"


def test_one_program_one_kernel_set_and_rank_weights(arts):
    from v4compile.artifact import load_artifact
    from v4compile.codegen.program_kernels import program_kernels
    from v4compile.ir.registry import get_op
    from v4compile.runtime.program_backend import artifact_program

    art = load_artifact(arts[0])
    m = art.manifest
    assert [t["name"] for t in m["targets"]] == ["gfx950", "sm_90a"]
    assert {t["program"] for t in m["targets"]} == {"gpu/program.txt"}
    assert {k: m["parallel"][k] for k in ("tp", "ep", "world")} == {"tp": 2, "ep": 2, "world": 2}
    assert [w["shards"][0].split("/")[1] for w in m["parallel"]["rank_weights"]] == ["rank-0", "rank-1"]
    prog = artifact_program(art)
    pk = program_kernels(prog)
    assert pk.complete
    for fname, f in prog.functions.items():
        ops = [l.op for l in f.launches]
        assert ops.count("all_reduce") == 10 and ops.count("local_experts") == 5, fname  # 5 layers
        for l, calls in zip(f.launches, pk.calls[fname]):  # a collective is no kernel call; the rest are
            assert (calls == []) == get_op(l.op).collective, (fname, l.op)
    names = {k["name"] for k in m["kernels"]}
    assert {c.name for c in pk.unique.values()} == {k["name"] for k in m["kernels"] if k["target"] == "sm_90a"}
    assert any(n.startswith("local_experts_") for n in names)
    fn = m["targets"][1]["functions"]["decode_b2"]
    assert fn["kernel_calls"] < fn["launches"]  # the 10 collectives are launches without kernel calls


def test_host_ranks_match_the_single_process_run(arts, tmp_path):
    import v4compile

    sess = v4compile.load(arts[1], device="host", threads=1, kernels="reference")
    steps, run = [], sess.backend.run
    sess.backend.run = lambda f, i: steps.append(run(f, i).copy()) or steps[-1]
    ids, logits = sess.generate(PROMPTS, NEW), None
    sess.close()
    logits = np.concatenate(steps)
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "new": NEW}))
    runs = launch([sys.executable, str(TESTS / "parallel_worker.py"), str(tmp_path), str(tmp_path / "prompts.json"),
                   str(arts[0])], 2, timeout_s=300, env={"V4_TEST_DEVICE": "host", "V4COMPILE_DIST_TIMEOUT": "60"})
    for r, (code, _, err) in enumerate(runs):
        assert code == 0, f"rank {r}: {err[-2000:]}"
    flat, scale = [t for seq in ids for t in seq], float(np.abs(logits).max())
    assert [len(x) for x in ids] == [NEW] * len(PROMPTS)
    got = [np.load(tmp_path / f"rank-{r}.npz") for r in range(2)]
    for r in range(2):
        assert got[r]["ids-0"].tolist() == flat, r
        assert got[r]["logits-0"].shape == logits.shape
        err = float(np.abs(got[r]["logits-0"] - logits).max())
        assert err <= TOL * scale, (r, err / scale)
    assert np.array_equal(got[0]["logits-0"], got[1]["logits-0"])  # every rank the same bits


def _nccl_ranks(art: Path, tmp_path: Path, steps: int = 3) -> list[dict]:
    from runtime_helpers import fake_driver, fake_nccl

    runs = launch([sys.executable, str(TESTS / "parallel_gpu_worker.py"), str(tmp_path), str(art),
                   str(fake_driver("cuda")), str(fake_nccl()), str(steps)], 2, timeout_s=180,
                  env={"V4COMPILE_DIST_TIMEOUT": "60"})
    for r, (code, _, err) in enumerate(runs):
        assert code == 0, f"rank {r}: {err[-2000:]}"
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]


def test_nccl_gets_the_programs_collectives_inside_the_graph(arts, tmp_path):
    """Device cuda through ProgramBackend: comm_init with rank 0's id through the store, then 3 decode steps."""
    res = _nccl_ranks(arts[0], tmp_path)
    for r, x in enumerate(res):
        assert x["differences"] == [] and x["collectives"] == 10 and x["captures"] == 1, (r, x["differences"])
        assert [c[:2] for c in x["comms"]] == [[2, r]]  # one communicator: the group of 2, this rank's place
    assert len(res[0]["made"]) == 1 and res[1]["made"] == []  # the group's first rank makes the id ...
    assert res[0]["joined"] == res[1]["joined"] == [{"2": res[0]["made"][0]}]  # ... every rank joins with it
