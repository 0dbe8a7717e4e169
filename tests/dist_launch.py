"""Launching the ranks of a process group as torchrun does, for the multi-process tests: each rank a
subprocess with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free
port), every one waited for with a deadline and killed and reaped if it passes it, so no test hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], world: int, ranks=None, timeout_s: float = 120, env: dict | None = None,
           cwd=None) -> list[tuple[int, str, str]]:
    """Run `argv` as ranks `ranks` (default all) of a `world`-rank group; (returncode, stdout, stderr) per
    rank, in order. A rank still running at the deadline is killed (returncode -9)."""
    port, procs = free_port(), []
    for r in range(world) if ranks is None else ranks:
        e = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **(env or {})}
        procs.append(subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd))
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                o, e = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
