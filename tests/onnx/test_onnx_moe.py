"""The cpu target's routed experts (`codegen/onnx/moe.py`): tokens grouped by expert (or, where
`moe.dense_is_cheaper`, every expert on every token), no copy of an expert's weights, the same numbers as
`op.moe_experts`. These small experts (24 KB) take the dense path at 1 to 16 tokens (weights after w2)
unless a test makes grouping free (`grouped`: NODE_US 0).

Tolerance: 1e-5 relative to the output's scale (fp32; Gemm sums in another order than torch's, measured
~1e-7). The bytes check reads ONNX Runtime's profile: the weight bytes a step's Gemms read (Gemms on an
empty group read nothing) are those of its distinct experts, whether 1 or 16 tokens chose them.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from v4compile.ops import op
from v4compile.codegen.onnx import linear, moe, quant
from v4compile.codegen.onnx.moe import moe_routed
from v4compile.codegen.onnx.graph import Graph, value_info
from v4compile.codegen.onnx_weights import materialise
from v4compile.formats import fp4_quant
from v4compile.ir.types import TensorType

E, K, D, I = 8, 2, 64, 32
LIMIT = 7.0


def _weights(seed: int, quantised):
    """fp32 (quantised False), bf16 ("bf16": upcast once at load) or FP4 (True) expert stacks."""
    g = torch.Generator().manual_seed(seed)
    w = {n: torch.randn(E, *s, generator=g) / 8 for n, s in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D)))}
    if quantised == "bf16":
        return {n: t.bfloat16() for n, t in w.items()}, {}
    if not quantised:
        return w, {}
    packed, scales = {}, {}
    for n, t in w.items():
        qs = [fp4_quant(t[e]) for e in range(E)]
        packed[n] = torch.stack([q for q, _ in qs])
        scales[n] = torch.stack([s for _, s in qs])
    return packed, scales


def _model(N: int, route_weight: str, w, scales, act: str = "native"):
    """One MoE step as an ONNX model: inputs x [N, D] (act "fp8": as the FP8 GEMMs see it), weights,
    indices [N, K] and the derived expert weights; also the derived entries (how the runtime builds those)."""
    g = Graph("moe")
    xt = TensorType((N, D), "fp32")
    it = TensorType((N, K), "i64")
    dt = "fp4x2" if scales else {torch.float32: "fp32", torch.bfloat16: "bf16"}[w["w1"].dtype]
    wt = tuple(TensorType(tuple(w[n].shape), dt) for n in ("w1", "w2", "w3"))
    sc = tuple(f"{n}.scale" for n in ("w1", "w2", "w3")) if scales else (None, None, None)
    y = moe_routed(g, "x", xt, "wts", "idx", it, ("w1", "w2", "w3"), wt, K, LIMIT, route_weight, sc, 32, act)
    g.op("Identity", y, out="y")
    g.inputs += [value_info("x", xt), value_info("wts", TensorType((N, K), "fp32")), value_info("idx", it)]
    g.inputs += [value_info(n, TensorType(tuple(d["shape"]), "fp32")) for n, d in sorted(g.derived.items())]
    used = {i for n in g.nodes for i in n.input}
    g.inputs += [value_info(n, t) for n, t in zip(("w1", "w2", "w3"), wt) if n in used]  # fp32 stacks, dense
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, D]))
    return g.model(), g.derived


def _run(model, derived, w, scales, feeds, profile=None):
    import onnxruntime as ort

    stored = {**w, **{f"{n}.scale": s for n, s in scales.items()}}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile)
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ins = {i.name for i in s.get_inputs()}
    stacks = {n: t.numpy() for n, t in w.items() if n in ins}
    y = s.run(None, {**feeds, **stacks, **{n: materialise(d, stored.__getitem__) for n, d in derived.items()}})[0]
    return y, (s.end_profiling() if profile else None)


def _routing(N: int, seed: int, experts=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    if experts is None:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    else:
        idx = torch.tensor([experts] * N)
    wts = torch.rand(N, K, generator=g) + 0.1
    return x, wts, idx


@pytest.fixture
def grouped(monkeypatch):
    monkeypatch.setattr(moe, "NODE_US", 0.0)


@pytest.mark.parametrize("quantised", [False, "bf16", True], ids=["fp32", "bf16", "fp4"])
@pytest.mark.parametrize("route_weight", ["after_w2", "before_w2"])
def test_grouped_experts_match_the_reference(quantised, route_weight, grouped):
    """Decode-sized (1, 3 tokens: some experts idle) and prefill-sized (16: every expert busy) steps."""
    _check_against_reference(quantised, route_weight)


@pytest.mark.parametrize("act", ["native", "fp8"])
@pytest.mark.parametrize("quantised", [False, True], ids=["fp32", "fp4"])
def test_dense_experts_match_the_reference(quantised, act):
    """The same steps on the dense path (weights after w2 only: tiny's hf decode; its bf16 and FP8 / FP4
    artifacts are checked end to end in test_onnx_bf16 / test_onnx_formats); with FP8 activations w2's
    input is rounded per expert row before the routing weight is applied."""
    _check_against_reference(quantised, "after_w2", act)


@pytest.mark.parametrize("route_weight", ["after_w2", "before_w2"])
def test_expert_parallel_pairs_match_the_reference(route_weight):
    """Routing as expert parallelism's `local_experts` leaves it: other ranks' pairs mapped to (expert 0,
    weight 0), so one token can hold (0, n) twice. The dense path (taken after w2; a before-w2 dense path
    would add the row's output twice, and the 2-rank cpu run caught it) and the grouped path match."""
    w, scales = _weights(0, False)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(9))
    idx = torch.tensor([[0, 0], [2, 0], [0, 5]])
    wts = torch.tensor([[0.7, 0.0], [0.4, 0.0], [0.0, 0.9]])
    model, derived = _model(3, route_weight, w, scales)
    assert bool(derived) == (route_weight == "before_w2")  # grouped: per-expert views; dense: the stacks
    got, _ = _run(model, derived, w, scales, {"x": x.numpy(), "wts": wts.numpy(), "idx": idx.numpy()})
    want = op.moe_experts.ref(x, wts, idx, w["w1"], w["w2"], w["w3"], None, None, None, limit=LIMIT, block=32,
                               act="native", acc="fp32", out_dtype="", route_weight=route_weight).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _check_against_reference(quantised, route_weight, act="native"):
    from v4compile.formats import act_qdq

    w, scales = _weights(0, quantised)
    for N in (1, 3, 16):
        x, wts, idx = _routing(N, N)
        model, derived = _model(N, route_weight, w, scales, act=act)
        onnx.checker.check_model(model, full_check=True)
        xin = act_qdq(x) if act == "fp8" else x
        got, _ = _run(model, derived, w, scales, {"x": xin.numpy(), "wts": wts.numpy(), "idx": idx.numpy()})
        sc = [scales.get(n) for n in ("w1", "w2", "w3")]
        want = op.moe_experts.ref(x, wts, idx, w["w1"], w["w2"], w["w3"], *sc, limit=LIMIT, block=32,
                                   act=act, acc="fp32", out_dtype="", route_weight=route_weight).numpy()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (N, np.abs(got - want).max())


