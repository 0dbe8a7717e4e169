"""Build HF transformers' DeepseekV4ForCausalLM from our config and canonical weights (the CPU oracle)."""

from __future__ import annotations

import torch

from v4compile.config import V4Config
from v4compile.names import canonical_sources


def hf_config(cfg: V4Config):
    from transformers import DeepseekV4Config

    skip = ("architectures", "model_type", "quantization_config", "expert_dtype")
    return DeepseekV4Config(**{k: v for k, v in cfg.to_hf().items() if k not in skip})


def hf_model(cfg: V4Config, dense: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """`dense`: canonical name -> float tensor (unstacked experts), e.g. from `Checkpoint.dense`."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    state = model.state_dict()
    new = {}
    for key, t in state.items():
        if "rotary_emb" in key:
            continue
        parts = canonical_sources(key, cfg.n_experts, cfg.moe_inter_dim)
        if len(parts) == 1 and parts[0][1].index is None:
            new[key] = dense[parts[0][0]].to(t.dtype).reshape(t.shape)
            continue
        value = torch.empty_like(t)
        for cname, sl in parts:
            r0, r1 = sl.rows if sl.rows else (0, t.shape[1])
            value[sl.index, r0:r1] = dense[cname].to(t.dtype)
        new[key] = value
    missing = set(k for k in state if "rotary_emb" not in k) - set(new)
    assert not missing, missing
    model.load_state_dict(new, strict=False)
    if dtype == torch.float32:
        return model
    # What `from_pretrained(dtype=...)` does: modules in `_keep_in_fp32_modules_strict` stay fp32, and
    # the RoPE frequency buffers (built explicitly in fp32) are not cast.
    keep = set(model._keep_in_fp32_modules_strict) | {"rotary_emb"}
    kept = {name: t.detach().clone() for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if keep & set(name.split("."))}
    model = model.to(dtype)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name in kept:
            t.data = kept[name]
    return model
