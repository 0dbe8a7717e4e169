"""How many CPU threads a command uses by default: one home for compile's torch threads and the cpu
device's ONNX Runtime intra-op threads."""

from __future__ import annotations

import os

MAX_DEFAULT_THREADS = 4


def default_threads() -> int:
    """min(4, the cores this process may use, minus the ones other processes keep busy), at least 1.
    Every core (torch's and ONNX Runtime's own default) oversubscribes a shared machine: two such
    processes on 2 cores took 3 minutes for a 9 s compile; one thread each, 19 s."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(MAX_DEFAULT_THREADS, cores, cores - busy))
