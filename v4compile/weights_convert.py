"""From a weight source's tensors to IR weights: the one declared source protocol, the conversion rule and
the source patterns of an IR weight.

* `WeightSource`: what the weights are read from (a checkpoint, `checkpoint.Checkpoint`; dense tensors,
  `DenseSource`: random weights and tests; one rank's part of a partitioned module,
  `rank_weights.RankTensors`). Compile time only: a compiled artifact's weights are its shards
  (`weights_map`), read by nothing here.
* `ir_tensor`: the conversion rule, one source tensor as the IR dtype takes it (quantised stays quantised,
  a V3-style fp32 scale becomes E8M0, norms become the IR's float dtype); the artifact writer
  (`weights_plan`) converts every piece it does not copy through it, `load_ir_weights` every weight.
* `expert_sources` / `expand_sources`: the source pattern of a stacked expert weight, and its names.
* `load_ir_weights(module, source)`: the tensor of every IR weight, converted to the weight's IR type
  (stacks are stacked; several sources are concatenated along the first axis; a partitioned module's for
  one rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from .errors import IRError
from .formats import float_to_e8m0
from .ir.core import Module
from .ir.types import DTYPES


@runtime_checkable
class WeightSource(Protocol):
    """Canonical source tensor names -> tensors (`names.canonical_sources`)."""

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (FP8 / FP4 bytes and their scales kept); raises the source's own error,
        naming the tensor, where it is missing, not finite or not stored quantised."""

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor with any quantisation undone (integer tensors as they are)."""

    def rows(self, name: str) -> int:
        """Its first axis, from what is cheapest (a header, a tensor in memory); 0 where the source has
        no such tensor: its conversion then names the problem."""


class DenseSource:
    """Canonical name -> float tensor (an in-memory model with no quantised storage)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self.tensors[name]
        return t if not t.is_floating_point() else t.to(dtype)

    def raw(self, name: str) -> torch.Tensor:
        raise IRError(f"weight '{name}' is quantised in the IR but the source has only dense tensors")

    def rows(self, name: str) -> int:
        try:
            return int(self.tensors[name].shape[0])
        except (KeyError, IndexError):
            return 0


def ir_tensor(source: WeightSource, name: str, dtype: str) -> torch.Tensor:
    """Source tensor `name` as IR dtype `dtype` takes it: FP8 / FP4 weights and E8M0 scales as stored (a
    V3-style fp32 scale, a power of two stored as a multiplier, to its E8M0 byte), everything else
    dequantised and cast."""
    if dtype == "fp8e4m3":
        return source.raw(name).view(torch.float8_e4m3fn)
    if dtype == "fp4x2":
        return source.raw(name).view(torch.int8)
    if dtype == "e8m0":
        t = source.raw(name)
        if t.dtype == torch.float32:
            t = float_to_e8m0(t)
        return t.view(torch.float8_e8m0fnu)
    t = source.dense(name, DTYPES[dtype]) if dtype in ("fp32", "bf16") else source.dense(name)
    return t.to(DTYPES[dtype])


def expert_sources(prefix: str, w: str, n: int, suffix: str = "weight") -> tuple[str, ...]:
    """Source pattern of a stacked expert weight: one string with an index range."""
    return (f"{prefix}ffn.experts.{{0..{n - 1}}}.{w}.{suffix}",)


def expand_sources(sources: tuple[str, ...]) -> list[str]:
    """The source tensor names of an IR weight's sources, index ranges (`expert_sources`) expanded."""
    out: list[str] = []
    for s in sources:
        if "{0.." in s:
            head, rest = s.split("{0..", 1)
            last, tail = rest.split("}", 1)
            out += [f"{head}{i}{tail}" for i in range(int(last) + 1)]
        else:
            out.append(s)
    return out


def load_ir_weights(m: Module, source: WeightSource, only: set[str] | None = None, rank: int | None = None
                    ) -> dict[str, torch.Tensor]:
    """Every IR weight's tensor; in a partitioned module, rank `rank`'s (`parallel.py`: a source `name#tp:0`
    is this rank's part of `name`)."""
    from .parallel import ParallelLayout, rank_part, split_shard, synthesized

    layout = ParallelLayout.of(m)
    out: dict[str, torch.Tensor] = {}
    for w in m.weights.values():
        if only is not None and w.name not in only:
            continue
        parts = []
        for s in w.sources:
            base, group, axis = split_shard(s)
            if group is not None and (layout is None or rank is None):
                raise IRError(f"weight @{w.name} is rank-local ('{s}')",
                              expected="a partitioned module loaded for one rank")
            whole = synthesized(base, layout) if layout is not None else None
            if whole is None:
                fetched = [ir_tensor(source, n, w.type.dtype) for n in expand_sources((base,))]
                whole = torch.stack(fetched) if "{0.." in base else fetched[0]
            parts.append(whole if group is None else rank_part(whole, group, axis, layout, rank, f"weight @{w.name}"))
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if not w.type.matches(t):
            raise IRError(f"weight @{w.name}: source tensors do not give its IR type", expected=str(w.type),
                          found=f"{t.dtype} {list(t.shape)}")
        out[w.name] = t
    return out
