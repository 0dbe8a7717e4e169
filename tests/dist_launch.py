"""Launching the ranks of a process group as torchrun does, for the multi-process tests: each rank a
subprocess with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free
port), every one waited for with a deadline and killed and reaped if it passes it, so no test hangs.

The bounded-time tests time a failure from the moment the ranks are ready (`print_ready`: a line each rank
prints once its imports are done; `since_ready`), not from the processes' start: two interpreters importing
torch take seconds, and many more on a busy 2-core machine, which no bound on the failure should include."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

READY = "v4-test-ready"  # the line's tag: `READY <time.time()>`, on stderr


def print_ready() -> None:
    """Called by a rank's process once its imports are done."""
    print(f"{READY} {time.time():.3f}", file=sys.stderr, flush=True)


def run_rank(body) -> int:
    """One rank's life under torchrun's environment: joins the gloo group (its timeout the runtime's), runs
    `body(rank)`, and leaves the group however it ends. A V4Error prints one `error:` line: exit status 2, as the
    CLI's; anything else is the test's bug and raises."""
    from datetime import timedelta

    import torch.distributed as dist

    from v4compile.errors import V4Error
    from v4compile.runtime.distributed import timeout_from_env

    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_from_env()))
        body(int(os.environ["RANK"]))
        return 0
    except V4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def since_ready(errs: list[str], end: float) -> float:
    """Seconds from the last rank's ready line (each of `errs`, the ranks' stderr, must hold exactly one) to
    `end` (a `time.time()`)."""
    stamps = []
    for e in errs:
        found = re.findall(rf"^{READY} (\d+\.\d+)$", e, re.M)
        assert len(found) == 1, f"a rank printed {len(found)} ready lines: {e[-500:]}"
        stamps.append(float(found[0]))
    return end - max(stamps)


def without_ready(err: str) -> str:
    return re.sub(rf"^{READY} .*\n", "", err, flags=re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], world: int, ranks=None, timeout_s: float = 120, env: dict | None = None,
           cwd=None, per_node: int | None = None) -> list[tuple[int, str, str]]:
    """Run `argv` as ranks `ranks` (default all) of a `world`-rank group; (returncode, stdout, stderr) per
    rank, in order. A rank still running at the deadline is killed (returncode -9). `per_node`: the ranks
    as torchrun places them on nodes of that many (LOCAL_RANK = RANK % per_node, GROUP_RANK = RANK //
    per_node); default one node, where LOCAL_RANK is RANK."""
    port, procs = free_port(), []
    per_node = per_node or world
    for r in range(world) if ranks is None else ranks:
        e = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r % per_node), "GROUP_RANK": str(r // per_node),
             "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node),
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
