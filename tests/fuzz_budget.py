"""The fuzz suites' example budget: a fixed count per property in CI, scaled up by `V4_FUZZ_SCALE` for the
long run (`scripts/fuzz_long.sh`). Derandomized in CI so a run is reproducible; random in the long run."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("V4_FUZZ_SCALE", "1"))


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=SCALE == 1,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture,
                                                          HealthCheck.filter_too_much])
