"""Fuzz the pass-pipeline strings (`--passes`): any text gives a pipeline or one PassError."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fuzz_budget import fuzz_settings
from v4compile.compile_cli import _split_specs
from v4compile.errors import PassError
from v4compile.passes import DEFAULT_PIPELINE, PassManager

PIECES = [*DEFAULT_PIPELINE, "testing_corrupt", "align", "quant", "kv_format", "op", "factor", "index", "{", "}", ",",
          "=", "0", "-1", "256", "1e3", "nan", "true", "fp8", " ", "x", "\x00", "é"]


@fuzz_settings(300)
@given(st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=12))
def test_fuzz_pass_pipeline_strings(pieces):
    text = "".join(pieces)
    try:
        pm = PassManager(_split_specs(text))
    except PassError:
        return
    for p in pm.passes:  # an accepted pipeline names registered passes whose spec parses back
        assert PassManager([p.spec()]).passes[0] == p
