#!/usr/bin/env bash
# The C runtime's GPU check (issue 10) on a machine with an NVIDIA H200 (or, with --device hip, an MI355X).
# Builds tiny and a ~0.5 B random model (with 2 MTP drafts), checks greedy ids against the reference, compares one
# decode step of tiny launch by launch with the host device (first differing launch named), times a decode step
# launch by launch and as a CUDA-graph replay, and reports achieved HBM bandwidth against 4.8 TB/s; checks the
# speculative steps (greedy ids and one captured call a step, the sampled step against the host rule, the step's
# time against decode's beside the modeled ratio). The details: scripts/gpu_check.py's docstring.
#   scripts/gpu_check.sh [--device cuda|hip] [--configs tiny,mid] [--steps 8] [--reps 50] [--draft-tokens 2|0]
# Exit: 0 passed, 1 a check failed, 2 no usable device / kernels. NOT RUN on a GPU yet (no device so far).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
elif command -v rocm-smi >/dev/null 2>&1; then
  rocm-smi --showproductname || true
else
  echo "error: no nvidia-smi / rocm-smi: this check needs a GPU machine" >&2
  exit 2
fi
python -c "from v4compile.runtime.build import library; print('C runtime:', library())"
exec python scripts/gpu_check.py --json gpu_check.json "$@"