def test_dense_fp8_activation_faults_are_caught(monkeypatch):
    """w2's input not rounded to FP8 on the dense path fails the fp8 comparison above."""
    monkeypatch.setattr(quant, "act_qdq", lambda g, x, xt, block=128: x)
    with pytest.raises(AssertionError):
        _check_against_reference(False, "after_w2", "fp8")


def _weight_readers(model, derived):
    """(node type, whether its first input comes from a Split) for every node that reads an expert weight."""
    split_outs = {o for n in model.graph.node if n.op_type == "Split" for o in n.output}
    stacked = {"w1", "w2", "w3"}
    return [(n.op_type, n.input[0] in split_outs) for n in model.graph.node
            if any(i in derived or i in stacked for i in n.input)]


@pytest.mark.parametrize("fault", ["token", "weight", "after_w2 dropped"])
def test_dense_path_faults_are_caught(fault, monkeypatch):
    """The dense path with its tokens' routing taken in reversed token order, each token's weights given to
    its experts in reversed order, or the weights not applied at all (w2's GEMM summing the raw experts)
    fails the reference comparison."""
    orig = moe._dense

    def broken(g, flat, pairs, weights, *rest):
        def rev(x, axis):
            return g.op("Slice", x, g.i64(-1), g.i64(-(2 ** 63)), g.i64(axis), g.i64(-1))

        if fault == "token":
            pairs, weights = rev(pairs, 0), rev(weights, 0)
        elif fault == "weight":
            weights = rev(weights, 1)
        else:
            weights = g.op("Add", g.op("Mul", weights, g.scalar(0.0)), g.scalar(1.0))
        return orig(g, flat, pairs, weights, *rest)

    monkeypatch.setattr(moe, "_dense", broken)
    with pytest.raises(AssertionError):
        _check_against_reference(False, "after_w2")


