"""Seeded operand builders shared by the attention-side kernel tests (pool planes, positions, CSR)."""

from __future__ import annotations

import math

import torch

from kernel_check import assert_matches
from v4compile.ops.paged import write_rows

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def positions(starts: list[int], counts: list[int], T: int) -> torch.Tensor:
    """pos [B, T]: lane i of sequence b holds start_b + i for i < count_b, -1 after (padding lanes)."""
    pos = torch.full((len(starts), T), -1, dtype=torch.int32)
    for b, (s, n) in enumerate(zip(starts, counts)):
        pos[b, :n] = torch.arange(s, s + n, dtype=torch.int32)
    return pos


def main_planes(fmt: str, n: int, d: int, rope: int, dtype: torch.dtype, g: torch.Generator) -> list:
    """Random existing pool content (so the test sees which rows a kernel wrote and which it kept)."""
    if fmt == "fp8":  # realistic rows: random values quantised by the reference writer
        nope = d - rope
        empty = [torch.zeros(n, nope, dtype=torch.float8_e4m3fn),
                 torch.zeros(n, nope // math.gcd(64, nope), dtype=torch.float8_e8m0fnu), torch.zeros(n, rope, dtype=dtype)]
        vals = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-2, 3, (n, 1), generator=g).float())
        return write_rows(empty, torch.arange(n), vals.to(dtype), "fp8")
    return [torch.randn(n, d, generator=g).to(torch.bfloat16 if fmt == "bf16" else dtype)]


def finite_fp8(t: torch.Tensor) -> torch.Tensor:
    """Replace e4m3 NaN bytes (0x7f / 0xff) so dequantised reads stay finite."""
    u = t.view(torch.uint8).clone()
    u[(u & 0x7F) == 0x7F] = 0x3C
    return u.view(torch.float8_e4m3fn)


def index_planes(fmt: str, n: int, d: int, dtype: torch.dtype, g: torch.Generator) -> list:
    if fmt == "fp4":
        return [torch.randint(-128, 127, (n, d // 2), generator=g, dtype=torch.int8),
                torch.randint(120, 130, (n, d // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)]
    if fmt == "fp8":
        return [finite_fp8(torch.randint(0, 255, (n, d), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)),
                torch.exp2(torch.randint(-4, 2, (n, 1), generator=g).float())]
    return [torch.randn(n, d, generator=g).to(dtype)]


def assert_plane(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Planes are compared bit for bit: every byte the kernel writes is a rounding the reference defines."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    a, b = got.view(torch.uint8) if got.element_size() == 1 else got, want.view(torch.uint8) if want.element_size() == 1 else want
    if a.dtype == torch.uint8:
        bad = a != b
    else:
        bad = ~((a == b) | (a.isnan() & b.isnan()))
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, first at {tuple(bad.nonzero()[0].tolist())}"


def assert_close(got, want, what, ulps=1.0):
    assert_matches(got, want, what, ulps)
