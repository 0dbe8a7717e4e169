"""From what the user names (a checkpoint, or a preset) to a traced module (on first use), its weight
source and the reference model to check it against."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .config import V4Config, preset
from .errors import InputError
from .ir.core import Module
from .trace import TraceOptions, trace
from .weights_convert import DenseSource

log = logging.getLogger(__name__)

WEIGHT_MODES = ("none", "random", "checkpoint")


@dataclass
class Frontend:
    cfg: V4Config
    weights: str  # none / random / checkpoint
    source: object | None  # gives IR weight tensors (None: shape-only)
    checkpoint: Path | None
    seed: int
    options: TraceOptions  # what `module` is traced with (shape-only: the released FP8 / FP4 formats)
    allow_nonfinite: bool = False
    formats: dict | None = None  # a checkpoint's stored weight formats (every later trace must use them)
    traced: Module | None = field(default=None, repr=False)

    @property
    def module(self) -> Module:
        """The model traced with `options`, on first use (an artifact is traced per bucket instead)."""
        if self.traced is None:
            self.traced = trace(self.cfg, self.options, formats=self.formats)
        return self.traced

    def reference(self, streaming: bool = False, on_load=None):
        """The ReferenceModel holding exactly the weights the IR will get; `streaming`: one decoder layer of them
        resident at a time, read from the checkpoint (or the random source) as the model reaches it
        (`StreamedWeights`, `on_load` its progress)."""
        from .model import ReferenceModel
        from .model.reference import StreamedWeights, build_weights, quantized_params

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.options.dtype]
        if streaming and self.weights in ("checkpoint", "random"):
            if self.weights == "checkpoint":
                ck = self.source  # the frontend's open checkpoint: its reader preads one tensor at a time
                load, quantized = (lambda n: ck.dense(n)), quantized_params(ck.stored_formats())
            else:
                src = self.source
                load, quantized = (lambda n: src.dense(n)), frozenset()
            return ReferenceModel(self.cfg, StreamedWeights(self.cfg, load, dtype, on_load),
                                  numerics=self.options.numerics, dtype=dtype, quantized=quantized)
        if self.weights == "checkpoint":
            return ReferenceModel.from_pretrained(self.checkpoint, numerics=self.options.numerics, dtype=dtype,
                                                  include_mtp=False, allow_nonfinite=self.allow_nonfinite)
        if self.weights == "random":
            src = self.source
            return ReferenceModel(self.cfg, build_weights(self.cfg, lambda n: src.dense(n), dtype, include_mtp=False),
                                  numerics=self.options.numerics, dtype=dtype)
        raise InputError("numerics checks need weights", expected="--weights random (presets) or a checkpoint",
                         found="--weights none")


def load(checkpoint: str | None, preset_name: str | None, weights: str | None, options: TraceOptions,
         seed: int = 0, allow_nonfinite: bool = False) -> Frontend:
    if checkpoint:
        weights = weights or "checkpoint"
        if weights == "random":
            raise InputError("--weights random is for presets; a checkpoint brings its own weights")
        ck = Checkpoint.open(checkpoint, allow_nonfinite=allow_nonfinite)
        cfg = ck.cfg
        ck.validate(include_mtp=any(n.startswith("mtp.") for n in ck.entries))
        return Frontend(cfg, weights, ck if weights == "checkpoint" else None, Path(checkpoint), seed, options,
                        allow_nonfinite, ck.stored_formats())
    cfg = preset(preset_name or "tiny")
    weights = weights or "random"
    if weights == "checkpoint":
        raise InputError("--weights checkpoint needs a CHECKPOINT")
    if weights == "none":
        options = TraceOptions(**{**options.__dict__, "weights": "released"})
        return Frontend(cfg, weights, None, None, seed, options)
    from .accounting import account
    from .init_random import random_source
    from .weights import spec_table

    if account(cfg).logical_params > 2_000_000_000:
        raise InputError(f"preset '{cfg.name}' is too large for random weights", expected="--weights none")
    src = random_source(cfg, seed)
    specs = spec_table(cfg)
    dense = DenseSource(_LazyDense(lambda n: src(specs[n])))
    return Frontend(cfg, weights, dense, None, seed, options)


class _LazyDense(dict):
    """Random tensors drawn on first access (and kept)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        t = self.make(name)
        self[name] = t
        return t
