"""Partition the module over ranks: tensor / data parallel attention, expert parallel MoE (one SPMD module).

Requires: a traced module (no fusion or lowering yet: it runs first in a pipeline), not partitioned.
Guarantees: one module every rank runs, with rank-local weight types (`v4compile/parallel.py`: the
layout in the attributes `parallel.tp` / `parallel.ep`, each weight's part in its source, `name#tp:0`):
- attention: the query heads split over the `tp` ranks of a group (`wq_b` rows, `attn_sink`), `wo_a`'s
  output groups with their heads (`groups` / tp), `wo_b` on its input, then `all_reduce{group=tp}`;
- MoE: the routed experts split over the `ep` ranks of a group (the stacks' first axis); every rank routes
  every token, `local_experts` marks other ranks' slots (index -1, weight 0: `moe_experts` skips them,
  no weight read, no FLOPs; `=expert_owner(E)`, the rank's owner table), `moe_experts{ep}` tells the cost
  models that 1 / ep of the slots land here, and one `all_reduce{group=ep}` adds the ranks' routed outputs
  before the shared expert's;
- replicated, because communicating them would cost more than holding them (bytes per layer of V4-Pro in
  the report, `parallel_report`): the single KV head (`wkv`; every rank keeps the whole KV pool), `wq_a`
  and `q_norm` (every rank needs the whole `qr`), the compressors and the indexer (each reads the whole
  `x` or `qr` and feeds every head), the router and the shared expert, mHC and the norms, and the
  embedding and head (vocab-parallel would add an all-gather of the logits per step).
- data parallel (`dp` > 1, `v4compile/parallel.py`: world = dp x tp, replica r // tp): every function is
  the replica's own (its batch, its pool and state: the rank's sequences); attention, the shared expert,
  mHC, embedding and head run on the rank's own tokens with replicated weights, unchanged. With `ep` the
  world (the only other choice is ep 1: every rank holds every expert and nothing is exchanged), each
  MoE's input x goes to every rank (`all_gather_rows{group=world}`, [B, T, D] -> [world B, T, D]), every
  rank routes all the gathered tokens (the router's weights are replicated: the same result on each rank;
  a hash router's token ids are gathered once per function, after its first op) and runs its own experts
  on them (`local_experts`), and `reduce_scatter_rows{group=world}` adds the ranks' partial outputs and
  leaves each rank its own tokens' rows, before the shared expert's: two collectives per layer.
  Why these collectives. Bytes a rank moves per MoE layer, V4-Pro (D 7168, bf16, top-6 of 384) over 8
  ranks at decode batch B per rank: all-gather + reduce-scatter 2 x 7 x B x D x 2 bytes = 0.20 MB at B 1,
  1.61 MB at B 8, 12.8 MB at B 64; all-to-all dispatch + combine with exact per-peer counts (a token goes
  to the ranks of its 6 experts, expected 4.4 of 8, 3.8 of them other ranks) 0.11 / 0.89 / 7.1 MB, but its
  counts vary by step: a captured graph needs static buffers, room for 6 slots of every peer's token,
  1.2 / 9.6 / 77 MB, or a host round trip of the counts each layer. At these batches a collective costs
  its latency (~10-20 us; 12.8 MB at ~400 GB/s is 32 us), both schemes make two calls a layer, and
  gathering x alone (routing on every rank) saves gathering the routing weights and indices: all-gather
  + reduce-scatter, which every torch.distributed backend (and NCCL / RCCL inside a graph) offers.
  With tp > 1 as well (`--dp D --tp T --ep D*T`: attention tensor-parallel inside each replica, whose T ranks
  hold the same tokens), both collectives carry `tp`: the gather keeps the rows of each replica's first rank
  only (all-gather over the world, then the duplicates dropped by a static choice: every rank routes the
  D x B distinct tokens once, and a replica's ranks see the same bits), and the reduce-scatter hands every
  rank of a replica its replica's rows of the world's sum (one call: no broadcast inside the replica after
  it). Bytes a rank moves per MoE layer, V4-Pro (D 7168, bf16) at world 8 = DP4 x TP2, batch B a replica:
  all-gather of the world then dropping duplicates 7 x B x D x 2 = 0.80 MB at B 8, the sum as a reduce-scatter
  of the replicas' rows repeated per rank 0.80 MB: 1.61 MB, two calls; gathering over a strided group of
  the ranks with the same tp part (D ranks) instead, then a reduce-scatter over that group and an all-reduce
  inside the replica: 0.34 + 0.34 + 0.11 = 0.80 MB, three calls and a communicator per strided group. At
  these batches each call is its latency (~10-20 us; 1.6 MB at ~400 GB/s is 4 us), so two calls over the
  world's one communicator win; at B 64 the strided scheme's bytes (6.4 against 12.8 MB: 16 us less) would
  pay for its third call.
Numerics: the sums of `wo_b` and of the routed experts are split into per-rank partial sums added by
the all-reduce: a rounding difference from the unpartitioned module (fp32: ~1e-7 of the logit scale, more
where it flips an FP8 rounding), none from the reference of the layout (`ReferenceModel.partitioned`),
which the module reproduces exactly and `--check-numerics` holds it to. Bad `tp` / `ep` (not dividing
the heads, `o_groups`, the experts, each other, or the scale blocks of a quantised weight) is an
InputError naming the constraint. Data parallel: the experts' GEMMs see another batch than the whole
model's (every rank's tokens, not every sequence at once) and the rest the replica's: batch-composition
rounding (hf: ~1e-6 of the logit scale on tiny-pro; official numerics can flip an FP8 / FP4 rounding).
Hits: `<func>.all_reduce` (collectives inserted: all-reduces, and with dp the gathers and
reduce-scatters), `sharded_weights` (rank-local weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from v4compile.errors import InputError
from v4compile.ir.core import WEIGHT, Function, Module, Op, Value
from v4compile.ir.registry import get_op
from v4compile.ir.types import TensorType
from v4compile.parallel import EP, TP, ParallelLayout, owner_source, shard_source

from .base import Pass, PassResult, register
from .rewrite import Namer, make_op, new_module, operands_of, prune_weights

# (op, role) -> {operand: axis} of the weights split over the tensor-parallel group.
TP_WEIGHTS = {("linear", "attn.wq_b"): {"w": 0, "scale": 0},
              ("attention", "attn"): {"sink": 0},
              ("grouped_out_proj", "attn.wo_a"): {"w": 0, "scale": 0},
              ("linear", "attn.wo_b"): {"w": 1, "scale": 1}}
EP_WEIGHTS = {n: 0 for n in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")}
SCALED = {"w": "scale", "w1": "w1_scale", "w2": "w2_scale", "w3": "w3_scale"}


def _need(cond: bool, what: str, expected: object, found: object) -> None:
    if not cond:
        raise InputError(what, where="partition", expected=expected, found=found)


def check_layout(m: Module, layout: ParallelLayout) -> None:
    """The constraints of a layout on the module, each named in its error."""
    tp, ep, dp = layout.tp, layout.ep, layout.dp
    bad = layout.problem()
    _need(bad is None, bad or "", "dp, tp, ep >= 1; without dp: tp | ep or ep | tp; with dp: ep = 1 or dp x tp",
          f"dp {dp}, tp {tp}, ep {ep}")
    for fn in m.functions.values():
        for op in fn.ops:
            if op.name == "attention":
                heads = op.operand("q").type.shape[-2]
                _need(heads % tp == 0, "--tp must divide the attention heads", f"a divisor of {heads}", tp)
            elif op.name == "grouped_out_proj":
                g = op.attrs["groups"]
                _need(g % tp == 0, "--tp must divide the output projection groups (o_groups)", f"a divisor of {g}", tp)
            elif op.name == "moe_experts":
                e = op.operand("w1").type.shape[0]
                _need(e % ep == 0, "--ep must divide the routed experts", f"a divisor of {e}", ep)
            for names, n in _sharded(op, layout):
                for name, axis in names.items():
                    _check_blocks(op, name, axis, n)


def _check_blocks(op: Op, name: str, axis: int, n: int) -> None:
    """A quantised weight splits only into whole scale blocks, and a GEMM with FP8 activations (quantised
    per 128-wide block of its input) only into whole input blocks: else the ranks would round otherwise."""
    w = op.operand(name)
    if w is None or name not in SCALED or (w.type.rank == 3 and axis == 0):  # a stack's expert axis: free
        return
    last = axis == w.type.rank - 1
    extent = w.type.shape[axis] * (2 if w.type.dtype == "fp4x2" and last else 1)  # fp4x2: two values a byte
    blocks = []
    if op.operand(SCALED[name]) is not None and (w.type.dtype == "fp8e4m3" or last):
        blocks.append((op.attrs["block"], "its scale blocks"))
    if op.attrs.get("act") == "fp8" and last:
        blocks.append((128, "the 128-wide blocks of its FP8 activations"))
    for block, what in blocks:
        _need(extent % (n * block) == 0, f"the partition must cut @{w.name} (axis {axis}) into whole blocks of {what}",
              f"{extent} a multiple of {n} x {block}", f"{extent} / {n} = {extent / n:g}")


def _sharded(op: Op, layout: ParallelLayout) -> list[tuple[dict[str, int], int]]:
    """The operands of `op` split over a group, with their axes, and the group's size."""
    out = []
    names = TP_WEIGHTS.get((op.name, op.attrs.get("role", "")))
    if names and layout.tp > 1:
        out.append((names, layout.tp))
    if op.name == "moe_experts" and layout.ep > 1:
        out.append((EP_WEIGHTS, layout.ep))
    return out


