"""The reference model: `ReferenceModel` (eager) built on `model_step` (traceable)."""

from .blocks import StepOptions, model_step, mtp_step
from .cache import Cache
from .reference import ReferenceModel

__all__ = ["ReferenceModel", "Cache", "StepOptions", "model_step", "mtp_step"]
