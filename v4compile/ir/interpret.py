"""The interpreter: run a function on CPU tensors with each op's torch reference.

Values are freed after their last use, so a run holds only what is live. An `observe(op, results)`
callback sees every op's results (used by numerics bisection). `interpret_ranks` runs an SPMD (partitioned)
function for all its ranks in one process, the collectives exchanging values between them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import IRError
from .core import WEIGHT, Function, Op
from .registry import get_op, ref_attrs
from .types import TensorType


def _check(t: torch.Tensor, ty: TensorType, what: str) -> None:
    if not ty.matches(t):
        raise IRError(f"{what}: tensor does not match its IR type", expected=str(ty),
                      found=f"{t.dtype} {list(t.shape)}")


def interpret(fn: Function, weights: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
              observe: Callable[[Op, list[torch.Tensor]], None] | None = None,
              check_types: bool = True) -> dict[str, torch.Tensor]:
    return interpret_ranks(fn, [weights], [inputs], observe, check_types)[0]


def interpret_ranks(fn: Function, weights: Sequence[Mapping[str, torch.Tensor]],
                    inputs: Sequence[Mapping[str, torch.Tensor]],
                    observe: Callable[[Op, list[torch.Tensor]], None] | None = None,
                    check_types: bool = True) -> list[dict[str, torch.Tensor]]:
    """Run an SPMD function on every rank at once (rank r: `weights[r]`, `inputs[r]`), in lockstep: each op
    runs on every rank before the next, so a collective sees every rank's operands (`OpDef.spmd_ref`).
    One rank is the plain interpreter. `observe` sees rank 0's results."""
    if len(weights) != len(inputs) or not weights:
        raise IRError("interpret_ranks needs one weight map and one input map per rank",
                      found=f"{len(weights)} weight maps, {len(inputs)} input maps")
    ranks = range(len(weights))
    env: list[dict[int, torch.Tensor]] = [{} for _ in ranks]
    for v in fn.inputs:
        for r in ranks:
            if v.name not in inputs[r]:
                raise IRError(f"missing input %{v.name}", where=f"@{fn.name}" + (f" rank {r}" if r else ""))
            if check_types:
                _check(inputs[r][v.name], v.type, f"input %{v.name}")
            env[r][id(v)] = inputs[r][v.name]
    last_use: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        for v in op.operands:
            if v is not None:
                last_use[id(v)] = i
    keep = {id(v) for _, v in fn.outputs}

    def get(r, v):
        if v is None:
            return None
        if v.kind == WEIGHT:
            if v.name not in weights[r]:
                raise IRError(f"no tensor for weight @{v.name}")
            return weights[r][v.name]
        return env[r][id(v)]

    for i, op in enumerate(fn.ops):
        opdef = get_op(op.name)
        if opdef.collective:
            per_rank = [list(r) for r in opdef.spmd_ref([[get(r, v) for v in op.operands] for r in ranks],
                                                         ref_attrs(op.attrs))]
        else:
            per_rank = [opdef.run([get(r, v) for v in op.operands], op.attrs) for r in ranks]
        for r, outs in zip(ranks, per_rank):
            for res, t in zip(op.results, outs):
                if check_types:
                    _check(t, res.type, f"@{fn.name} %{res.name} = {op.name} ({op.loc})")
                env[r][id(res)] = t
        if observe is not None:
            observe(op, per_rank[0])
        for v in op.operands:
            if v is not None and v.kind != WEIGHT and last_use.get(id(v)) == i and id(v) not in keep:
                for r in ranks:
                    env[r].pop(id(v), None)
    return [{name: get(r, v) for name, v in fn.outputs} for r in ranks]
