"""Semantic tags: the two attributes every op may carry, saying what part of the model it computes.

* `layer` (int): the decoder layer the op belongs to; an MTP block j is layer `n_layers + j` (as
  `decoder_layer` numbers it). Absent outside layers (embedding, final head).
* `role` (str): what the op is in the model, from `ROLES` below; an op that a pass made from several
  (a merged GEMM, a fused seam) carries its members' roles joined by `+`, e.g. `attn.wq_a+attn.wkv`.

The model sets them (`registry.scope(name, layer=, role=)` for a block, `role=` on a call for a single
op such as each GEMM); the tracer records them; passes match on them instead of parsing `loc` strings or
checkpoint names. They never reach an op's reference, shape rule or cost rule, and CSE ignores them (as
it ignores `loc`): they describe provenance, not the computation. Eager calls drop them.
"""

from __future__ import annotations

from typing import Any

from ..errors import IRError

TAGS: dict[str, type] = {"layer": int, "role": str}

# The role vocabulary, the one place it is defined. GEMM roles are named after the checkpoint tensor the
# GEMM reads (`attn.wq_a` reads `layers.<l>.attn.wq_a.weight`); other roles name the block an op is in.
ROLES: dict[str, str] = {
    "embed": "token embedding and the expansion to the mHC streams",
    "attn_hc": "the mHC pre / post mixing around the attention",
    "ffn_hc": "the mHC pre / post mixing around the FFN",
    "attn": "the attention's own ops: input / q / kv norms, RoPE, scores, window write, output RoPE",
    "attn.wq_a": "GEMM: query down-projection",
    "attn.wq_b": "GEMM: query up-projection",
    "attn.wkv": "GEMM: the shared key / value latent projection",
    "attn.wo_a": "GEMM: grouped output down-projection",
    "attn.wo_b": "GEMM: output up-projection",
    "attn.compressor": "the KV compressor (pooling, norm, RoPE, state ring) of CSA / HCA layers",
    "attn.compressor.wkv": "GEMM: the compressor's kv projection",
    "attn.compressor.wgate": "GEMM: the compressor's gate projection",
    "attn.indexer": "the lightning indexer's own ops (query RoPE / rounding, scores, top-k)",
    "attn.indexer.wq_b": "GEMM: the indexer's query projection",
    "attn.indexer.weights_proj": "GEMM: the indexer's per-head weights",
    "attn.indexer.compressor": "the indexer's key compressor",
    "attn.indexer.compressor.wkv": "GEMM: the indexer compressor's kv projection",
    "attn.indexer.compressor.wgate": "GEMM: the indexer compressor's gate projection",
    "ffn": "the FFN's own ops (its input norm)",
    "ffn.gate": "the MoE router",
    "ffn.experts": "the routed experts",
    "ffn.shared": "the shared expert's activation and the sum with the routed experts",
    "ffn.shared.w1": "GEMM: shared expert gate projection",
    "ffn.shared.w2": "GEMM: shared expert down projection",
    "ffn.shared.w3": "GEMM: shared expert up projection",
    "head": "final mHC collapse, last-token pick, final norm and the LM head GEMM",
    "mtp": "an MTP block's input ops (embedding, enorm / hnorm, the sum)",
    "mtp.e_proj": "GEMM: MTP embedding projection",
    "mtp.h_proj": "GEMM: MTP hidden-state projection",
}


def roles_of(role: str) -> list[str]:
    """The member roles of a (possibly joined) role."""
    return role.split("+") if role else []


def has_role(op, role: str) -> bool:
    """Whether the op does the work of `role` (alone or as a member of a joined role)."""
    return role in roles_of(op.attrs.get("role", ""))


def join_roles(*ops) -> str:
    """The joined role of ops a pass combines (members in order, each once)."""
    out: list[str] = []
    for op in ops:
        for r in roles_of(op.attrs.get("role", "")):
            if r not in out:
                out.append(r)
    return "+".join(out)


def tags_of(op, **override: Any) -> dict[str, Any]:
    """The op's tags (for a new op that replaces it), with `override`s; None drops a tag."""
    t = {k: op.attrs[k] for k in TAGS if k in op.attrs}
    t.update(override)
    return {k: v for k, v in t.items() if v is not None and v != ""}


def check_tags(tags: dict[str, Any], at: str) -> dict[str, Any]:
    for k, v in tags.items():
        if k == "layer":
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise IRError("attribute 'layer' must be an int >= 0", where=at, found=repr(v))
        elif k == "role":
            bad = [r for r in roles_of(v) if r not in ROLES] if isinstance(v, str) and v else [v]
            if bad:
                raise IRError(f"unknown role {bad[0]!r}", where=at, expected="roles of ir/semantics.py ROLES, "
                              "joined by '+'")
    return tags


def without_tags(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if k not in TAGS}
