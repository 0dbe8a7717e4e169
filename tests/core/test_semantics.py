"""Semantic tags (`layer`, `role`): validated by the registry, invisible to references, ignored by CSE, set on
every traced op, and what passes and the report read instead of `loc` strings."""

from __future__ import annotations

import pytest
import torch

from v4compile.config import preset
from v4compile.errors import IRError
from v4compile.ir.registry import get_op, ref_attrs
from v4compile.ir.semantics import ROLES, roles_of
from v4compile.ir.text import parse_module
from v4compile.ir.verify import verify
from v4compile.ops.basic import linear
from v4compile.trace import TraceOptions, trace

IR = """module @t
weight @w : fp32[4,8] from "w"
func @f(%x : fp32[1,8]) {
  %0 = linear(%x, @w, none) {layer = 3, role = "ROLE"} : fp32[1,4]
  %1 = linear(%x, @w, none) {layer = 5, role = "attn.wkv"} : fp32[1,4]
  return a = %0, b = %1
}
"""


def test_tags_are_validated():
    verify(parse_module(IR.replace("ROLE", "attn.wq_a+attn.wkv")))
    with pytest.raises(IRError, match="unknown role 'attn.wq'"):
        parse_module(IR.replace("ROLE", "attn.wq"))
    with pytest.raises(IRError, match="unknown role"):
        parse_module(IR.replace("ROLE", "attn.wq_a+nonsense"))
    with pytest.raises(IRError, match="layer"):
        parse_module(IR.replace("layer = 3", "layer = -1").replace("ROLE", "attn.wq_a"))


def test_references_never_see_tags():
    opdef = get_op("linear")
    attrs = opdef.normalize_attrs({"layer": 2, "role": "attn.wq_a"})
    assert attrs["layer"] == 2 and "layer" not in ref_attrs(attrs) and "role" not in ref_attrs(attrs)
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(linear(x, w, None, role="attn.wq_a"), linear(x, w, None))  # eager: tags dropped


def test_cse_ignores_tags_like_loc():
    from v4compile.passes import PassManager

    m = PassManager(["cse"]).run(parse_module(IR.replace("ROLE", "attn.wq_a"))).module
    assert [op.name for op in m.functions["f"].ops] == ["linear"]


def test_every_traced_op_is_tagged():
    cfg = preset("tiny")
    m = trace(cfg, TraceOptions(batch=1, chunk=8, decode_batch=1, capacity=64))
    fn = m.functions["decode"]
    for op in fn.ops:
        assert op.attrs.get("role") in ROLES, (op.name, op.loc)
        in_layer = op.loc.startswith("layers.")
        assert ("layer" in op.attrs) == in_layer, (op.name, op.loc)
        if in_layer:
            assert op.loc.startswith(f"layers.{op.attrs['layer']}.")
        if op.name == "linear":
            assert ROLES[op.attrs["role"]].startswith("GEMM") or op.attrs["role"] == "head"
    gemm_roles = [r for r in ROLES if ROLES[r].startswith("GEMM") and not r.startswith("mtp.")]
    per_layer = {(op.attrs.get("layer"), op.attrs["role"]) for op in fn.ops if op.name in ("linear", "grouped_out_proj")}
    for layer in range(cfg.n_layers):
        kind = cfg.kind(layer)
        want = {r for r in gemm_roles if (".compressor." not in r or kind != "swa")
                and (".indexer." not in r or kind == "csa")}
        assert {r for lay, r in per_layer if lay == layer} == want, (layer, kind)


def test_merged_ops_carry_their_members_roles():
    from v4compile.passes import PassManager

    m = trace(preset("tiny"), TraceOptions(batch=1, chunk=8, decode_batch=1, capacity=64))
    out = PassManager(["merge_wq_a_wkv", "fuse_moe", "merge_sibling_gemms", "fuse_mhc_post_pre"]).run(m).module
    fn = out.functions["decode"]
    roles = {op.attrs["role"] for op in fn.ops}
    assert "attn.wq_a+attn.wkv" in {r for r in roles if r.startswith("attn.wq_a")} or any(
        set(roles_of(r)) >= {"attn.wq_a", "attn.wkv"} for r in roles)
    assert "ffn.experts+ffn.shared" in roles
    assert any(op.name == "mhc_post_pre" and op.attrs["role"] == "ffn_hc+attn_hc" for op in fn.ops)
