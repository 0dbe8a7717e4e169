"""`v4compile.load(dir, device=...)`: a session over a compiled artifact, independent of the device.

The session does the host side of serving: per-sequence slots and KV-pool blocks (allocated when a
sequence joins, freed when it finishes), chunked prefill (batch 1, the smallest chunk bucket that holds
the rest of the prompt), decode steps over any set of live sequences (the smallest batch bucket that
holds them; padding lanes have pos = -1 and slot = -1 and write nothing) and sampling. `generate` submits
its prompts to the one generation loop (`batcher.Batcher`: admission, prefill, decode or speculative
steps, sampling, stopping; the server and `run --prompt` step through the same loop) and runs it until
idle. The device work is one call: `backend.run(function, step inputs)` (see `backend.py`).

Threads: every public call that touches the sequences, the pool or the backend holds the session's lock
(`Session.lock`, reentrant), so calls from several threads run one at a time, each as it would alone; a
`generate` holds it to its end (its prompts are not batched with another thread's).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from v4compile.artifact import Artifact, load_artifact
from v4compile.errors import CONTEXT_LENGTH_EXCEEDED, DeviceError, InputError
from v4compile.pool import Allocator

from .prefix_cache import DEFAULT_SNAPSHOT_BYTES, PrefixCache, granularity, whole_blocks
from v4compile.threads import MAX_THREADS

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "host", "hip", "cuda")
MAX_PROMPTS = 1 << 20
MAX_IDS = 1 << 24  # ids in one prompt (far beyond any compiled context)


def is_int(v) -> bool:
    """A Python or numpy integer (never a bool, a float or a string)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def check_ids(ids, where: str) -> list[int]:
    """A list of token ids: a list, tuple or 1-D integer array of integers (a float, a string, None or a
    nested list is refused, never truncated or iterated)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise InputError("token ids must be a 1-D integer array", where=where,
                             found=f"{ids.ndim}-D {ids.dtype}")
        ids = ids.tolist()
    elif not isinstance(ids, (list, tuple)):
        raise InputError("token ids must be a list of integers", where=where, found=type(ids).__name__)
    if len(ids) > MAX_IDS:
        raise InputError("too many token ids", where=where, expected=f"<= {MAX_IDS}", found=len(ids))
    bad = next((t for t in ids if not is_int(t)), None)
    if bad is not None or any(t is None for t in ids):
        raise InputError("token ids must be integers", where=where, found=repr(bad)[:40])
    return [int(t) for t in ids]


def check_prompts(prompts, where: str = "prompts") -> list:
    """A list of prompts, each a list of ids (a flat list of ids is refused: it is one prompt, not many)."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2:
            raise InputError("prompts must be a list of id lists (or a 2-D integer array)", where=where,
                             found=f"{prompts.ndim}-D array")
        return list(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise InputError("prompts must be a list of id lists", where=where, found=type(prompts).__name__)
    if len(prompts) > MAX_PROMPTS:
        raise InputError("too many prompts", where=where, expected=f"<= {MAX_PROMPTS}", found=len(prompts))
    bad = next((p for p in prompts if not isinstance(p, (list, tuple, np.ndarray))), None)
    if bad is not None or any(p is None for p in prompts):
        raise InputError("prompts must be a list of id lists (one list per prompt)", where=where,
                         found=f"an entry {repr(bad)[:40]}")
    return list(prompts)


def check_sampling(temperature, top_p, seed) -> None:
    """Sampling arguments: finite numbers in range, and a seed in [0, 2^64) (checked also for greedy decoding,
    where it is unused: a bad argument is bad whatever the mode)."""
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise InputError(f"{name} must be a finite number", found=repr(v)[:40], param=name)
    if temperature < 0 or not 0 < top_p <= 1:
        raise InputError("sampling needs temperature >= 0 and 0 < top_p <= 1", found=(temperature, top_p),
                         param="temperature" if temperature < 0 else "top_p")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2 ** 64):
        raise InputError("seed must be an integer in [0, 2^64) or None", found=repr(seed)[:40], param="seed")


def request_seed(seed: int | None, index: int) -> int | None:
    """The seed of prompt `index` of a `generate(..., seed=seed)` call: seed + index (mod 2^64), so prompt 0 of
    a call samples as `run --seed seed` and a server request with that seed do; None stays None (fresh
    entropy for each prompt)."""
    return None if seed is None else (seed + index) % 2 ** 64


def sample(row: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator | None) -> int:
    """One id from one row of logits `[V]`: the argmax at temperature 0, else drawn with `rng` from the
    smallest set of most likely ids whose probability reaches `top_p` (softmax(row / temperature))."""
    if temperature == 0:
        return int(row.argmax())
    # the maximum taken out before the division: a temperature in range but tiny (1e-310) would overflow
    # row / temperature to inf and the softmax to NaN; this way it tends to the argmax, as it should
    p = row.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # -inf after the division is exp's 0, as meant
        p = np.exp((p - p.max()) / temperature)
    total = p.sum()
    if not np.isfinite(total) or total <= 0:  # non-finite logits: no distribution to draw from
        raise DeviceError("the sampling probabilities are not finite (the logits hold inf or NaN)",
                         expected="finite logits", found=f"temperature {temperature:g}, top_p {top_p:g}")
    p /= total
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    keep = order[: int(np.searchsorted(cum, top_p) + 1)]
    q = p[keep] / p[keep].sum()
    return int(keep[rng.choice(len(keep), p=q)])


