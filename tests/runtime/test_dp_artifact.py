"""Data-parallel artifacts (`compile --dp 2 --ep 2 -o DIR`) run by their ranks under torchrun's environment with
gloo, against the same model compiled without partition and run in one process.

One launch for both devices and the speculative run (the process start-up is most of a rank's time): tiny-pro,
hf numerics (official numerics: tests/passes/test_partition_dp.py, every rank in one process), fp32, the cpu device (ONNX segments,
gloo between them) and then the host device (the sm_90a program with placeholder kernels in the C runtime,
the ops' reference kernels, its collective launches handed back to Python and run on gloo; then again with
layer 1's MoE, its one-shot rows collectives folded in, run by its kernel, and by a broken one, against the
program compiled with `--allreduce nccl` whose layer 1's MoE runs the same kernel). Five ragged
prompts over two replicas of one decode bucket of 2: more sequences than a replica holds, so the fifth waits,
and once the first four end it runs alone on its replica while the other replica runs padding steps. Greedy
ids over 32 new tokens equal the single-process run's on every rank and device; every logits row a
request sampled from lies within TOL of the single-process row (the experts see every rank's tokens at
once, the rest the replica's: batch-composition rounding). Then the cpu device decoding speculatively (the
same layout compiled for cpu with 2 draft tokens: the MTP block's verify and draft functions): the same
greedy ids. Then, in the same launch, a rank killed mid-run ends the other with one error line in
bounded time. And a second launch: four ranks of `--dp 2 --tp 2 --ep 4`, the cpu device.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dist_launch import launch, without_ready
from v4compile.cli import main

TOL = 1e-5  # of the logit scale, hf numerics: batch-composition rounding (measured below 1e-6)
NEW = 32
# the fifth shares the second's first 18 tokens: more than a cache piece (16 tokens), so it hits the piece the
# second kept on its replica
PROMPTS = [[5, 17, 3, 99, 42], [7 + i for i in range(20)], [311], [8, 9], [7 + i for i in range(18)] + [40, 41, 42]]
PIECE = 16  # the prefix cache's granularity here: the prefill bucket (16) over the compression ratios' lcm
WORKER = Path(__file__).resolve().parents[1] / "dp_worker.py"
DRAFT = 2  # the dp artifact's draft tokens: the launch also decodes speculatively (the MTP block)


def _compile(out: Path, layout: tuple[str, ...] = (), targets: str = "cpu,sm_90a") -> Path:
    from fake_aot import placeholder_compile_calls
    from v4compile.codegen import aot

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "compile_calls", placeholder_compile_calls(loadable=True))
        assert main(["-q", "compile", "--preset", "tiny-pro", "--numerics", "hf", "--dtype", "fp32", "--target",
                     targets, "--decode-buckets", "2", "--prefill-buckets", "16", *layout, "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """(the dp 2 / ep 2 artifact, the same model unpartitioned)."""
    d = tmp_path_factory.mktemp("dp")
    return _compile(d / "dp2", ("--dp", "2", "--ep", "2")), _compile(d / "one")


@pytest.fixture(scope="module")
def spec_art(tmp_path_factory):
    """The dp 2 / ep 2 artifact with DRAFT draft tokens: the cpu target only (the device these tests run)."""
    return _compile(tmp_path_factory.mktemp("dp-spec") / "dp2", ("--dp", "2", "--ep", "2", "--draft-tokens", str(DRAFT)),
                    targets="cpu")


@pytest.fixture(scope="module")
def nccl_art(tmp_path_factory):
    """The dp 2 / ep 2 artifact's GPU program with its rows collectives on the communicator (`--allreduce nccl`):
    nothing one-shot, nothing folded into the MoE's launch."""
    return _compile(tmp_path_factory.mktemp("dp-nccl") / "dp2", ("--dp", "2", "--ep", "2", "--allreduce", "nccl"),
                    targets="sm_90a")


