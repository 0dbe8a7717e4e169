"""One rank's weights of a partitioned module (`parallel.py`), as the artifact writer reads them
(`driver.write_rank_weights`): each weight its own source, its rank-local tensor cut from the checkpoint
one weight at a time (`weights_convert.load_ir_weights` for that rank).
"""

from __future__ import annotations

import torch

from .ir.core import WEIGHT, Module, Value
from .weights_convert import load_ir_weights


def rank_weights_module(m: Module) -> Module:
    """`m`'s weights as one rank holds them, each its own source (`name`): what the artifact writer plans
    for one rank with `RankTensors` as the source."""
    return Module(m.name, {n: Value(n, w.type, WEIGHT, (n,)) for n, w in m.weights.items()}, {}, dict(m.attrs))


class RankTensors:
    """A weight source (`weights_convert.WeightSource`) of one rank of a partitioned module: weight name -> its
    rank-local tensor, read from `source` one weight at a time when asked for (so a rank's weights are never
    all in memory at once)."""

    def __init__(self, m: Module, source, rank: int):
        self.m, self.source, self.rank = m, source, rank

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.m.weights[name]
        return load_ir_weights(Module(self.m.name, {name: w}, {}, dict(self.m.attrs)), self.source, rank=self.rank)[name]

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self[name]
        return t if not t.is_floating_point() else t.to(dtype)

    def raw(self, name: str) -> torch.Tensor:
        return self[name]

    def rows(self, name: str) -> int:
        """From its IR type (the rank-local tensor's shape): nothing is read."""
        w = self.m.weights.get(name)
        return w.type.shape[0] if w is not None and w.type.shape else 0
