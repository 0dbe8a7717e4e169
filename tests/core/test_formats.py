"""FP8 / FP4 / E8M0 codecs against hand-made bytes (`v4-reference.md` 14.2-14.3)."""

from __future__ import annotations

import math

import pytest
import torch

from v4compile.errors import CheckpointError
from v4compile.formats import (FP4_VALUES, e8m0_to_float, fp4_dequant, fp4_pack, fp4_quant, fp4_round, fp4_unpack,
                               fp8_block_dequant, fp8_block_quant)


def u8(*vals: int) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8)


def test_e8m0_exponents():
    s = e8m0_to_float(u8(0, 1, 126, 127, 128, 130, 254, 255))
    assert s[:7].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 8.0, 2.0 ** 127]
    assert math.isnan(s[7])
    # The float8_e8m0fnu view of the same bytes decodes identically.
    assert torch.equal(e8m0_to_float(u8(126, 127, 128).view(torch.float8_e8m0fnu)), torch.tensor([0.5, 1.0, 2.0]))


def test_fp4_nibble_order_low_first():
    # byte 0x21: element 0 = low nibble 1 (0.5), element 1 = high nibble 2 (1.0).
    assert fp4_unpack(u8(0x21).view(torch.int8)).tolist() == [1, 2]
    w = fp4_dequant(u8(0x21, 0xF7).view(torch.int8).view(1, 2), u8(127).view(1, 1), block=4)
    assert w.tolist() == [[0.5, 1.0, 6.0, -6.0]]


def test_every_fp4_code():
    codes = torch.arange(16)
    packed = fp4_pack(codes.view(1, 16))
    w = fp4_dequant(packed, u8(127).view(1, 1), block=16)
    expect = list(FP4_VALUES) + [-v for v in FP4_VALUES]
    assert w[0].tolist() == expect
    assert math.copysign(1.0, w[0, 8].item()) == -1.0  # code 8 is -0


def test_fp4_scales_apply_per_32_block():
    packed = fp4_pack(torch.full((2, 64), 2))  # every element 1.0
    scale = u8(127, 129, 125, 130).view(2, 2)  # 1, 4, 0.25, 8
    w = fp4_dequant(packed, scale, block=32)
    assert w[0, :32].unique().tolist() == [1.0] and w[0, 32:].unique().tolist() == [4.0]
    assert w[1, :32].unique().tolist() == [0.25] and w[1, 32:].unique().tolist() == [8.0]
    with pytest.raises(CheckpointError, match="scale grid"):
        fp4_dequant(packed, u8(127, 127).view(2, 1), block=32)


def test_fp4_round_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, 5.9])
    vals = torch.tensor(list(FP4_VALUES) + [-v for v in FP4_VALUES])[fp4_round(x)]
    assert vals.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 6.0]


def test_fp4_quant_round_trip_and_scale_choice():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    packed, scale = fp4_quant(w)
    assert packed.dtype == torch.int8 and packed.shape == (8, 32) and scale.shape == (8, 2)
    deq = fp4_dequant(packed, scale)
    s = e8m0_to_float(scale).repeat_interleave(32, 1)
    assert ((deq - w).abs() <= s * 1.0 + 1e-7).all()  # half of the widest step (2) times the scale
    blocks = w.view(8, 2, 32).abs().amax(-1)
    assert torch.equal(e8m0_to_float(scale), torch.exp2(torch.ceil(torch.log2(blocks / 6))))
    # Values already on the grid survive exactly.
    assert torch.equal(fp4_dequant(*fp4_quant(deq)), deq)


def test_fp8_hand_bytes():
    b = u8(0x38, 0x7E, 0xFE, 0x01, 0x40, 0x00).view(torch.float8_e4m3fn)
    w = fp8_block_dequant(b.view(1, 6), u8(127).view(1, 1), block=128)
    assert w[0].tolist() == [1.0, 448.0, -448.0, 2.0 ** -9, 2.0, 0.0]


def test_fp8_partial_edge_blocks():
    weight = torch.ones(130, 200).to(torch.float8_e4m3fn)
    scale = u8(127, 128, 129, 130).view(2, 2)  # 1, 2, 4, 8
    w = fp8_block_dequant(weight, scale, block=128)
    assert w[0, 0] == 1 and w[0, 127] == 1 and w[0, 128] == 2 and w[0, 199] == 2
    assert w[127, 0] == 1 and w[128, 0] == 4 and w[129, 199] == 8
    with pytest.raises(CheckpointError, match="expected \\[2, 2\\]"):
        fp8_block_dequant(weight, u8(127).view(1, 1), block=128)


def test_fp8_block_quant_round_trip():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * 5
    q, s = fp8_block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    deq = fp8_block_dequant(q, s)
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + 1e-3).all()
    assert torch.equal(fp8_block_dequant(*fp8_block_quant(deq)), deq)