def test_no_node_copies_expert_weights(grouped, monkeypatch):
    """Every expert matrix is read by exactly one Gemm on its group of tokens, and by nothing else (no
    Gather / Slice of a stacked weight); a lowering that gathers the weights is caught."""
    w, scales = _weights(0, False)
    model, derived = _model(4, "after_w2", w, scales)
    readers = _weight_readers(model, derived)
    assert len(readers) == 3 * E and set(readers) == {("Gemm", True)}
    assert {n for node in model.graph.node for n in node.input} & {"w1", "w2", "w3"} == set()

    def gathering(g, w_, wt, scale=None, block=None, index=None):  # the old lowering: each expert's matrix
        return g.op("Gather", w_, g.iscalar(index), axis=0), wt.with_shape(*wt.shape[1:])  # picked per step

    monkeypatch.setattr(linear, "weight", gathering)
    bad, _ = _model(4, "after_w2", w, scales)
    assert set(_weight_readers(bad, {})) != {("Gemm", True)}


def _gemm_weight_bytes(profile: str) -> int:
    """Bytes of the B operands of the Gemms that had rows to compute, from ONNX Runtime's profile."""
    total = 0
    for e in json.load(open(profile)):
        if e.get("cat") == "Node" and e["args"].get("op_name") == "Gemm" and e["name"].endswith("_kernel_time"):
            a, b = (next(iter(s.values())) for s in e["args"]["input_type_shape"][:2])
            if a[0] > 0:
                total += 4 * int(np.prod(b))
    return total


def test_dense_where_it_is_cheaper():
    """tiny (8 experts of 32 x 64, 2 active): decode steps dense, a 64-token prefill grouped; mid (32 of
    512 x 1024, 4 active): grouped even at one token."""
    cheaper = moe.dense_is_cheaper
    assert cheaper(8, 2, 1, 32, 64) and cheaper(8, 2, 8, 32, 64) and not cheaper(8, 2, 64, 32, 64)
    assert not cheaper(32, 4, 1, 512, 1024)


def test_dense_path_reads_each_stack_once():
    """Small experts: each stacked matrix is read in place by one GEMM over every token (w1 and w3 through
    a Reshape of the stack, w2 through a Transpose and Reshape, which ONNX Runtime folds; no Gather, Slice
    or Split of a weight), and the grouped path's 3 Gemms per expert are gone, as are the pairs' sort and
    gathers (no TopK, Gather or ScatterND)."""
    w, scales = _weights(0, False)
    model, derived = _model(4, "after_w2", w, scales)
    nodes = model.graph.node
    readers = sorted((n.op_type, i) for n in nodes for i in n.input if i in ("w1", "w2", "w3"))
    assert readers == [("Reshape", "w1"), ("Reshape", "w3"), ("Transpose", "w2")]
    consumers = {i: [n for n in nodes if i in n.input] for n in nodes for i in n.output}
    for r in (n for n in nodes if n.input[0] in ("w1", "w2", "w3")):
        after = consumers[r.output[0]]
        if r.op_type == "Transpose":
            assert [n.op_type for n in after] == ["Reshape"]
            after = consumers[after[0].output[0]]
        assert [n.op_type for n in after] == ["Gemm"]
    assert not derived and len([n for n in nodes if n.op_type == "Gemm"]) == 3
    assert not {"TopK", "Gather", "ScatterND"} & {n.op_type for n in nodes}
    assert len(nodes) < 24  # the grouped path: 61; the dense path weighting after w2: 31