class _Partitioner:
    def __init__(self, m: Module, layout: ParallelLayout):
        self.m, self.layout = m, layout
        # data parallel with the experts over the world: the tokens of every rank go to the experts
        self.gather = layout.dp > 1 and layout.ep > 1
        self.weights: dict[str, Value] = dict(m.weights)
        self.sharded: set[str] = set()

    def local_weight(self, w: Value, group: str, axis: int) -> Value:
        """The rank-local weight `w` (one per module: the functions share it)."""
        if w.name in self.sharded:
            return self.weights[w.name]
        n = self.layout.size(group)
        shape = list(w.type.shape)
        shape[axis] //= n
        local = Value(w.name, TensorType(tuple(shape), w.type.dtype), WEIGHT,
                      tuple(shard_source(s, group, axis) for s in w.sources))
        self.weights[w.name] = local
        self.sharded.add(w.name)
        return local

    def owner(self, w1: Value) -> Value:
        E = w1.type.shape[0]
        name = w1.name.rsplit(".", 1)[0] + ".owner"  # layers.<l>.ffn.experts.owner
        if name not in self.weights:
            self.weights[name] = Value(name, TensorType((E,), "i64"), WEIGHT, (owner_source(E),))
            self.sharded.add(name)
        return self.weights[name]

    def function(self, fn: Function) -> tuple[Function, int]:
        namer = Namer(fn)
        env: dict[int, Value] = {}
        ops: list[Op] = []
        reduces = 0

        def sub(v):
            return None if v is None else env.get(id(v), v)

        gathered: dict[int, Value] = {}  # id(a rank's value) -> every rank's, gathered (data parallel)
        reduces_box = [0]  # the gathers inserted (`gather` counts them)
        # the routers' token ids, gathered once each right after they are made (a function input: after the
        # first op, so that no segment of the cpu target is empty: `codegen/onnx_segments.py`)
        ids_at = _router_ids(fn) if self.gather else {}

        def gather(v: Value, op: Op) -> Value:
            if id(v) not in gathered:
                g = make_op(namer, "all_gather_rows", {"x": v},
                            {**_tags(op), "group": self.layout.world, "tp": self.layout.tp}, op.loc)
                ops.append(g)
                gathered[id(v)] = g.result
                reduces_box[0] += 1
            return gathered[id(v)]

        for i, op in enumerate(fn.ops):
            operands = {k: sub(v) for k, v in operands_of(op).items()}
            attrs = dict(op.attrs)
            if self.gather and op.name in ("router", "moe_experts"):
                # the router runs on every rank's tokens (each rank routes all of them: the same result on
                # every rank, cheaper than gathering its weights and indices: partition docstring)
                operands["x"] = gather(operands["x"], op)
                if op.name == "router" and operands.get("ids") is not None:
                    operands["ids"] = gathered[id(operands["ids"])]
            for names, _ in _sharded(op, self.layout):
                group = TP if names is not EP_WEIGHTS else EP
                for name, axis in names.items():
                    if operands.get(name) is not None:
                        operands[name] = self.local_weight(operands[name], group, axis)
            if op.name == "grouped_out_proj" and op.attrs.get("role") == "attn.wo_a" and self.layout.tp > 1:
                attrs["groups"] = op.attrs["groups"] // self.layout.tp
            if op.name == "reshape" and operands["x"].type != op.operand("x").type:
                shape = list(op.attrs["shape"])  # [B, T, heads, head_dim] of the rank's heads
                shape[-2] = operands["x"].type.shape[-1] // shape[-1]
                attrs["shape"] = tuple(shape)
            if op.name == "moe_experts" and self.layout.ep > 1:
                mask = make_op(namer, "local_experts", {"weights": operands["weights"], "indices": operands["indices"],
                                                         "owner": self.owner(op.operand("w1"))},
                               _tags(op), op.loc)
                ops.append(mask)
                operands["weights"], operands["indices"] = mask.results
                attrs["ep"] = self.layout.ep  # for the cost models: k / ep of each token's slots land here
            new = self._retyped(op, operands, attrs, namer)
            ops.append(new)
            for old, v in zip(op.results, new.results):
                if v is not old:
                    env[id(old)] = v
            group = self._reduce_group(op)
            if group:
                kind = "reduce_scatter_rows" if self.gather and op.name == "moe_experts" else "all_reduce"
                rows = {"tp": self.layout.tp} if kind == "reduce_scatter_rows" else {}  # a replica's ranks: its rows
                red = make_op(namer, kind, {"x": new.result}, {**_tags(op), "group": group, **rows}, op.loc)
                ops.append(red)
                env[id(op.result)] = red.result
                reduces += 1
            for v in ids_at.get(i, ()):
                gather(sub(v), op)
        outputs = [(n, sub(v)) for n, v in fn.outputs]
        for (n, v), (_, old) in zip(outputs, fn.outputs):
            if v.type != old.type:
                raise InputError(f"partition: output '{n}' of @{fn.name} would be rank-local",
                                 expected="replicated outputs", found=str(v.type))
        return Function(fn.name, list(fn.inputs), ops, outputs, dict(fn.attrs)), reduces + reduces_box[0]

    def _reduce_group(self, op: Op) -> int:
        if op.name == "linear" and op.attrs.get("role") == "attn.wo_b" and self.layout.tp > 1:
            return self.layout.tp
        if op.name == "moe_experts" and self.layout.ep > 1:
            return self.layout.ep  # == the world under data parallelism (`ParallelLayout.problem`)
        return 0

    @staticmethod
    def _retyped(op: Op, operands: dict[str, Value | None], attrs: dict, namer: Namer) -> Op:
        """`op` on the new operands, its results retyped by its shape rule (a result whose type is unchanged
        keeps its value, so names and uses stay)."""
        opdef = get_op(op.name)
        ordered = [operands[n] for n in opdef.operand_names]
        if ordered == list(op.operands) and attrs == op.attrs:
            return op
        types = opdef.result_types([v.type if v is not None else None for v in ordered], attrs)
        results = tuple(r if r.type == t else Value(r.name, t, r.kind) for r, t in zip(op.results, types))
        return Op(op.name, tuple(ordered), results, attrs, op.loc)


