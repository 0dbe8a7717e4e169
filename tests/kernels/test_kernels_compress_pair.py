"""compress_pair (a CSA layer's two compressors in one launch, `passes/pair_compressors.py`) vs the two
compress_paged launches it replaces, under the interpreter: every result (both halves' state rings and pool
planes) bit for bit, on a decode step that closes windows (the prefill chunk's halves are the same
`compress_program` on other constexprs, checked by test_kernels_compress.py), with the attention's
compressor (FP8 planes) and the indexer's (FP4 planes, Hadamard) as the two halves. A pair kernel whose
second half read the first half's norm weight is caught."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kernel_check as kc  # noqa: E402
from test_kernels_compress import operands  # noqa: E402
from v4compile.codegen.kernels import compress, launch  # noqa: E402

SHARED = ("pos", "slot", "block_table")
# (main, index) halves: one ratio, positions and chunk, as in a V4 CSA layer
PAIRS = {
    "decode": (("bf16", 4, True, [11, 12], [1, 1], 1, 32, 8, "fp8", "fp8", "fp32"),
               ("bf16", 4, True, [11, 12], [1, 1], 1, 32, 8, "index-fp4", "fp4", "fp32")),
}


def _halves(pair):
    halves = [operands(*case, seed=i + 1) for i, case in enumerate(pair)]
    for k in SHARED:  # one chunk: the second half reads the first's positions, slots and block table
        halves[1][0][k] = halves[0][0][k]
    return halves


def _results(args, planes):
    work = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    outs = {"state_kv_out": work["state_kv"], "state_gate_out": work["state_gate"],
            **{f"q{i}": work[f"p{i}"] for i in range(len(planes))}}
    return work, outs


def check_pair(pair):
    halves = _halves(pair)
    want = []
    for args, attrs, planes, _ in halves:  # two launches, as before the pass
        work, outs = _results(args, planes)
        launch("compress_paged", work, attrs, outs)
        want.append(outs)
    args, attrs, outs = {}, {}, {}
    for i, (a, at, planes, _) in enumerate(halves):
        work, o = _results(a, planes)
        args.update({(k if k in SHARED else f"{k}_{i}"): v for k, v in work.items()})
        attrs.update({f"{k}_{i}": v for k, v in at.items()})
        outs.update({f"{k}_{i}": v for k, v in o.items()})
    calls = launch("compress_pair", args, attrs, outs)
    assert [c.kernel_name for c in calls] == ["compress_pair_kernel"] and calls[0].grid == (4, 1, 1)
    for i, w in enumerate(want):
        for k, t in w.items():
            got = outs[f"{k}_{i}"]
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), f"compress_pair half {i} {k} differs"
    # the case writes rows into both pools (a pair that skipped a half would be caught)
    for i, (a, _, planes, _) in enumerate(halves):
        assert not torch.equal(outs[f"q0_{i}"].view(torch.uint8), a["p0"].view(torch.uint8)), f"half {i} wrote no row"


@pytest.mark.parametrize("step", list(PAIRS))
def test_compress_pair_is_the_two_launches(step):
    check_pair(PAIRS[step])


def test_a_pair_reading_the_wrong_half_is_caught(monkeypatch, tmp_path):
    kc.install_broken_kernel(monkeypatch, tmp_path, compress, "compress_pair_kernel",
                             "norm_ptr_1, skv_ptr_1, sg_ptr_1, pos_ptr", "norm_ptr_0, skv_ptr_1, sg_ptr_1, pos_ptr")
    with pytest.raises(AssertionError, match="half 1"):
        check_pair(PAIRS["decode"])
