#!/usr/bin/env bash
# The long fuzz run: every parser fuzz suite with V4_FUZZ_SCALE times the CI example budget (default 40),
# random (not derandomized) examples, and hypothesis' per-test statistics (examples run, time, failures).
#   scripts/fuzz_long.sh            # about 40 x the CI budget
#   V4_FUZZ_SCALE=200 scripts/fuzz_long.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export V4_FUZZ_SCALE="${V4_FUZZ_SCALE:-40}"
exec nice python -m pytest -q -p no:cacheprovider --hypothesis-show-statistics \
    tests/core/test_fuzz_config.py tests/core/test_fuzz_safetensors.py tests/core/test_fuzz_ir.py tests/passes/test_fuzz_pipeline.py tests/core/test_fuzz_program.py \
    tests/core/test_safetensors.py -k fuzz "$@"
