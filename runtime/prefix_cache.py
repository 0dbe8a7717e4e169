"""Prefix cache: a prompt prefix already computed by an earlier sequence is taken by reference, bit-exact.

**Key.** A chain of hashes over the prompt's token ids in *pieces* of `g` tokens: piece i's key is
sha256(key of piece i-1 || ids of piece i), so one key names the whole prefix up to the end of the piece
(ids compared too: a hash collision is a miss, never a wrong hit). This is a radix tree whose edges are
whole pieces, flattened into one dict: the runtime only ever asks "the longest cached prefix of this prompt
in whole pieces", which is one dict probe per piece, no node splitting; a partial piece can never be
shared anyway (see granularity), so a radix tree's token-level edges would buy nothing. Leaves (entries no
other entry extends) are what eviction takes, least recently used first.

**Granularity.** g = lcm of the compression ratios and of the largest prefill chunk bucket. The ratios'
lcm is half a pool block (`block_tokens` = 2 x lcm: 128 tokens for V4-Pro / V4-Flash, whose ratios are 4 and
128; 16 for the tiny presets): at a multiple of it every compressor of every layer has just closed a
compression window, so the compressed rows of the prefix (CSA / HCA KV, CSA indexer keys) are final and
live in the pool blocks before the boundary; everything else V4 carries from one position to the next is
per slot and small, and goes into the entry's snapshot. The chunk bucket: prefill runs a long prompt in
chunks of the largest bucket, so a boundary at a multiple of it is where a chunk ends, without cutting the
chunks otherwise. Cutting them at every lcm would make more snapshots possible but change the chunking, and
a differently chunked prefill is not bit-identical (measured on tiny, buckets 16 and 64: logits 2e-6 apart):
with the chunking untouched, a request served from the cache is byte for byte the request run with the
cache off, and the tail after a hit is chunked exactly as the cold run chunks it from the same position.
With a largest bucket of at most 128, V4's g stays 128: a prompt of a few hundred tokens with a shared
system prompt hits (not only beyond a 4,096-token block). A finer g would need no more state (the
compressor rings hold any partial window), only more snapshots.

**What a snapshot holds** (taken when a prompt's prefill chunk ends at a boundary; restored into the new
sequence's slot):
* the slot's sliding-window ring of every layer (and of the compiled MTP block): `window` rows of the
  main planes each (the last `window` positions before the boundary);
* every overlapping (CSA) compressor's state rings `state.layers.<l>.state_kv` / `state_gate` (its
  pending-window state and gate rows, and the previous window it overlaps) and the CSA indexer's
  compressor rings `index_state_kv` / `index_state_gate`: the indexer's state at that position (its keys
  of closed windows are pool rows, shared). An HCA compressor's ring is not kept: at a boundary it holds
  only the window just closed, which nothing reads again (its next window's slots are all written before
  the window's row is computed, as in a slot reused from an earlier sequence); for V4-Pro that is 16 of
  the 19 MB of FP32 rings a snapshot would otherwise carry.
`snapshot_bytes` gives its size from the config (the report states it for V4-Pro and V4-Flash).

**The copies** (`snapshot.py`): the snapshot, its restore and the block copied on write are ranges of one copy
table derived from the program's pool geometry; on host / hip / cuda the C runtime issues them from that table
(device to host, host to device, device to device on the stream, outside the captured decode graphs:
`snapshot.py` says why), and the host device checks each one's bytes and order (`copy_check.py`).

**Blocks by reference.** A hit of n pieces (n x g <= prompt length - 1: the last prompt token is always
computed, it gives the first logits) takes the blocks under the prefix by reference (a reference count per
block: the sequences holding it and the entries naming it); a whole block is taken from the entry holding
its last token (the entry of its first tokens may name another: a sequence that hit there copied the
block, then wrote its own tail into it). Positions after the boundary write only rows of
later compression windows, so a whole shared block is never written again; a boundary in the middle of a
block leaves that block to be written by the new sequence's tail, so it is copied first (copy on
write, at the hit, into a block of the sequence's own). Rejected speculative drafts only restore rows they
wrote, so they never write a shared block either (speculative decoding with a `draft` source prefills
through the cache, tests/onnx/test_spec_session.py; so does the compiled MTP block's, below).

**The compiled MTP block's prefill** (`speculative.CompiledDraft.prefill`) takes and keeps pieces too: its
window ring is in the snapshot. Its row of position q is the block applied to position q's streams *and the
token q + 1*, so the snapshot at boundary P depends on the token at P, one beyond the piece: those entries
are keyed on the piece's ids and that next token (`look` 1), and start their chain from their own root, apart
from plain prefill's entries (whose MTP rows are not written: a plain prefill runs no MTP block). The block
runs over each chunk as soon as the chunk's next token is known (the prompt's, before the next chunk; the
last chunk's after the first sampled token), so a boundary's snapshot is taken with every ring at P; a piece
is kept only where the prompt holds its next token. Rejected drafts write no shared block: the verify step's
positions are past the prompt, in blocks of the sequence's own, and the draft steps write only the slot's MTP
ring (both restored from the undo log).

**Data parallel** (`--dp`): one cache per replica (`Session.caches`). An entry's blocks live in its replica's
pool and its snapshot is that replica's rings, so a hit is taken only inside the replica that holds it. Every
rank keeps every replica's books (the same calls in the same order, as for the allocators), and only the
ranks of a replica hold its snapshots' bytes (the others count them, so that the snapshot bound evicts alike
everywhere). `Session.place` sends a new prompt to the replica caching its longest prefix, then to the least
loaded (fewest live sequences, most free blocks, lowest index): a prompt sharing a system prompt lands where
that prompt was computed.

**Eviction.** Under pool pressure (a sequence needs a block and none is free) and to keep the snapshots
under their bound, least recently used leaves go first; dropping an entry frees its block only when no
sequence holds it (the reference count), so a block in use is never freed. The cache never makes a request
fail that would run without it: what it holds is given back before the pool is declared full, and an entry
that would not fit the snapshot bound is simply not kept.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_BYTES = 1 << 30  # bound on the snapshots' host memory (a knob of `load`)


def granularity(block_tokens: int, chunk: int = 1) -> int:
    """Tokens per cache piece: lcm of the ratios (half the pool's block, `pool.PoolGeometry.build`) and of the
    largest prefill chunk `chunk` (so that a piece always ends where a prefill chunk ends)."""
    return math.lcm(block_tokens // 2 if block_tokens % 2 == 0 else block_tokens, chunk)


def snapshot_bytes(cfg, main_row_bytes: int | None = None, mtp_layers: int = 1, state_bytes: int = 4,
                   chunk: int = 1) -> dict:
    """Bytes of one boundary snapshot of `cfg` (a `V4Config`) and per cached pool block (block_tokens / g
    snapshots, g = `granularity` with the largest prefill bucket `chunk`: two for a bucket of at most the
    ratios' lcm): the window rings (`main_row_bytes` a row: default one BF16 row of head_dim; `mtp_layers`:
    the compiled MTP block's ring), the compressor state rings (FP32) and the CSA indexer's rings. Ring shapes as the runtime's state tensors: a compressor
    of ratio m keeps c x m rows of c x d values for KV and gate each (c = 2 for CSA, which overlaps the previous
    window; 1 for HCA)."""
    from v4compile.config import CSA, HCA

    row = main_row_bytes if main_row_bytes is not None else 2 * cfg.head_dim
    window = (cfg.n_layers + mtp_layers) * cfg.window * row
    state = 0
    for i in range(cfg.n_layers):
        kind, m = cfg.kind(i), cfg.ratio(i)
        if kind not in (CSA, HCA):
            continue
        if kind == CSA:  # an HCA ring holds only the window a boundary has just closed: not kept
            c = 2
            state += 2 * (c * m) * (c * cfg.head_dim) * state_bytes
            state += 2 * (c * m) * (c * cfg.index_head_dim) * state_bytes
    ratios = sorted({cfg.ratio(i) for i in range(cfg.n_layers) if cfg.kind(i) in (CSA, HCA)}) or [1]
    bt = 2 * math.lcm(*ratios)
    g = granularity(bt, chunk)
    snap = window + state
    return {"granularity": g, "block_tokens": bt, "window_bytes": window, "state_bytes": state,
            "snapshot_bytes": snap, "per_block_bytes": snap * bt / g}


def whole_blocks(hit: list["Entry"], n: int, g: int, bt: int) -> list[int]:
    """The first n pool blocks under a hit (pieces of g tokens, blocks of bt): each the block of the entry that
    holds the block's last token (the entry of its first tokens may name another block: a sequence that hit
    there copied the block, then wrote its own tail into it)."""
    out = []
    for j in range(n):
        e = hit[((j + 1) * bt - 1) // g]
        out.append(e.blocks[j - e.index * g // bt])
    return out


def root(look: int) -> bytes:
    """The key a chain starts from: entries of a prefill that ran the compiled MTP block apart (`look` 1)."""
    return b"mtp" if look else b""


def _key(parent: bytes, ids) -> bytes:
    return hashlib.sha256(parent + np.asarray(ids, dtype=np.int64).tobytes()).digest()


@dataclass(eq=False)
class Entry:
    key: bytes
    parent: "Entry | None"
    ids: tuple[int, ...]
    index: int  # piece index: it covers tokens [index * g, (index + 1) * g)
    blocks: tuple[int, ...]  # the pool blocks those tokens' compressed rows are in
    snapshot: dict[str, np.ndarray]
    nbytes: int
    end: int  # tokens of the prefix it closes (its boundary)
    used: int = 0  # LRU tick
    children: int = 0


@dataclass
class Stats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    inserted: int = 0
    evicted: int = 0
    skipped: int = 0  # entries not kept (the snapshot bound)
    copies: int = 0  # blocks copied on write


@dataclass
class PrefixCache:
    """The entries and the block reference counts (the session does the copying of rows)."""

    g: int
    max_bytes: int = DEFAULT_SNAPSHOT_BYTES
    entries: dict[bytes, Entry] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)  # block -> holders (sequences + entries), cache-known only
    nbytes: int = 0
    tick: int = 0
    stats: Stats = field(default_factory=Stats)

    # ---- lookup / insert -------------------------------------------------------------------------
    def lookup(self, prompt: list[int], look: int = 0) -> list[Entry]:
        """The longest chain of entries that is a prefix of `prompt` and leaves at least its last token. `look`:
        1 for the entries of a prefill that ran the compiled MTP block (their pieces' ids end with the token
        after the piece, see `root`)."""
        out, key = [], root(look)
        for i in range((len(prompt) - 1) // self.g):
            ids = tuple(prompt[i * self.g:(i + 1) * self.g + look])
            e = self.entries.get(_key(key, ids))
            if e is None or e.ids != ids:
                break
            out.append(e)
            key = e.key
        self.tick += 1
        for e in out:
            e.used = self.tick
        self.stats.lookups += 1
        self.stats.hits += bool(out)
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += len(out) * self.g
        return out

    def peek(self, prompt: list[int]) -> int:
        """Pieces of `prompt` cached (plain or MTP prefill's entries, the longer), counting nothing."""
        best = 0
        for look in (0, 1):
            key, n = root(look), 0
            for i in range((len(prompt) - 1) // self.g):
                ids = tuple(prompt[i * self.g:(i + 1) * self.g + look])
                e = self.entries.get(_key(key, ids))
                if e is None or e.ids != ids:
                    break
                n, key = n + 1, e.key
            best = max(best, n)
        return best

    def find(self, parent: Entry | None, ids, look: int = 0) -> Entry | None:
        e = self.entries.get(_key(parent.key if parent is not None else root(look), ids))
        return e if e is not None and e.ids == tuple(ids) else None

    def insert(self, parent: Entry | None, ids, index: int, blocks, snapshot: dict[str, np.ndarray],
               look: int = 0, nbytes: int | None = None) -> tuple[Entry | None, list[int]]:
        """Keep a new entry (its blocks held by the entry; a block the cache did not know yet is the inserting
        sequence's own, which holds it too). Returns the entry (None when it does not fit the bound) and the
        blocks the evictions it needed freed. `nbytes`: the snapshot's bytes where this process holds none of them
        (a data-parallel rank of another replica keeps the same books)."""
        if nbytes is None or snapshot:
            nbytes = sum(a.nbytes for a in snapshot.values())
        freed: list[int] = []
        while self.nbytes + nbytes > self.max_bytes:
            b = self._evict_one(keep=parent)
            if b is None:
                self.stats.skipped += 1
                return None, freed
            freed += b
        key = _key(parent.key if parent is not None else root(look), ids)
        self.tick += 1
        e = Entry(key, parent, tuple(ids), index, tuple(blocks), snapshot, nbytes, (index + 1) * self.g, self.tick)
        self.entries[key] = e
        if parent is not None:
            parent.children += 1
        for b in e.blocks:
            self.refs[b] = self.refs.get(b, 1) + 1
        self.nbytes += nbytes
        self.stats.inserted += 1
        return e, freed

    # ---- block references ------------------------------------------------------------------------
    def hold(self, block: int) -> None:
        self.refs[block] += 1

    def drop(self, block: int) -> bool:
        """One holder less; True when the block is free now (or was never the cache's: the caller frees it)."""
        n = self.refs.get(block)
        if n is None:
            return True
        if n > 1:
            self.refs[block] = n - 1
            return False
        del self.refs[block]
        return True

    # ---- eviction --------------------------------------------------------------------------------
    def _evict_one(self, keep: Entry | None = None) -> list[int] | None:
        """Drop the least recently used leaf (not `keep` nor its ancestors); the blocks that frees (its block
        when no sequence and no other entry holds it). None when nothing can go."""
        protected = set()
        while keep is not None:
            protected.add(keep.key)
            keep = keep.parent
        leaves = [e for e in self.entries.values() if e.children == 0 and e.key not in protected]
        if not leaves:
            return None
        e = min(leaves, key=lambda x: x.used)
        del self.entries[e.key]
        if e.parent is not None:
            e.parent.children -= 1
        self.nbytes -= e.nbytes
        self.stats.evicted += 1
        return [b for b in e.blocks if self.drop(b)]

    def evict_for_blocks(self) -> list[int]:
        """Evict leaves until a pool block comes free (or nothing is left to evict); the freed blocks."""
        while True:
            b = self._evict_one()
            if b is None or b:
                return b or []

    def clear(self) -> list[int]:
        freed = []
        while self.entries:
            b = self._evict_one()
            if b is None:
                break
            freed += b
        return freed

    def summary(self) -> dict:
        s = self.stats
        return {"entries": len(self.entries), "cached_blocks": len({b for e in self.entries.values() for b in e.blocks}),
                "snapshot_bytes": self.nbytes, "max_snapshot_bytes": self.max_bytes, "granularity": self.g,
                "lookups": s.lookups, "hits": s.hits, "hit_rate": s.hits / s.lookups if s.lookups else 0.0,
                "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                "token_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "inserted": s.inserted, "evicted": s.evicted, "skipped": s.skipped, "copies": s.copies}


def merged_summary(caches: list[PrefixCache]) -> dict:
    """The figures of several replicas' caches as one (counts summed, rates of the sums)."""
    out = caches[0].summary()
    for c in caches[1:]:
        for k, v in c.summary().items():
            if k not in ("granularity", "hit_rate", "token_hit_rate"):
                out[k] += v
    out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
    out["token_hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
    return out
