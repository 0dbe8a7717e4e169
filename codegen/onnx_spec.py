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
   lanes and -1 elsewhere (a rejected lane writes nothing of the MTP's ring). Its lane arithmetic (the nodes
   computed from the positions, slot and block table alone: `index_values`) is made twice: for its reads
   (window rows, masks, rotary tables) on verify's `pos`, where it is verify's own nodes on the same inputs and
   constants (`same_constants`), which ONNX Runtime's common-subexpression elimination merges; for its ring
   writes and its last-lane pick (`KEPT_OPS`) on the kept positions. A rejected lane then reads as a live one,
   and nothing reads its results: the kept lanes are a prefix and attend only the lanes up to their own, and
   its streams and logits are never taken (tiny-doc, bucket 1, k = 1: 1518 -> 1491 nodes after ONNX Runtime's
   optimisation; the draft's part 236 -> 212).

4. for `drafts` = k > 1, the recursive drafts, unrolled: copy j = 2 .. k of the MTP block's nodes (names
   `draft<j>/...`) runs one lane per sequence, lane 0: `hidden` = the previous copy's streams at its last
   lane (copy 1: the last kept lane, `a` = kept lanes - 1; later copies: lane 0), `ids` = the previous copy's
   argmax, `pos` = L' + j - 2 (L' = the last kept position + 1, the sequence's new length; -1 for a sequence
   with no kept lane, or past the positions the graph has), the other lanes padding (zeros, pos -1).

The recursive copies' ring writes are never stored: they are not outputs of the graph (the pool after the step
holds exactly what the unfused path's undo leaves: verify's and copy 1's writes). Each copy still sees the
writes of the copies before it: its one read of the pool (the draft graph's `Gather` of `pool.main`) is
patched with their rows (`patched_gather`: for each read row, the last earlier copy's write of that row
wins, as the backend's in-order row writes would), before the copy's own in-step patch of its own writes.
The values are the bytes the backend would have stored, so the drafts equal the separate `draft_b<B>` calls'.

Exact: the next step's verify reads the pool the two-call path leaves. That path stores verify's rows, then
draft_b<B>'s ring rows of the kept lanes (copy 1 here: the same nodes on the same inputs, a rejected lane at pos
-1 writes nothing), and its recursive draft_b<B> calls' ring rows, which `PoolUndo` restores before the next
step; here those are never stored, and the rejected positions' verify rows are held back (the backend's
`run_held`), so every byte matches (the tests compare drafts step by step and the pool after a step).

One graph per k (`spec_b<B>_d<k>`, made before a bucket's first greedy step: `CompiledDraft.prepare`), not the
K-draft graph with its unused drafts dropped: a draft copy costs ~0.3 decode steps of ONNX Runtime's per-node time
on the trained example whether its drafts are read or not (the K-draft graph at k = 1: ~1.99 against ~1.58 decode
steps, batch 1), and every variant binds the backend's one set of weight arrays, so a variant costs a session's
build and its own buffers.

Where a draft copy's time goes (the trained example, 5 layers, batch 1): draft_b<B> is 265 nodes (242 after ONNX
Runtime's optimisation), ~0.2-0.35 of a decode step (1325 nodes; 1209) alone and ~0.25 more per recursive copy
here, the same with 2 lanes or 4 (ONNX Runtime's time is per node at these sizes, not per lane): the two mHC
Sinkhorns (`hc_pre_norm` 60, `mhc_post_pre` 66 nodes, 76 of them LpNormalization, already one node per
normalisation; an artifact compiled with `--draft-sinkhorn-iters 1` has none: 187 nodes, 166 optimised), then the
MoE 25, sparse attention 18, the window rows 16 (shared with verify in copy 1, step 3), qkv 16. Nothing the greedy
step needs less of: its logits feed the in-graph argmax (the host reads ids), and the last copy's ring write, read
by no later copy, is dropped by ONNX Runtime as dead. The verify's lanes are not free either: warm, on a mid-text
step's inputs, verify_b<B> on 2 / 3 / 4 lanes costs 1.16 / 1.25 / 1.41 decode steps (its kernels +8 % by ONNX
Runtime's profiler; the rest is outside them).

Outputs: verify's `logits` (the host checks the graph's acceptance, `next_ids` = best and `kept_pos`, against
its own rule on those ids), the MTP's `draft.logits` `[B, V]` (its last kept lane: the first next draft)
and `draft.streams`, `spec.drafts` `[B, k]` (each copy's argmax: the next step's greedy drafts); each written
plane's rows and values are verify's then copy 1's (disjoint rows: the MTP block writes only its own
ring). Sampling cannot use it: the token after the last accepted lane is drawn on the host after the verify.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from v4compile.artifact import cpu_spec_name

