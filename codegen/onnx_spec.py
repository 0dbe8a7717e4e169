"""Greedy speculative decoding's one-call step for the cpu target: `verify_b<B>` and the MTP block's `draft_b<B>`
composed into one ONNX graph, with the greedy acceptance in between (built at load time from the artifact's
own, checked graphs; nothing new is stored).

On a small model ONNX Runtime's cost is per call and per node, not per FLOP: a separate draft call costs its
binding, its output copies and a Python round trip on top of its nodes. The fused graph runs, for `B`
sequences of `T = 1 + K` lanes (ids, pos as verify's):

1. verify's nodes: every lane's logits `[B, T, V]` and final streams `[B, T, n, D]`;
2. the acceptance (greedy, as `speculation.accept` at temperature 0): `best = argmax(logits)`; draft j
   (lane j's id, j >= 1, pos >= 0) survives while every draft before it did and it equals `best[j - 1]`;
   lane j is kept when j = 0 or draft j survived (`keep`), and the token after a kept lane is `best` there
   (the survivor, or the new token after the last one);
3. the MTP block's nodes on those lanes: `hidden` = verify's streams, `ids` = `best`, `pos` = pos on the kept
   lanes and -1 elsewhere (a rejected lane writes nothing of the MTP's ring).

Outputs: verify's `logits` (the host decides the acceptance from them too, and checks it against the graph's:
`next_ids` = best, `kept_pos`), the MTP's `draft.logits` `[B, V]` (its last kept lane: the first next draft)
and `draft.streams` (for recursive drafts); each written plane's rows and values are verify's then the
MTP's (disjoint rows: the MTP block writes only its own ring). Sampling cannot use it: the token after the
last accepted lane is drawn on the host after the verify.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

PREFIX = "draft/"  # the draft graph's own value, node and constant names inside the fused graph
# the draft graph's step inputs, fed from the graph above (verify's streams, the glue's ids and positions)
DRAFT_INPUTS = {"hidden": "streams", "ids": "spec.next_ids", "pos": "spec.kept_pos"}
DRAFT_OUTPUTS = {"logits": "draft.logits", "streams": "draft.streams"}


def fuse_verify_draft(verify: onnx.ModelProto, draft: onnx.ModelProto, batch: int, tokens: int) -> onnx.ModelProto:
    """The one-call greedy step of bucket `batch` (`tokens` = 1 + K lanes): see the module doc."""
    gv, gd = verify.graph, draft.graph
    v_in = {i.name for i in gv.input}
    d_in = {i.name: i for i in gd.input}
    # the draft's other inputs keep their names (those verify declares too, the weights, pool planes, block
    # table and slot, are one input)
    own = DRAFT_INPUTS
    shared = {n for n in d_in if n not in own}

    def rename(x: str) -> str:
        if not x:
            return x  # an omitted optional input
        if x in own:
            return own[x]
        return x if x in shared else PREFIX + x

    d_out = {o.name: o for o in gd.output}
    both = [o.name for o in gv.output if o.name.endswith((".rows", ".vals")) and o.name in d_out]
    nodes = []
    for n in gv.node:  # a plane both graphs write: verify's rows and values renamed, concatenated below
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.input[:] = ["verify/" + x if x in both else x for x in n.input]
        m.output[:] = ["verify/" + x if x in both else x for x in n.output]
        nodes.append(m)
    nodes += glue(batch, tokens)
    for n in gd.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ValueError(f"the draft graph's node {n.name} has a subgraph: not fused")
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.name = PREFIX + n.name
        m.input[:] = [rename(x) for x in n.input]
        m.output[:] = [rename(x) for x in n.output]
        nodes.append(m)
    nodes += [helper.make_node("Concat", ["verify/" + x, PREFIX + x], [x], axis=0, name="spec/concat/" + x)
              for x in both]
    inits = list(gv.initializer)
    for t in gd.initializer:
        c = TensorProto()
        c.CopyFrom(t)
        c.name = PREFIX + t.name
        inits.append(c)
    inputs = list(gv.input) + [d_in[n] for n in shared if n not in v_in]
    outputs = [o for o in gv.output if o.name != "streams"]  # verify's streams are the draft's input only
    for n, o in d_out.items():
        if n in DRAFT_OUTPUTS:
            nodes.append(helper.make_node("Identity", [rename(n)], [DRAFT_OUTPUTS[n]], name="spec/out/" + n))
            outputs.append(_renamed(o, DRAFT_OUTPUTS[n]))
        elif n not in both:
            raise ValueError(f"the draft graph's output {n} has no place in the fused graph")
    outputs += [helper.make_tensor_value_info("spec.next_ids", TensorProto.INT64, [batch, tokens]),
                helper.make_tensor_value_info("spec.kept_pos", TensorProto.INT64, [batch, tokens])]
    graph = helper.make_graph(nodes, f"spec_b{batch}", inputs, outputs, inits)
    opsets = {o.domain: o.version for o in list(verify.opset_import) + list(draft.opset_import)}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              ir_version=max(verify.ir_version, draft.ir_version))
    return model


def _renamed(vi: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    c = onnx.ValueInfoProto()
    c.CopyFrom(vi)
    c.name = name
    return c


def glue(batch: int, tokens: int) -> list[onnx.NodeProto]:
    """The greedy acceptance between the two graphs (module doc, step 2): `spec.next_ids`, `spec.kept_pos`."""
    B, T = batch, tokens

    def const(name, value, dtype=TensorProto.INT64, dims=None):
        dims = [len(value)] if dims is None else dims
        return helper.make_node("Constant", [], [name], name=name,
                                value=helper.make_tensor(name + ".value", dtype, dims, value))

    n = helper.make_node
    return [
        n("ArgMax", ["logits"], ["spec.next_ids"], axis=2, keepdims=0, name="spec/argmax"),
        const("spec/zero", [0]), const("spec/one", [1]), const("spec/last", [T - 1]), const("spec/end", [T]),
        const("spec/neg", [-1], dims=[]), const("spec/izero", [0], dims=[]), const("spec/ione", [1], dims=[]),
        const("spec/first", [True] * B, TensorProto.BOOL, [B, 1]),
        # lane j's argmax against draft j + 1 (its lane's id), for the real drafts (pos >= 0)
        n("Slice", ["spec.next_ids", "spec/zero", "spec/last", "spec/one"], ["spec/best_head"], name="spec/s0"),
        n("Slice", ["ids", "spec/one", "spec/end", "spec/one"], ["spec/drafts"], name="spec/s1"),
        n("Slice", ["pos", "spec/one", "spec/end", "spec/one"], ["spec/draft_pos"], name="spec/s2"),
        n("Equal", ["spec/best_head", "spec/drafts"], ["spec/eq"], name="spec/eq"),
        n("GreaterOrEqual", ["spec/draft_pos", "spec/izero"], ["spec/real"], name="spec/real"),
        n("And", ["spec/eq", "spec/real"], ["spec/match"], name="spec/match"),
        n("Not", ["spec/match"], ["spec/miss_b"], name="spec/miss_b"),
        n("Cast", ["spec/miss_b"], ["spec/miss"], to=TensorProto.INT64, name="spec/miss"),
        # a draft survives when no draft up to it missed
        n("CumSum", ["spec/miss", "spec/ione"], ["spec/misses"], name="spec/misses"),
        n("Equal", ["spec/misses", "spec/izero"], ["spec/survived"], name="spec/survived"),
        n("Concat", ["spec/first", "spec/survived"], ["spec/keep"], axis=1, name="spec/keep"),
        n("Where", ["spec/keep", "pos", "spec/neg"], ["spec.kept_pos"], name="spec/kept_pos"),
    ]