@pytest.fixture(scope="module")
def reference(arts):
    """The single-process run of the unpartitioned artifact (cpu) with the prefix cache off: ids, and each
    request's logits rows."""
    import v4compile
    from v4compile.runtime.batcher import Batcher

    rows: dict[int, list] = {}
    pick = Batcher._pick

    def recorded(self, r, row):
        rows.setdefault(r.index, []).append(np.asarray(row, dtype=np.float32).copy())
        return pick(self, r, row)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batcher, "_pick", recorded)
        sess = v4compile.load(arts[1], device="cpu", threads=1, prefix_cache=False)
        ids = sess.generate(PROMPTS, NEW)
        sess.close()
    return ids, {i: np.stack(v) for i, v in rows.items()}


def _ranks(tmp: Path, art: Path, devices: str, env: dict | None = None, timeout_s: float = 400, world: int = 2,
           spec: Path | None = None, nccl: Path | None = None):
    (tmp / "prompts.json").write_text(json.dumps({"prompts": PROMPTS, "new": NEW, "draft_tokens": DRAFT,
                                                  "spec_art": str(spec), "nccl_art": str(nccl)}))
    return launch([sys.executable, str(WORKER), str(tmp), str(tmp / "prompts.json"), str(art)], world,
                  timeout_s=timeout_s, env={"V4_TEST_DEVICES": devices, **(env or {})})


def check_against_reference(tmp: Path, device: str, reference, world: int = 2) -> None:
    ids, rows = reference
    flat = [t for seq in ids for t in seq]
    scale = max(float(np.abs(r).max()) for r in rows.values())
    got = [np.load(tmp / f"{device}-rank-{r}.npz") for r in range(world)]
    for r, g in enumerate(got):
        assert g["ids"].tolist() == flat and g["lens"].tolist() == [NEW] * len(PROMPTS), \
            f"{device} rank {r}: the greedy ids are not the single-process run's"
        for i, want in rows.items():
            err = float(np.abs(g[f"rows-{i}"] - want).max()) / scale
            assert err <= TOL, f"{device} rank {r}: request {i}'s logits off by {err:.2e} of their scale"
        assert np.array_equal(g["placed"], got[0]["placed"])  # every rank keeps the same books
    placed = got[0]["placed"].tolist()
    # least loaded first: the first four two on each replica, the fifth alone while the other idles
    assert placed[0] == [2, 2] and placed[-1] in ([1, 0], [0, 1]) and max(map(max, placed)) == 2


@pytest.fixture(scope="module")
def dp_run(arts, spec_art, nccl_art, tmp_path_factory):
    """Both devices, then the run in which rank 1 dies, in one launch of the two ranks (the start-up is most of
    a rank's time): the directory of their files, each rank's (exit code, stderr) and the launch's end."""
    tmp = tmp_path_factory.mktemp("dp-run")
    runs = _ranks(tmp, arts[0], "cpu,host,oneshot_off,oneshot,oneshot_reversed,spec,nocache,die",
                  env={"V4COMPILE_DIST_TIMEOUT": "20"}, spec=spec_art, nccl=nccl_art)
    return tmp, [(code, err) for code, _, err in runs], time.time()


@pytest.mark.parametrize("device", ["cpu", "host"])
def test_dp_ranks_match_the_single_process_run(dp_run, reference, device):
    check_against_reference(dp_run[0], device, reference)