PREFIX = "draft/"  # the draft graph's own value, node and constant names inside the fused graph
# the draft graph's step inputs, fed from the graph above (verify's streams, the glue's ids and positions)
DRAFT_INPUTS = {"hidden": "streams", "ids": "spec.next_ids", "pos": "spec.kept_pos"}
DRAFT_OUTPUTS = {"logits": "draft.logits", "streams": "draft.streams"}
# Copy 1's lane arithmetic (module doc, step 3): its reads on verify's positions (`READ_POS`: the same nodes as
# verify's, merged by ONNX Runtime), its writes and its last-lane pick (`KEPT_OPS`) on the kept ones (`KEPT`)
READ_POS = "pos"
KEPT = PREFIX + "kept/"
INDEX_INPUTS = ("pos", "slot", "block_table")
KEPT_OPS = ("last_token",)


def fuse_verify_draft(verify: onnx.ModelProto, draft: onnx.ModelProto, batch: int, tokens: int, drafts: int = 1,
                      max_pos: int | None = None) -> onnx.ModelProto:
    """The one-call greedy step of bucket `batch` (`tokens` = 1 + K lanes) drafting `drafts` tokens (`max_pos`:
    the last position the graph has; a recursive draft past it is padding): see the module doc."""
    gv, gd = verify.graph, draft.graph
    v_in = {i.name for i in gv.input}
    d_in = {i.name: i for i in gd.input}
    # the draft's other inputs keep their names (those verify declares too, the weights, pool planes, block
    # table and slot, are one input)
    own = DRAFT_INPUTS
    shared = {n for n in d_in if n not in own}
    same = same_constants(gv, gd)

    def rename(x: str) -> str:
        if not x:
            return x  # an omitted optional input
        if x in own:
            return own[x]
        if x in same:
            return same[x]
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
    idx = index_values(gd)

    def read(x: str) -> str:
        return READ_POS if x == "pos" else rename(x)

    def kept(x: str) -> str:
        return KEPT + x if x in idx else rename(x)
    for n in gd.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise ValueError(f"the draft graph's node {n.name} has a subgraph: not fused")
        lane_op = n.doc_string.split(" ")[0] in KEPT_OPS
        for copy in ("read", "kept") if n.output[0] in idx else ("kept",) if lane_op else ("read",):
            m = onnx.NodeProto()
            m.CopyFrom(n)
            m.name = (KEPT if copy == "kept" else PREFIX) + n.name
            m.input[:] = [(kept if copy == "kept" else read)(x) for x in n.input]
            m.output[:] = [(kept if copy == "kept" and x in idx else rename)(x) for x in n.output]
            nodes.append(m)
    nodes += [helper.make_node("Concat", ["verify/" + x, kept(x)], [x], axis=0, name="spec/concat/" + x)
              for x in both]
    inits = list(gv.initializer)
    for t in gd.initializer:
        if t.name in same:
            continue
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
    rec, rec_inits = recursive(gd, shared, batch, tokens, drafts, max_pos, kept, same)
    nodes += rec
    inits += rec_inits
    outputs.append(helper.make_tensor_value_info("spec.drafts", TensorProto.INT64, [batch, drafts]))
    nodes = needed(nodes, {o.name for o in outputs})
    graph = helper.make_graph(ordered(nodes, {i.name for i in inputs} | {t.name for t in inits}),
                              cpu_spec_name(batch, drafts), inputs, outputs, inits)
    opsets = {o.domain: o.version for o in list(verify.opset_import) + list(draft.opset_import)}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              ir_version=max(verify.ir_version, draft.ir_version))
    return model


