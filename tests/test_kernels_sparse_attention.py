"""sparse_attention kernel vs its op reference (interpreter): native and fp8 pool planes, window-only
(SWA), window + all compressed rows (HCA) and window + selected rows (CSA) layers, prefill chunks with
padding lanes and decode, fp32 and bf16.

Tolerances. fp32: 2e-6 x max|ref| + 1e-5 x |ref| (online softmax rescaling and exp order; a few fp32
ulps). bf16: the logits are rounded exactly as the reference rounds them, the only difference is where
the probabilities are rounded to bf16 before the PV product: the reference rounds normalised
probabilities p, the kernel unnormalised exp(s - m_running) (each a relative 2^-9), and the reference
rounds its pool and chunk halves separately before adding them. Bound: 2^-8 x max|value rows| (both
probability roundings, summed over rows with weights adding to <= 1) + 2 bf16 ulps of |ref| (output
roundings).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from attn_cases import DT, main_planes, positions  # noqa: E402
from kernel_check import bf16_ulp, poisoned, reference  # noqa: E402
from v4compile.codegen.kernels import launch  # noqa: E402
from v4compile.ops.paged import read_rows  # noqa: E402


def _operands(kind, fmt, dtype, starts, counts, T, H, d, rope, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    B = len(starts)
    window, ratio, block_tokens, n_layers, env = 8, 4, 16, 3, 11
    max_rows = 64
    blocks = max_rows * ratio // block_tokens
    n_blocks = B * blocks + 1
    slot_rows = n_layers * window
    n_rows = n_blocks * env + (B + 1) * slot_rows
    pos = positions(starts, counts, T)
    slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
    bt = torch.randperm(n_blocks, generator=g)[: B * blocks].view(B, blocks).to(torch.int32)
    planes = main_planes(fmt, n_rows, d, rope, dt, g)
    win = reference("csr_window", {"pos": pos, "slot": slot}, {"window": window, "slot_rows": slot_rows,
                                                                 "n_rows": n_rows})
    csr_attrs = {"ratio": ratio, "block_tokens": block_tokens, "envelope_rows": env}
    if kind == "hca":
        comp = reference("csr_compressed", {"pos": pos, "block_table": bt}, dict(csr_attrs, max_rows=max_rows))
    elif kind == "csa":
        # Distinct picks per lane, as the indexer's top-k makes them (the op lists each key once).
        sel = torch.argsort(torch.rand(B, T, max_rows, generator=g), dim=-1)[..., :5]
        lim = (pos.clamp(min=0) + 1) // ratio
        sel = torch.where(sel < lim.unsqueeze(-1), sel, -1)
        comp = reference("csr_selected", {"selected": sel, "pos": pos, "block_table": bt}, csr_attrs)
    else:
        comp = (None, None)
    args = {"q": (torch.randn(B, T, H, d, generator=g) * 1.5).to(dt), "kv": torch.randn(B, T, d, generator=g).to(dt),
            "pos": pos, "sink": torch.rand(H, generator=g) * 4 - 1, "slot": slot,
            "block_table": bt if kind != "swa" else None, "win_indptr": win[0], "win_indices": win[1],
            "comp_indptr": comp[0], "comp_indices": comp[1],
            **{f"p{i}": (planes[i] if i < len(planes) else None) for i in range(3)}}
    attrs = {"window": window, "scale": d ** -0.5, "win_base": window, "comp_base": 2 if kind != "swa" else 0,
             "fmt": fmt, "slot_rows": slot_rows, "n_rows": n_rows}
    if kind != "swa":
        attrs.update(csr_attrs, comp_rows=max_rows)
    return args, attrs


CASES = [  # kind, fmt, dtype, starts, counts, T, H, d, rope
    ("swa", "native", "fp32", [0, 5, 20], [3, 3, 0], 3, 4, 32, 8),     # seq 0: no history; seq 2: padding only
    ("hca", "native", "fp32", [250, 9], [1, 1], 1, 20, 24, 8),         # decode, 62 compressed rows (> BN), 2 head blocks
    ("csa", "native", "bf16", [40, 3], [4, 2], 4, 4, 32, 8),
    ("hca", "fp8", "bf16", [255, 30], [2, 1], 2, 4, 56, 8),             # 48 NoPE dims = 3 x 16, 63 comp rows
    ("csa", "fp8", "fp32", [60, 0], [1, 1], 1, 4, 40, 8),
    ("swa", "bf16", "bf16", [100], [1], 1, 6, 32, 8),
]


def _check(case, seed=0, wrong=None):
    kind, fmt, dtype = case[:3]
    args, attrs = _operands(*case, seed=seed)
    want = reference("sparse_attention", args, attrs)[0]
    out = poisoned(want.shape, want.dtype)[0]
    launch("sparse_attention", args, dict(attrs, **(wrong or {})), {"out": out})
    assert not out.float().isnan().any(), "unwritten output lanes"
    d = (out.float() - want.float()).abs()
    if want.dtype == torch.float32:
        tol = 2e-6 * want.abs().max() + 1e-5 * want.abs()
    else:
        planes = [args[f"p{i}"] for i in range(3) if args[f"p{i}"] is not None]
        pool = read_rows(planes, torch.arange(planes[0].shape[0]), fmt, torch.float32)
        vmax = max(float(args["kv"].float().abs().max()), float(pool.abs().max()))
        tol = 2.0 ** -8 * vmax + 2 * bf16_ulp(want.float())
    bad = d > tol
    assert not bad.any(), (f"sparse_attention {case[:3]}: {int(bad.sum())}/{d.numel()} off, max |d| {d.max():.3g}, "
                           f"max |ref| {want.float().abs().max():.3g}")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-T{c[5]}" for c in CASES])
def test_sparse_attention(case):
    _check(case)


@pytest.mark.parametrize("wrong", [{"scale": 0.5}, {"comp_base": 3}, {"win_base": 0}])
def test_wrong_kernel_is_caught(wrong):
    with pytest.raises(AssertionError, match="off"):
        _check(CASES[3] if "comp_base" in wrong else CASES[2], wrong=wrong)
