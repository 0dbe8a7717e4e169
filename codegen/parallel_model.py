"""The report of a partitioned module (`partition{tp,ep}`): what one rank holds and moves per decode step.

    parallel_section(cfg, traced, final, targets) -> the report's "parallel" entry (JSON)

* `per_rank_weight_bytes`: the rank-local weights of the final module (rank-local types, after merges),
  next to the unpartitioned total, and which weights stay whole on every rank, with their bytes;
* `per_rank_kv_bytes`: every state the decode function carries from step to step (KV pool planes, sliding
  windows, compressor states) at the compiled decode batch and max context; the partition replicates it
  (the single KV head), so every rank holds all of it;
* `collectives_per_decode_step`: the decode function's collectives with the bytes each moves (and, for a
  program, its collective launches among all its launches);
* `layouts` (8 ranks, EP 8): the per-layout table, TP8/EP8 against DP8/EP8 (`layout_model.py`);
* `decode_step`: per GPU target, a modeled per-rank decode step (stated model below) and whether the
  rank's weights + KV fit the device.

Model (per rank, serial, no overlap but the one said below): the bytes a step moves at the HBM roofline (`targets.TARGETS`): for a
program with kernels for every launch, what its decode kernel calls move (`bytes_moved`, as the roofline
step model counts them: the MoE kernels count only this rank's k / ep slots per token, other ranks' slots
run nothing); else the weights model: every weight once, and of the routed experts those a step touches
(each of the rank's experts is read when one of the batch's tokens picks it, expected fraction
`1 - (1 - k/E)^tokens` under uniform routing), which `weights_read_bytes` keeps either way; plus the per-launch latency (`targets.TARGETS`: a graph node, with PDL on
sm_90a) of every kernel call of the partitioned program (`decode_calls`; of every launch op when the module
was not lowered to a program), plus each
collective as a ring: `latency + 2 (n - 1) / n * bytes / link bandwidth` for an all-reduce
(`targets.TargetSpec.link`), except the one-shot all-reduce over peer memory (`all_reduce_oneshot`,
`codegen/kernels/allreduce.py`; issue 34's option A): a kernel call (counted with the calls; or the leading phase of
its consumer's, `passes/fuse_oneshot_consumer.py`, or a trailing part of its producer's,
`passes/fuse_oneshot_producer.py`: no call of its own) + `oneshot latency + (n - 1) * bytes / link bandwidth`
where the target has a measured one-shot figure (else the ring's); likewise data parallelism's rows collectives
lowered one-shot (`all_gather_rows_oneshot`, `reduce_scatter_rows_oneshot`), `bytes` then a rank's part of the
gathered value, what it pulls from each peer (`part_bytes`). The one overlap modeled: one folded into its
producer's launch (the EP MoE's) waits while that launch reads the shared expert's weights (published before them,
waited for after), so its exposed time is max(0, that time - those bytes / HBM bandwidth); the report says so
("hidden behind the shared expert's N MB: modeled"). For a
program whose all-reduces stayed on the communicator (`--allreduce nccl`), `oneshot` is the step with them
one-shot. KV reads
are left out (a decode step reads the window and the selected rows, small next to the weights at these batches).
"""

from __future__ import annotations

from typing import Any

from v4compile.ir.core import Module
from v4compile.ir.registry import get_op
from v4compile.ops.fused_allreduce import DP_MOE, PRODUCED, consumer_of, hidden_bytes, producer_of, rows_folded
from v4compile.parallel import ParallelLayout, is_rank_local, split_shard
from v4compile.targets import TARGETS, oneshot_allreduce
from v4compile.weights import spec_table
from v4compile.weights_convert import expand_sources

from .layout_model import WORLD, layout_table, render_layout_table


def _kind(name: str, specs: dict) -> str:
    """What a weight is, for the replicated-bytes breakdown (the checkpoint's categories, the attention's
    KV head and query low-rank part told apart)."""
    base = expand_sources((split_shard(name)[0],))[0]
    if base.startswith("="):
        return "expert_owner"
    tail = base.rsplit(".", 1)
    weight = tail[0] + ".weight" if tail[-1] == "scale" else base
    if any(k in base for k in ("attn.wkv.", "attn.kv_norm.")):
        return "kv_head"
    if any(k in base for k in ("attn.wq_a.", "attn.q_norm.")):
        return "q_lora"
    spec = specs.get(weight) or specs.get(base)
    return spec.category if spec is not None else "other"


