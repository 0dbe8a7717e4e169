"""torch.distributed for a partitioned program: the process group `torchrun` describes, the groups of the
layout, the collectives between ONNX segments (gloo on CPU), and the lockstep of the ranks' sessions.

    ranks = join(layout, timeout_s)      # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment
    y = ranks.all_reduce(x, group=2)     # sum over this rank's group of 2 consecutive ranks
    inputs = ranks.step(f, fname, inputs)  # rank 0's step (function and inputs), on every rank
    outs = ranks.replicas(outs)          # data parallel: every replica's logits, on every rank
    toks = ranks.share_ids(toks)         # rank 0's sampled ids, on every rank
    data = ranks.share_bytes(data)       # rank 0's bytes (a server's tick: `lockstep.py`), on every rank

Every rank runs the same session calls; rank 0 owns the scheduler and sampling: each step's function and
inputs and each sampled id come from it (a rank whose own step differs, from other prompts or arguments,
is an InputError rather than a silent divergence). Data parallel (`dp` > 1): a step's inputs hold one
entry per replica along a new first axis (every rank keeps every replica's books, `session.Session`); each
rank runs its own replica's (`ParallelLayout.replica`), and the logits of every replica come back to every
rank (one all-gather), so the sampling goes on as before. Every collective has the process group's timeout
(`timeout_s`, default `V4COMPILE_DIST_TIMEOUT` seconds from the environment, else DEFAULT_TIMEOUT_S), so
a rank that dies or never arrives ends the others with one DeviceError in bounded time instead of a hang.
A world size other than the layout's is one InputError.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch

from v4compile.errors import RANKS_DIVERGED, DeviceError, InputError
from v4compile.parallel import ParallelLayout

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 120
TIMEOUT_ENV = "V4COMPILE_DIST_TIMEOUT"
STEP_INPUTS = ("ids", "pos", "block_table", "slot")  # what a session step sends (`backend.py`)


def _first(e: BaseException) -> str:
    """The first line of torch.distributed's message (gloo's run to pages of C++ context)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not 0 < t <= 86400:
        raise InputError(f"{TIMEOUT_ENV} must be seconds in (0, 86400]", found=raw[:40])
    return t