def test_weight_bytes_do_not_scale_with_routed_pairs(tmp_path, grouped):
    """1 token or 16 tokens on the same 2 experts read the same weight bytes (2 experts x 3 matrices);
    4 tokens on 4 distinct pairs of experts read 8 experts' worth."""
    w, scales = _weights(0, False)
    per_expert = 4 * 3 * I * D
    seen = {}
    for N, experts in ((1, [2, 5]), (16, [2, 5]), (4, None)):
        x, wts, idx = _routing(N, 1, experts)
        if experts is None:
            idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
        model, derived = _model(N, "after_w2", w, scales)
        _, prof = _run(model, derived, w, scales, {"x": x.numpy(), "wts": wts.numpy(), "idx": idx.numpy()},
                       profile=tmp_path / f"p{N}")
        seen[N] = _gemm_weight_bytes(prof)
    assert seen == {1: 2 * per_expert, 16: 2 * per_expert, 4: 8 * per_expert}


def test_compiled_graphs_read_expert_weights_only_through_their_gemms(tmp_path, grouped):
    """In every function of a compiled tiny artifact (decode and prefill; its experts grouped here, as a
    larger model's are), no stacked expert weight is a graph input, and each expert's matrix (a derived
    view) feeds exactly one node: a Gemm on a Split group (decode and prefill alike)."""
    from v4compile import frontend
    from v4compile.artifact import Buckets, load_artifact
    from v4compile.cli.driver import compile_artifact
    from v4compile.trace import TraceOptions

    fe = frontend.load(None, "tiny", "random", TraceOptions(numerics="hf", dtype="fp32", capacity=64))
    art = compile_artifact(fe, tmp_path / "tiny", Buckets(decode=(1, 4), prefill=(16,)))
    m = load_artifact(art).manifest
    stacked = {n for n, t in m["weights"]["tensors"].items() if len(t["shape"]) == 3 and ".experts." in n}
    assert stacked
    for fname, spec in m["targets"][0]["functions"].items():
        model = onnx.load(str(art / spec["file"]))
        views = {n for n, d in spec["derived"].items() if d["index"] is not None}
        assert {d["of"] for n, d in spec["derived"].items() if n in views} == stacked, fname
        assert not stacked & {i.name for i in model.graph.input}, fname
        readers = _weight_readers(model, views)
        assert len(readers) == len(views) and set(readers) == {("Gemm", True)}, fname


def _shared_model(N: int, w, scales, s, shared_act: str):
    """One `moe_experts_shared` step (routed stacks `w`, fp32 shared expert `s`) as an ONNX model."""
    from v4compile.codegen.onnx_export import Operands

    g = Graph("moe_shared")
    xt, it = TensorType((N, D), "fp32"), TensorType((N, K), "i64")
    dt = "fp4x2" if scales else "fp32"
    types = {"x": xt, "weights": TensorType((N, K), "fp32"), "indices": it,
             **{n: TensorType(tuple(w[n].shape), dt) for n in ("w1", "w2", "w3")},
             **{n: TensorType(tuple(t.shape), "fp32") for n, t in s.items()}}
    names = {n: n for n in types} | {"weights": "wts", "indices": "idx"}
    names |= {f"{n}_scale": (f"{n}.scale" if scales and n[0] == "w" else None) for n in (*w, *s)}
    a = {"limit": LIMIT, "block": 32, "act": "native", "acc": "fp32", "out_dtype": "", "route_weight": "after_w2",
         "shared_block": 128, "shared_act": shared_act}
    y = moe.lower_moe_experts_shared(g, Operands(names, types), a, None)
    g.op("Identity", y, out="y")
    g.inputs += [value_info(n, t) for n, t in (("x", xt), ("wts", types["weights"]), ("idx", it))]
    g.inputs += [value_info(n, TensorType(tuple(d["shape"]), "fp32")) for n, d in sorted(g.derived.items())]
    used = {i for n in g.nodes for i in n.input}
    g.inputs += [value_info(n, types[n]) for n in (*w, *s) if n in used]
    g.outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, D]))
    return g.model(), g.derived


