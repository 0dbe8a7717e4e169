"""Phases inside one launch: some programs produce what the others then read, without a second launch.

A program takes a ticket (an atomic counter: its place in the order programs actually started), and the
first tickets do the producing phase; the rest wait for the producers' count. A waiting program only waits
for programs that took their tickets before it, which have started and are resident, so they finish
whatever the hardware's scheduling order and however few programs fit at once: no deadlock, unlike a wait
keyed on the program id. Under Triton's interpreter programs run one after another, so tickets follow
program order and every wait is already satisfied when it starts.

Ordering: a producer's stores happen before its `publish` (barrier, then a release atomic at GPU scope);
`wait_for` acquires the count and then synchronises the program's threads, so what they read next sees
those stores. The counters are a `semaphore` pointer (zero before and after the call): the last program to
finish (`arrival.last_to_arrive`) resets them.
"""

import triton
import triton.language as tl


@triton.jit
def ticket(counter_ptr):
    """This program's place in the order the launch's programs started (0, 1, ...)."""
    return tl.atomic_add(counter_ptr, 1, sem="relaxed")


@triton.jit
def publish(counter_ptr):
    """Count this program's phase as done; its stores before the call are visible to `wait_for`."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def wait_for(counter_ptr, n):
    """Spin until n producers have published."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < n:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()
