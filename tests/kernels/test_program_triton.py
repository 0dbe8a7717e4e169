"""The program run end to end by the Triton kernels (under TRITON_INTERPRET=1): every launch of tiny's
decode and prefill programs, at its exact places in the byte buffers, against the program executor's op
references.

Tolerance: fp32, hf numerics. A kernel differs from its reference by fp32 summation order (~1e-6 relative
per op, see tests/kernels/test_kernels_*.py); through 5 layers and 3 calls the logits then differ by ~1e-5 of their
scale. 1e-4 leaves room for that, while a wrong argument, stride or kernel moves logits by > 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from conftest import dense_weights
from v4compile.config import preset
from v4compile.harness import IRRunner, Scenario, ir_logits
from v4compile.ir.verify import verify
from v4compile.passes import DEFAULT_PIPELINE, PassManager, PipelineOptions
from v4compile.program.build import build_program
from v4compile.program.execute import Buffers, execute
from v4compile.trace import TraceOptions, trace
from v4compile.weights_convert import DenseSource, load_ir_weights

pytestmark = pytest.mark.slow
RTOL = 1e-4


def triton_launch(l, args, outs):
    from v4compile.codegen.kernels import launch

    launch(l.op, args, l.attrs, outs)


def test_tiny_program_on_triton_kernels_matches_the_executor():
    from v4compile.codegen.program_kernels import program_kernels

    cfg = preset("tiny")
    m = verify(PassManager(DEFAULT_PIPELINE, PipelineOptions()).run(
        trace(cfg, TraceOptions(numerics="hf", batch=2, chunk=16, decode_batch=2, capacity=64))).module)
    prog = build_program(m)
    assert program_kernels(prog).complete  # every launch has its kernels
    w = load_ir_weights(m, DenseSource(dense_weights("tiny")))
    sc = Scenario.make(cfg.vocab_size, 2, 20, 2, seed=7)  # two prefill chunks (ragged), two decode steps

    def runner(kernel):
        bufs = Buffers()
        return IRRunner(m, w, interpreter=lambda fn, weights, inputs, **_: execute(prog.functions[fn.name], bufs,
                                                                                    inputs, weights, kernel))

    want = ir_logits(runner(None), sc)
    got = ir_logits(runner(triton_launch), sc)
    scale = max(float(t.abs().max()) for t in want)
    err = max(float((a - b).abs().max()) for a, b in zip(want, got))
    assert scale > 1 and err / scale < RTOL, err / scale
    assert all(torch.isfinite(t).all() for t in got)