class Ranks:
    """This process's place in the layout, and one gloo group per consecutive block of each group size."""

    def __init__(self, layout: ParallelLayout, owns: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist

        self.dist = dist
        self.owns = owns  # whether `close` ends the process group (not when the caller had joined it)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = layout
        self.groups: dict[int, object] = {}
        for size in sorted({layout.tp, layout.ep} | ({layout.world} if layout.dp > 1 else set())):
            for start in range(0, self.world, size):  # every rank creates every group, in the same order
                # the timeout again: a new group's default is torch's 30 minutes, not the process group's
                g = dist.new_group(list(range(start, start + size)), backend="gloo",
                                   timeout=timedelta(seconds=timeout_s))
                if start <= self.rank < start + size:
                    self.groups[size] = g

    def _do(self, what: str, fn, *a, **kw) -> None:
        """A torch.distributed call; its failure (a peer gone, the timeout) is one DeviceError."""
        try:
            fn(*a, **kw)
        except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ..."
            raise DeviceError(f"rank {self.rank}: {what} failed (a rank died or did not arrive): {_first(e)}") from None

    def all_reduce(self, x: np.ndarray, group: int) -> np.ndarray:
        return self.collective_np("all_reduce", x, group)

    def exchange(self, group: int, blob: bytes) -> tuple[list[bytes], int]:
        """Every rank of this rank's group of `group` ranks contributes `blob` (all of one length): theirs in rank
        order, and this rank's index among them (the one-shot all-reduce's IPC handles: uint8 tensors, no pickle)."""
        if group not in self.groups:
            raise InputError("an exchange over a group size the layout does not have", expected=sorted(self.groups),
                             found=group)
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(group)]
        self._do("exchanging the one-shot all-reduce's handles", self.dist.all_gather, parts, mine,
                 group=self.groups[group])
        return [bytes(p.numpy().tobytes()) for p in parts], self.rank % group

    def collective_np(self, op: str, x: np.ndarray, group: int, tp: int = 1) -> np.ndarray:
        return self.collective(op, torch.from_numpy(np.ascontiguousarray(x)), group, tp).numpy()

    def collective(self, op: str, x: torch.Tensor, group: int, tp: int = 1) -> torch.Tensor:
        """A collective registry op (`ops/collective.py`) over this rank's group of `group` ranks: a new tensor.
        `tp` (the rows ops): the group's replicas of `tp` ranks holding the same rows (the op's docstring)."""
        if group not in self.groups:
            raise InputError("a collective over a group size the layout does not have", expected=sorted(self.groups),
                             found=group)
        op = op.removesuffix("_oneshot")  # a one-shot's placeholder (the reference kernels mode)
        if op == "all_reduce":
            t = x.contiguous().clone()
            self._do(op, self.dist.all_reduce, t, group=self.groups[group])
            return t
        if op in ("all_gather", "all_gather_rows"):
            parts = [torch.empty_like(x.contiguous()) for _ in range(group)]
            self._do(op, self.dist.all_gather, parts, x.contiguous(), group=self.groups[group])
            return torch.cat(parts if op == "all_gather" else parts[::tp], dim=-1 if op == "all_gather" else 0)
        if op == "reduce_scatter_rows":
            # gloo has no reduce-scatter: the whole sum, of which this rank keeps its part (the bytes of an
            # all-reduce on the host and cpu devices; NCCL / RCCL run a reduce-scatter)
            t = x.contiguous().clone()
            self._do(op, self.dist.all_reduce, t, group=self.groups[group])
            return t.chunk(group // tp, dim=0)[self.rank % group // tp].clone()
        raise InputError(f"no collective '{op}'", expected="all_reduce, all_gather, all_gather_rows, "
                         "reduce_scatter_rows")

    def broadcast(self, x: np.ndarray, src: int = 0) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(x)).clone()
        self._do("broadcast", self.dist.broadcast, t, src)
        return t.numpy()

    def step(self, index: int, fname: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rank 0's step (function `index` and its step inputs) on every rank: the one each rank runs."""
        mine = np.concatenate([np.asarray([index], dtype=np.int64)] +
                              [np.asarray(inputs[n]).astype(np.int64).reshape(-1) for n in STEP_INPUTS])
        head = self.broadcast(np.asarray([index, mine.size], dtype=np.int64))
        if tuple(head) != (index, mine.size):
            raise InputError(f"rank {self.rank} runs another function than rank 0 (every rank must make the same "
                             "session calls: the same prompts and arguments)", expected=f"function #{head[0]}",
                             found=fname, code=RANKS_DIVERGED)
        got = self.broadcast(mine)
        if not np.array_equal(got, mine):
            raise InputError(f"rank {self.rank}'s step inputs differ from rank 0's (every rank must make the same "
                             "session calls: the same prompts and arguments)", where=fname, code=RANKS_DIVERGED)
        out, at = {}, 1
        for n in STEP_INPUTS:
            a = np.asarray(inputs[n])
            out[n] = got[at: at + a.size].reshape(a.shape).astype(a.dtype)
            at += a.size
        # the other inputs (a draft's hidden streams) every rank computed alike from the step outputs it has: its own
        out.update({n: np.asarray(a) for n, a in inputs.items() if n not in STEP_INPUTS})
        if self.layout.dp > 1:  # one entry per replica: this rank's
            d = self.layout.replica(self.rank)
            if any(a.shape[:1] != (self.layout.dp,) for a in out.values()):
                raise InputError("a data-parallel step needs one entry per replica", expected=self.layout.dp,
                                 found=out["ids"].shape[:1], where=fname)
            out = {n: np.ascontiguousarray(a[d]) for n, a in out.items()}
        return out

    def replicas(self, outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A step's outputs with those of every replica, `[dp, B, ...]` (data parallel: the logits, and a
        speculative step's final `streams`, which the next draft reads; each replica's from its first rank, one
        all-gather over the world each); as they are otherwise."""
        if self.layout.dp == 1:
            return outs
        out = {}
        for name in ("logits", "streams"):
            if name not in outs:
                continue
            x = torch.from_numpy(np.ascontiguousarray(outs[name]))
            parts = [torch.empty_like(x) for _ in range(self.world)]
            self._do(f"the all-gather of the {name}", self.dist.all_gather, parts, x)
            out[name] = torch.stack(parts[::self.layout.tp]).numpy()
        return out

    def comm_ids(self, unique_id) -> dict[int, bytes]:
        """This rank's communicator unique ids, one per group size (the GPU runtime's NCCL / RCCL, issue 18):
        the first rank of each group makes it (`unique_id()`) and puts it in torch.distributed's store; the
        others wait for it there (within the process group's timeout). It returns once every rank has its ids,
        as NCCL's communicator init does: the store lives in rank 0, which may otherwise finish (its NCCL
        a stand-in that waits for no peer) and take the store with it while another rank still reads."""
        from torch.distributed.distributed_c10d import _get_default_store

        store, out = _get_default_store(), {}
        for size in sorted(self.groups):
            key = f"v4compile/comm/{size}/{self.rank // size}"
            if self.rank % size == 0:
                store.set(key, unique_id())
            try:
                out[size] = bytes(store.get(key))
            except RuntimeError as e:
                raise DeviceError(f"rank {self.rank}: the communicator id of its group never came: {_first(e)}") \
                    from None
        self._do("the barrier after the communicator ids", self.dist.barrier)
        return out

    def share_ids(self, ids: list[int]) -> list[int]:
        """Rank 0's sampled ids, on every rank."""
        return [int(t) for t in self.broadcast(np.asarray(ids, dtype=np.int64))]

    def share_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0's `data` on every rank (the other ranks pass None); None on every rank when rank 0 passes
        None. Two broadcasts: the size (-1: None), then the bytes if there are any."""
        size = -1 if data is None else len(data)
        size = int(self.broadcast(np.asarray([size], dtype=np.int64))[0])
        if size <= 0:
            return None if size < 0 else b""
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == 0 else np.zeros(size, dtype=np.uint8)
        return self.broadcast(buf).tobytes()

    def close(self) -> None:
        if self.owns and self.dist.is_initialized():
            self.dist.destroy_process_group()


def join(layout: ParallelLayout, timeout_s: float | None = None) -> Ranks:
    """Join the process group of the standard environment (torchrun's) with gloo; check its size."""
    import torch.distributed as dist

    timeout_s = timeout_from_env() if timeout_s is None else timeout_s

    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise InputError(f"a partitioned program ({layout.world} ranks) runs under torchrun",
                         expected=f"torchrun --nproc-per-node {layout.world} ...", found=f"no {', '.join(missing)}")
    world = int(os.environ["WORLD_SIZE"]) if os.environ["WORLD_SIZE"].isdigit() else -1
    if dist.is_initialized():
        world = dist.get_world_size()
    if world != layout.world:
        raise InputError("the world size differs from the program's", expected=f"{layout.world} ranks "
                         f"(dp {layout.dp}, tp {layout.tp}, ep {layout.ep})", found=f"WORLD_SIZE {world}")
    owns = not dist.is_initialized()
    if owns:
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # the store: a rank that never arrives, a bad address
            raise DeviceError(f"rank {os.environ['RANK']}: joining the process group failed: {_first(e)}") from None
    try:
        return Ranks(layout, owns, timeout_s)
    except RuntimeError as e:  # new_group is itself a collective over the store
        raise DeviceError(f"rank {os.environ['RANK']}: creating the process groups failed: {_first(e)}") from None


def run_segment(sess, env: dict[str, np.ndarray], state: dict[str, np.ndarray],
                weights: dict[str, np.ndarray]) -> None:
    """One ONNX segment of one rank (`codegen/onnx_segments.py`): inputs from `env` (step inputs, earlier
    segments' and collectives' values), `state` or `weights` (with its derived weights, `add_derived`); the
    rows it writes go into `state` (the cpu backend's rule), its other outputs into `env`."""
    names = [o.name for o in sess.get_outputs()]
    add_derived(sess, weights)
    feed = {i.name: env[i.name] if i.name in env else state[i.name] if i.name in state else weights[i.name]
            for i in sess.get_inputs()}
    res = dict(zip(names, sess.run(names, feed)))
    for n, a in res.items():
        if n.endswith(".rows"):
            base = n[: -len(".rows")]
            ok = a >= 0
            state[base][a[ok]] = res[base + ".vals"][ok]
        elif not n.endswith(".vals"):
            env[n] = a


def add_derived(sess, weights: dict[str, np.ndarray]) -> None:
    """The segment's derived weight inputs (an expert of a stacked weight, a weight as fp32:
    `codegen/onnx_weights.py`, listed in the model's metadata), built from the rank's stored weights once
    and kept in `weights` for the segments after it."""
    import json

    from v4compile.codegen.onnx.graph import DERIVED_KEY
    from v4compile.codegen.onnx_weights import materialise

    derived = json.loads(sess.get_modelmeta().custom_metadata_map.get(DERIVED_KEY, "{}"))
    for name, d in sorted(derived.items()):
        if name in weights:
            continue
        missing = [n for n in (d["of"], d["scale"]) if n is not None and n not in weights]
        if missing:
            raise InputError(f"derived weight '{name}' is built from a weight this rank does not hold",
                             found=missing[0])
        weights[name] = materialise(d, lambda n: torch.from_numpy(weights[n]))