def _check_shared(quantised, shared_act="native", steps=(1, 3, 16)):
    """`moe_experts_shared` at 1, 3 and 16 tokens (the dense path's sizes here) against the reference."""
    w, scales = _weights(0, quantised)
    gen = torch.Generator().manual_seed(7)
    s = {n: torch.randn(*sh, generator=gen) / 8 for n, sh in (("s1", (I, D)), ("s2", (D, I)), ("s3", (I, D)))}
    models = []
    for N in steps:
        x, wts, idx = _routing(N, N)
        model, derived = _shared_model(N, w, scales, s, shared_act)
        onnx.checker.check_model(model, full_check=True)
        got, _ = _run(model, derived, {**w, **s}, scales, {"x": x.numpy(), "wts": wts.numpy(), "idx": idx.numpy()})
        sc = [scales.get(n) for n in ("w1", "w2", "w3")]
        want = op.moe_experts_shared.ref(x, wts, idx, w["w1"], w["w2"], w["w3"], s["s1"], s["s2"], s["s3"], *sc,
                                          None, None, None, limit=LIMIT, block=32, act="native", acc="fp32",
                                          out_dtype="", route_weight="after_w2", shared_block=128,
                                          shared_act=shared_act).numpy()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (N, np.abs(got - want).max())
        models.append(model)
    return models


@pytest.mark.parametrize("quantised", [False, True], ids=["fp32", "fp4"])
def test_shared_expert_joins_the_dense_stacks(quantised):
    """On the dense path the shared expert is expert E of the stacks: the step has the routed experts'
    three Gemms and no GEMM of its own (its weights reach them only through Concats of constants, which
    ONNX Runtime folds once: tiny's decode b1, -7 nodes per MoE layer after its optimiser), and matches
    the reference."""
    for model in _check_shared(quantised):
        nodes = model.graph.node
        assert sorted(n.op_type for n in nodes if n.op_type in ("Gemm", "FusedMatMul", "MatMul")) == \
            ["Gemm", "Gemm", "Gemm"]
        readers = {n.op_type for n in nodes for i in n.input if i in ("s1", "s2", "s3")}
        assert readers <= {"Concat", "Reshape"}, readers


def test_shared_expert_with_its_own_activations_stays_apart():
    """A shared expert whose GEMMs see other activations (fp8 where the routed see native ones) is not
    folded in: its own three GEMMs, the same numbers as the reference."""
    for model in _check_shared(False, shared_act="fp8", steps=(3,)):
        assert {i for n in model.graph.node if n.op_type == "Gemm" for i in n.input} >= {"s1", "s3"}


@pytest.mark.parametrize("fault", ["dropped", "gate_up_swapped"])
def test_shared_expert_faults_are_caught(fault, monkeypatch):
    """The folded shared expert left out of the sum, or joined with its gate and up matrices swapped,
    fails the reference comparison."""
    orig = moe._dense

    def broken(*args):
        *rest, shared = args
        if shared is not None:
            shared = None if fault == "dropped" else (shared[2], shared[1], shared[0])
        return orig(*rest, shared)

    monkeypatch.setattr(moe, "_dense", broken)
    with pytest.raises(AssertionError):
        _check_shared(False)
