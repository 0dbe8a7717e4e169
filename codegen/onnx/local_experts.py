"""ONNX lowering of the `local_experts` family: expert parallelism's ownership mask (`ops/collective.py`)."""

from __future__ import annotations


def lower_local_experts(g, o, a, r):
    if o.types["weights"].dtype != "fp32":
        raise NotImplementedError("local_experts on non-fp32 routing weights (cpu: fp32)")
    local = g.op("Gather", o.owner, o.indices, axis=0)
    return g.where(g.op("GreaterOrEqual", local, g.iscalar(0)), o.weights, g.scalar(0.0)), local