def test_oneshot_rows_collectives_equal_the_communicators(dp_run):
    """The sm_90a program's one-shot all-gather / reduce-scatter of rows (`passes/oneshot_allreduce.py`), folded into
    the MoE's launch between them with the seam before it (`passes/fuse_oneshot_rows.py`: the seam first, its pointers
    through the call's table, the gather of its output next, the reduce-scatter the trailing part), run by that
    launch's kernel on the host device (layer 1 at decode, interpreted, the rest of the MoE with them;
    `dp_worker.rows_kernels`) give the ids and every logits row of the program compiled with them on the communicator
    (`oneshot_off`: `--allreduce nccl`, layer 1's seam before the MoE and MoE at decode by their kernels, the gather
    and the reduce-scatter on gloo; two prompts, one a replica, 4 tokens) bit for bit on both ranks (at 2 ranks gloo's
    a + b is the kernel's rank-order sum; the order past 2 ranks: tests/kernels/test_kernels_allreduce.py); the
    all-gather placing the ranks' rows in reverse order is caught (a table in another order faults the host device's
    memory guard: shown by hand, and `test_dp_seam_pointers_reach_the_kernel_through_its_table` checks the tables)."""
    tmp = dp_run[0]
    for r in range(2):
        ran = [line.split() for line in (tmp / f"oneshot-ran-{r}.txt").read_text().splitlines()]
        # the folded launch ran, the seam before and both collectives in it (`allreduce.fold_rows`' name), in both
        # runs; unfolded, the seam's and the MoE's kernels
        assert [m for m, _ in ran] == ["oneshot_off", "oneshot_off", "oneshot", "oneshot_reversed"], ran
        assert ran[0][1].startswith("mhc_post_pre_") and ran[1][1].startswith("moe_fused_") and "_ag_" not in ran[1][1]
        # (`_tab`: the seam's pointers through the call's table, which the runtime filled: `moe_router.TABLED`)
        assert all(n.startswith("moe_fused_") and "_seams_ag_g2_rs_g2_" in n and n.endswith("_tab")
                   for _, n in ran[2:]), ran
        want, got, bad = (np.load(tmp / f"{d}-rank-{r}.npz") for d in ("oneshot_off", "oneshot", "oneshot_reversed"))
        rows = [k for k in want.files if k.startswith("rows-")]
        assert want["ids"].tolist() == got["ids"].tolist()
        assert all(np.array_equal(want[k], got[k]) for k in rows), f"rank {r}: the one-shot's logits differ"
        assert not all(np.array_equal(want[k], bad[k]) for k in rows if k in bad.files), f"rank {r}: not caught"


def test_dp_speculative_ranks_match_plain_decoding(dp_run, reference):
    """`generate(..., speculative="mtp")` on the dp artifact (the MTP block drafting 2 tokens a step): each
    rank verifies its own replica's sequences, every rank takes part in every verify and draft call (a
    replica without work pads), and the greedy ids are the single-process plain decoding's on every rank."""
    ids, _ = reference
    for r in range(2):
        g = np.load(dp_run[0] / f"spec-rank-{r}.npz")
        assert g["ids"].tolist() == [t for seq in ids for t in seq] and g["lens"].tolist() == [NEW] * len(PROMPTS)


def test_the_comparison_catches_rows_of_another_replica(dp_run, reference, tmp_path):
    """The check above on the run's own files with request 0's rows swapped for request 1's (the first
    sequence of each replica: what a reduce-scatter handing each rank the other's rows would mix): it fails.
    (The collective itself keeping the wrong rows: test_partition_dp.py, every rank in one process.)"""
    for r in range(2):
        g = dict(np.load(dp_run[0] / f"cpu-rank-{r}.npz"))
        g["rows-0"], g["rows-1"] = g["rows-1"], g["rows-0"]
        np.savez(tmp_path / f"cpu-rank-{r}.npz", **g)
    with pytest.raises(AssertionError, match="logits off by"):
        check_against_reference(tmp_path, "cpu", reference)


