"""The IR's text form: one op per line, result types and provenance on every line; parses back to an
equal module.

    module @tiny attributes {batch = 2, capacity = 256, numerics = "hf"}
    weight @embed.weight : fp32[512,64] from "embed.weight"
    func @decode(
        %ids : i64[2,1],
        ...
    ) attributes {batch = 2, tokens = 1} {
      %0 = embed(%ids, @embed.weight) : fp32[2,1,64] loc("embed")
      %4, %5, %6 = hc_pre(%3, @layers.0.hc_attn_fn, ...) {eps = 1e-06, hc_eps = 1e-06, iters = 20}
          : fp32[2,1,64], fp32[2,1,4], fp32[2,1,4,4] loc("layers.0.attn_hc")
      ...
      return logits = %170, cache.layers.0.win = %17, ...
    }

Absent optional operands print as `none`. `#` starts a comment. Parse errors name line and column; a
parsed module keeps the line:column of its functions and ops (`source_positions`, by object id) so that
the verifier's errors can name them too. Names always print as identifiers (`ir_ident`), so every
printed module parses back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import IRError
from .core import INPUT, SSA, WEIGHT, Function, Module, Op, Value
from .types import DTYPES, TensorType

# ---- printing ----------------------------------------------------------------------------------

_IDENT = re.compile(r"[A-Za-z0-9_.\-]+")


def ir_ident(name: str) -> str:
    """`name` as an IR identifier (what may follow `@` or `%`): other characters become `_`."""
    return name if _IDENT.fullmatch(name) else (re.sub(r"[^A-Za-z0-9_.\-]", "_", name) or "_")



def fmt_attr(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple):
        return "(" + ", ".join(fmt_attr(e) for e in v) + (",)" if len(v) == 1 else ")")
    raise TypeError(f"unprintable attribute {v!r}")


def fmt_attrs(attrs: dict[str, Any]) -> str:
    if not attrs:
        return ""
    return " {" + ", ".join(f"{k} = {fmt_attr(v)}" for k, v in sorted(attrs.items())) + "}"


def fmt_op(op: Op) -> str:
    res = ", ".join(r.ref for r in op.results)
    args = ", ".join(v.ref if v is not None else "none" for v in op.operands)
    types = ", ".join(str(r.type) for r in op.results)
    loc = f' loc("{op.loc}")' if op.loc else ""
    return f"{res} = {op.name}({args}){fmt_attrs(op.attrs)} : {types}{loc}"


def print_function(fn: Function) -> str:
    lines = [f"func @{fn.name}("]
    lines += [f"    {v.ref} : {v.type}," for v in fn.inputs]
    lines.append(f"){' attributes' + fmt_attrs(fn.attrs) if fn.attrs else ''} {{")
    lines += ["  " + fmt_op(op) for op in fn.ops]
    rets = [f"{n} = {v.ref}" for n, v in fn.outputs]
    lines.append("  return " + (",\n         ".join(rets)))
    lines.append("}")
    return "\n".join(lines)


def print_module(m: Module, functions: list[str] | None = None, weights: str = "first") -> str:
    """The module's text. `weights`: "first" (parses back), or, as views for reading only, "last" (after
    the functions) or "none" (no weight declarations)."""
    head = [f"module @{ir_ident(m.name)}{' attributes' + fmt_attrs(m.attrs) if m.attrs else ''}"]
    decls = [f"weight {w.ref} : {w.type} from {', '.join(fmt_attr(s) for s in w.sources)}"
             for w in m.weights.values()]
    body = []
    for name, fn in m.functions.items():
        if functions is None or name in functions:
            body += ["", print_function(fn)]
    if weights == "none":
        head.append(f"# {len(decls)} weight declarations left out")
        decls = []
    out = head + (decls + body if weights == "first" else body + ([""] if decls else []) + decls)
    return "\n".join(out) + "\n"


# ---- lexing ------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\n]+|\#[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<ref>[%@][A-Za-z0-9_.\-]+)
  | (?P<num>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+(?:[eE][-+]?\d+)?|inf|nan|\d+))
  | (?P<id>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[(){}\[\],:=])
""", re.VERBOSE)


@dataclass
class Tok:
    kind: str
    text: str
    line: int
    col: int


