"""Small helpers for passes that rebuild functions (ops are immutable; values are identities)."""

from __future__ import annotations

from collections.abc import Callable

from v4compile.ir.core import SSA, Function, Module, Op, Value
from v4compile.ir.graph import dataflow, fusion_blockers
from v4compile.ir.registry import get_op
from v4compile.ir.semantics import has_role, join_roles, tags_of  # noqa: F401  (re-exported for passes)
from v4compile.ir.types import TensorType


def new_module(m: Module, functions: dict[str, Function] | None = None, weights: dict[str, Value] | None = None,
               attrs: dict | None = None) -> Module:
    return Module(m.name, dict(weights if weights is not None else m.weights),
                  dict(functions if functions is not None else m.functions), dict(attrs if attrs is not None else m.attrs))


def substitute(fn: Function, mapping: dict[int, Value], ops: list[Op] | None = None) -> Function:
    """The function with every use of `id(old)` replaced by `mapping[id(old)]`."""
    def sub(v):
        while v is not None and id(v) in mapping:
            v = mapping[id(v)]
        return v

    new_ops = []
    for op in (ops if ops is not None else fn.ops):
        operands = tuple(sub(v) for v in op.operands)
        new_ops.append(op if operands == op.operands else op.replace(operands=operands))
    outputs = [(n, sub(v)) for n, v in fn.outputs]
    return Function(fn.name, list(fn.inputs), new_ops, outputs, dict(fn.attrs))


class Namer:
    """Fresh SSA names for values a pass creates (after the function's largest numeric name)."""

    def __init__(self, fn: Function):
        nums = [int(r.name) for op in fn.ops for r in op.results if r.name.isdigit()]
        self.next = max(nums, default=-1) + 1

    def value(self, type: TensorType) -> Value:
        v = Value(str(self.next), type, SSA)
        self.next += 1
        return v


def make_op(namer: Namer, opname: str, operands: dict[str, Value | None] | list, attrs: dict, loc: str,
            result_names: list[Value] | None = None) -> Op:
    """A new op with results typed by its shape rule; `result_names` reuses existing result values.

    `operands` by name (`{"x": v, "w": w}`; absent optionals may be left out), or a list in signature
    order for ops whose operands are a uniform run (pool planes)."""
    opdef = get_op(opname)
    if isinstance(operands, dict):
        unknown = set(operands) - set(opdef.operand_names)
        if unknown:
            raise KeyError(f"op '{opname}' has no operand {sorted(unknown)[0]!r}")
        operands = [operands.get(n) for n in opdef.operand_names]
    operands = list(operands) + [None] * (len(opdef.operands) - len(operands))  # absent trailing optionals
    attrs = opdef.normalize_attrs(opdef.with_variant(operands, attrs))
    types = opdef.result_types([v.type if v is not None else None for v in operands], attrs)
    if result_names is not None:
        results = tuple(result_names)
        assert [r.type for r in results] == types, (opname, [str(r.type) for r in results], [str(t) for t in types])
    else:
        results = tuple(namer.value(t) for t in types)
    return Op(opname, tuple(operands), results, attrs, loc)


def rebuild(fn: Function, replace: dict[int, Op], drop: set[int] = frozenset()) -> Function:
    """The function with `replace[id(op)]` in place of those ops and the ops in `drop` removed."""
    ops = [replace.get(id(op), op) for op in fn.ops if id(op) not in drop]
    return Function(fn.name, list(fn.inputs), ops, list(fn.outputs), dict(fn.attrs))


def producers(fn: Function) -> dict[int, Op]:
    return fn.producers()


