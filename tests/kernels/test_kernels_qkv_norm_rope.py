"""qkv_norm_rope kernel vs its op reference (interpreter): hf numerics (fp32), official numerics (bf16,
FP8 kv rounding, indexer q Hadamard + FP4), YaRN and plain RoPE, prefill with padding lanes and decode
with the window-ring write into native and fp8 pool planes (updated in place).

Tolerance: the kernel performs the reference's roundings in the same order (rsqrt rounded to the
activation dtype, cos / sin rounded to it, one rounding after the rotation, FP8 / FP4 quantisation with
exact power-of-two scales). fp32 outputs: 1e-5 x max|ref| (cos / sin / rsqrt differ by an fp32 ulp
between numpy and torch); bf16: 1 bf16 ulp (such an fp32 ulp may move a bf16 rounding). The pool planes
must hold the kernel's own kv_out row written by the reference writer, bit for bit.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import DT, assert_plane, main_planes, positions  # noqa: E402
from kernel_check import assert_matches, poisoned, reference  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402

YARN = (16.0, 256, 32.0, 1.0)
CASES = [  # dtype, starts, counts, T, H, d, dim, yarn, kv_round, qi (Hi, di, round), planes fmt
    ("fp32", [0, 9], [3, 1], 3, 4, 32, 16, (), 0, None, None),
    ("bf16", [5, 300], [4, 2], 4, 4, 32, 16, YARN, 16, (8, 32, "fp4"), None),
    ("bf16", [7, 20, 0], [1, 1, 0], 1, 4, 56, 8, YARN, 48, (4, 32, "fp4"), "fp8"),   # decode, a padding lane
    ("fp32", [3, 1000], [1, 1], 1, 20, 24, 8, (), 0, (3, 16, "none"), "native"),      # 2 head blocks
]


def _run(dtype, starts, counts, T, H, d, dim, yarn, kv_round, qi, fmt, seed=0, wrong=None, q_mean="fp32"):
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    B = len(starts)
    pos = positions(starts, counts, T)
    args = {"q": (torch.randn(B, T, H, d, generator=g) * 2).to(dt), "kv": (torch.randn(B, T, d, generator=g) * 3).to(dt),
            "norm": torch.rand(d, generator=g) + 0.5, "pos": pos, "qi": None, "slot": None,
            "p0": None, "p1": None, "p2": None}
    attrs = {"eps": 1e-6, "dim": dim, "theta": 10000.0, "yarn": yarn, "kv_round_dims": kv_round,
             "kv_round_block": 16, "qi_round": "none", "q_mean": q_mean}
    if qi is not None:
        args["qi"] = torch.randn(B, T, qi[0], qi[1], generator=g).to(dt)
        attrs["qi_round"] = qi[2]
    if fmt is not None:
        window, slot_rows = 8, 24
        n_rows = 5 + (B + 1) * slot_rows
        planes = main_planes(fmt, n_rows, d, 8, dt, g)
        args.update(slot=torch.randperm(B + 1, generator=g)[:B].to(torch.int32),
                    **{f"p{i}": (planes[i] if i < len(planes) else None) for i in range(3)})
        attrs.update(window=window, slot_rows=slot_rows, n_rows=n_rows, layer_row=8, fmt=fmt)
    want = reference("qkv_norm_rope", args, attrs)
    work = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    outs = {"q_out": poisoned(want[0].shape, dt, pad=3)[0], "kv_out": poisoned(want[1].shape, dt)[0]}
    names = ["q_out", "kv_out"] + (["qi_out"] if qi is not None else [])
    if qi is not None:
        outs["qi_out"] = poisoned(want[2].shape, dt)[0]
    for i in range(3):
        if work[f"p{i}"] is not None:
            outs[f"q{i}"] = work[f"p{i}"]
            names.append(f"q{i}")
    launch("qkv_norm_rope", work, dict(attrs, **(wrong or {})), outs)
    if fmt is not None:  # the ring write of the kernel's own kv row, exactly (kv_out is checked below)
        planes = reference("pool_write_window", {"kv": outs["kv_out"], "pos": pos, "slot": args["slot"],
                                                 **{f"p{i}": args[f"p{i}"] for i in range(3)}},
                           {k: attrs[k] for k in ("window", "slot_rows", "n_rows", "layer_row", "fmt")})
        want = list(want[: len(want) - len(planes)]) + list(planes)
    for n, w in zip(names, want):
        if n.startswith("q") and n[1:].isdigit():
            assert_plane(outs[n], w, f"qkv_norm_rope plane {n}")
        elif dt == torch.bfloat16:
            assert_matches(outs[n], w, f"qkv_norm_rope {n}", ulps=1.0)
        else:
            assert_matches(outs[n], w, f"qkv_norm_rope {n}")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[3]}-{c[10]}" for c in CASES])
def test_qkv_norm_rope(case):
    _run(*case)


@pytest.mark.parametrize("wrong", [{"theta": 5e5}, {"layer_row": 16}, {"eps": 1.0}])
def test_wrong_kernel_is_caught(wrong):
    with pytest.raises(AssertionError):
        _run(*CASES[2], wrong=wrong)


def test_q_mean_in_the_activation_dtype():
    """Official numerics (spec 15 item 10): the q norm's statistic in bf16, the official bf16 case."""
    _run(*CASES[1], q_mean="dtype")