def weight_bytes(partitioned: Module, cfg) -> dict[str, Any]:
    """Per-rank bytes of a module straight after the partition (before merges: one weight per source),
    split into replicated and rank-local, by kind."""
    specs = spec_table(cfg)
    rep: dict[str, int] = {}
    local: dict[str, int] = {}
    for w in partitioned.weights.values():
        d = local if is_rank_local(w.sources) else rep
        k = _kind(w.sources[0], specs)
        d[k] = d.get(k, 0) + w.type.nbytes
    return {"replicated": dict(sorted(rep.items(), key=lambda kv: -kv[1])),
            "rank_local": dict(sorted(local.items(), key=lambda kv: -kv[1]))}


def state_bytes(m: Module, func: str = "decode") -> int:
    """Bytes of what `func` carries between steps (its inputs that are also outputs)."""
    fn = m.functions[func]
    carried = {n for n, _ in fn.outputs}
    return sum(v.type.nbytes for v in fn.inputs if v.name in carried)


def collectives(m: Module, func: str = "decode") -> list[dict[str, Any]]:
    """Every collective of `func`, one-shot all-reduces folded into their consumers' launches
    (`passes/fuse_oneshot_consumer.py`) as the one-shot all-reduces they are (`folded_into`: the consumer op), and
    those folded into their producers' (`passes/fuse_oneshot_producer.py`) too (`folded_after`: the producer op;
    `hidden_bytes`: what its launch reads between publishing and waiting, `fused_allreduce.hidden_bytes`); data
    parallelism's rows collectives folded into their MoE's launch (`passes/fuse_oneshot_rows.py`) as the one-shot
    all-gather and reduce-scatter they are (no bytes hidden: modeled as the standalone one-shots)."""
    out = []
    for op in m.functions[func].ops:
        if rows_folded(op.name):
            common = {"group": op.attrs["group"], "role": op.attrs.get("role", "")}
            at = get_op(op.name).results.index(PRODUCED)
            # (the gathered part: the rank's tokens, of the shared expert's output's type)
            out.append({"op": "all_gather_rows_oneshot", "folded_into": DP_MOE,
                        "bytes": op.results[get_op(op.name).results.index("shared")].type.nbytes, **common})
            out.append({"op": "reduce_scatter_rows_oneshot", "folded_after": DP_MOE,
                        "bytes": op.results[at].type.nbytes * op.attrs["group"], **common})
        elif get_op(op.name).collective:
            inner = consumer_of(op.name)
            producer = producer_of(inner or op.name)
            common = {"group": op.attrs["group"], "role": op.attrs.get("role", ""),
                      **({"tp": op.attrs["tp"]} if op.attrs.get("tp", 1) > 1 else {})}
            if inner or not producer:
                out.append({"op": "all_reduce_oneshot" if inner else op.name, **({"folded_into": inner} if inner else {}),
                            "bytes": op.operands[0].type.nbytes, **common})
            if producer:
                at = get_op(op.name).results.index(PRODUCED)
                out.append({"op": "all_reduce_oneshot", "folded_after": producer, "bytes": op.results[at].type.nbytes,
                            "hidden_bytes": hidden_bytes(op), **common})
    return out