def _router_ids(fn: Function) -> dict[int, list[Value]]:
    """Index of the op after which each distinct token-id operand of a (hash) router is complete: its
    producer, or the function's first op for a function input."""
    where: dict[int, int] = {}
    for i, op in enumerate(fn.ops):
        for r in op.results:
            where[id(r)] = i
    out: dict[int, list[Value]] = {}
    seen: set[int] = set()
    for op in fn.ops:
        v = op.operand("ids") if op.name == "router" else None
        if v is not None and id(v) not in seen:
            seen.add(id(v))
            out.setdefault(where.get(id(v), 0), []).append(v)
    return out


def _tags(op: Op) -> dict:
    return {k: op.attrs[k] for k in ("layer", "role") if k in op.attrs}


@register
@dataclass(frozen=True)
class Partition(Pass):
    name = "partition"
    first = True  # it partitions the traced ops: no fusion or lowering yet
    tp: int = 1
    ep: int = 1
    dp: int = 1

    def run(self, module: Module) -> PassResult:
        layout = ParallelLayout(self.tp, self.ep, self.dp)
        if ParallelLayout.of(module) is not None:
            raise InputError("the module is already partitioned", where="partition",
                             found=ParallelLayout.of(module))
        check_layout(module, layout)
        if layout.world == 1:
            return PassResult(module, {"sharded_weights": 0})
        p = _Partitioner(module, layout)
        funcs, hits = {}, {}
        for name, fn in module.functions.items():
            funcs[name], hits[f"{name}.all_reduce"] = p.function(fn)
        hits["sharded_weights"] = len(p.sharded)
        out = new_module(module, funcs, p.weights, {**module.attrs, **layout.attrs()})
        return PassResult(prune_weights(out), hits)