class Rewrite:
    """One function's fusion: match producer chains, replace the op at the chain's end, drop what it absorbs.

        rw = Rewrite(fn)
        for op in fn.ops:
            n = rw.producer(op.operand("x"), "rms_norm", only_use=True)  # None unless that is the chain
            if n is not None:
                rw.replace(op, make_op(rw.namer, "norm_linear", ..., [op.result]), absorbed=[n])
        return rw.done("fused")

    Producers, users and use counts are those of `fn` as given. A replacement takes the replaced op's
    place and keeps its result values (`make_op(..., result_names)`), so every use of them is kept."""

    def __init__(self, fn: Function):
        self.fn = fn
        self.namer = Namer(fn)
        self.prod = fn.producers()
        self.users = fn.users()
        self.uses = use_counts(fn)
        self.replaced: dict[int, Op] = {}
        self.dropped: set[int] = set()
        self.count = 0
        self.graph = None  # `fn`'s dataflow graph, built on the first `can_fuse`

    def producer(self, v: Value | None, name: str | None = None, only_use: bool = False) -> Op | None:
        """The op that produces `v`, if it is a `name` op (and with `only_use`, `v` has no other use)."""
        op = self.prod.get(id(v)) if v is not None else None
        if op is None or (name is not None and op.name != name) or (only_use and self.uses.get(id(v)) != 1):
            return None
        return op

    def sole_user(self, v: Value, name: str) -> Op | None:
        """The one op that uses `v`, if it is a `name` op and uses it once."""
        u = self.users.get(id(v), [])
        return u[0] if self.uses.get(id(v)) == 1 and len(u) == 1 and u[0].name == name else None

    def used_once(self, *ops: Op) -> bool:
        """Whether each op's single result has exactly one use (the chain owns it)."""
        return all(self.uses.get(id(o.result)) == 1 for o in ops)

    def can_fuse(self, op: Op, absorbed=()) -> bool:
        """Whether `op` and the ops it would absorb may become one op standing in `op`'s place: no op left
        outside lies on a path between them, none that must follow them stands before that place, none that
        must precede them after it (in-place updates included: `ir/graph.fusion_blockers`)."""
        if self.graph is None:
            self.graph = dataflow(self.fn)
            self.index = {id(o): i for i, o in enumerate(self.fn.ops)}
        at = self.index[id(op)]
        return not fusion_blockers(self.graph, [at, *(self.index[id(o)] for o in absorbed)], at)

    def replace(self, op: Op, new: Op, absorbed=()) -> None:
        self.replaced[id(op)] = new
        self.dropped.update(id(o) for o in absorbed)
        self.count += 1

    def gone(self, op: Op) -> bool:
        return id(op) in self.dropped

    def done(self, hits: str | dict[str, int] = "fused") -> tuple[Function, dict[str, int]]:
        """The rewritten function and its hits: `{hits: replacements}`, or the pass's own counts."""
        return rebuild(self.fn, self.replaced, self.dropped), {hits: self.count} if isinstance(hits, str) else hits


def use_counts(fn: Function) -> dict[int, int]:
    counts: dict[int, int] = {}
    for op in fn.ops:
        for v in op.operands:
            if v is not None:
                counts[id(v)] = counts.get(id(v), 0) + 1
    for _, v in fn.outputs:
        counts[id(v)] = counts.get(id(v), 0) + 1
    return counts


def map_functions(m: Module, fn_pass: Callable[[Function], tuple[Function, dict[str, int]]]
                  ) -> tuple[Module, dict[str, int]]:
    hits: dict[str, int] = {}
    funcs = {}
    for name, fn in m.functions.items():
        new, h = fn_pass(fn)
        funcs[name] = new
        for k, v in h.items():
            hits[f"{name}.{k}"] = hits.get(f"{name}.{k}", 0) + v
    return new_module(m, funcs), hits


def prune_weights(m: Module) -> Module:
    used = m.used_weights()
    return new_module(m, weights={k: w for k, w in m.weights.items() if k in used})


def operands_of(op: Op) -> dict[str, Value | None]:
    """The op's operands by signature name (to rebuild it with some of them changed)."""
    return dict(zip(get_op(op.name).operand_names, op.operands))


def planes(op: Op, prefix: str, results: bool = False) -> list[Value]:
    """The present pool-plane operands (`p0`, `p1`, `p2`) or results (`q0`, ...) of an op, in order."""
    opdef = get_op(op.name)
    names = opdef.results if results else opdef.operand_names
    values = op.results if results else op.operands
    return [v for n, v in zip(names, values) if n.startswith(prefix) and n[len(prefix):].isdigit() and v is not None]