def parallel_section(cfg, traced: Module, partitioned: Module, final: Module, targets: tuple[str, ...]) -> dict:
    """`partitioned`: the module right after the partition pass; `final`: after the whole pipeline."""
    layout = ParallelLayout.of(final)
    coll = collectives(final)
    per_rank = sum(w.type.nbytes for w in final.weights.values())
    kv = state_bytes(final)
    dec = final.functions["decode"]
    tokens = int(dec.attrs["batch"]) * int(dec.attrs["tokens"])
    kinds = weight_bytes(partitioned, cfg)
    routed = kinds["rank_local"].get("routed_experts", 0)
    touched = 1 - (1 - cfg.n_active_experts / cfg.n_experts) ** tokens
    read = per_rank - routed + routed * touched
    launches, counted, kernel_bytes = decode_calls(final)
    moved = read if kernel_bytes is None else kernel_bytes
    steps = {}
    for t in targets:
        spec = TARGETS[t]
        link = spec.link
        coll_s = sum(collective_s(c, link, c["op"] in ONESHOT, spec.hbm_bytes_s) for c in coll)
        after = [c for c in coll if "hidden_bytes" in c]  # folded into their producers: partly hidden
        hidden_s = sum(collective_s(c, link, True) - collective_s(c, link, True, spec.hbm_bytes_s) for c in after)
        # every launch as a graph node, with PDL where the target has it (its kernels all wait: kernels/pdl.py)
        kind = "graph_pdl" if spec.pdl else "graph"
        # all-reduces the lowering left on the communicator (`--allreduce nccl`) that could run one-shot
        one = [id(c) for c in coll if c["op"] == "all_reduce" and oneshot_allreduce(c["group"], c["bytes"])]
        roof_s, launch_s = moved / spec.hbm_bytes_s, launches * spec.launch_latency(kind)
        steps[t] = {"device": link.device, "fits": per_rank + kv <= link.memory_bytes,
                    "memory_bytes": link.memory_bytes, "weights_read_bytes": int(read),
                    "program_kernel_bytes": kernel_bytes,
                    "roofline_us": round(roof_s * 1e6, 1), "launch_latency_us": round(launch_s * 1e6, 1),
                    "collectives_us": round(coll_s * 1e6, 1),
                    **({"folded_after": len(after), "hidden_us": round(hidden_s * 1e6, 1),
                        "hidden_bytes_each": max(c["hidden_bytes"] for c in after)} if after else {}),
                    "modeled_us": round((roof_s + launch_s + coll_s) * 1e6, 1), "launches": launches,
                    "launches_counted": counted,
                    "link_bytes_s": link.bytes_s, "allreduce_latency_us": link.allreduce_latency_s * 1e6,
                    "source": link.source, "oneshot_all_reduces": sum(c["op"] in ONESHOT for c in coll),
                    **({"oneshot_latency_us": link.oneshot_latency_s * 1e6, "oneshot_source": link.oneshot_source}
                       if link.oneshot_latency_s is not None else {})}
        if one and link.oneshot_latency_s is not None:  # what lowering them one-shot would give (issue 34's option A)
            steps[t]["oneshot"] = {
                "all_reduces": len(one), "launch_latency_us": round(len(one) * spec.launch_latency(kind) * 1e6, 1),
                "collectives_us": round(sum(collective_s(c, link, id(c) in one) for c in coll) * 1e6, 1)}
    out = {
        "tp": layout.tp, "ep": layout.ep, **({"dp": layout.dp} if layout.dp > 1 else {}), "world": layout.world,
        "per_rank_weight_bytes": per_rank,
        "unpartitioned_weight_bytes": sum(w.type.nbytes for w in traced.weights.values()),
        "weight_bytes_by_kind": kinds,
        "per_rank_kv_bytes": kv,
        "kv_at": {"decode_batch": int(dec.attrs["batch"]), "max_context": final.attrs.get("capacity")},
        "collectives_per_decode_step": {"count": len(coll), "bytes": sum(c["bytes"] for c in coll),
                                        "ops": coll, **program_collectives(final)},
        "decode_step": steps,
    }
    if layout.world == WORLD and layout.tp in (1, WORLD) and layout.ep == WORLD:
        # the per-layout table (TP8/EP8 against DP8/EP8, from the config), the compiled program's kernel calls
        # per step in its own layout's row (the other layout's: the bar, not a compiled figure)
        compiled = "DP8/EP8" if layout.dp > 1 else "TP8/EP8"
        out["layouts"] = layout_table(cfg, targets or tuple(TARGETS), int(dec.attrs["batch"]),
                                      {compiled: launches} if counted == "kernel calls" else None,
                                      oneshot=any(c["op"] in ONESHOT for c in coll),
                                      hidden_bytes=max([c["hidden_bytes"] for c in coll if "hidden_bytes" in c],
                                                       default=0))
    return out


