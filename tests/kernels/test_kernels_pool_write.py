"""pool_write_window kernel vs its op reference (interpreter). Planes are compared bit for bit: the
kernel's only arithmetic is the FP8 row quantisation (exact power-of-two scales) and casts."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import assert_plane, main_planes, positions  # noqa: E402
from kernel_check import reference  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402

CASES = [  # (fmt, dtype, starts, counts, T, window, d, rope)
    ("native", "fp32", [0, 7, 30], [5, 3, 0], 5, 4, 24, 8),    # T > window: only the last 4 lanes of seq 0
    ("bf16", "fp32", [2, 0], [1, 1], 1, 8, 24, 8),              # decode-like, fp32 compute, bf16 plane
    ("native", "bf16", [9, 3], [6, 2], 6, 16, 40, 8),
    ("fp8", "bf16", [0, 13, 5], [3, 7, 0], 7, 4, 56, 8),        # 48 NoPE dims = 3 x 16 (non-pow2 groups)
    ("fp8", "fp32", [100], [1], 1, 8, 32, 16),
]


def _run(fmt, dtype, starts, counts, T, window, d, rope, seed=0, wrong=False):
    g = torch.Generator().manual_seed(seed)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    B = len(starts)
    n_layers, layer = 3, 1
    slot_rows = n_layers * window
    n_rows = 10 + (B + 1) * slot_rows
    kv = (torch.randn(B, T, d, generator=g) * 3).to(dt)
    pos = positions(starts, counts, T)
    slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
    planes = main_planes(fmt, n_rows, d, rope, dt, g)
    attrs = {"window": window, "slot_rows": slot_rows, "n_rows": n_rows, "layer_row": layer * window, "fmt": fmt}
    args = {"kv": kv, "pos": pos, "slot": slot, **{f"p{i}": (planes[i] if i < len(planes) else None) for i in range(3)}}
    want = reference("pool_write_window", args, attrs)
    if wrong:  # a deliberately wrong spec: the ring slot ignores the layer's offset
        attrs = dict(attrs, layer_row=0)
    work = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    outs = {f"q{i}": work[f"p{i}"] for i in range(len(planes))}
    launch("pool_write_window", work, attrs, outs)
    for i, w in enumerate(want):
        assert_plane(outs[f"q{i}"], w, f"pool_write_window {fmt}/{dtype} plane {i}")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-T{c[4]}" for c in CASES])
def test_pool_write_window(case):
    _run(*case)


def test_wrong_kernel_is_caught():
    with pytest.raises(AssertionError):
        _run(*CASES[3], wrong=True)
