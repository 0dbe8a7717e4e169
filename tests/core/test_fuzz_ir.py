"""Fuzz the IR text parser and the verifier: mutated IR text (tokens deleted, duplicated, replaced or
swapped, lines dropped or repeated, random bytes) parses and verifies or raises one IRError; an accepted
module prints back to text that parses to the same text."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import apply_token_edits, fuzz_settings, token_edits
from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.ir.text import lex, parse_module, print_module
from v4compile.ir.verify import verify
from v4compile.trace import TraceOptions, trace


@functools.lru_cache(maxsize=None)
def small_text() -> str:
    """One CSA layer with hash routing (every op kind of a layer), decode only, weights as released."""
    cfg = preset("tiny").replace(n_layers=1, layer_kinds=("csa",), n_hash_layers=1, n_mtp_layers=0, name="fuzz")
    return print_module(trace(cfg, TraceOptions(weights="released"), functions=("decode",)))


@functools.lru_cache(maxsize=None)
def tokens() -> list[str]:
    return [t.text for t in lex(small_text()) if t.kind != "eof"]


def accepts(text) -> None:
    try:
        m = verify(parse_module(text))
    except IRError:
        return
    again = print_module(m)
    assert print_module(verify(parse_module(again))) == again


EXTRA = ["(", ")", "{", "}", "[", "]", ",", ":", "=", "none", "0", "-1", "1e400", "inf", "nan", "99999999999999999999",
         "fp32", "e8m0", "fp4x2", "%0", "%9999", "@embed.weight", '"x"', "block", "linear", "return", "func", "module",
         "true", "\xff", "#", "\n"]


@fuzz_settings(150)
@given(token_edits(EXTRA))
def test_fuzz_ir_tokens(edits):
    accepts(apply_token_edits(tokens(), edits))


@fuzz_settings(60)
@given(st.lists(st.tuples(st.sampled_from(["drop", "repeat"]), st.integers(0, 10 ** 6)), min_size=1, max_size=3))
def test_fuzz_ir_lines(edits):
    lines = small_text().splitlines()
    for kind, i in edits:
        i %= len(lines)
        if kind == "drop":
            del lines[i]
        else:
            lines.insert(i, lines[i])
    accepts("\n".join(lines))


@fuzz_settings(100)
@given(st.binary(max_size=24), st.integers(0, 10 ** 7))
def test_fuzz_ir_bytes(junk, at):
    raw = small_text().encode()
    at %= len(raw) + 1
    accepts(raw[:at] + junk + raw[at:])


@fuzz_settings(100)
@given(st.text(max_size=200))
def test_fuzz_ir_any_text(text):
    accepts(text)
    accepts("module @m\n" + text)
