"""The one-shot all-reduce kernel (codegen/kernels/allreduce.py) across 3 real processes, interpreted: each rank's
result equals the IR's rank-order sum (`ops.collective._rank_sum`) bit for bit, in bf16 and fp32, over
consecutive all-reduces that reuse both slots; broken kernels are caught (another order, no wait, one slot), and
a peer that never arrives ends the others with the status error in bounded time. Three ranks, not two: two
values add the same in either order, so only three tell the rank order from another.

One launch of the ranks runs every scenario (tests/allreduce_worker.py), so the imports are paid once."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_launch import launch, without_ready  # noqa: E402

WORKER = Path(__file__).resolve().parents[1] / "allreduce_worker.py"
WORLD = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("allreduce")
    t0 = time.monotonic()
    out = launch([sys.executable, str(WORKER), str(d)], WORLD, timeout_s=240)
    wall = time.monotonic() - t0
    for rc, o, e in out:
        assert rc == 0, without_ready(e)[-3000:]
    return [json.loads(o.strip().splitlines()[-1]) for _, o, _ in out], wall


def test_exact_rank_order(ranks):
    res, _ = ranks
    for r, got in enumerate(res):
        assert got["exact"]["error"] is None
        assert [eq for eq, _ in got["exact"]["equal"]] == [True] * 4, f"rank {r}: {got['exact']}"
        # the data discriminates: the reverse order rounds differently from the rank order
        assert not all(same for _, same in got["exact"]["equal"])
    assert not res[0]["reversed"]["equal"][0][1]


def test_other_order_caught(ranks):
    res, _ = ranks
    assert all(not got["reversed"]["equal"][0][0] for got in res)


def test_no_wait_caught(ranks):
    res, _ = ranks
    # ranks 0 and 1 read the last rank's slot before it wrote it
    assert [got["no_wait"]["equal"][0][0] for got in res[:2]] == [False, False]


def test_one_slot_caught_two_slots_hold(ranks):
    res, _ = ranks
    assert all(got["slow"]["error"] is None and [e for e, _ in got["slow"]["equal"]] == [True, True] for got in res)
    # the slow last rank reads the fast ranks' slot after they overwrote it with the next all-reduce's tile
    assert not res[-1]["one_slot"]["equal"][0][0]


def test_mixed_element_types_share_no_tile_bytes(ranks):
    """bf16, fp32, bf16 on one region, the last rank reading slowly: every result exact, as a tile is the same bytes
    of a slot in every call. With tiles of 2048 elements whatever the type, the fast ranks' next bf16 all-reduce
    overwrites half of the fp32 tile the slow rank is still to read: its fp32 result is wrong."""
    res, _ = ranks
    assert all(got["dtypes"]["error"] is None and [e for e, _ in got["dtypes"]["equal"]] == [True] * 3 for got in res)
    assert not res[-1]["dtypes_element_tiles"]["equal"][1][0]


def test_late_peer_ends_with_error(ranks):
    res, _ = ranks
    for r, got in enumerate(res[:2]):
        assert got["late"]["error"] == (f"rank {r}: peer rank 2 of its group of 3 did not reach one-shot "
                                        f"all-reduce 1 within 64 polls"), got["late"]
        assert got["late"]["seconds"] < 20


def test_rows_exact(ranks):
    """The one-shot all-gather / reduce-scatter of rows (`rows_kernel`) equal `ops/collective`'s references bit
    for bit, between all-reduces on the same region; the data discriminates (the reverse rank order differs)."""
    res, _ = ranks
    for r, got in enumerate(res):
        assert got["rows"]["error"] is None
        assert [eq for eq, _ in got["rows"]["equal"]] == [True] * 6, f"rank {r}: {got['rows']}"
        assert not any(same for _, same in got["rows"]["equal"][:2])


def test_rows_broken_caught(ranks):
    """A reduce-scatter summing in reverse rank order, an all-gather placing the ranks' rows in reverse order, and a
    reduce-scatter that does not wait (the last rank starts late) are each caught."""
    res, _ = ranks
    assert all(not got["rs_reversed"]["equal"][0][0] for got in res)
    assert all(not got["ag_rank_order"]["equal"][0][0] for got in res)
    assert [got["rs_no_wait"]["equal"][0][0] for got in res[:2]] == [False, False]


def test_compiles_without_spills(tmp_path):
    """V4-Pro's decode all-reduce (8 rows x 7168 bf16, 112 KB, over 8 ranks) and DP8's rows all-gather / reduce-
    scatter of the MoE's input / output (64 gathered rows) compiled for both GPU targets: no
    spills, and each binary waits its own GPU bound on a peer (the interpreted bound is ~30 s of polls there)."""
    from v4compile.codegen import aot
    from v4compile.codegen.kernels import TensorArg, allreduce
    from v4compile.ir.types import TensorType
    from v4compile.targets import GPU_TARGETS

    x = TensorArg(TensorType((8, 7168), "bf16"), (7168, 1))
    call = allreduce.oneshot_call(x, x, 8, allreduce.Region(8, allreduce.MAX_BYTES))
    # and DP8's MoE input gathered / output reduce-scattered (8 x 8 rows: the region holds the gathered value)
    whole = TensorArg(TensorType((64, 7168), "bf16"), (7168, 1))
    region = allreduce.Region(8, whole.type.nbytes)
    calls = [call, allreduce.rows_call("all_gather_rows", x, whole, 8, region),
             allreduce.rows_call("reduce_scatter_rows", whole, x, 8, region)]
    rows = aot.compile_calls(calls, list(GPU_TARGETS), tmp_path, jobs=2)
    assert sorted(r["target"] for r in rows) == sorted(GPU_TARGETS * 3)
    for r in rows:
        assert r["spills"] == 0, f"{r['name']} ({r['target']}) spills {r['spills']}"
    for c in calls:
        for t in GPU_TARGETS:
            assert c.for_target(t)[2]["SPIN"] > 100 * allreduce.SPIN