def test_a_killed_dp_rank_ends_the_other_in_bounded_time(dp_run):
    """The launch's last run: rank 1 exits abruptly at its third decode step; rank 0 ends with one `error:`
    line (a DeviceError naming the failed collective) within the process group's timeout (20 s here), timed
    from the start of that run."""
    import re

    _, ((code0, err0), (code1, err1)), end = dp_run
    assert code1 == 3 and code0 == 2, (code0, err0[-2000:])
    start = float(re.findall(r"^v4-test-die-start (\d+\.\d+)$", err0, re.M)[0])
    lines = [ln for ln in without_ready(err0).strip().splitlines() if not ln.startswith("v4-test-die-start")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0:") and "failed" in lines[0], lines
    assert end - start < 60


def test_dp_tp_ranks_match_the_single_process_run(arts, reference, tmp_path):
    """--dp 2 --tp 2 --ep 4: four ranks, two replicas of two (attention heads split inside a replica, the
    experts over all four), the cpu device: the same prompts, placements, ids and logits rows (within TOL) as
    the single-process run, on every rank."""
    art = _compile(tmp_path / "dp2tp2", ("--dp", "2", "--tp", "2", "--ep", "4"), targets="cpu")
    runs = _ranks(tmp_path, art, "cpu", world=4)
    assert [code for code, _, _ in runs] == [0] * 4, [without_ready(err)[-2000:] for _, _, err in runs]
    check_against_reference(tmp_path, "cpu", reference, world=4)



def check_cache_hit(tmp: Path, device: str) -> None:
    """The fifth prompt (sharing 18 tokens with the second) went to the replica the second ran on and took a
    piece (PIECE tokens) from that replica's prefix cache, on every rank; the cpu device's run is byte for byte
    the cache-off run's (`nocache`: the same artifact, ranks and prompts, the prefix cache off, in which the
    fifth prompt goes to the other replica: so the cache placed it)."""
    for r in range(2):
        g, off = np.load(tmp / f"{device}-rank-{r}.npz"), np.load(tmp / f"nocache-rank-{r}.npz")
        assert g["cached"].tolist() == [0, 0, 0, 0, PIECE], f"{device} rank {r}: cached tokens {g['cached']}"
        if device == "spec":  # the compiled MTP block's prefill (rows and replicas not recorded)
            continue
        assert g["replicas"][4] == g["replicas"][1], f"{device} rank {r}: the fifth prompt is not where its prefix is"
        assert off["cached"].tolist() == [0] * 5 and off["replicas"][4] != off["replicas"][1]
        assert g["ids"].tolist() == off["ids"].tolist(), f"{device} rank {r}: ids are not the cache-off run's"
        if device == "cpu":
            for i in range(len(PROMPTS)):
                assert np.array_equal(g[f"rows-{i}"], off[f"rows-{i}"]), \
                    f"{device} rank {r}: request {i}'s logits are not the cache-off run's"


@pytest.mark.parametrize("device", ["cpu", "host", "spec"])
def test_dp_prefix_cache_hit_across_ranks(dp_run, device):
    """A real prefix-cache hit across two gloo ranks (`check_cache_hit`); the logits of the host device's run
    are checked against the cache-off single-process run (`reference`, within TOL) above."""
    check_cache_hit(dp_run[0], device)


@pytest.mark.parametrize("fault", ["no hit", "other replica", "one ulp"])
def test_the_cache_hit_check_catches(dp_run, tmp_path, fault):
    """`check_cache_hit` on the run's own cpu files with the fifth prompt's cached tokens zeroed, its replica
    changed, or one of its logits one ulp off: it fails."""
    import shutil

    for r in range(2):
        shutil.copy(dp_run[0] / f"nocache-rank-{r}.npz", tmp_path)
        g = dict(np.load(dp_run[0] / f"cpu-rank-{r}.npz"))
        if fault == "no hit":
            g["cached"] = np.zeros_like(g["cached"])
        elif fault == "other replica":
            g["replicas"][4] = 1 - g["replicas"][4]
        else:
            g["rows-4"][-1, 0] = np.nextafter(g["rows-4"][-1, 0], np.float32(np.inf))
        np.savez(tmp_path / f"cpu-rank-{r}.npz", **g)
    with pytest.raises(AssertionError, match="cached tokens|not where its prefix is|logits are not"):
        check_cache_hit(tmp_path, "cpu")
