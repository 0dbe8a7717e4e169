"""CPU thread counts: the cores this process may use (`usable_cores`, the one place that asks the OS), the
bound every entry point accepts and the default when none is given."""

from __future__ import annotations

import os

MAX_THREADS = 256  # `v4compile.load(threads=)`, `--threads`
TORCH_THREADS = 4  # compile / generate (torch): the default's cap
ORT_THREADS = 8  # the cpu device (ONNX Runtime): the default's cap


def default_threads(cap: int) -> int:
    """min(cap, the cores this process may use, minus the ones other processes keep busy), at least 1.
    Every core (torch's and ONNX Runtime's own default) oversubscribes a shared machine: two such compiles
    on 2 cores took 3 minutes for a 9 s compile; one thread each, 19 s."""
    cores = usable_cores()
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(cap, cores, cores - busy))


def usable_cores() -> int:
    """The cores this process may use: its affinity mask (a container or `taskset` may allow fewer than the
    machine has), else every core the OS reports."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform (macOS)
        return os.cpu_count() or 1
