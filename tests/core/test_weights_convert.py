"""How a weight source's tensors become IR weights (`v4compile/weights_convert.py`): the conversion rule
(`ir_tensor`, used by the artifact writer and `load_ir_weights` alike) and the one source protocol
(`WeightSource`) that a checkpoint, dense tensors and one rank's part all keep."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import dense_weights
from v4compile import weights_convert
from v4compile.checkpoint import Checkpoint
from v4compile.config import preset
from v4compile.ir.core import WEIGHT, Module, Value
from v4compile.ir.types import TensorType
from v4compile.rank_weights import RankTensors
from v4compile.weights import spec_table
from v4compile.weights_convert import DenseSource, WeightSource, ir_tensor


class Stored:
    """A source of stored tensors, as a checkpoint holds them (`raw`), and of their float values (`dense`)."""

    def __init__(self, raw: dict[str, torch.Tensor], dense: dict[str, torch.Tensor]):
        self._raw, self._dense = raw, dense

    def raw(self, name: str) -> torch.Tensor:
        return self._raw[name]

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self._dense[name]
        return t if not t.is_floating_point() else t.to(dtype)

    def rows(self, name: str) -> int:
        return self._raw[name].shape[0] if name in self._raw else 0


@pytest.mark.parametrize("fault", [None, "V3 scale cast, not its exponent"])
def test_the_conversion_rule_keeps_quantised_bytes_and_converts_v3_scales(monkeypatch, fault):
    """FP8 weights and E8M0 scales come as stored (the same bytes); a V3-style fp32 scale 2^k becomes the
    E8M0 byte k + 127; a bf16 norm becomes the IR's fp32, value for value. The expected bytes come from
    the drawn exponents and stored bytes, not from the formats' functions. The fault, the fp32 scale's
    value cast to a byte instead of its exponent taken, gives other bytes."""
    g = torch.Generator().manual_seed(7)
    exps = torch.randint(-30, 31, (4, 8), generator=g)
    e8 = torch.randint(0, 255, (4, 8), generator=g, dtype=torch.uint8)
    fp8 = torch.randint(0, 128, (8, 16), generator=g, dtype=torch.uint8) * 2  # even bytes: never e4m3 NaN
    norm = torch.randn(16, generator=g).to(torch.bfloat16)
    src = Stored({"v3.scale": torch.pow(2.0, exps.float()), "e8.scale": e8.view(torch.float8_e8m0fnu),
                  "w.weight": fp8.view(torch.float8_e4m3fn)}, {"norm.weight": norm})
    if fault:
        monkeypatch.setattr(weights_convert, "float_to_e8m0", lambda t: t.to(torch.uint8))
    v3, kept, w, n = (ir_tensor(src, "v3.scale", "e8m0"), ir_tensor(src, "e8.scale", "e8m0"),
                      ir_tensor(src, "w.weight", "fp8e4m3"), ir_tensor(src, "norm.weight", "fp32"))
    assert (v3.dtype, kept.dtype, w.dtype, n.dtype) == (torch.float8_e8m0fnu, torch.float8_e8m0fnu,
                                                        torch.float8_e4m3fn, torch.float32)
    assert torch.equal(kept.view(torch.uint8), e8) and torch.equal(w.view(torch.uint8), fp8)
    assert torch.equal(n, norm.float())
    assert torch.equal(v3.view(torch.uint8), (exps + 127).to(torch.uint8)) == (fault is None)


def _names(seed: int) -> list[str]:
    """A few of tiny's matrices whose first and last axes differ (so rows are not columns by chance)."""
    specs = [s for s in spec_table(preset("tiny")).values()
             if len(s.shape) >= 2 and s.shape[0] != s.shape[-1] and s.fmt != "i64"]
    return sorted(s.name for s in random.Random(seed).sample(specs, 6))


def _source(kind: str, ckpt):
    if kind == "checkpoint":
        return Checkpoint.open(ckpt)
    dense = DenseSource(dense_weights("tiny"))
    if kind == "dense":
        return dense
    names = _names(1)
    shapes = {n: tuple(dense.dense(n).shape) for n in names}
    m = Module("m", {n: Value(n, TensorType(shapes[n], "fp32"), WEIGHT, (n,)) for n in names}, {}, {})
    return RankTensors(m, dense, 0)


class OnlyTensors:
    """A source with `raw` and `dense` but no `rows` (the duck-typed sources before the protocol)."""

    def __init__(self, src):
        self.raw, self.dense = src.raw, src.dense


@pytest.mark.parametrize("fault", [None, "no rows", "rows of the last axis"])
@pytest.mark.parametrize("kind", ["checkpoint", "dense", "rank"])
def test_the_three_sources_keep_one_protocol(tiny_quant_ckpt, monkeypatch, kind, fault):
    """A checkpoint, dense tensors and one rank's part are each a `WeightSource`, and each gives the rows
    of a tensor (what the writer plans a concatenation's parts by) as its first axis, 0 for a tensor it
    lacks. Faults: a source without `rows`; `rows` giving the last axis."""
    src = _source(kind, tiny_quant_ckpt)
    if fault == "no rows":
        src = OnlyTensors(src)
    elif fault:
        monkeypatch.setattr(type(src), "rows", lambda self, n: int(self.dense(n).shape[-1]))
    names = _names(1)
    ok = isinstance(src, WeightSource) and [src.rows(n) for n in names] == \
        [src.dense(n).shape[0] for n in names] and src.rows("no.such.weight") == 0
    assert ok == (fault is None)
