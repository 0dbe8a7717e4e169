"""Ops of a partitioned (SPMD) module (the `parallel` op set): the collectives and the expert ownership mask.

A partitioned module is one program every rank runs on its own weights (`passes/partition.py`). Ranks
form consecutive groups of `group` ranks (ranks `[g * group, (g + 1) * group)`); a collective combines
the values of the ranks of one group. Each collective declares its reference across ranks (`@op.spmd`:
every rank's operands in, every rank's results out), which `interpret_ranks` runs with all ranks in one
process; its plain reference is the one-rank case. The sum of `all_reduce` adds the ranks in rank order
in the value's dtype (NCCL's ring order differs: a rounding difference, within the numerics tolerance;
`all_reduce_oneshot`, the GPU programs' one-shot kernel, adds in rank order as well: bit for bit).
"""

from __future__ import annotations

import torch

from ..errors import IRError
from ..ir.registry import Cost, defop, require


def _groups(per_rank: list, group: int, op: str) -> list[list[int]]:
    n = len(per_rank)
    if group < 1 or n % group:
        raise IRError(f"{op} over groups of {group} ranks in a run of {n} ranks",
                      expected=f"a group size dividing the rank count {n}")
    return [list(range(g, g + group)) for g in range(0, n, group)]


def _rank_sum(per_rank: list, ranks: list[int]) -> torch.Tensor:
    """The group's values added in rank order, in their dtype (every summing collective's order)."""
    total = per_rank[ranks[0]][0].clone()
    for r in ranks[1:]:
        total += per_rank[r][0]
    return total


def _require_group(op: str, group: int, tp: int = 1) -> None:
    require(group >= 1, f"{op}: group must be >= 1", found=group)
    require(tp >= 1 and group % tp == 0, f"{op}: tp must divide the group", found=(group, tp))


def _one_rank(op: str, group: int) -> None:
    if group != 1:
        raise IRError(f"{op} over {group} ranks needs every rank's value", expected="interpret_ranks (all ranks)")


@defop("all_reduce(x) -> y", attrs={"group": int}, kernel="collective")
def all_reduce(x, *, group):
    """The sum of `x` over the ranks of this rank's group (every rank gets the same sum)."""
    _one_rank("all_reduce", group)
    return x.clone()


@all_reduce.infer
def _(x, *, group):
    _require_group("all_reduce", group)
    require(x.dtype in ("fp32", "bf16"), "all_reduce sums floating-point values", found=x.dtype)
    return x


@all_reduce.spmd
def _(per_rank, attrs):
    out: list = [None] * len(per_rank)
    for ranks in _groups(per_rank, attrs["group"], "all_reduce"):
        total = _rank_sum(per_rank, ranks)
        for r in ranks:
            out[r] = [total.clone()]
    return out