def serialised(method):
    """The method under the session's lock (see the module's docstring: threads)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


def check_threads(threads) -> None:
    if threads is not None and (not is_int(threads) or not 1 <= threads <= MAX_THREADS):
        raise InputError("threads must be an integer in [1, %d] (or None: the default)" % MAX_THREADS,
                         found=repr(threads)[:40])


@dataclass
class SeqState:
    """One live sequence: its slot, its pool blocks and how many tokens the pool holds for it."""

    id: int
    slot: int
    length: int = 0
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens its first prefill took from the prefix cache
    replica: int = 0  # a data-parallel artifact's replica holding it (its ranks' pool and state)


class Session:
    def __init__(self, art: Artifact, backend, prefix_cache: bool = True,
                 prefix_cache_bytes: int = DEFAULT_SNAPSHOT_BYTES):
        self.art = art
        self.backend = backend
        m = art.manifest
        pool = m["pool"]
        self.vocab = int(m["vocab_size"])
        self.max_context = int(m["max_context"])
        self.block_tokens = int(pool["block_tokens"])
        self.blocks_per_seq = int(pool["blocks_per_seq"])
        fns = backend.functions()
        self.decode_fns = sorted((f.batch, f.name) for f in fns.values() if f.kind == "decode")
        self.prefill_fns = sorted((f.tokens, f.name) for f in fns.values() if f.kind == "prefill")
        if not self.decode_fns or not self.prefill_fns:
            raise InputError("the artifact needs decode and prefill functions", where=str(art.path))
        # Data parallel (`--dp`): each replica (the tp ranks of rank // tp) owns its sequences' slots and blocks
        # in its own pool, of the compiled geometry; every rank keeps every replica's books (each makes the
        # same calls), and runs its own replica's part of each step.
        self.dp = int(m.get("parallel", {}).get("dp", 1))
        self.allocs = [Allocator(int(pool["n_slots"]), int(pool["n_blocks"])) for _ in range(self.dp)]
        self._n_slots = int(pool["n_slots"])
        self.placed = [0] * self.dp  # sequences opened on each replica so far (the server's /health shows it)
        self.seqs: dict[int, SeqState] = {}
        self._next = 0
        self.first_token_s: float | None = None  # the last `generate`: seconds to its first token (prefill)
        self._tokenizer = None  # read on first use (`tokenizer`)
        self.last_acceptance = None  # the last speculative `generate`'s `speculation.Acceptance`
        self.spec_auto: dict = {}  # draft_tokens "auto"'s step costs and running acceptance (`spec_auto.py`)
        self.last_cached_tokens: list[int] = []  # the last `generate`: each prompt's tokens from the prefix cache
        self.lock = threading.RLock()  # held by every public call that changes sequences, pool or backend
        self.device = getattr(backend, "device", "cpu")  # what it runs on (the self-check's tolerance reads it)
        # the prefix cache (`prefix_cache.py`; None: off), one per replica: an entry's blocks are in its replica's
        # pool, its snapshot that replica's rings, so a hit is only ever taken inside the replica holding it.
        # Rank-local: every rank keeps every replica's books alike (the same calls), and only the ranks of a
        # replica hold its snapshots' bytes (`_replica_copies`).
        g = granularity(self.block_tokens, self.prefill_fns[-1][0])
        self.caches: list[PrefixCache | None] = [PrefixCache(g, prefix_cache_bytes) if prefix_cache else None
                                                 for _ in range(self.dp)]

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache of replica 0 (the cache, without data parallelism); None: off."""
        return self.caches[0]

    @cache.setter
    def cache(self, c: PrefixCache | None) -> None:
        """Set replica 0's cache (None: every replica's off)."""
        self.caches = [None] * self.dp if c is None else [c] + [
            x if x is not None else PrefixCache(c.g, c.max_bytes) for x in self.caches[1:]]

    @property
    def alloc(self) -> Allocator:
        """Replica 0's allocator (the only one without data parallelism)."""
        return self.allocs[0]

    @property
    def free_slots(self) -> list[int]:
        """Free slots (of every replica, data parallel: replica d's slot s as d * n_slots + s)."""
        if self.dp == 1:
            return self.alloc.free_slots
        n = self._n_slots
        return [d * n + s for d, a in enumerate(self.allocs) for s in a.free_slots if self._room(d)]

    @property
    def free_blocks(self) -> list[int]:
        return [b for a in self.allocs for b in a.free_blocks]

    @property
    def ranks(self):
        """This process's rank of a partitioned artifact (`distributed.Ranks`), or None."""
        return getattr(self.backend, "ranks", None)

    @property
    def max_batch(self) -> int:
        """The largest decode bucket: the live sequences of one replica."""
        return self.decode_fns[-1][0]

    @property
    def max_live(self) -> int:
        """Live sequences at once: a decode bucket on each replica."""
        return self.max_batch * self.dp

    def _room(self, d: int) -> bool:
        return sum(1 for s in self.seqs.values() if s.replica == d) < self.max_batch

    def place(self, prompt: Sequence[int] | None = None) -> int:
        """The replica a new sequence goes to (data parallel), among those with a free slot and room in their
        largest decode bucket: the one whose prefix cache holds the longest prefix of `prompt` (a hit is only
        taken inside the replica holding it, so it saves that replica the prefix's prefill), then the least
        loaded (the fewest live sequences, then the most free pool blocks), then the lowest index. -1: none."""
        live = [sum(1 for s in self.seqs.values() if s.replica == d) for d in range(self.dp)]
        ok = [d for d in range(self.dp) if self.allocs[d].free_slots and live[d] < self.max_batch]
        hit = {d: self.caches[d].peek(list(prompt)) if prompt is not None and self.caches[d] is not None else 0
               for d in ok}
        return min(ok, key=lambda d: (-hit[d], live[d], -len(self.allocs[d].free_blocks), d)) if ok else -1

    @property
    def tokenizer(self):
        """The artifact's tokenizer (`v4compile.tokenizer.Tokenizer`: encode, decode, stream, chat template,
        eos ids), or None when the checkpoint compiled had none. Read on first use, hash-checked."""
        entry = self.art.manifest.get("tokenizer")
        if entry is None:
            return None
        if self._tokenizer is None:
            from v4compile.errors import ArtifactError
            from v4compile.tokenizer import MAX_TOKENIZER_BYTES, Tokenizer

            data = {k: self.art.read_bytes(rel, f"tokenizer {k}", MAX_TOKENIZER_BYTES) for k, rel in entry.items()}
            self._tokenizer = Tokenizer.from_bytes(data["json"], data.get("config"), str(self.art.path), ArtifactError)
            if self._tokenizer.vocab_size > self.vocab:
                raise ArtifactError("the tokenizer has more ids than the model's vocabulary", where=str(self.art.path),
                                    expected=f"<= {self.vocab}", found=self._tokenizer.vocab_size)
        return self._tokenizer

    # ---- sequences -------------------------------------------------------------------------------
    def check_prompt(self, ids: Sequence[int], where: str) -> list[int]:
        ids = check_ids(ids, where)
        if not ids:
            raise InputError("empty prompt", where=where, expected="at least one token id", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise InputError("token id outside the vocabulary", where=where, expected=f"0 <= id < {self.vocab}",
                             found=bad[0], param="prompt")
        return ids

    @serialised
    def reserve(self, s: SeqState, last_pos: int) -> None:
        """Pool blocks for `s` up to position `last_pos` (one clear error beyond the context or a full pool)."""
        if last_pos >= self.max_context:
            raise InputError("context beyond the compiled maximum", where=f"sequence {s.id}",
                             expected=f"<= {self.max_context} tokens", found=last_pos + 1)
        need = last_pos // self.block_tokens + 1
        alloc = self.allocs[s.replica]
        while not alloc.grow(s.blocks, need):
            # the cache's unused blocks go back before the pool is declared full (LRU leaves first)
            cache = self.caches[s.replica]
            freed = cache.evict_for_blocks() if cache is not None else []
            if not freed:
                raise InputError("the KV pool is full", where=f"sequence {s.id}")
            alloc.free_blocks.extend(freed)

    @serialised
    def open(self, prompt: Sequence[int] | None = None) -> SeqState:
        """A new sequence (`prompt`, if given: the prompt it will take, which may choose its replica: `place`)."""
        d = self.place(prompt) if self.dp > 1 else 0
        slot = self.allocs[d].slot() if d >= 0 else None
        if slot is None:
            raise InputError("no free sequence slot", expected=f"<= {self.max_live} live sequences")
        s = SeqState(self._next, slot, replica=d)
        self.placed[d] += 1
        self._next += 1
        self.seqs[s.id] = s
        return s

    def _live(self, s, where: str) -> SeqState:
        if not isinstance(s, SeqState):
            raise InputError("not a sequence of this session", where=where, found=type(s).__name__)
        if self.seqs.get(s.id) is not s:
            raise InputError("the sequence was released (or belongs to another session)", where=where,
                             found=f"sequence {s.id}")
        return s

    @serialised
    def release(self, s: SeqState) -> None:
        if not isinstance(s, SeqState):
            raise InputError("not a sequence of this session", where="release", found=type(s).__name__)
        if self.seqs.get(s.id) is s:
            del self.seqs[s.id]
            # blocks the prefix cache also holds stay until their last holder lets go
            cache = self.caches[s.replica]
            free = [b for b in s.blocks if cache is None or cache.drop(b)]
            self.allocs[s.replica].release(s.slot, free)
            s.blocks = []

    def table(self, seqs: Sequence[SeqState | None], B: int) -> tuple[np.ndarray, np.ndarray]:
        """The step inputs `block_table` [B, blocks_per_seq] and `slot` [B] of `seqs` (lanes past them, or
        None: padding, -1)."""
        table, slot = np.empty((B, self.blocks_per_seq), dtype=np.int32), np.empty((B,), dtype=np.int32)
        self.fill_table(seqs, table, slot)
        return table, slot

    @staticmethod
    def fill_table(seqs: Sequence[SeqState | None], table: np.ndarray, slot: np.ndarray) -> None:
        """`table`'s step inputs written into arrays of those shapes (`table`'s own, or a backend's,
        `OrtBackend.step_inputs`): every lane; one write an array (a numpy write per lane costs more)."""
        B, W = table.shape
        pad = [-1] * W
        table[...] = [pad if s is None else s.blocks + pad[len(s.blocks):] for s in seqs] + [pad] * (B - len(seqs))
        slot[...] = [-1 if s is None else s.slot for s in seqs] + [-1] * (B - len(seqs))

    # ---- steps -----------------------------------------------------------------------------------
    @serialised
    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[list[SeqState], np.ndarray]:
        """Open one sequence per prompt and run its prompt through chunked prefill. Returns the sequences
        and the logits after each prompt's last token `[n, V]`."""
        prompts = [self.check_prompt(p, f"prompt {i}") for i, p in enumerate(check_prompts(prompts))]
        for i, p in enumerate(prompts):
            if len(p) > self.max_context:
                raise InputError("prompt longer than the compiled maximum context", where=f"prompt {i}",
                                 expected=f"<= {self.max_context} tokens", found=len(p))
        if len(prompts) > len(self.free_slots):
            raise InputError("more prompts than free sequence slots", expected=f"<= {len(self.free_slots)}",
                             found=len(prompts))
        seqs, out = [], []
        for p in prompts:
            s = self.open(p)
            seqs.append(s)
            out.append(self.extend(s, p))
        return seqs, np.stack(out)

    @serialised
    def extend(self, s: SeqState, ids: Sequence[int]) -> np.ndarray:
        """Append tokens to a sequence through prefill chunks; logits after the last one `[V]`."""
        s = self._live(s, "extend")
        return self.prefill_into(s, self.check_prompt(ids, f"sequence {s.id}"))

    def prefill_into(self, s: SeqState, ids: list[int], run=None) -> np.ndarray:
        """`extend` of checked ids. `run(s, function, step inputs, n, ids left) -> logits [V]`: runs each chunk
        in the caller's way (the compiled MTP block's prefill, `speculative.py`, which runs the block over the
        chunk too); a new sequence's prompt goes through the prefix cache either way."""
        if self.caches[s.replica] is not None and s.length == 0:
            return self._extend_cached(s, ids, run)
        last = None
        while ids:
            last, ids = self._prefill_step(s, ids, run)
        return last

    def _prefill_step(self, s: SeqState, ids: list[int], run=None) -> tuple[np.ndarray, list[int]]:
        """One prefill chunk of `ids` into `s` (`run`: as `prefill_into`'s): its last logits `[V]`, the ids left."""
        fname, inputs, n = self.prefill_chunk(s, ids)
        last = (run(s, fname, inputs, n, ids) if run is not None
                else self._run(fname, [(s.replica, inputs)])[s.replica][0])
        s.length += n
        return last, ids[n:]

    # ---- prefix cache ----------------------------------------------------------------------------
    def _extend_cached(self, s: SeqState, prompt: list[int], run=None) -> np.ndarray:
        """A new sequence's prompt through the prefix cache: the longest cached prefix taken by reference (its
        boundary snapshot restored into the slot), the rest prefilled in chunks cut at the cache's pieces, each
        new piece of the prompt kept (`prefix_cache.py`). `run`: as `prefill_into`'s; with it (the compiled MTP
        block's prefill) the entries are keyed on each piece's next token too (`look`)."""
        cache, bt = self.caches[s.replica], self.block_tokens
        g = cache.g
        look = int(run is not None)
        hit = cache.lookup(prompt, look)
        parent = hit[-1] if hit else None
        if hit:
            P = len(hit) * g
            whole = P // bt
            s.blocks = whole_blocks(hit, whole, g, bt)
            for b in s.blocks:
                cache.hold(b)
            if P % bt:  # the boundary is inside the block: the tail writes it again, so a copy of its own
                self._take_partial(s, hit[-1].blocks[-1], P)
            self._restore(s.slot, parent.snapshot, P, s.replica)
            s.length = s.cached = P
        ids, last, chain = prompt[s.length:], None, True
        while ids:
            last, ids = self._prefill_step(s, ids, run)
            if s.length % g == 0 and chain and s.length + look <= len(prompt):
                # a piece is kept only under its parent, still cached (evictions under pool pressure)
                chain = parent is None or cache.entries.get(parent.key) is parent
                parent = self._keep(s, prompt, parent, look) if chain else None
                chain = parent is not None
        return last

    def _take_partial(self, s: SeqState, block: int, P: int) -> None:
        """The block the boundary P is inside, for `s`: a copy (its rows before P are the prefix's; the tail
        writes the rest, which other sequences sharing the prefix write too)."""
        cache = self.caches[s.replica]
        cache.hold(block)  # not freed by an eviction the reservation makes before it is copied
        try:
            self.reserve(s, P)
            self._copy_block(block, s.blocks[-1], s.replica)
        finally:
            if cache.drop(block):
                self.allocs[s.replica].free_blocks.append(block)
        cache.stats.copies += 1

    def _keep(self, s: SeqState, prompt: list[int], parent, look: int = 0):
        """Keep the piece of `prompt` that ends at `s.length` (just prefilled) with its boundary snapshot (its
        ids: with the `look` tokens after it); the entry (None: not kept, and no later piece of this prompt is
        either)."""
        cache = self.caches[s.replica]
        g = cache.g
        i = s.length // g - 1
        ids = prompt[i * g:s.length + look]
        e = cache.find(parent, ids, look)
        if e is not None:  # another sequence kept it meanwhile
            return e
        blocks = s.blocks[(i * g) // self.block_tokens:(s.length - 1) // self.block_tokens + 1]
        snap = self._snapshot(s.slot, s.length, s.replica)
        if not snap:  # a rank of another replica: the books count the bytes the replica's ranks hold
            from .snapshot import copies

            nbytes = copies(self.backend).nbytes_slot
        e, freed = cache.insert(parent, ids, i, blocks, snap, look, nbytes=None if snap else nbytes)
        self.allocs[s.replica].free_blocks.extend(freed)
        return e

    def _replica_copies(self, replica: int):
        """The copies (`snapshot.py`) of the backend holding `replica`'s pool and rings in this process, or None
        (a data-parallel rank of another replica: it keeps the books, the replica's ranks the bytes)."""
        from .snapshot import copies

        backend = self.backend
        if self.dp > 1:
            if hasattr(backend, "replica"):  # a backend holding every replica in this process (`replica(d)`)
                backend = backend.replica(replica)
            elif self.ranks is None or self.ranks.layout.replica(self.ranks.rank) != replica:
                return None
        return copies(backend)

    def _snapshot(self, slot: int, boundary: int, replica: int = 0) -> dict[str, np.ndarray]:
        """The slot's rings at `boundary` (`snapshot.py`: on the C runtime, copies it issues and the host device
        checks); {} on a rank that does not hold the replica."""
        c = self._replica_copies(replica)
        return {} if c is None else c.save(slot, boundary)

    def _restore(self, slot: int, snap: dict[str, np.ndarray], boundary: int, replica: int = 0) -> None:
        c = self._replica_copies(replica)
        if c is not None:
            c.restore(slot, snap, boundary)

    def _copy_block(self, src: int, dst: int, replica: int = 0) -> None:
        c = self._replica_copies(replica)
        if c is not None:
            c.copy_block(src, dst)

    @serialised
    def clear_prefix_cache(self) -> None:
        """Drop every cache entry; the blocks no live sequence holds go back to the pool."""
        for cache, alloc in zip(self.caches, self.allocs):
            if cache is not None:
                alloc.free_blocks.extend(cache.clear())

    @serialised
    def prefix_cache_stats(self) -> dict | None:
        """The prefix cache's figures (entries, cached blocks, snapshot bytes, hit rates, evictions), or None
        when it is off."""
        from .prefix_cache import merged_summary

        return None if self.cache is None else merged_summary([c for c in self.caches if c is not None])

    @serialised
    def prefill_chunk(self, s: SeqState, ids: list[int]) -> tuple[str, dict[str, np.ndarray], int]:
        """The next prefill chunk of `ids` for `s` (the smallest chunk bucket that holds them, else the largest),
        its blocks reserved: (function, step inputs, tokens it takes). The caller runs it and advances
        `s.length`."""
        T, fname = next(((t, f) for t, f in self.prefill_fns if t >= len(ids)), self.prefill_fns[-1])
        part = ids[:T]
        self.reserve(s, s.length + len(part) - 1)
        x = np.zeros((1, T), dtype=np.int64)
        pos = np.full((1, T), -1, dtype=np.int64)
        x[0, : len(part)] = part
        pos[0, : len(part)] = np.arange(s.length, s.length + len(part))
        table, slot = self.table([s], 1)
        return fname, {"ids": x, "pos": pos, "block_table": table, "slot": slot}, len(part)

    @serialised
    def decode(self, seqs: Sequence[SeqState], tokens: Sequence[int]) -> np.ndarray:
        """One token for each of the given live sequences; their next-token logits `[n, V]`."""
        if not isinstance(seqs, (list, tuple)):
            raise InputError("decode needs a list of sequences", found=type(seqs).__name__)
        seqs = [self._live(s, "decode") for s in seqs]
        if len({s.id for s in seqs}) != len(seqs):
            raise InputError("decode names a sequence twice")
        tokens = check_ids(tokens, "decode tokens")
        n = len(seqs)
        if n != len(tokens) or n == 0:
            raise InputError("decode needs one token per sequence", expected=n, found=len(tokens))
        if n > self.max_live or any(sum(1 for s in seqs if s.replica == d) > self.max_batch for d in range(self.dp)):
            raise InputError("more sequences than the largest decode bucket", expected=f"<= {self.max_batch}"
                             + (f" on each of {self.dp} replicas" if self.dp > 1 else ""), found=n)
        toks = self.check_prompt(tokens, "decode tokens")
        lanes = [[i for i, s in enumerate(seqs) if s.replica == d] for d in range(self.dp)]
        B, fname = next((b, f) for b, f in self.decode_fns if b >= max(map(len, lanes)))
        for s in seqs:
            self.reserve(s, s.length)
        steps = []
        for d, mine in enumerate(lanes):
            x = np.zeros((B, 1), dtype=np.int64)
            pos = np.full((B, 1), -1, dtype=np.int64)
            x[: len(mine), 0] = [toks[i] for i in mine]
            pos[: len(mine), 0] = [seqs[i].length for i in mine]
            table, slot = self.table([seqs[i] for i in mine], B)
            steps.append((d, {"ids": x, "pos": pos, "block_table": table, "slot": slot}))
        out = self._run(fname, steps)
        if self.dp == 1:  # the backend's own array (the caller keeps it: no copy of [n, vocab] a step)
            logits = out[0][:n]
        else:
            logits = np.empty((n, out[0].shape[-1]), dtype=out[0].dtype)
            for d, mine in enumerate(lanes):
                for b, i in enumerate(mine):
                    logits[i] = out[d][b]
        for s in seqs:
            s.length += 1
        return logits

    def _run(self, fname: str, steps: list[tuple[int, dict[str, np.ndarray]]]) -> list[np.ndarray]:
        """One step of `fname`: each (replica, step inputs) of `steps`; logits per replica. Data parallel:
        every replica runs the step (the collectives need every rank), one without inputs here on padding
        lanes only (pos -1, slot -1: it writes nothing)."""
        if self.dp == 1:
            (_, inputs), = steps
            return [self.backend.run(fname, inputs)]
        return list(self.backend.run(fname, self._stacked(steps)))

    def _stacked(self, steps: list[tuple[int, dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
        """A data-parallel step's inputs: one entry per replica along a new first axis, padding for a replica
        `steps` has no inputs for."""
        given = dict(steps)
        pad = _padding(next(iter(given.values())))
        return {k: np.stack([given.get(d, pad)[k] for d in range(self.dp)]) for k in pad}

    @property
    def replica(self) -> int:
        """The replica whose pool and state this process holds (its rank's, data parallel; else 0): the rows an
        undo may save and restore are its sequences' only."""
        r = self.ranks
        return r.layout.replica(r.rank) if r is not None and self.dp > 1 else 0

    def lanes(self, seqs: Sequence[SeqState]) -> int:
        """The lanes a step over `seqs` needs in each replica's batch (the bucket to pick holds that many)."""
        return max((sum(1 for s in seqs if s.replica == d) for d in range(self.dp)), default=0)

    def run_on(self, replica: int, fname: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output (`backend.run_outputs`) of one replica's step (data parallel: the others pad)."""
        if self.dp == 1:
            return self.backend.run_outputs(fname, inputs)
        return {k: v[replica] for k, v in self.backend.run_outputs(fname, self._stacked([(replica, inputs)])).items()}

    def run_lanes(self, fname: str, B: int, seqs: Sequence[SeqState], arrays: dict[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
        """A step whose lane b (b < len(seqs)) is sequence seqs[b]: `arrays` ([max(B, len(seqs)), ...] each: ids,
        pos, a draft's hidden streams) with the block table and slots of `seqs`; every output in the same lane
        order (as many lanes). Data parallel: each replica's sequences go to its own batch of B (in their order,
        padding after: `lanes(seqs)` <= B), and the outputs come back to their lanes."""
        if self.dp == 1:
            table, slot = self.table(seqs, B)
            return self.backend.run_outputs(fname, {**arrays, "block_table": table, "slot": slot})
        lanes = [[i for i, s in enumerate(seqs) if s.replica == d] for d in range(self.dp)]
        steps = []
        for d, mine in enumerate(lanes):
            part = {k: _padding({k: a[:1].repeat(B, axis=0)})[k] for k, a in arrays.items()}
            for k, a in arrays.items():
                part[k][: len(mine)] = a[mine]
            table, slot = self.table([seqs[i] for i in mine], B)
            steps.append((d, {**part, "block_table": table, "slot": slot}))
        out = {}
        for k, v in self.backend.run_outputs(fname, self._stacked(steps)).items():
            out[k] = np.zeros((max(B, len(seqs)), *v.shape[2:]), dtype=v.dtype)
            for d, mine in enumerate(lanes):
                out[k][: len(seqs)][mine] = v[d][: len(mine)]
        return out

    @serialised
    def warmup(self, prompt_len: int, batch: int = 1) -> None:
        """Prepare the functions a generation of `batch` prompts of `prompt_len` tokens will use."""
        names = {f for t, f in self.prefill_fns if t >= prompt_len}
        names = {min(names)} if names else {self.prefill_fns[-1][1]}
        names |= {f for b, f in self.decode_fns if b <= max(batch, 1)} | {next(f for b, f in self.decode_fns if b >= batch)}
        if hasattr(self.backend, "prepare"):
            self.backend.prepare(sorted(names))

    # ---- generation ------------------------------------------------------------------------------
    def check_request(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = None, where: str = "prompt", *,
                      min_new_tokens: int = 1) -> list[int]:
        """A generation request's prompt ids, checked (max_new_tokens >= min_new_tokens, 1 unless the request
        only scores its prompt; the sampling arguments, the ids, the context): one InputError naming what is
        wrong."""
        if not is_int(max_new_tokens) or max_new_tokens < min_new_tokens:
            raise InputError(f"max_new_tokens must be an integer >= {min_new_tokens}",
                             found=repr(max_new_tokens)[:40], param="max_new_tokens")
        check_sampling(temperature, top_p, seed)
        ids = self.check_prompt(prompt, where)
        self.check_context(ids, max_new_tokens, where)
        return ids

    def check_context(self, ids: list[int], max_new_tokens: int, where: str) -> None:
        """The prompt and the tokens it asks for fit the compiled context."""
        if len(ids) + max_new_tokens > self.max_context:
            raise InputError("prompt + max_new_tokens exceed the compiled maximum context", where=where,
                             expected=f"<= {self.max_context} tokens", found=len(ids) + max_new_tokens,
                             code=CONTEXT_LENGTH_EXCEEDED, param="max_new_tokens")

    sample = staticmethod(sample)

    @staticmethod
    def check_stop_ids(stop_ids) -> list[int]:
        """Stop ids: a list (or set) of integers."""
        return check_ids(sorted(stop_ids) if isinstance(stop_ids, (set, frozenset)) else stop_ids, "stop_ids")

    def share_ids(self, ids: list[int]) -> list[int]:
        """Sampled ids as every rank takes them: a partitioned artifact's ranks all take rank 0's
        (`distributed.Ranks.share_ids`, one broadcast); the ids themselves otherwise."""
        share = getattr(self.backend, "share_ids", None)
        return share(ids) if share is not None else ids

    @serialised
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop_ids: Sequence[int] = (),
                 speculative: str | None = None, draft_tokens: int | str = "auto", draft=None) -> list[list[int]]:
        """New ids for every prompt (continuous batching: at most `max_batch` sequences live at once; a
        waiting prompt joins as soon as a slot is free; each sequence stops at `max_new_tokens` or at a
        stop id, which is included). The prompts are requests of the one generation loop
        (`batcher.Batcher`, which the server and `run --prompt` use too), run until it is idle.

        Sampling (temperature > 0): prompt i draws from its own generator, `np.random.default_rng(seed + i)`
        (mod 2^64; `request_seed`), so its ids do not depend on the other prompts of the call or on the
        batch they share, and prompt 0 samples as `run --seed seed` or a server request with that seed;
        seed None: fresh entropy for each prompt. Greedy ids do not depend on the seed.

        `speculative="mtp"`: speculative decoding with `draft_tokens` drafts per step (default "auto": k
        chosen per step, 0 = plain decoding, from the running acceptance and the step costs, `spec_auto.py`;
        with a `draft` source the artifact's K) from the artifact's
        compiled MTP block (`runtime/speculative.py`, the loop's verify step: greedy ids identical,
        sampled ones identically distributed; `draft` replaces the MTP block as the draft source;
        `last_acceptance` then holds the statistics).

        Thread-safe: the call holds the session's lock to its end (see the module's docstring)."""
        from .batcher import Batcher, Request

        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise InputError("max_new_tokens must be an integer >= 0", found=repr(max_new_tokens)[:40])
        check_sampling(temperature, top_p, seed)
        stop_ids = self.check_stop_ids(stop_ids)
        prompts = [self.check_prompt(p, f"prompt {i}") for i, p in enumerate(check_prompts(prompts))]
        for i, p in enumerate(prompts):  # all checked before any runs (submit checks each again, for the server)
            self.check_context(p, max_new_tokens, f"prompt {i}")
        spec = None
        if speculative is not None:
            from .speculative import SpecStep

            if speculative != "mtp" or top_p != 1:
                raise InputError("speculative decoding drafts with the MTP block and samples without top-p",
                                 expected="speculative='mtp', top_p 1", found=(speculative, top_p))
            spec = SpecStep(self, draft_tokens, draft)
        self.first_token_s = None
        if max_new_tokens == 0:
            if spec is not None:
                self.last_acceptance = spec.stats
            return [[] for _ in prompts]
        loop = Batcher(self, spec=spec, raise_errors=True)
        t0 = time.perf_counter()
        reqs = [loop.submit(Request(p, max_new_tokens, temperature, top_p, request_seed(seed, i), frozenset(stop_ids),
                                    index=i), where=f"prompt {i}")
                for i, p in enumerate(prompts)]
        try:
            loop.run_until_idle()
        finally:  # an error mid-way (a full pool, say) must not leave this call's sequences open
            loop.abort()
        self.last_cached_tokens = [r.cached_tokens for r in reqs]
        firsts = [r.first_token_at for r in reqs if r.first_token_at is not None]
        self.first_token_s = min(firsts) - t0 if firsts else None
        if spec is not None:
            self.last_acceptance = spec.stats
        return [r.ids for r in reqs]

    @serialised
    def self_check(self):
        """Run the artifact's golden through this session's own generation loop and compare it with the
        reference model's answer (`self_check.py`): a `SelfCheckResult` (passed, each check's error and
        tolerance, the first departing step, lane and, where measured, layer). An artifact compiled with
        `--no-golden` is an ArtifactError."""
        from .self_check import self_check

        return self_check(self, self.device)

    @serialised
    def close(self) -> None:
        self.backend.close()


def _padding(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Step inputs of the same shapes with every lane padding (ids and a draft's hidden streams 0)."""
    return {k: np.zeros_like(a) if k in ("ids", "hidden") else np.full_like(a, -1) for k, a in inputs.items()}


def auto_device(art: Artifact) -> str:
    import ctypes

    from v4compile.targets import DEVICE_TARGET, DRIVER_LIB

    names = {t["name"] for t in art.manifest["targets"]}
    for dev in ("cuda", "hip"):
        if DEVICE_TARGET[dev] in names:
            try:
                ctypes.CDLL(DRIVER_LIB[dev])
            except OSError:
                continue
            return dev
    return "cpu" if "cpu" in names else "host"


def load(path, device: str = "auto", *, threads: int | None = None, verify: bool = True,
         driver_lib: str | None = None, graphs: bool = True, kernels: str = "auto", prefix_cache: bool = True,
         prefix_cache_bytes: int = DEFAULT_SNAPSHOT_BYTES) -> Session:
    """Load an artifact directory for `device`: `cpu` (ONNX Runtime), `host` (the C runtime on host memory,
    kernels run from Python), `hip` / `cuda` (the C runtime on a GPU; `driver_lib` overrides the driver
    library path), `auto` (a GPU whose driver library loads and whose target the artifact holds, else
    `cpu` when the artifact has it, else `host`). `graphs`: decode steps as captured graphs (C runtime
    devices). `prefix_cache`: a shared prompt prefix is computed once and taken by reference after
    (`prefix_cache.py`; bit-exact, so on by default); `prefix_cache_bytes` bounds its snapshots' memory."""
    if not isinstance(device, str) or device not in DEVICES:
        raise InputError(f"unknown device {device!r}", expected=", ".join(DEVICES))
    check_threads(threads)
    if not isinstance(prefix_cache, (bool, np.bool_)):
        raise InputError("prefix_cache must be True or False", found=repr(prefix_cache)[:40], param="prefix_cache")
    if not is_int(prefix_cache_bytes) or prefix_cache_bytes < 0:
        raise InputError("prefix_cache_bytes must be an integer >= 0", found=repr(prefix_cache_bytes)[:40],
                         param="prefix_cache_bytes")
    art = load_artifact(path, verify=verify, defer_weights=True)  # the backend hashes the shards as it reads them
    if art.manifest["weights"].get("shape_only"):
        raise InputError("a shape-only artifact (compiled with --weights none) has no weights to run",
                         where=str(art.path), expected="an artifact compiled with weights")
    if device == "auto":
        device = auto_device(art)
        log.info("device auto: %s", device)
    ranks = _join(art, device) if "parallel" in art.manifest else None
    try:
        return Session(art, _backend(art, device, threads, graphs, kernels, driver_lib, ranks),
                       prefix_cache=bool(prefix_cache), prefix_cache_bytes=int(prefix_cache_bytes))
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _backend(art: Artifact, device: str, threads: int | None, graphs: bool, kernels: str, driver_lib: str | None,
             ranks=None):
    """The device's backend (the one place one is built): `OrtBackend` (cpu) or `ProgramBackend` (host / hip /
    cuda); `ranks`: this process's rank of a partitioned artifact."""
    if device in ("host", "hip", "cuda"):
        from .program_backend import ProgramBackend

        return ProgramBackend(art, device, driver_lib=driver_lib, graphs=graphs, kernels=kernels, threads=threads,
                              ranks=ranks)
    from .cpu_backend import OrtBackend

    return OrtBackend(art, threads=threads, ranks=ranks)


def _join(art: Artifact, device: str):
    """This process's rank of a partitioned artifact (`--tp` / `--ep`) under torchrun: it joins the process
    group (`distributed.join`) and its backend maps its own weights only. Device cpu: the ONNX segments with
    gloo between them; host: the C runtime, whose collective launches come back to Python and run on gloo;
    cuda / hip: the C runtime's NCCL / RCCL communicators, their ids through the process group's store
    (`program_backend.join_communicators`), the collectives enqueued on the stream.
    Every rank makes the same session calls; rank 0's steps and sampled ids are the ones run."""
    from v4compile.parallel import ParallelLayout

    from .distributed import join

    if device in ("hip", "cuda"):
        from v4compile.targets import DEVICE_TARGET

        art.target(DEVICE_TARGET[device])  # before joining: a cpu-only artifact is one error, not a wait for peers
    return join(ParallelLayout.from_manifest(art.manifest["parallel"]))
