"""The interpreter: run a function on CPU tensors with each op's torch reference.

Values are freed after their last use, so a run holds only what is live. An `observe(op, results)`
callback sees every op's results (used by numerics bisection).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..errors import IRError
from .core import WEIGHT, Function, Op
from .registry import get_op
from .types import TensorType


def _check(t: torch.Tensor, ty: TensorType, what: str) -> None:
    if not ty.matches(t):
        raise IRError(f"{what}: tensor does not match its IR type", expected=str(ty),
                      found=f"{t.dtype} {list(t.shape)}")


def interpret(fn: Function, weights: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
              observe: Callable[[Op, list[torch.Tensor]], None] | None = None,
              check_types: bool = True) -> dict[str, torch.Tensor]:
    env: dict[int, torch.Tensor] = {}
    for v in fn.inputs:
        if v.name not in inputs:
            raise IRError(f"missing input %{v.name}", where=f"@{fn.name}")
        if check_types:
            _check(inputs[v.name], v.type, f"input %{v.name}")
        env[id(v)] = inputs[v.name]
    last_use: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        for v in op.operands:
            if v is not None:
                last_use[id(v)] = i
    keep = {id(v) for _, v in fn.outputs}

    def get(v):
        if v is None:
            return None
        if v.kind == WEIGHT:
            if v.name not in weights:
                raise IRError(f"no tensor for weight @{v.name}")
            return weights[v.name]
        return env[id(v)]

    for i, op in enumerate(fn.ops):
        opdef = get_op(op.name)
        outs = opdef.run([get(v) for v in op.operands], op.attrs)
        for r, t in zip(op.results, outs):
            if check_types:
                _check(t, r.type, f"@{fn.name} %{r.name} = {op.name} ({op.loc})")
            env[id(r)] = t
        if observe is not None:
            observe(op, outs)
        for v in op.operands:
            if v is not None and v.kind != WEIGHT and last_use.get(id(v)) == i and id(v) not in keep:
                env.pop(id(v), None)
    return {name: get(v) for name, v in fn.outputs}
