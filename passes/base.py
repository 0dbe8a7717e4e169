"""The pass interface and the registry of passes by name.

A pass is a frozen dataclass whose fields are its typed options (set from the command line as
`name{key=value,...}`), with a class-level `name`. `run(module)` returns a `PassResult`: the new
module (the input is never modified) and hit counts (what the pass did, for reports).

A pass also declares where it may stand in a pipeline, which the pass manager checks before anything runs
(`manager.check_order`): `after`, the passes that must run before it when the pipeline has them (each with
the reason: most fuse an op another pass makes, and run before it they find nothing and say nothing); a
`first` pass has only first passes before it, a `final` pass only final passes after it. `after` orders,
it does not require: a pass run without them (alone on hand-written IR, or a pipeline that leaves one out)
is a pipeline that may find less to do, not a wrong one.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from v4compile.errors import PassError
from v4compile.ir.core import Function, Module

PASSES: dict[str, type["Pass"]] = {}

# Every pass module, imported on first use so that `register` has run.
_PASS_MODULES = ("partition", "dce", "cse", "merge_wq_a_wkv", "merge_sibling_gemms", "fuse_mhc_post_pre", "fold_inverse_rope_wo_a_quant",
                 "fuse_inv_rope_wo_a", "pair_sibling_gemms", "fuse_qkv_norm_rope", "fuse_norm_linear", "fuse_indexer_topk", "fuse_moe",
                 "fuse_moe_router", "fuse_moe_mhc", "fuse_mhc_moe", "fuse_attn_front", "fuse_out_proj",
                 "pair_compressors", "pair_rope_compress",
                 "lower_sparse_attention", "spec_steps", "oneshot_allreduce", "fuse_oneshot_rows",
                 "fuse_oneshot_producer", "fuse_oneshot_consumer", "plan_memory",
                 "lower_to_program",
                 "testing_corrupt")


@dataclass
class PassResult:
    module: Module
    hits: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = ""
    after: ClassVar[dict[str, str]] = {}  # pass name -> why it must run before this one, if in the pipeline
    first: ClassVar[bool] = False  # only first passes may run before it
    final: ClassVar[bool] = False  # only final passes may run after it

    def run(self, module: Module) -> PassResult:
        raise NotImplementedError

    def spec(self) -> str:
        opts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


@dataclass(frozen=True)
class FunctionPass(Pass):
    """A pass that rewrites each function on its own: subclasses implement `rewrite(fn) -> (fn, hits)`;
    hits are reported per function (`decode.fused`)."""

    def rewrite(self, fn: Function) -> tuple[Function, dict[str, int]]:
        raise NotImplementedError

    def run(self, module: Module) -> PassResult:
        from .rewrite import map_functions

        m, hits = map_functions(module, self.rewrite)
        return PassResult(m, hits)


def function_pass(name: str, rewrite, after: dict[str, str] | None = None) -> type[FunctionPass]:
    """Register a pass without options that rewrites each function with `rewrite(fn) -> (fn, hits)`; its
    documentation is its module's docstring (like every pass's: `ir passes NAME`); `after`: `Pass.after`."""
    cls = type(f"FunctionPass[{name}]", (FunctionPass,),
               {"name": name, "rewrite": lambda self, fn: rewrite(fn), "__module__": rewrite.__module__,
                "__qualname__": f"function_pass[{name}]", "after": dict(after or {})})
    return register(dataclass(frozen=True)(cls))


def register(cls: type[Pass]) -> type[Pass]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in PASSES and PASSES[cls.name] is not cls:
        raise ValueError(f"pass {cls.name} registered twice")
    PASSES[cls.name] = cls
    return cls


def load_all() -> dict[str, type[Pass]]:
    for mod in _PASS_MODULES:  # a missing module is an install defect: let its ImportError say so
        importlib.import_module(f"v4compile.passes.{mod}")
    return PASSES


_SPEC = re.compile(r"^\s*([A-Za-z_][\w-]*)\s*(?:\{(.*)\})?\s*$")


def _convert(value: str, typ: Any, where: str) -> Any:
    t = typ if isinstance(typ, type) else {"int": int, "float": float, "bool": bool, "str": str}.get(str(typ), str)
    try:
        if t is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return t(value)
    except ValueError:
        raise PassError(f"option value must be {t.__name__}", where=where, found=value) from None


def parse_pass_spec(spec: str) -> Pass:
    """`name` or `name{key=value,...}` -> a configured pass."""
    m = _SPEC.match(spec)
    if not m:
        raise PassError("malformed pass spec", expected="name or name{key=value,...}", found=spec)
    name, body = m.group(1), m.group(2)
    options: dict[str, str] = {}
    for kv in (body or "").split(","):
        if not kv.strip():
            continue
        if "=" not in kv:
            raise PassError("pass option needs a value", where=f"pass '{name}'", expected="key=value", found=kv.strip())
        k, v = kv.split("=", 1)
        if k.strip() in options:
            raise PassError(f"option '{k.strip()}' given twice", where=f"pass '{name}'")
        options[k.strip()] = v
    return get_pass(name, options, raw=True)


def get_pass(name: str, options: dict[str, Any] | None = None, raw: bool = False) -> Pass:
    passes = load_all()
    if name not in passes:
        raise PassError(f"unknown pass '{name}'", expected=", ".join(sorted(passes)))
    cls = passes[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in (options or {}).items():
        k = k.strip()
        if k not in fields:
            raise PassError(f"unknown option '{k}' for pass '{name}'", expected=sorted(fields) or "no options")
        kwargs[k] = _convert(v.strip(), fields[k].type, f"{name}.{k}") if raw else v
    return cls(**kwargs)
