"""indexer_select kernel (scores, then the pick in each lane's last program) vs the op reference (interpreter): native / fp4 / fp8 index planes, fp32 and
bf16 queries, lanes that see fewer rows than k (all taken), more (top-k), none (padding), a position
beyond the compiled maximum (clamped) and a non-power-of-two row maximum (two score blocks).

Checked exactly: indptr (min(k, visible rows) per lane). The picks: the kernel lists them in ascending
row order and the reference by descending score, and rows with equal scores (ReLU zeros) may be picked
either way, so per lane the check is the top-k property against the reference's own scores: the same
count, only visible rows, no duplicates, and min(picked) >= max(not picked) - 1e-6 x max|score| (fp32
summation order of the head sum). Where no such tie exists this is the same set as the reference's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import DT, index_planes, positions  # noqa: E402
from kernel_check import install_broken_kernel, poisoned, reference  # noqa: E402
from v4compile.errors import CodegenError  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402
from v4compile.ops.paged import compressed_row  # noqa: E402

CASES = [  # dtype, fmt, starts, counts, T, Hi, di, k, max_rows
    ("fp32", "native", [0, 30], [5, 5], 5, 8, 32, 4, 64),
    ("bf16", "fp4", [500, 9, 0], [1, 1, 0], 1, 8, 64, 7, 70),
    ("fp32", "fp8", [40, 14], [3, 2], 3, 4, 32, 5, 16),
]


def _run(dtype, fmt, starts, counts, T, Hi, di, k, max_rows, seed=0, wrong=None):
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    B = len(starts)
    ratio, block_tokens, ienv, ioff, env = 4, 32, 13, 5, 9
    per_block = block_tokens // ratio
    blocks = -(-max_rows // per_block)
    bt = torch.randperm(B * blocks + 1, generator=g)[: B * blocks].view(B, blocks).to(torch.int32)
    planes = index_planes(fmt, (B * blocks + 1) * ienv, di, dt, g)
    pos = positions(starts, counts, T)
    args = {"q": torch.randn(B, T, Hi, di, generator=g).to(dt), "weights": torch.rand(B, T, Hi, generator=g).to(dt),
            "pos": pos, "block_table": bt, "p0": planes[0], "p1": planes[1] if len(planes) > 1 else None}
    attrs = {"ratio": ratio, "q_scale": di ** -0.5, "w_scale": Hi ** -0.5, "k": k, "block_tokens": block_tokens,
             "index_envelope_rows": ienv, "index_offset": ioff, "envelope_rows": env, "max_rows": max_rows, "fmt": fmt}
    want = reference("indexer_select", args, attrs)
    scores = reference("indexer_scores_paged", args, {**attrs, "envelope_rows": ienv, "layer_offset": ioff})[0]
    outs = {"indptr": poisoned(want[0].shape, torch.int32)[0], "indices": poisoned(want[1].shape, torch.int32)[0]}
    launch("indexer_select", args, dict(attrs, **(wrong or {})), outs)
    assert torch.equal(outs["indptr"], want[0]), f"indptr {outs['indptr'].tolist()} != {want[0].tolist()}"
    ip = want[0].tolist()
    for lane in range(B * T):
        b, t = divmod(lane, T)
        s = scores[b, t]
        rows = compressed_row(torch.arange(max_rows), torch.full((max_rows,), b), bt, ratio, block_tokens, env)
        w_of = {int(r): w for w, r in enumerate(rows.tolist())}
        got = outs["indices"][ip[lane]: ip[lane + 1]].tolist()
        assert all(r in w_of for r in got), f"lane {lane}: rows {got} are not this sequence's"
        ws = [w_of[r] for r in got]
        assert len(set(ws)) == len(ws), f"lane {lane}: duplicate picks {ws}"
        assert all(torch.isfinite(s[w]) for w in ws), f"lane {lane}: picked a row it may not see"
        rest = torch.ones(max_rows, dtype=torch.bool)
        rest[ws] = False
        tol = 1e-6 * s[torch.isfinite(s)].abs().max() if torch.isfinite(s).any() else 0
        if ws and rest.any():
            assert s[ws].min() >= s[rest].max() - tol, f"lane {lane}: not a top-{k}: {ws}"


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-T{c[4]}" for c in CASES])
def test_indexer_select(case):
    _run(*case)


@pytest.mark.parametrize("wrong", [{"index_offset": 4}, {"k": 3}, {"w_scale": -1.0}])
def test_wrong_kernel_is_caught(wrong):
    with pytest.raises(AssertionError):
        _run(*CASES[0], wrong=wrong)


@pytest.mark.parametrize("old,new,error", [
    # no program picks (nor resets its counter)
    ("last_to_arrive(sem_ptr + lane, (MAXR + BR - 1) // BR)", "last_to_arrive(sem_ptr + lane, (MAXR + BR - 1) // BR + 1)",
     CodegenError),
    # the last program picks for the wrong lane
    ("_pick(lane,", "_pick(lane * 0,", AssertionError),
    # the counter is left set: the next call of the program would pick early
    ("tl.store(sem_ptr + lane, 0)", "pass", CodegenError),
])
def test_broken_arrival_is_caught(monkeypatch, tmp_path, old, new, error):
    """The pick runs in the last of a lane's score programs to arrive (case 1: two score blocks)."""
    from v4compile.codegen.kernels import indexer
    install_broken_kernel(monkeypatch, tmp_path, indexer, "indexer_select_kernel", old, new)
    with pytest.raises(error):
        _run(*CASES[1])