def ring_bytes(c: dict) -> float:
    """What one rank sends of a collective in a ring, `c["bytes"]` its operand: an all-reduce 2 (n - 1) / n of
    it, an all-gather of rows its part to each of the n - 1 others, a reduce-scatter (n - 1) / n of it."""
    n, b, op = c["group"], c["bytes"], c["op"].removesuffix("_oneshot")
    if op == "all_gather_rows":
        return (n - 1) * b
    if op == "reduce_scatter_rows":  # with a replica's tp ranks: as of its rows repeated for each
        return (n - 1) / n * b * c.get("tp", 1)
    return 2 * (n - 1) / n * b


ONESHOT = ("all_reduce_oneshot", "all_gather_rows_oneshot", "reduce_scatter_rows_oneshot")


def part_bytes(c: dict) -> float:
    """What a rank pulls from each peer one-shot: an all-reduce's value; a rows collective's part of the gathered
    value (the all-gather's operand; the reduce-scatter's operand over the group)."""
    op = c["op"].removesuffix("_oneshot")
    return c["bytes"] / c["group"] if op == "reduce_scatter_rows" else c["bytes"]


def collective_s(c: dict, link, oneshot: bool, hbm_bytes_s: float | None = None) -> float:
    """A collective's own time (its launch, if a kernel call, is counted with the calls). One-shot, where the
    link has a measured figure (`targets.Link.oneshot_s`): that fixed cost + what a rank pulls from its
    n - 1 peers at the link's bandwidth; else a ring: the link's latency + the ring's bytes at its bandwidth.
    With `hbm_bytes_s`, what is exposed of a one-shot folded into its producer's launch (`hidden_bytes`: the
    shared expert's weights, read between publishing and waiting): max(0, that time - hidden bytes / HBM)."""
    t = link.oneshot_s(c["group"], part_bytes(c)) if oneshot and link.oneshot_latency_s is not None else \
        link.allreduce_latency_s + ring_bytes(c) / link.bytes_s
    if hbm_bytes_s is not None and c.get("hidden_bytes"):
        return max(0.0, t - c["hidden_bytes"] / hbm_bytes_s)
    return t


def decode_calls(final: Module) -> tuple[int, str, int | None]:
    """What a decode step launches besides its collectives, what was counted, and the bytes those calls move:
    the program's kernel calls (each launch's Triton calls, `program_kernels`; a MoE launch is two or three)
    when the module is lowered to a program with kernels for every launch, else its launch ops (bytes None)."""
    if final.attrs.get("stage") == "program":
        from v4compile.program.build import program_of

        from .program_kernels import program_kernels

        pk = program_kernels(program_of(final))
        if pk.complete:
            live = [c for calls in pk.calls["decode"] for c in calls if 0 not in c.grid]
            return len(live), "kernel calls", sum(c.bytes_moved for c in live)
    return sum(1 for op in final.functions["decode"].ops if get_op(op.name).launch
               and not get_op(op.name).communicator), "launches", None


def program_collectives(final: Module) -> dict[str, int]:
    """The decode program's collective launches next to all its launches (a program-stage module only)."""
    if final.attrs.get("stage") != "program":
        return {}
    from v4compile.program.build import program_of

    launches = program_of(final).functions["decode"].launches
    return {"program_launches": len(launches),
            "program_collective_launches": sum(1 for l in launches
                                               if get_op(l.op).collective and not consumer_of(l.op)
                                               and not producer_of(l.op) and not rows_folded(l.op)),
            "program_folded": sum(1 for l in launches if consumer_of(l.op) or rows_folded(l.op)),
            "program_folded_after": sum(1 for l in launches if producer_of(consumer_of(l.op) or l.op)
                                        or rows_folded(l.op))}


def _moved(s: dict) -> str:
    gb = 1e9
    if s.get("program_kernel_bytes") is None:
        return f"weights at the HBM roofline {s['roofline_us']:.1f} us ({s['weights_read_bytes'] / gb:.2f} GB read)"
    return (f"the program's kernels at the HBM roofline {s['roofline_us']:.1f} us "
            f"({s['program_kernel_bytes'] / gb:.2f} GB moved; weights model {s['weights_read_bytes'] / gb:.2f} GB)")


