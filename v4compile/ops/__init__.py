"""Every op of the IR, with its torch reference and shape rule (see `ir/registry.py`).

The reference model is written in these ops; importing this package registers all of them.
"""

from .basic import add, embed, last_token, linear, reshape, rms_norm, split, swiglu
from .mhc import hc_expand, hc_head, hc_post, hc_pre
from .rope import rope
from .attention import attention, grouped_out_proj, window_write
from .compressor import compress
from .indexer import indexer_scores, topk
from .moe import moe_experts, router
from .numerics import fp8_round, hadamard_fp4_round
from . import fused, paged  # noqa: F401  (ops made by passes)

__all__ = ["add", "embed", "last_token", "linear", "reshape", "rms_norm", "split", "swiglu", "hc_expand", "hc_head",
           "hc_post", "hc_pre", "rope", "attention", "grouped_out_proj", "window_write", "compress",
           "indexer_scores", "topk", "moe_experts", "router", "fp8_round", "hadamard_fp4_round"]
