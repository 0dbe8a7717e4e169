"""Tensor, expert and data parallelism: the rank layout of a partitioned module and its rank-local weights.

A partitioned module (`passes/partition.py`) is one SPMD program: every rank runs the same functions on
its own weights. Its attributes `parallel.tp` and `parallel.ep` (and `parallel.dp` when > 1) give the
layout: `world = max(dp * tp, ep)` ranks; a tensor-parallel group is `tp` consecutive ranks (rank r is
part `r % tp` of its group), an expert-parallel group `ep` consecutive ranks (part `r % ep`).
Data parallel (`dp` > 1): rank r serves replica `r // tp` (its own sequences, KV pool and state; the tp
ranks of a replica see the same tokens), and `ep` is 1 (every rank holds every expert) or the whole world
(`ep == dp * tp`: the EP group spans the world; the tokens of every replica are gathered to the experts
once, from its first rank: `ops/collective.py`, `tp`). Which part of a checkpoint tensor a rank
holds is written in the weight's source: `name#tp:0` is part `r % tp` of `name` cut into `tp` equal
pieces along axis 0 (`#ep:0`: by `ep`). A merged weight concatenates such parts with whole tensors, so
merges compose with the partition. `=expert_owner(E)` is the one rank-local table that is not a
checkpoint tensor: `local_experts`' owner table (`ops/collective.py`), every rank's table stacked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import IRError
from .ir.core import Function, Module

TP, EP = "tp", "ep"
_SHARD = re.compile(r"^(.*)#(tp|ep):(\d+)$")
_OWNER = re.compile(r"^=expert_owner\((\d+)\)$")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1
    dp: int = 1  # last, keyword in practice: ParallelLayout(tp, ep) is the layout without data parallelism

    @property
    def world(self) -> int:
        return max(self.dp * self.tp, self.ep)

    def replica(self, rank: int) -> int:
        """The data-parallel replica rank `rank` serves (its sequences, pool and state)."""
        return rank // self.tp if self.dp > 1 else 0

    def size(self, group: str) -> int:
        return self.tp if group == TP else self.ep

    def part(self, group: str, rank: int) -> int:
        """Which piece of a `group`-sharded tensor rank `rank` holds."""
        return rank % self.size(group)

    def attrs(self) -> dict[str, int]:
        # `parallel.dp` only when > 1: the modules (and IR text) of TP / EP layouts stay as they were
        return {"parallel.tp": self.tp, "parallel.ep": self.ep, **({"parallel.dp": self.dp} if self.dp > 1 else {})}

    def manifest(self) -> dict[str, int]:
        """The manifest's `parallel` layout fields (`dp` only when > 1, like the module attributes)."""
        return {"tp": self.tp, "ep": self.ep, **({"dp": self.dp} if self.dp > 1 else {}), "world": self.world}

    @staticmethod
    def from_manifest(p: Mapping) -> "ParallelLayout":
        return ParallelLayout(int(p["tp"]), int(p["ep"]), int(p.get("dp", 1)))

    @staticmethod
    def of(m: Module) -> "ParallelLayout | None":
        """The layout of a partitioned module (None for a single-rank one)."""
        if "parallel.tp" not in m.attrs:
            return None
        return ParallelLayout(int(m.attrs["parallel.tp"]), int(m.attrs["parallel.ep"]),
                              int(m.attrs.get("parallel.dp", 1)))

    def problem(self) -> str | None:
        """What is wrong with the layout itself (None: nothing), one sentence naming the constraint."""
        tp, ep, dp = self.tp, self.ep, self.dp
        if min(tp, ep, dp) < 1:
            return "--dp, --tp and --ep must be >= 1"
        if dp > 1:
            if ep not in (1, dp * tp):
                return (f"with --dp the expert-parallel group spans the world: --ep must be 1 or dp x tp = {dp * tp}")
            return None
        if self.world % tp or self.world % ep:
            return "--tp and --ep: the smaller must divide the larger (the world is max(tp, ep) ranks)"
        return None


def shard_source(source: str, group: str, axis: int) -> str:
    return f"{source}#{group}:{axis}"


def split_shard(source: str) -> tuple[str, str | None, int]:
    """`name#tp:0` -> (`name`, `tp`, 0); a whole tensor -> (name, None, 0)."""
    m = _SHARD.match(source)
    return (m.group(1), m.group(2), int(m.group(3))) if m else (source, None, 0)


def owner_source(n_experts: int) -> str:
    return shard_source(f"=expert_owner({n_experts})", EP, 0)


def synthesized(source: str, layout: ParallelLayout) -> torch.Tensor | None:
    """The whole tensor of a source that is not a checkpoint tensor (None for a checkpoint name)."""
    m = _OWNER.match(source)
    if m is None:
        return None
    from .ops.collective import owner_table

    E = int(m.group(1))
    return torch.cat([owner_table(E, layout.ep, p) for p in range(layout.ep)])


def rank_part(t: torch.Tensor, group: str, axis: int, layout: ParallelLayout, rank: int, what: str) -> torch.Tensor:
    n = layout.size(group)
    if t.shape[axis] % n:
        raise IRError(f"{what}: axis {axis} does not split into {n} equal parts", found=list(t.shape))
    return t.chunk(n, dim=axis)[layout.part(group, rank)].contiguous()


def is_rank_local(sources: Sequence[str]) -> bool:
    return any(split_shard(s)[1] is not None for s in sources)


def spmd_interpreter(fn: Function, weights: Sequence[Mapping[str, torch.Tensor]], inputs: Mapping[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """An `IRRunner` interpreter for a partitioned module: every rank (one weight map each) runs `fn` on the
    same inputs in one process. Everything a function returns (logits, caches) is replicated by the
    partition, so every rank must return the same bits; rank 0's outputs are the result."""
    from .ir.interpret import interpret_ranks

    outs = interpret_ranks(fn, weights, [inputs] * len(weights))
    for r, o in enumerate(outs[1:], 1):
        for name, t in o.items():
            if not torch.equal(t, outs[0][name]):
                raise IRError(f"@{fn.name}: output '{name}' differs between rank 0 and rank {r}",
                              expected="replicated outputs (the same on every rank)")
    return outs[0]