@all_reduce.cost
def _(operands, results, attrs):
    # What a rank moves in a ring all-reduce: 2 (n - 1) / n of the value each way; reported as read + written.
    n, b = attrs["group"], operands[0].nbytes
    moved = 2 * (n - 1) * b // n
    return Cost(operands[0].numel * (n - 1) // n, b + moved, b + moved)


@defop("all_reduce_oneshot(x) -> y", attrs={"group": int, "region_bytes": int}, kernel="allreduce")
def all_reduce_oneshot(x, *, group, region_bytes):
    """`all_reduce` as one kernel launch over symmetric peer memory (codegen/kernels/allreduce.py; what
    `passes/oneshot_allreduce.py` lowers a GPU program's all-reduces of a group within one node to): the same
    rank-order sum, bit for bit. `region_bytes`: the largest value of the module's one-shot all-reduces, which
    sizes every rank's symmetric region (one region serves them all)."""
    _one_rank("all_reduce_oneshot", group)
    return x.clone()


@all_reduce_oneshot.infer
def _(x, *, group, region_bytes):
    _require_group("all_reduce_oneshot", group)
    require(x.dtype in ("fp32", "bf16"), "all_reduce_oneshot sums floating-point values", found=x.dtype)
    require(0 < x.nbytes <= region_bytes, "all_reduce_oneshot: the value must fit the region",
            found=(x.nbytes, region_bytes))
    return x


@all_reduce_oneshot.spmd
def _(per_rank, attrs):
    return all_reduce.spmd_ref(per_rank, attrs)


@all_reduce_oneshot.cost
def _(operands, results, attrs):
    # the ideal of the sum it computes: an all-reduce's (the ring's bytes are the least a rank moves); the
    # one-shot's own time is the parallel model's (codegen/parallel_model.py)
    return all_reduce._cost(operands, results, attrs)


@defop("all_gather(x) -> y", attrs={"group": int}, kernel="collective")
def all_gather(x, *, group):
    """The group's values concatenated along the last axis in rank order."""
    _one_rank("all_gather", group)
    return x.clone()


@all_gather.infer
def _(x, *, group):
    _require_group("all_gather", group)
    require(x.rank >= 1, "all_gather needs at least one axis", found=x)
    return x.with_shape(*x.shape[:-1], x.shape[-1] * group)


@all_gather.spmd
def _(per_rank, attrs):
    out: list = [None] * len(per_rank)
    for ranks in _groups(per_rank, attrs["group"], "all_gather"):
        whole = torch.cat([per_rank[r][0] for r in ranks], dim=-1)
        for r in ranks:
            out[r] = [whole.clone()]
    return out


@defop("local_experts(weights, indices, owner) -> weights_out, indices_out", kernel="local_experts")
def local_experts(weights, indices, owner):
    """Expert parallelism: `owner[e]` is expert e's index in this rank's stack, -1 where another rank owns
    it. This rank's slots get their local index; other ranks' slots get index -1, which `moe_experts`
    skips (no weight read, no FLOPs: an index outside the stack adds nothing), and weight 0 as well.
    Every rank routes every token; the MoE output's all-reduce adds the ranks' parts."""
    local = owner[indices]
    return torch.where(local >= 0, weights, torch.zeros_like(weights)), local


@local_experts.infer
def _(weights, indices, owner):
    require(weights.shape == indices.shape, "local_experts: routing weights and indices shapes differ",
            found=(list(weights.shape), list(indices.shape)))
    require(indices.dtype == "i64" and owner.dtype == "i64" and owner.rank == 1,
            "local_experts: indices and the owner table must be i64, the table [n_experts]",
            found=(indices.dtype, str(owner)))
    return weights, indices


def owner_table(n_experts: int, parts: int, part: int) -> torch.Tensor:
    """`owner` of `local_experts` for the rank holding experts `[part * E / parts, (part + 1) * E / parts)`."""
    per = n_experts // parts
    e = torch.arange(n_experts, dtype=torch.int64) - part * per
    return torch.where((e >= 0) & (e < per), e, torch.full_like(e, -1))



# ---- data parallel (`partition{dp}`): the tokens of every rank to the experts and the results back ----------
# Both move along the first axis (a batch of sequences): the layout NCCL / RCCL / gloo gather and scatter
# contiguous buffers in, so neither needs a copy around the call. `tp` > 1 (data parallel with tensor-parallel
# attention, `--dp D --tp T --ep D*T`): the group's ranks come in replicas of `tp` consecutive ranks that hold
# the same rows; the gather keeps each replica's rows once (its first rank's: a static choice, the copies are
# equal bit for bit), and each rank of a replica gets the replica's part of the sum.

def _replica_ranks(ranks: list[int], tp: int, op: str) -> list[int]:
    if tp < 1 or len(ranks) % tp:
        raise IRError(f"{op}: replicas of {tp} ranks in a group of {len(ranks)}", expected="tp dividing the group")
    return ranks[::tp]


@defop("all_gather_rows(x) -> y", attrs={"group": int, "tp": (int, 1)}, kernel="collective")
def all_gather_rows(x, *, group, tp=1):
    """The group's values concatenated along the first axis in rank order (every rank gets all of them);
    with `tp` > 1 the first rank's of each replica of `tp` ranks only."""
    _one_rank("all_gather_rows", group)
    return x.clone()


@all_gather_rows.infer
def _(x, *, group, tp=1):
    _require_group("all_gather_rows", group, tp)
    require(x.rank >= 1, "all_gather_rows needs at least one axis", found=x)
    return x.with_shape(x.shape[0] * group // tp, *x.shape[1:])


@all_gather_rows.spmd
def _(per_rank, attrs):
    out: list = [None] * len(per_rank)
    for ranks in _groups(per_rank, attrs["group"], "all_gather_rows"):
        whole = torch.cat([per_rank[r][0] for r in _replica_ranks(ranks, attrs.get("tp", 1), "all_gather_rows")], dim=0)
        for r in ranks:
            out[r] = [whole.clone()]
    return out


@all_gather_rows.cost
def _(operands, results, attrs):
    # a ring all-gather: a rank sends its part and receives the (n - 1) others (with tp > 1 the whole group's
    # parts still travel: the duplicates are dropped after the call)
    b = operands[0].nbytes
    return Cost(0, b * attrs["group"], b * attrs["group"])


@defop("reduce_scatter_rows(x) -> y", attrs={"group": int, "tp": (int, 1)}, kernel="collective")
def reduce_scatter_rows(x, *, group, tp=1):
    """The sum of `x` over the ranks of the group (in rank order, in the value's dtype), of which the k-th rank
    of the group keeps the k-th of `group` equal parts along the first axis; with `tp` > 1, the k-th rank keeps
    part k // tp of group / tp (every rank of a replica its replica's rows)."""
    _one_rank("reduce_scatter_rows", group)
    return x.clone()


@reduce_scatter_rows.infer
def _(x, *, group, tp=1):
    _require_group("reduce_scatter_rows", group, tp)
    require(x.dtype in ("fp32", "bf16"), "reduce_scatter_rows sums floating-point values", found=x.dtype)
    parts = group // tp
    require(x.rank >= 1 and x.shape[0] % parts == 0, "reduce_scatter_rows: the first axis must split into "
            "one equal part per rank (per replica with tp)", found=(list(x.shape), group, tp))
    return x.with_shape(x.shape[0] // parts, *x.shape[1:])


@reduce_scatter_rows.spmd
def _(per_rank, attrs):
    out: list = [None] * len(per_rank)
    tp = attrs.get("tp", 1)
    for ranks in _groups(per_rank, attrs["group"], "reduce_scatter_rows"):
        parts = _rank_sum(per_rank, ranks).chunk(len(_replica_ranks(ranks, tp, "reduce_scatter_rows")), dim=0)
        for k, r in enumerate(ranks):
            out[r] = [parts[k // tp].clone()]
    return out


@reduce_scatter_rows.cost
def _(operands, results, attrs):
    # a ring reduce-scatter: (n - 1) / n of the value sent and received, (n - 1) / n of it added; with tp > 1
    # as one of the value repeated for each rank of a replica (what the ranks' identical parts cost)
    n, b = attrs["group"], operands[0].nbytes * attrs["tp"]
    moved = (n - 1) * b // n
    return Cost(operands[0].numel * attrs["tp"] * (n - 1) // n, b + moved, b // n + moved)


def _rows_oneshot(base):
    """`base` (one replica a rank: tp 1) as one kernel launch over symmetric
    peer memory (codegen/kernels/allreduce.py `rows_call`; what `passes/oneshot_allreduce.py` lowers a GPU
    program's rows collectives within one node to): the same result bit for bit (the reduce-scatter's sum in rank
    order). `region_bytes`: the largest value the module's one-shot collectives put in the region (here the
    gathered value), which sizes every rank's symmetric region."""
    name = base.name + "_oneshot"

    def ref(x, *, group, region_bytes):
        _one_rank(name, group)
        return x.clone()

    ref.__doc__ = _rows_oneshot.__doc__.replace("`base`", f"`{base.name}`")
    op = defop(f"{name}(x) -> y", attrs={"group": int, "region_bytes": int}, kernel="allreduce")(ref)

    @op.infer
    def _(x, *, group, region_bytes):
        y = base._infer(x, group=group)
        whole = max(x.nbytes, y.nbytes)
        require(x.dtype in ("fp32", "bf16"), f"{name} moves floating-point values", found=x.dtype)
        require(0 < whole <= region_bytes, f"{name}: the gathered value must fit the region",
                found=(whole, region_bytes))
        return y

    @op.spmd
    def _(per_rank, attrs):
        return base.spmd_ref(per_rank, {"group": attrs["group"]})

    @op.cost
    def _(operands, results, attrs):
        # the ideal of what it computes: the ring's (the least a rank moves); the one-shot's own time is the
        # parallel model's (codegen/parallel_model.py)
        return base._cost(operands, results, {"group": attrs["group"], "tp": 1})

    return op


all_gather_rows_oneshot = _rows_oneshot(all_gather_rows)
reduce_scatter_rows_oneshot = _rows_oneshot(reduce_scatter_rows)