def render_parallel(p: dict) -> str:
    gb = 1e9
    kinds = p["weight_bytes_by_kind"]
    dp = f"dp {p['dp']}, " if "dp" in p else ""
    lines = [f"  parallel: {dp}tp {p['tp']}, ep {p['ep']} ({p['world']} ranks); per rank: weights "
             f"{p['per_rank_weight_bytes'] / gb:.2f} GB (of {p['unpartitioned_weight_bytes'] / gb:.2f} GB), KV and "
             f"state {p['per_rank_kv_bytes'] / gb:.3f} GB at decode batch {p['kv_at']['decode_batch']}, "
             f"{p['kv_at']['max_context']} tokens",
             "    rank-local: " + ", ".join(f"{k} {v / gb:.2f} GB" for k, v in kinds["rank_local"].items()),
             "    replicated: " + ", ".join(f"{k} {v / gb:.3f} GB" for k, v in kinds["replicated"].items())]
    c = p["collectives_per_decode_step"]
    size = sorted({x["bytes"] for x in c["ops"]})
    kinds = sorted({x["op"] for x in c["ops"]})
    what = "all-reduces" if kinds in ([], ["all_reduce"]) else "one-shot all-reduces" if kinds == [
        "all_reduce_oneshot"] else "collectives (" + ", ".join(
        f"{sum(x['op'] == k for x in c['ops'])} {k}" for k in kinds) + ")"
    lines.append(f"    collectives per decode step: {c['count']} {what}, {c['bytes']:,} bytes in all "
                 f"({', '.join(f'{s:,}' for s in size)} bytes each)"
                 + (f"; launches of the program: {c['program_collective_launches']} of its {c['program_launches']}"
                    + (" (" + ", ".join(w for w in (
                        f"{c['program_folded']} more folded into their consumers' launches"
                        if c.get("program_folded") else "",
                        f"{c['program_folded_after']} into their producers'" if c.get("program_folded_after") else "")
                        if w) + ")" if c.get("program_folded") or c.get("program_folded_after") else "")
                    if "program_launches" in c else ""))
    for t, s in p["decode_step"].items():
        lines.append(f"    {t} ({s['device']}, {s['memory_bytes'] / gb:.0f} GB: {'fits' if s['fits'] else 'does NOT fit'}): "
                     f"modeled decode step {s['modeled_us']:.1f} us = {_moved(s)} + {s['launches']} "
                     f"{s.get('launches_counted', 'launches')} "
                     f"{s['launch_latency_us']:.1f} us + collectives {s['collectives_us']:.1f} us "
                     f"({s['allreduce_latency_us']:.0f} us + bytes / {s['link_bytes_s'] / gb:.0f} GB/s each"
                     + (f"; the {s['oneshot_all_reduces']} one-shot collectives {s['oneshot_latency_us']:.1f} us + "
                        f"(n - 1) x bytes pulled from each peer (a rows collective's: a rank's part) / "
                        f"{s['link_bytes_s'] / gb:.0f} GB/s each besides their kernel calls (their "
                        f"own, or the consumers' they lead, or the producers' they trail): {s['oneshot_source']}" if s["oneshot_all_reduces"] and "oneshot_latency_us" in s else "")
                     + (f"; its {s['oneshot_all_reduces']} one-shot collectives modeled as the ring: no measured "
                        "one-shot figure below it on this target" if s["oneshot_all_reduces"]
                        and "oneshot_latency_us" not in s else "") + ")")
        if "folded_after" in s:
            lines.append(f"      the {s['folded_after']} MoE all-reduces folded into their MoE's launch hidden behind the "
                         f"shared expert's {s['hidden_bytes_each'] / 1e6:.0f} MB each: modeled (exposed = max(0, its time "
                         f"- those bytes / HBM)): {s['hidden_us']:.1f} us hidden, the rest in the collectives above")
        if "oneshot" in s:
            o = s["oneshot"]
            lines.append(f"      with its {o['all_reduces']} all-reduces one-shot over peer memory (modeled; this "
                         f"artifact runs them on NCCL / RCCL: --allreduce nccl): + {o['all_reduces']} kernel calls "
                         f"{o['launch_latency_us']:.1f} us, collectives {o['collectives_us']:.1f} us")
    return "\n".join(lines) + "\n" + (render_layout_table(p["layouts"]) if "layouts" in p else "")
