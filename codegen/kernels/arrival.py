"""Arrival counters: how one launch finishes a split reduction without a second launch.

The programs of a group (a GEMM tile's K splits, an attention group's KV splits, ...) each write their
partial to scratch and then arrive at the group's int32 counter; the one that arrives last (it sees n - 1)
does the group's reduction, in the order the partials are indexed (so the result does not depend on which
program that is), and then stores 0, leaving the counter as it found it. The counters are a `semaphore`
pointer of the call (`KernelCall`): zero before the call, zero after it.

Ordering: the barrier makes every thread's partial stores happen before the arrival, which one thread
performs as an acq_rel atomic at GPU scope (release for this program's partials, acquire of the others'
before the last program reads them).
"""

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter_ptr, n):
    """Arrive at `counter_ptr`; True in the last of the n programs to arrive."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel") == n - 1
