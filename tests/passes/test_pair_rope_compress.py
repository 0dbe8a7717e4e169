"""pair_rope_compress's conditions: on tiny-pro it fuses every layer's decode prologue and compressor launch
(HCA: `compress_paged`, CSA: `compress_pair`) and no prefill one, and it keeps the two launches apart where the
compressor reads another result of the prologue, or where the rows they write could meet (from the ops'
attributes). Each refusal is shown to be the pass's own check: without it the pass fuses. (Numerics: the pass
runs in the default pipeline that test_passes.py checks against the reference model; the kernels:
tests/kernels/test_kernels_rope_compress.py; the IR: tests/golden/pair_rope_compress.ir.)"""

from __future__ import annotations

import functools

import pytest

from v4compile.config import preset
from v4compile.ir.core import Function
from v4compile.passes import PassManager, PipelineOptions
from v4compile.passes import pair_rope_compress as prc
from v4compile.passes.rewrite import new_module
from v4compile.trace import TraceOptions, trace

BEFORE = ["merge_sibling_gemms", "lower_sparse_attention", "fuse_qkv_norm_rope", "pair_compressors"]


@functools.cache
def lowered():
    m = trace(preset("tiny-pro"), TraceOptions(batch=2, chunk=16, decode_batch=2, capacity=160))
    return PassManager(BEFORE, PipelineOptions()).run(m).module


def fused(module, verify=True):
    res = PassManager(["pair_rope_compress"], PipelineOptions(verify_each=verify)).run(module)
    return res.records[0].hits, res.module


def layer_ops(fn, layer):
    return [op.name for op in fn.ops if op.attrs.get("layer") == layer and op.name in (
        "qkv_norm_rope", "compress_paged", "compress_pair", "qkv_rope_compress", "qkv_rope_compress_pair")]


def edited(module, edit):
    """`module` with decode's ops passed through `edit(op, ops by (name, layer)) -> op`."""
    fn = module.functions["decode"]
    by = {(op.name, op.attrs.get("layer")): op for op in fn.ops}
    ops = [edit(op, by) for op in fn.ops]
    return new_module(module, {**module.functions, "decode": Function(fn.name, list(fn.inputs), ops, list(fn.outputs),
                                                                       dict(fn.attrs))})


def test_every_decode_layer_and_no_prefill_chunk():
    hits, out = fused(lowered())
    assert hits == {"decode.fused": 5, "prefill.fused": 0}
    assert [layer_ops(out.functions["decode"], n) for n in (0, 2)] == [["qkv_rope_compress"], ["qkv_rope_compress_pair"]]
    assert layer_ops(out.functions["prefill"], 0) == ["qkv_norm_rope", "compress_paged"]  # no window write in it


def reads_kv_out(op, by):
    """Layer 0's compressor reading the prologue's normed kv (same type as its own input): a real dependency."""
    if (op.name, op.attrs.get("layer")) == ("compress_paged", 0):
        qkv = by["qkv_norm_rope", 0]
        return op.replace(operands=(qkv.out("kv_out"), *op.operands[1:]))
    return op


def window_into_next_layer(op, by):
    """Layer 1's window ring one row past its share of the slot: its rows could meet the next layer's ring, and
    the check refuses anything whose window rows leave the ring region it can vouch for."""
    if (op.name, op.attrs.get("layer")) == ("qkv_norm_rope", 1):
        a = op.attrs
        return op.replace(attrs={**a, "layer_row": a["slot_rows"] - a["window"] + 1})
    return op


def rows_in_the_slots(op, by):
    """Layer 3's compressed rows past its envelope (layer_offset + rows a block > envelope_rows): the last block's
    rows would run into the slots' window region."""
    if (op.name, op.attrs.get("layer")) == ("compress_paged", 3):
        return op.replace(attrs={**op.attrs, "layer_offset": op.attrs["envelope_rows"] - 1})
    return op


@pytest.mark.parametrize("edit, layer, check, blind", [
    (reads_kv_out, 0, "reads_another_result", False), (window_into_next_layer, 1, "rows_disjoint", True),
    (rows_in_the_slots, 3, "rows_disjoint", True)], ids=["operand-dependency", "window-rows", "compressed-rows"])
def test_kept_apart(monkeypatch, edit, layer, check, blind):
    module = edited(lowered(), edit)
    hits, out = fused(module)
    assert hits["decode.fused"] == 4
    assert layer_ops(out.functions["decode"], layer) == ["qkv_norm_rope", "compress_paged"]
    # the refusal is that check's: without it the same module fuses every layer (the dependent pair into an op
    # that reads its own result: unverified here, as the verifier refuses it)
    monkeypatch.setattr(prc, check, lambda *a: blind)
    assert fused(module, verify=False)[0]["decode.fused"] == 5
