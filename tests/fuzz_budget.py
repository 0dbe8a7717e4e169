"""The fuzz suites' example budget: a fixed count per property in CI, scaled up by `V4_FUZZ_SCALE` for the
long run (`scripts/fuzz_long.sh`). Derandomized in CI so a run is reproducible; random in the long run.
Also the generators the text fuzzers share (token edits of a valid text), written once here."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("V4_FUZZ_SCALE", "1"))


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=SCALE == 1,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture,
                                                          HealthCheck.filter_too_much])


def token_edits(extra: list[str]):
    """Up to three edits of a token list: delete, duplicate, replace (by one of `extra`, short random text or
    another token) or swap; applied by `apply_token_edits`."""
    return st.lists(st.tuples(st.sampled_from(["delete", "duplicate", "replace", "swap"]), st.integers(0, 10 ** 6),
                              st.integers(0, 10 ** 6), st.sampled_from(extra) | st.text(max_size=3)),
                    min_size=1, max_size=3)


def apply_token_edits(toks: list[str], edits) -> str:
    toks = list(toks)
    for kind, i, j, new in edits:
        i %= len(toks)
        j %= len(toks)
        if kind == "delete":
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, toks[i])
        elif kind == "replace":
            toks[i] = new if new else toks[j]
        else:
            toks[i], toks[j] = toks[j], toks[i]
    return " ".join(toks)
