"""compress_paged kernel vs its op reference (interpreter): HCA (non-overlapping) and CSA (overlapping)
main-pool compressors and the indexer's compressor, native / fp8 (main: NoPE + scale + RoPE planes;
index: e4m3 + fp32 scale) / fp4 planes, official rounding (FP8 NoPE, Hadamard + FP4), prefill chunks
that close several windows, windows that take their first slots from the state ring, decode steps that
close a window and ones that do not, padding lanes and a sequence with no valid lane.

Checked: the state rings bit for bit (copies and one fp32 add); native planes against the reference's
with fp32 1e-5 x max|ref|, bf16 1 bf16 ulp (the per-slot softmax and the RMS are summed in another
order, an fp32 ulp that may move a bf16 rounding); FP8 / FP4 planes bit for bit (such an ulp could in
principle move an e4m3 / e2m1 rounding; for these seeded cases it does not, and a change would be
reported with the row).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import DT, assert_plane, index_planes, main_planes, positions  # noqa: E402
from kernel_check import assert_matches, reference  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402

CASES = [  # dtype, ratio, overlap, starts, counts, T, dk, rope, fmt (main|index), round, state dtype
    ("fp32", 4, False, [0, 6, 3], [5, 5, 0], 5, 24, 8, "native", "none", "fp32"),
    ("bf16", 4, True, [0, 13], [9, 4], 9, 56, 8, "fp8", "fp8", "bf16"),
    ("bf16", 4, True, [11, 12], [1, 1], 1, 32, 8, "index-fp4", "fp4", "fp32"),
    ("fp32", 4, True, [3, 27], [1, 1], 1, 32, 8, "index-fp8", "none", "fp32"),
    ("bf16", 64, False, [127, 50], [1, 1], 1, 32, 8, "native", "none", "fp32"),   # 64 slots: two slot chunks
]


def operands(dtype, ratio, overlap, starts, counts, T, dk, rope, fmt, rnd, sdt, seed=0):
    """(args, attrs, planes, plane format) of one seeded case (also `test_kernels_compress_pair.py`'s)."""
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    B = len(starts)
    c = 2 if overlap else 1
    CW = c * dk
    block_tokens, env, layer_offset = 2 * ratio, 5, 1
    per_block = block_tokens // ratio
    blocks = (max(starts) + T) // ratio // per_block + 2
    bt = torch.randperm(B * blocks + 1, generator=g)[: B * blocks].view(B, blocks).to(torch.int32)
    n_rows = (B * blocks + 1) * env
    if fmt.startswith("index"):
        planes = index_planes(fmt.split("-")[1], n_rows, dk, dt, g)
        pf = fmt.split("-")[1]
    else:
        planes = main_planes(fmt, n_rows, dk, rope, dt, g)
        pf = fmt
    slots = B + 1
    args = {"kv": torch.randn(B, T, CW, generator=g).to(dt), "gate": torch.randn(B, T, CW, generator=g).to(dt),
            "ape": torch.randn(ratio, CW, generator=g), "norm": torch.rand(dk, generator=g) + 0.5,
            "state_kv": torch.randn(slots, c * ratio, CW, generator=g).to(DT[sdt]),
            "state_gate": torch.randn(slots, c * ratio, CW, generator=g), "pos": positions(starts, counts, T),
            "slot": torch.randperm(slots, generator=g)[:B].to(torch.int32), "block_table": bt,
            **{f"p{i}": (planes[i] if i < len(planes) else None) for i in range(3)}}
    attrs = {"ratio": ratio, "overlap": overlap, "eps": 1e-6, "rope_dim": rope, "theta": 160000.0,
             "yarn": (16.0, 256, 32.0, 1.0), "round": rnd, "block_tokens": block_tokens, "envelope_rows": env,
             "layer_offset": layer_offset, "fmt": pf}
    return args, attrs, planes, pf


def _run(*case, seed=0, wrong=None):
    args, attrs, planes, pf = operands(*case, seed=seed)
    want = reference("compress_paged", args, attrs)
    assert not torch.equal(want[2].view(torch.uint8) if want[2].element_size() == 1 else want[2],
                           args["p0"].view(torch.uint8) if want[2].element_size() == 1 else args["p0"]), \
        "case closes no window: it would not test the pooling"
    work = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    outs = {"state_kv_out": work["state_kv"], "state_gate_out": work["state_gate"],
            **{f"q{i}": work[f"p{i}"] for i in range(len(planes))}}
    launch("compress_paged", work, dict(attrs, **(wrong or {})), outs)
    assert_plane(outs["state_kv_out"], want[0], "compress_paged state_kv")
    assert_plane(outs["state_gate_out"], want[1], "compress_paged state_gate")
    if pf == "native":
        assert_matches(outs["q0"], want[2], "compress_paged rows", ulps=1.0)
    else:
        for i in range(len(planes)):
            assert_plane(outs[f"q{i}"], want[2 + i], f"compress_paged plane {i}")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-m{c[1]}-{'csa' if c[2] else 'hca'}-T{c[5]}-{c[8]}" for c in CASES])
def test_compress_paged(case):
    _run(*case)


@pytest.mark.parametrize("wrong", [{"layer_offset": 0}, {"eps": 1.0}, {"theta": 10000.0}])
def test_wrong_kernel_is_caught(wrong):
    with pytest.raises(AssertionError):
        _run(*CASES[1], wrong=wrong)



def test_padding_lane_leaves_the_last_slot_to_its_sequence():
    """A decode step whose one live sequence holds the last slot and whose padding lane has slot -1 (a replica
    running one sequence in a reused slot, issue 34): the sequence's token lands in its ring and no other slot
    changes, in the reference (slot -1 used to index the last slot and write its old ring back over the
    sequence's: the host device's departure at decode position 11) and in the kernel. The old write order is
    caught by the same check."""
    from v4compile.ops.compressor import update_ring

    args, attrs, _, _ = operands("fp32", 4, True, [7, 0], [1, 0], 1, 24, 8, "native", "none", "fp32", seed=3)
    last = args["state_kv"].shape[0] - 1
    args["slot"] = torch.tensor([last, -1], dtype=torch.int32)
    want, _ = update_ring(args["state_kv"][last:], args["state_gate"][last:], args["kv"][:1], args["gate"][:1],
                          args["pos"][:1])
    assert not torch.equal(want[0], args["state_kv"][last]), "the step pushes nothing: it would test nothing"

    def check(state_kv, what):
        assert torch.equal(state_kv[last], want[0]), f"{what}: the sequence's ring push is lost"
        assert torch.equal(state_kv[:last], args["state_kv"][:last]), f"{what}: another slot changed"

    got = reference("compress_paged", args, attrs)
    check(got[0], "reference")
    work = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    outs = {"state_kv_out": work["state_kv"], "state_gate_out": work["state_gate"], "q0": work["p0"]}
    launch("compress_paged", work, attrs, outs)
    check(outs["state_kv_out"], "kernel")
    old = got[0].clone()
    old[args["slot"].long()] = torch.stack([want[0], args["state_kv"][last]])  # every lane written back, in order
    with pytest.raises(AssertionError, match="push is lost"):
        check(old, "old reference")
