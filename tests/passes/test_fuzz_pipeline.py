"""Fuzz the pass-pipeline strings (`--passes`): any text gives a pipeline or one PassError."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.cli.args import split_specs
from v4compile.errors import PassError
from v4compile.passes import DEFAULT_PIPELINE, PassManager

PIECES = [*DEFAULT_PIPELINE, "testing_corrupt", "align", "quant", "kv_format", "op", "factor", "index", "{", "}", ",",
          "=", "0", "-1", "256", "1e3", "nan", "true", "fp8", " ", "x", "\x00", "é"]


names = st.sampled_from([*DEFAULT_PIPELINE, "testing_corrupt", "nope", ""]) | st.text(max_size=4)
values = st.sampled_from(["0", "-1", "256", "3", "1e3", "nan", "true", "fp8", "none", "", " ", "{", "}", ","]) \
    | st.text(max_size=3)
items = st.tuples(st.sampled_from(["align", "quant", "kv_format", "index_format", "op", "factor", "index", "x", ""]),
                  st.none() | values).map(lambda kv: kv[0] if kv[1] is None else f"{kv[0]}={kv[1]}")
specs = st.tuples(names, st.none() | st.lists(items, max_size=3)).map(
    lambda nb: nb[0] if nb[1] is None else nb[0] + "{" + ",".join(nb[1]) + "}")


def check(text: str) -> None:
    try:
        pm = PassManager(split_specs(text))
    except PassError:
        return
    for p in pm.passes:  # an accepted pipeline names registered passes whose spec parses back
        assert PassManager([p.spec()]).passes[0] == p


@fuzz_settings(200)
@given(st.lists(specs, min_size=1, max_size=4), st.lists(st.tuples(st.integers(0, 200), st.sampled_from(PIECES)),
                                                         max_size=2))
def test_fuzz_pass_pipelines(spec_list, noise):
    """Well-formed-looking pipelines (names, option lists, values), sometimes with a piece spliced in."""
    text = ",".join(spec_list)
    for at, piece in noise:
        at %= len(text) + 1
        text = text[:at] + piece + text[at:]
    check(text)


@fuzz_settings(100)
@given(st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=12))
def test_fuzz_pass_pipeline_strings(pieces):
    check("".join(pieces))
