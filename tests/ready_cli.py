"""`python ready_cli.py ARGS`: the command line (`v4compile ARGS`, as `python -m v4compile ARGS` runs it) after
importing what a cpu run under torchrun imports and printing `dist_launch.print_ready`'s line, for the
bounded-time tests of tests/runtime/test_parallel_artifact.py."""

from __future__ import annotations

import sys

import onnxruntime  # noqa: F401  (each imported here, before the ready line, not inside the timed run)
import torch.distributed  # noqa: F401

import v4compile.runtime.cpu_backend  # noqa: F401
import v4compile.runtime.distributed  # noqa: F401
import v4compile.runtime.session  # noqa: F401
from dist_launch import print_ready
from v4compile.cli import main

if __name__ == "__main__":
    print_ready()
    sys.exit(main(sys.argv[1:]))
