"""Op facts live in the registry: traits (view rules, tied results, kernel family, variants), operands and
results by name, and the verifier's checks of them."""

from __future__ import annotations

import pytest

from v4compile.errors import IRError
from v4compile.ir.registry import REGISTRY, Layout, get_op, reshape_view, split_view
from v4compile.ir.text import parse_module, print_module
from v4compile.ir.types import T
from v4compile.ir.verify import verify


def test_traits_are_declared_in_the_registry():
    assert REGISTRY["reshape"].view is reshape_view and not REGISTRY["reshape"].launch
    assert REGISTRY["split"].view is split_view
    assert REGISTRY["compress_paged"].tied == {"state_kv_out": "state_kv", "state_gate_out": "state_gate",
                                               "q0": "p0", "q1": "p1", "q2": "p2"}
    lowered = ["embed", "linear", "norm_linear", "grouped_out_proj", "inv_rope_group_quant", "rope_out_proj", "linear_pair", "hc_pre_norm",
               "mhc_post_pre", "mhc_post_head", "router", "moe_experts_shared", "qkv_norm_rope", "compress_paged",
               "csr_window", "csr_compressed", "indexer_select", "sparse_attention", "last_token", "hc_expand"]
    assert all(REGISTRY[n].kernel for n in lowered)


def test_split_and_reshape_view_rules():
    x = T("fp32", 2, 1, 144)
    a, b = split_view(Layout.contiguous(x.shape, 1024), x, [], {"at": 80})
    assert a == Layout(1024, (144, 144, 1)) and b == Layout(1024 + 80 * 4, (144, 144, 1))
    # a split of a split: offsets add up, strides stay the root's
    c, d = split_view(b, T("fp32", 2, 1, 64), [], {"at": 32})
    assert c.offset == b.offset and d.offset == b.offset + 32 * 4 and d.strides == (144, 144, 1)
    # reshaping a strided half splits its last axis: a view with the root's row stride
    (r,) = reshape_view(b, T("fp32", 2, 1, 64), [T("fp32", 2, 1, 2, 32)], {})
    assert r.offset == b.offset and (r.strides[0], r.strides[2], r.strides[3]) == (144, 32, 1)  # axis 1 has size 1
    # merging the rows of a strided half is not a view
    with pytest.raises(IRError, match="not a view"):
        reshape_view(b, T("fp32", 2, 1, 64), [T("fp32", 128)], {})


def test_operands_and_results_by_name():
    m = parse_module("""module @m
weight @n : fp32[32] from "n"
func @f(%q : fp32[2,1,4,32], %kv : fp32[2,1,32], %pos : i64[2,1], %slot : i32[2], %p : fp32[480,32]) {
  %0, %1, %2 = qkv_norm_rope(%q, %kv, @n, %pos, none, %slot, %p, none, none) {eps = 1e-6, dim = 16, theta = 1e4, yarn = (), window = 16, slot_rows = 80, n_rows = 480, fmt = "native"} : fp32[2,1,4,32], fp32[2,1,32], fp32[480,32]
  return pool = %2
}""")
    op = m.functions["f"].ops[0]
    assert op.attrs["variant"] == "write"  # inferred from the optional operands, and printed
    assert op.operand("p0").name == "p" and op.operand("qi") is None
    assert op.out("q0").name == "2" and op.out("qi_out") is None  # names, not positions
    with pytest.raises(KeyError):
        op.operand("nonsense")
    verify(m)
    assert 'variant = "write"' in print_module(m)


def _one_op_module(line: str) -> str:
    return f"""module @m
weight @w : fp32[8] from "w"
func @f(%x : fp32[2,8], %st : fp32[2,8]) {{
  {line}
  return y = %0
}}"""


def test_verifier_checks_variants():
    with pytest.raises(IRError, match="variant 'unweighted', not 'weighted'"):
        verify(parse_module(_one_op_module('%0 = rms_norm(%x, none) {eps = 1e-6, variant = "weighted"} : fp32[2,8]')))
    with pytest.raises(IRError, match="unknown variant"):
        verify(parse_module(_one_op_module('%0 = rms_norm(%x, @w) {eps = 1e-6, variant = "odd"} : fp32[2,8]')))
    verify(parse_module(_one_op_module('%0 = rms_norm(%x, @w) {eps = 1e-6, variant = "weighted"} : fp32[2,8]')))


def test_costs_come_from_the_types():
    c = get_op("add").cost_of([T("fp32", 4, 8), T("fp32", 4, 8)], [T("fp32", 4, 8)], {})
    assert (c.bytes_read, c.bytes_written) == (256, 128)
    assert get_op("reshape").cost_of([T("fp32", 4, 8)], [T("fp32", 32)], {"shape": (32,)}).bytes_read == 0
