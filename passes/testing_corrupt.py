"""A deliberately wrong pass, for testing the numerics tools (`ir bisect`, `--check-numerics`).

Requires: a module with at least `index + 1` ops named `op` in function `func`.
Guarantees: nothing good: the `index`-th such op gets its `eps` attribute (or, for ops without one, its
first float attribute) multiplied by `factor`, keeping its result names, so the divergence starts exactly
there. The default (the first `rms_norm` of prefill, eps x 1e8: eps 1e-6 becomes 100, which flattens that
norm's output) breaks the numerics tolerance by orders of magnitude on every preset, so that a check
which fails to notice is itself shown broken. Never part of a pipeline unless asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.errors import PassError
from v4compile.ir.core import Function

from .base import Pass, PassResult, register
from .rewrite import new_module


@register
@dataclass(frozen=True)
class TestingCorrupt(Pass):
    name = "testing-corrupt"
    op: str = "rms_norm"
    index: int = 0
    func: str = "prefill"
    factor: float = 1e8

    def run(self, module):
        fn = module.functions.get(self.func)
        if fn is None:
            raise PassError(f"testing-corrupt: no function @{self.func}")
        seen = -1
        ops = list(fn.ops)
        for i, op in enumerate(ops):
            if op.name != self.op:
                continue
            seen += 1
            if seen == self.index:
                key = "eps" if "eps" in op.attrs else next((k for k, v in op.attrs.items() if isinstance(v, float)), None)
                if key is None:
                    raise PassError(f"testing-corrupt: op '{self.op}' has no float attribute to corrupt")
                ops[i] = op.replace(attrs={**op.attrs, key: op.attrs[key] * self.factor})
                fns = dict(module.functions)
                fns[self.func] = Function(fn.name, list(fn.inputs), ops, list(fn.outputs), dict(fn.attrs))
                return PassResult(new_module(module, fns), {"corrupted": 1})
        raise PassError(f"testing-corrupt: fewer than {self.index + 1} '{self.op}' ops in @{self.func}")