def lex(text: str) -> list[Tok]:
    toks: list[Tok] = []
    i, line, line_start = 0, 1, 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if not m:
            raise IRError(f"unexpected character {text[i]!r}", where=f"line {line}:{i - line_start + 1}")
        kind = m.lastgroup
        s = m.group()
        if kind != "ws":
            toks.append(Tok(kind, s, line, i - line_start + 1))
        nl = s.count("\n")
        if nl:
            line += nl
            line_start = i + s.rindex("\n") + 1
        i = m.end()
    toks.append(Tok("eof", "", line, i - line_start + 1))
    return toks


# ---- parsing -----------------------------------------------------------------------------------

class Parser:
    def __init__(self, text: str):
        self.toks = lex(text)
        self.i = 0
        self.positions: dict[int, tuple[int, int]] = {}  # id(op or function) -> (line, column)

    @property
    def tok(self) -> Tok:
        return self.toks[self.i]

    def error(self, what: str, tok: Tok | None = None) -> IRError:
        t = tok or self.tok
        return IRError(what, where=f"line {t.line}:{t.col}", found=repr(t.text) if t.text else "end of input")

    def next(self) -> Tok:
        t = self.tok
        self.i += 1
        return t

    def accept(self, text: str) -> bool:
        if self.tok.text == text and self.tok.kind in ("punct", "id"):
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> Tok:
        if self.tok.text != text:
            raise self.error(f"expected '{text}'")
        return self.next()

    def expect_kind(self, kind: str, what: str) -> Tok:
        if self.tok.kind != kind:
            raise self.error(f"expected {what}")
        return self.next()

    # ---- pieces ----
    def parse_type(self) -> TensorType:
        t = self.expect_kind("id", "a type like fp32[2,3]")
        if t.text not in DTYPES:
            raise self.error(f"unknown dtype '{t.text}'", t)
        self.expect("[")
        dims: list[int] = []
        if self.tok.text != "]":
            while True:
                d = self.expect_kind("num", "a dimension")
                if not d.text.isdigit():
                    raise self.error("dimensions must be non-negative integers", d)
                dims.append(int(d.text))
                if not self.accept(","):
                    break
        self.expect("]")
        return TensorType(tuple(dims), t.text)

    def parse_attr_value(self) -> Any:
        t = self.tok
        if t.kind == "str":
            self.next()
            return re.sub(r"\\(.)", r"\1", t.text[1:-1])
        if t.kind == "num":
            self.next()
            if re.fullmatch(r"[-+]?\d+", t.text):
                return int(t.text)
            return float(t.text)
        if t.kind == "id" and t.text in ("true", "false"):
            self.next()
            return t.text == "true"
        if t.text == "(":
            self.next()
            items: list[Any] = []
            while self.tok.text != ")":
                items.append(self.parse_attr_value())
                if not self.accept(","):
                    break
            self.expect(")")
            return tuple(items)
        raise self.error("expected an attribute value (number, string, true/false or tuple)")

    def parse_attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        if not self.accept("{"):
            return attrs
        while self.tok.text != "}":
            k = self.expect_kind("id", "an attribute name")
            if k.text in attrs:
                raise self.error(f"attribute '{k.text}' given twice", k)
            self.expect("=")
            attrs[k.text] = self.parse_attr_value()
            if not self.accept(","):
                break
        self.expect("}")
        return attrs

    # ---- module ----
    def parse_module(self) -> Module:
        self.expect("module")
        name = self.expect_kind("ref", "a module name like @tiny")
        m = Module(name=name.text[1:], weights={}, functions={},
                   attrs=self.parse_attrs() if self.accept("attributes") else {})
        while self.tok.kind != "eof":
            if self.tok.text == "weight":
                self.parse_weight(m)
            elif self.tok.text == "func":
                fn = self.parse_function(m)
                if fn.name in m.functions:
                    raise self.error(f"function @{fn.name} defined twice")
                m.functions[fn.name] = fn
            else:
                raise self.error("expected 'weight' or 'func'")
        m.source_positions = self.positions
        return m

    def parse_weight(self, m: Module) -> None:
        self.expect("weight")
        t = self.expect_kind("ref", "a weight name like @embed.weight")
        if not t.text.startswith("@"):
            raise self.error("weight names start with @", t)
        if t.text[1:] in m.weights:
            raise self.error(f"weight {t.text} declared twice", t)
        self.expect(":")
        ty = self.parse_type()
        self.expect("from")
        sources = [self.parse_attr_value()]
        while self.accept(","):
            sources.append(self.parse_attr_value())
        if not all(isinstance(s, str) for s in sources):
            raise self.error("weight sources must be strings")
        m.weights[t.text[1:]] = Value(t.text[1:], ty, WEIGHT, tuple(sources))

    def parse_function(self, m: Module) -> Function:
        start = self.tok
        self.expect("func")
        name = self.expect_kind("ref", "a function name like @decode")
        env: dict[str, Value] = {}
        inputs: list[Value] = []
        self.expect("(")
        while self.tok.text != ")":
            r = self.expect_kind("ref", "an input like %ids")
            if not r.text.startswith("%"):
                raise self.error("function inputs start with %", r)
            if r.text[1:] in env:
                raise self.error(f"input {r.text} defined twice", r)
            self.expect(":")
            v = Value(r.text[1:], self.parse_type(), INPUT)
            env[v.name] = v
            inputs.append(v)
            if not self.accept(","):
                break
        self.expect(")")
        attrs = self.parse_attrs() if self.accept("attributes") else {}
        self.expect("{")
        ops: list[Op] = []
        outputs: list[tuple[str, Value]] = []
        while True:
            if self.tok.text == "return":
                self.next()
                while self.tok.text != "}":
                    n = self.expect_kind("id", "an output name")
                    self.expect("=")
                    outputs.append((n.text, self.parse_use(m, env)))
                    if not self.accept(","):
                        break
                self.expect("}")
                break
            if self.tok.kind == "eof" or self.tok.text == "}":
                raise self.error("function body must end with 'return name = %value, ...' and '}'")
            ops.append(self.parse_op(m, env))
        fn = Function(name.text[1:], inputs, ops, outputs, attrs)
        self.positions[id(fn)] = (start.line, start.col)
        return fn

    def parse_use(self, m: Module, env: dict[str, Value]) -> Value:
        r = self.expect_kind("ref", "a value like %3 or @weight")
        key = r.text[1:]
        if r.text.startswith("@"):
            if key not in m.weights:
                raise self.error(f"unknown weight {r.text}", r)
            return m.weights[key]
        if key not in env:
            raise self.error(f"use of undefined value {r.text}", r)
        return env[key]

    def parse_op(self, m: Module, env: dict[str, Value]) -> Op:
        from .registry import get_op

        names: list[Tok] = []
        start = self.tok
        while True:
            r = self.expect_kind("ref", "a result like %3")
            if not r.text.startswith("%"):
                raise self.error("results start with %", r)
            names.append(r)
            if not self.accept(","):
                break
        self.expect("=")
        opname = self.expect_kind("id", "an op name")
        try:
            opdef = get_op(opname.text)
        except IRError:
            raise self.error(f"unknown op '{opname.text}'", opname) from None
        self.expect("(")
        operands: list[Value | None] = []
        while self.tok.text != ")":
            if self.tok.kind == "id" and self.tok.text == "none":
                self.next()
                operands.append(None)
            else:
                operands.append(self.parse_use(m, env))
            if not self.accept(","):
                break
        self.expect(")")
        if len(operands) != len(opdef.operands):
            raise self.error(f"op '{opdef.name}' takes {len(opdef.operands)} operands, got {len(operands)}", opname)
        attr_tok = self.tok
        attrs = self.parse_attrs()
        try:
            # `variant` may be left out in hand-written IR: the optional operands given name it.
            attrs = opdef.normalize_attrs(opdef.with_variant(operands, attrs), where=f"line {attr_tok.line}:{attr_tok.col}")
        except IRError as e:
            raise IRError(e.what, where=f"line {attr_tok.line}:{attr_tok.col}", expected=e.expected,
                          found=e.found) from None
        self.expect(":")
        types = [self.parse_type()]
        while self.accept(","):
            types.append(self.parse_type())
        if len(types) != len(names):
            raise self.error(f"{len(names)} results but {len(types)} types", names[0])
        loc = ""
        if self.accept("loc"):
            self.expect("(")
            loc = self.expect_kind("str", "a location string")
            loc = loc.text[1:-1]
            self.expect(")")
        results = []
        for r, ty in zip(names, types):
            key = r.text[1:]
            if key in env:
                raise self.error(f"value {r.text} defined twice", r)
            v = Value(key, ty, SSA)
            env[key] = v
            results.append(v)
        op = Op(opdef.name, tuple(operands), tuple(results), attrs, loc)
        self.positions[id(op)] = (start.line, start.col)
        return op


def parse_module(text: str) -> Module:
    return Parser(text).parse_module()
