"""Programmatic dependent launch (PDL): the kernel half, shared by every family.

A kernel adopts it with two lines: a `PDL: tl.constexpr` parameter (KernelCall binds it to False; the AOT
stage sets it from the target, `targets.TargetSpec.pdl`) and `pdl_enter(PDL)` as its first statement.

On sm_90a, a kernel launched with programmatic stream serialization may start while the previous kernel
of the stream still runs. `gdc_wait` (PTX `griddepcontrol.wait`) then blocks until that kernel has
completed and its memory is visible: nothing before it may read what an earlier kernel wrote or write
what an earlier kernel reads, so it comes first. `gdc_launch_dependents` (`griddepcontrol.launch_dependents`)
lets the next kernel's blocks be scheduled as soon as every block of this one has started; they wait in
their own `pdl_enter`, so the next kernel's launch overlaps this one's run instead of following its end.
Both are no-ops on a launch without the attribute. The chain stays ordered: a kernel completes only after
its own wait returned, so waiting for the previous kernel waits for every earlier one too; hence the
runtime sets the attribute only on launches of kernels that wait (`uses_pdl`, in the package's flags.py:
that and the flag's other facts live outside this @triton.jit module, so that importing the runtime loads no
kernel module before the host device has chosen Triton's interpreter).

With PDL False (gfx950: HIP has no programmatic launch; Triton's interpreter has no grid-dependency ops)
nothing is emitted.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
