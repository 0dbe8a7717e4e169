"""Wall-clock time of the compiler's stages (tracing, each pass, change detection, checks, output), and
a progress line for any stage that runs longer than `PROGRESS_AFTER` seconds.

`Stages` accumulates seconds by stage name in first-seen order; `render(wall)` prints them with an
`other` row (interpreter start-up, argument parsing, anything between stages) so that the rows add
up to the wall clock the caller measured.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager

log = logging.getLogger("v4compile")

PROGRESS_AFTER = 2.0  # seconds: a stage that takes longer says so while it runs and when it ends
# What the pass manager does around the passes; printed after them.
INSTRUMENTS = ("change detection", "verify", "numerics checks", "print / dump IR")


def process_seconds() -> float | None:
    """Wall-clock seconds since this process started (Linux /proc; None elsewhere)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
        btime = next(int(ln.split()[1]) for ln in open("/proc/stat") if ln.startswith("btime"))
        return max(time.time() - (btime + start), 0.0)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class Stages:
    def __init__(self, progress_after: float | None = PROGRESS_AFTER):
        self.seconds: dict[str, float] = {}
        self.progress_after = progress_after

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def __call__(self, name: str, progress: str | None = None):
        """Time a stage under `name`; `progress` (e.g. 'tracing') turns on the progress lines."""
        timer = None
        if progress and self.progress_after is not None:
            timer = threading.Timer(self.progress_after, log.info, (f"{progress} ...",))
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if timer is not None:
                timer.cancel()
                if dt > self.progress_after:
                    log.info("%s: done in %.1f s", progress, dt)
            self.add(name, dt)

    def total(self) -> float:
        return sum(self.seconds.values())

    def render(self, wall: float | None = None, title: str = "timing") -> str:
        """One row per stage (the passes together, then the pass manager's instruments); with `wall`, an
        `other` row makes the rows add up to it."""
        items = list(self.seconds.items())
        passes = [r for r in items if r[0].startswith("pass ")]
        inst = [r for r in items if r[0] in INSTRUMENTS and r[1] >= 5e-5]
        rows = []
        for r in items:
            if r in passes:
                if r is passes[0]:
                    rows += passes + inst
            elif r[0] not in INSTRUMENTS:
                rows.append(r)
        if not passes:
            rows += inst
        if wall is not None:
            rows.append(("other (interpreter start-up, imports, between stages)", max(wall - self.total(), 0.0)))
        total = sum(s for _, s in rows)
        out = [f"// ----- {title} (wall clock) -----\n"]
        for name, s in rows:
            out.append(f"  {s:8.4f} s  {100 * s / max(total, 1e-9):5.1f}%  {name}\n")
        out.append(f"  {total:8.4f} s  100.0%  total\n")
        return "".join(out)
