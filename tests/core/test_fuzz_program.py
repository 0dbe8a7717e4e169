"""Fuzz the program text parser and verifier (the stage after `plan_memory`): mutated program text parses
and verifies or raises one IRError; an accepted program prints back to the same text."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import apply_token_edits, fuzz_settings, token_edits
from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.ir.text import lex
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.program.build import build_program
from v4compile.program.text import parse_program, print_program
from v4compile.program.verify import verify_program
from v4compile.trace import TraceOptions, trace


@functools.lru_cache(maxsize=None)
def small_text() -> str:
    cfg = preset("tiny").replace(n_layers=1, layer_kinds=("csa",), n_hash_layers=1, n_mtp_layers=0, name="fuzz")
    m = trace(cfg, TraceOptions(weights="released", decode_batch=2, capacity=128), functions=("decode",))
    m = PassManager(DEFAULT_PIPELINE, PipelineOptions()).run(m).module
    return print_program(verify_program(build_program(m)))


@functools.lru_cache(maxsize=None)
def tokens() -> list[str]:
    return [t.text for t in lex(small_text()) if t.kind != "eof"]


def accepts(text: str) -> None:
    try:
        p = verify_program(parse_program(text))
    except IRError:
        return
    again = print_program(p)
    assert print_program(verify_program(parse_program(again))) == again


EXTRA = ["(", ")", "{", "}", "[", "]", ",", ":", "=", "none", "0", "-1", "7", "1e400", "inf", "99999999999999999999",
         "fp32", "e8m0", "arena", "pool", "align", "launch", "buffer", "writes", "in", "%arena", "%0", "return", "\xff"]


@fuzz_settings(60)
@given(token_edits(EXTRA))
def test_fuzz_program_tokens(edits):
    accepts(apply_token_edits(tokens(), edits))


@fuzz_settings(40)
@given(st.text(max_size=200))
def test_fuzz_program_any_text(text):
    accepts(text)
    accepts("program @p\nfunc @f {\n" + text)
