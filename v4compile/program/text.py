"""The program's text form; parses back to an equal program.

    program @tiny attributes {numerics = "hf", ...}

    func @decode attributes {arena_bytes = 12800, batch = 2, tokens = 1} {
      buffer %arena : arena 12800 align 256
      buffer %pool.main : pool fp32[480,32] align 256
      launch linear [gemm] (x = %arena[4096] fp32[2,1,64] (64, 64, 1) %5, w = %layers.0.attn.wqkv_a.weight[0]
          fp32[80,64] (64, 1) %layers.0.attn.wqkv_a.weight, scale = none)
          writes (y = %arena[4096] fp32[2,1,80] (80, 80, 1) %208) {block = 128} loc("layers.0.attn")
      return logits = %logits[0] fp32[2,512] (512, 1) %206
    }

An argument is `%buffer[byte offset] type (element strides) %value [in %root]` (`in` names the value
that owns the storage when it is not the value itself: views and in-place updates). One launch per line.
"""

from __future__ import annotations

from ..errors import IRError
from ..ir.text import Parser, fmt_attr, fmt_attrs
from .core import BUFFER_KINDS, Arg, Buffer, FunctionProgram, Launch, Program


def fmt_arg(a: Arg | None) -> str:
    if a is None:
        return "none"
    root = f" in %{a.root}" if a.root and a.root != a.value else ""
    return f"%{a.buffer}[{a.offset}] {a.type} {fmt_attr(tuple(a.strides))} %{a.value}{root}"


def fmt_launch(l: Launch) -> str:
    ops = ", ".join(f"{n} = {fmt_arg(a)}" for n, a in l.operands)
    res = ", ".join(f"{n} = {fmt_arg(a)}" for n, a in l.results)
    loc = f' loc("{l.loc}")' if l.loc else ""
    return f"launch {l.op} [{l.kernel or 'none'}] ({ops}) writes ({res}){fmt_attrs(l.attrs)}{loc}"


def fmt_buffer(b: Buffer) -> str:
    what = str(b.nbytes) if b.type is None else str(b.type)
    return f"buffer %{b.name} : {b.kind} {what} align {b.align}"


def print_function(f: FunctionProgram) -> str:
    lines = [f"func @{f.name}{' attributes' + fmt_attrs(f.attrs) if f.attrs else ''} {{"]
    lines += ["  " + fmt_buffer(b) for b in f.buffers]
    lines += ["  " + fmt_launch(l) for l in f.launches]
    lines.append("  return " + ",\n         ".join(f"{n} = {fmt_arg(a)}" for n, a in f.outputs))
    lines.append("}")
    return "\n".join(lines)


def print_program(p: Program, functions: list[str] | None = None) -> str:
    out = [f"program @{p.name}{' attributes' + fmt_attrs(p.attrs) if p.attrs else ''}"]
    for name, f in p.functions.items():
        if functions is None or name in functions:
            out += ["", print_function(f)]
    return "\n".join(out) + "\n"


class ProgramParser(Parser):
    def name(self, what: str) -> str:
        t = self.expect_kind("ref", what)
        return t.text[1:]

    def parse_int(self, what: str) -> int:
        t = self.expect_kind("num", what)
        if not t.text.isdigit():
            raise self.error(f"{what} must be a non-negative integer", t)
        return int(t.text)

    def parse_arg(self) -> Arg | None:
        if self.accept("none"):
            return None
        buf = self.name("a buffer like %arena")
        self.expect("[")
        off = self.parse_int("a byte offset")
        self.expect("]")
        ty = self.parse_type()
        t = self.tok
        strides = self.parse_attr_value()
        if not isinstance(strides, tuple) or len(strides) != ty.rank or not all(isinstance(s, int) for s in strides):
            raise self.error(f"strides must be a tuple of {ty.rank} integers", t)
        value = self.name("the value it holds, like %47")
        root = self.name("the storage root, like %213") if self.accept("in") else value
        return Arg(buf, off, ty, tuple(strides), value, root)

    def parse_pairs(self, what: str, end: str) -> list:
        """`name = ARG, ...` up to (not including) `end`."""
        out = []
        while self.tok.text != end:
            n = self.expect_kind("id", what)
            self.expect("=")
            out.append((n.text, self.parse_arg()))
            if not self.accept(","):
                break
        return out

    def parse_named_args(self) -> tuple:
        self.expect("(")
        out = self.parse_pairs("an argument name", ")")
        self.expect(")")
        return tuple(out)

    def parse_function(self) -> FunctionProgram:
        self.expect("func")
        name = self.name("a function name like @decode")
        attrs = self.parse_attrs() if self.accept("attributes") else {}
        self.expect("{")
        buffers, launches = [], []
        while True:
            if self.accept("buffer"):
                bname = self.name("a buffer name")
                self.expect(":")
                kind = self.expect_kind("id", "a buffer kind")
                if kind.text not in BUFFER_KINDS:
                    raise self.error(f"unknown buffer kind '{kind.text}' (one of {', '.join(BUFFER_KINDS)})", kind)
                if kind.text == "arena":
                    size, ty = self.parse_int("a size in bytes"), None
                else:
                    ty = self.parse_type()
                    size = ty.nbytes
                self.expect("align")
                buffers.append(Buffer(bname, kind.text, size, self.parse_int("an alignment"), ty))
            elif self.accept("launch"):
                op = self.expect_kind("id", "an op name").text
                self.expect("[")
                kernel = self.expect_kind("id", "a kernel family or none").text
                self.expect("]")
                operands = self.parse_named_args()
                self.expect("writes")
                results = self.parse_named_args()
                lattrs = self.parse_attrs()
                loc = ""
                if self.accept("loc"):
                    self.expect("(")
                    loc = self.expect_kind("str", "a location string").text[1:-1]
                    self.expect(")")
                launches.append(Launch(op, None if kernel == "none" else kernel, operands, results, lattrs, loc))
            elif self.accept("return"):
                outputs = self.parse_pairs("an output name", "}")
                self.expect("}")
                return FunctionProgram(name, buffers, launches, outputs, attrs)
            else:
                raise self.error("expected 'buffer', 'launch' or 'return'")

    def parse_program(self) -> Program:
        self.expect("program")
        name = self.name("a program name like @tiny")
        attrs = self.parse_attrs() if self.accept("attributes") else {}
        funcs: dict[str, FunctionProgram] = {}
        while self.tok.kind != "eof":
            f = self.parse_function()
            if f.name in funcs:
                raise self.error(f"function @{f.name} defined twice")
            funcs[f.name] = f
        return Program(name, funcs, attrs)


def parse_program(text: str) -> Program:
    try:
        return ProgramParser(text).parse_program()
    except RecursionError:
        raise IRError("program text nested too deeply") from None
