"""csr_window / csr_compressed / csr_selected kernels vs their op references (interpreter). Integer
results, compared exactly: indptr in full, indices up to indptr[L] (the tail is unused by contract)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import positions  # noqa: E402
from kernel_check import poisoned, reference  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402


def _check(op, args, attrs, shapes, kernel_attrs=None):
    """`kernel_attrs` (the wrong-kernel test) launches with different attributes than the reference."""
    want = reference(op, args, attrs)
    outs = {"indptr": poisoned(shapes[0], torch.int32)[0], "indices": poisoned(shapes[1], torch.int32)[0]}
    launch(op, args, kernel_attrs or attrs, outs)
    assert torch.equal(outs["indptr"], want[0]), f"{op} indptr {outs['indptr'].tolist()} != {want[0].tolist()}"
    n = int(want[0][-1])
    got, exp = outs["indices"][:n], want[1][:n]
    assert torch.equal(got, exp), f"{op} indices differ at {(got != exp).nonzero()[:5].flatten().tolist()}"
    return want


WINDOW_CASES = [  # starts, counts, T, window
    ([0, 7, 30], [5, 3, 0], 5, 4),        # seq 0 starts empty (no history), seq 2 all padding
    ([3, 100], [1, 1], 1, 128),           # decode; 100 < window - 1 keeps all history
    ([200, 9], [1, 1], 1, 16),            # full window (the largest row count)
    ([17], [70], 70, 8),                  # more lanes than one prefix chunk (BL = 64)
]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_csr_window(case):
    starts, counts, T, window = case
    B = len(starts)
    pos = positions(starts, counts, T)
    slot = torch.randperm(B + 2, generator=torch.Generator().manual_seed(1))[:B].to(torch.int32)
    attrs = {"window": window, "slot_rows": 3 * window, "n_rows": 7 + (B + 2) * 3 * window}
    _check("csr_window", {"pos": pos, "slot": slot}, attrs, ((B * T + 1,), (B * T * (window - 1),)))


def _block_table(B, blocks, g):
    bt = torch.randperm(B * blocks, generator=g).view(B, blocks).to(torch.int32)
    bt[:, -1] = -1  # an unallocated block
    return bt


@pytest.mark.parametrize("case", [([0, 5, 60], [5, 5, 0], 5, 4, 16, 16), ([90, 3], [1, 1], 1, 4, 16, 20),
                                  ([1000], [3], 3, 16, 64, 70)])
def test_csr_compressed(case):
    starts, counts, T, ratio, block_tokens, max_rows = case
    B = len(starts)
    g = torch.Generator().manual_seed(2)
    pos = positions(starts, counts, T)
    blocks = -(-max_rows * ratio // block_tokens) + 1
    attrs = {"ratio": ratio, "block_tokens": block_tokens, "envelope_rows": 23, "max_rows": max_rows}
    _check("csr_compressed", {"pos": pos, "block_table": _block_table(B, blocks, g)}, attrs,
           ((B * T + 1,), (B * T * max_rows,)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_csr_selected(dtype):
    g = torch.Generator().manual_seed(3)
    B, T, K, ratio, bt_tokens = 2, 3, 7, 4, 16
    pos = positions([10, 40], [3, 2], T)
    sel = torch.randint(0, 12, (B, T, K), generator=g)
    sel[torch.rand(B, T, K, generator=g) < 0.3] = -1
    sel[0, 1] = -1  # an empty row
    attrs = {"ratio": ratio, "block_tokens": bt_tokens, "envelope_rows": 9}
    _check("csr_selected", {"selected": sel.to(dtype), "pos": pos, "block_table": _block_table(B, 4, g)}, attrs,
           ((B * T + 1,), (B * T * K,)))


def test_wrong_kernel_is_caught():
    """The same check must fail on a wrong kernel: window rows in a slot of the wrong size."""
    pos = positions([200, 9], [1, 1], 1)
    slot = torch.tensor([1, 0], dtype=torch.int32)
    attrs = {"window": 16, "slot_rows": 48, "n_rows": 200}
    with pytest.raises(AssertionError, match="indices differ"):
        _check("csr_window", {"pos": pos, "slot": slot}, attrs, ((3,), (30,)), dict(attrs, slot_rows=32))