def same_constants(gv: onnx.GraphProto, gd: onnx.GraphProto) -> dict[str, str]:
    """The draft graph's constants (initializers) equal to one of the verify graph's (type, shape, bytes), each
    mapped to that one's name: one name for one value, so that ONNX Runtime's common-subexpression elimination
    can merge the draft's lane arithmetic with verify's (the same nodes on the same positions)."""
    key = {}
    for t in gv.initializer:
        key.setdefault(_const_key(t), t.name)
    return {t.name: key[k] for t in gd.initializer if (k := _const_key(t)) in key}


def _const_key(t: onnx.TensorProto) -> tuple:
    return t.data_type, tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes()


def needed(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes an output depends on (copy 1's lane arithmetic is made twice, each copy read in part)."""
    made = {o: i for i, n in enumerate(nodes) for o in n.output}
    todo, keep = [made[o] for o in outputs if o in made], set()
    while todo:
        i = todo.pop()
        if i not in keep:
            keep.add(i)
            todo += [made[x] for x in nodes[i].input if x in made]
    return [n for i, n in enumerate(nodes) if i in keep]


def index_values(g: onnx.GraphProto) -> set[str]:
    """The values of `g` computed from its index inputs (`INDEX_INPUTS`) and constants alone: the lane
    arithmetic (pool rows, masks, rotary tables), as opposed to what the hidden state and ids flow through."""
    const = {t.name for t in g.initializer} | {""}
    out: set[str] = set()
    for n in g.node:
        ins = [x for x in n.input if x not in const]
        if n.op_type == "Constant":
            const.update(n.output)
        elif ins and all(x in INDEX_INPUTS or x in out for x in ins):
            out.update(n.output)
    return out


def ordered(nodes: list[onnx.NodeProto], known: set[str]) -> list[onnx.NodeProto]:
    """`nodes` in an order where each node follows the producers of its inputs (ONNX's rule), stable."""
    have, out, todo = set(known) | {""}, [], list(nodes)
    while todo:
        rest = []
        for m in todo:
            if all(x in have for x in m.input):
                out.append(m)
                have.update(m.output)
            else:
                rest.append(m)
        if len(rest) == len(todo):
            raise ValueError(f"the fused graph's node {rest[0].name} has an input nothing makes")
        todo = rest
    return out


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


def recursive(gd: onnx.GraphProto, shared: set[str], batch: int, tokens: int, drafts: int,
              max_pos: int | None, first=None, same: dict[str, str] | None = None
              ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Module doc, step 4: copies 2 .. `drafts` of the draft graph `gd` after copy 1 (`draft/`), and
    `spec.drafts` (`first(name)`: copy 1's name of the draft graph's value `name`; `same`: the draft's
    constants that are verify's, `same_constants`)."""
    first = first or (lambda x: PREFIX + x)
    same = same or {}
    B, T = batch, tokens
    n = helper.make_node
    out_of = {o.name: o for o in gd.output}
    rows_name = next((x for x in out_of if x.endswith(".rows")), None)
    plane = rows_name[: -len(".rows")] if rows_name else None
    hid = next(i for i in gd.input if i.name == "hidden")
    tail = [d.dim_value for d in hid.type.tensor_type.shape.dim][2:]  # [n, D]

    def const(name, value, dtype=TensorProto.INT64, dims=None):
        dims = [len(value)] if dims is None else dims
        return n("Constant", [], [name], name=name, value=helper.make_tensor(name + ".value", dtype, dims, value))

    nodes = [n("ArgMax", ["draft.logits"], ["spec/d1"], axis=1, keepdims=1, name="spec/d1"),
             const("spec/r/one", [1], dims=[]), const("spec/r/zero", [0], dims=[]),
             const("spec/r/neg", [-1], dims=[]),
             const("spec/r/pad_ids", [0] * (B * (T - 1)), dims=[B, T - 1]),
             const("spec/r/pad_pos", [-1] * (B * (T - 1)), dims=[B, T - 1]),
             const("spec/r/pad_hidden", [0.0] * (B * (T - 1) * tail[0] * tail[1]), TensorProto.FLOAT,
                   [B, T - 1, *tail]),
             const("spec/r/gshape", [B, 1, *tail]),
             # the last kept lane of each sequence, and its new length L' (the last kept position + 1)
             n("GreaterOrEqual", ["spec.kept_pos", "spec/r/zero"], ["spec/r/kept_b"], name="spec/r/kept_b"),
             n("Cast", ["spec/r/kept_b"], ["spec/r/kept_i"], to=TensorProto.INT64, name="spec/r/kept_i"),
             n("ReduceSum", ["spec/r/kept_i", "spec/r/one_ax"], ["spec/r/n_kept"], keepdims=1, name="spec/r/n_kept"),
             const("spec/r/one_ax", [1]),
             n("Sub", ["spec/r/n_kept", "spec/r/one"], ["spec/r/last_raw"], name="spec/r/last_raw"),
             n("Max", ["spec/r/last_raw", "spec/r/zero"], ["spec/r/last"], name="spec/r/last"),  # [B, 1]
             n("ReduceMax", ["spec.kept_pos", "spec/r/one_ax"], ["spec/r/top"], keepdims=1, name="spec/r/top"),
             n("Add", ["spec/r/top", "spec/r/one"], ["spec/r/length"], name="spec/r/length")]
    if drafts == 1:  # no recursive copy: only the first draft's id
        nodes = nodes[:1]
    inits: list[onnx.TensorProto] = []
    last_ids, streams, lane = "spec/d1", "draft.streams", "spec/r/last"
    writes = [(first(rows_name), first(out_of[plane + ".vals"].name))] if plane else []
    picked = ["spec/d1"]
    for j in range(2, drafts + 1):
        pre = f"draft{j}/"
        # lane 0's inputs from the previous copy; the other lanes padding
        idx = f"spec/r{j}/idx"
        nodes += [n("Reshape", [lane, "spec/r/idx_shape"], [idx + "4"], name=idx + "4"),
                  n("Expand", [idx + "4", "spec/r/gshape"], [idx], name=idx),
                  n("GatherElements", [streams, idx], [f"spec/r{j}/h0"], axis=1, name=f"spec/r{j}/h0"),
                  n("Concat", [f"spec/r{j}/h0", "spec/r/pad_hidden"], [f"spec/r{j}/hidden"], axis=1,
                    name=f"spec/r{j}/hidden"),
                  n("Concat", [last_ids, "spec/r/pad_ids"], [f"spec/r{j}/ids"], axis=1, name=f"spec/r{j}/ids"),
                  const(f"spec/r{j}/off", [j - 2], dims=[]),
                  n("Add", ["spec/r/length", f"spec/r{j}/off"], [f"spec/r{j}/p"], name=f"spec/r{j}/p"),
                  n("Greater", ["spec/r/length", "spec/r/zero"], [f"spec/r{j}/live"], name=f"spec/r{j}/live")]
        ok = f"spec/r{j}/live"
        if max_pos is not None:
            nodes += [const(f"spec/r{j}/maxp", [max_pos], dims=[]),
                      n("LessOrEqual", [f"spec/r{j}/p", f"spec/r{j}/maxp"], [f"spec/r{j}/inside"],
                        name=f"spec/r{j}/inside"),
                      n("And", [ok, f"spec/r{j}/inside"], [f"spec/r{j}/ok"], name=f"spec/r{j}/ok")]
            ok = f"spec/r{j}/ok"
        nodes += [n("Where", [ok, f"spec/r{j}/p", "spec/r/neg"], [f"spec/r{j}/p0"], name=f"spec/r{j}/p0"),
                  n("Concat", [f"spec/r{j}/p0", "spec/r/pad_pos"], [f"spec/r{j}/pos"], axis=1,
                    name=f"spec/r{j}/pos")]
        step_in = {"hidden": f"spec/r{j}/hidden", "ids": f"spec/r{j}/ids", "pos": f"spec/r{j}/pos"}

        def rename(x: str, pre=pre, step_in=step_in) -> str:
            if not x:
                return x
            if x in step_in:
                return step_in[x]
            if x in same:
                return same[x]
            return x if x in shared else pre + x
        for node in gd.node:
            m = onnx.NodeProto()
            m.CopyFrom(node)
            m.name = pre + node.name
            m.input[:] = [rename(x) for x in node.input]
            m.output[:] = [rename(x) for x in node.output]
            if plane and m.op_type == "Gather" and m.input[0] == plane and writes:
                got = m.output[0]
                m.output[0] = got + ".unpatched"
                nodes.append(m)
                nodes += patched_gather(pre, got + ".unpatched", m.input[1], writes, got)
                continue
            nodes.append(m)
        for t in gd.initializer:
            if t.name in same:
                continue
            c = TensorProto()
            c.CopyFrom(t)
            c.name = pre + t.name
            inits.append(c)
        if plane:
            writes.append((pre + rows_name, pre + out_of[plane + ".vals"].name))
        d = f"spec/d{j}"
        nodes.append(n("ArgMax", [pre + "logits"], [d], axis=1, keepdims=1, name=d))
        picked.append(d)
        last_ids, streams, lane = d, pre + "streams", "spec/r/zero_lane"
    if drafts > 1:
        nodes.append(const("spec/r/idx_shape", [B, 1, 1, 1]))
    if drafts > 2:  # the third copy on reads lane 0 (unused at 2: ONNX Runtime would warn of it at every load)
        nodes.append(const("spec/r/zero_lane", [0] * B, dims=[B, 1]))
    nodes.append(n("Concat", picked, ["spec.drafts"], axis=1, name="spec/drafts") if len(picked) > 1 else
                 n("Identity", picked, ["spec.drafts"], name="spec/drafts"))
    return nodes, inits


def _int_const(name: str, dims: list[int], value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name,
                            value=helper.make_tensor(name + ".v", TensorProto.INT64, dims, [value]))


def patched_gather(pre: str, got: str, rows: str, writes: list[tuple[str, str]], out: str) -> list[onnx.NodeProto]:
    """`out` = `got` (rows `rows` gathered from the plane) with each row an earlier copy wrote replaced by the
    last such write's values (`writes`: (rows [N], values [N, row]) in write order; negative rows: none)."""
    n = helper.make_node
    p = pre + "patch/"
    wr = [w for w, _ in writes]
    wv = [v for _, v in writes]
    nodes = [n("Concat", wr, [p + "rows"], axis=0, name=p + "rows") if len(wr) > 1 else
             n("Identity", wr, [p + "rows"], name=p + "rows"),
             n("Concat", wv, [p + "vals"], axis=0, name=p + "vals") if len(wv) > 1 else
             n("Identity", wv, [p + "vals"], name=p + "vals"),
             n("Unsqueeze", [rows, p + "ax"], [p + "read"], name=p + "read"),
             _int_const(p + "ax", [1], -1),
             n("Equal", [p + "read", p + "rows"], [p + "eq"], name=p + "eq"),  # [*rows, N]
             n("Cast", [p + "eq"], [p + "eqi"], to=TensorProto.INT64, name=p + "eqi"),
             # 1 + the index of each write, 0 where it does not match: the largest is the last matching write
             n("Shape", [p + "rows"], [p + "n"], name=p + "n"),
             _int_const(p + "one", [], 1),
             _int_const(p + "zero", [], 0),
             n("Squeeze", [p + "n"], [p + "n0"], name=p + "n0"),
             n("Add", [p + "n0", p + "one"], [p + "n1"], name=p + "n1"),
             n("Range", [p + "one", p + "n1", p + "one"], [p + "order"], name=p + "order"),
             n("Mul", [p + "eqi", p + "order"], [p + "score"], name=p + "score"),
             n("ReduceMax", [p + "score", p + "ax"], [p + "best"], keepdims=0, name=p + "best"),
             n("Greater", [p + "best", p + "zero"], [p + "hit"], name=p + "hit"),
             n("Sub", [p + "best", p + "one"], [p + "which0"], name=p + "which0"),
             n("Max", [p + "which0", p + "zero"], [p + "which"], name=p + "which"),
             n("Gather", [p + "vals", p + "which"], [p + "new"], axis=0, name=p + "new"),  # [*rows, row]
             n("Unsqueeze", [p + "hit", p + "ax"], [p + "hit1"], name=p + "hit1"),
             n("Where", [p + "hit1", p + "new", got], [out], name=p + "out")]
    return nodes
