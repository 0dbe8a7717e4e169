"""The ranks of a partitioned artifact serving together (`serve` under torchrun): one `Batcher` on every
rank, in lockstep with rank 0's, which takes the requests.

Every rank's Batcher must hold the same requests, admit them in the same order, open the same slots and
pool blocks and end each request at the same point of the same step: then the steps themselves run as
`run`'s do (each step's function and inputs are rank 0's and are checked against the rank's own:
`Ranks.step`, whose mismatch ends the server rather than letting the ranks drift; each sampled id is rank
0's: `Ranks.share_ids`). What happens only on rank 0 -- a request's arrival, its cancellation (a client
gone, its timeout), and an end its consumer decides (a stop string, the consumer's own error) -- waits
for the next tick: at the start of each step rank 0 broadcasts it (`Lockstep.exchange`) and every rank
applies it at that same point, in one order: the consumers' ends first (in rank 0's order: freed slots and
blocks go onto stacks, so the order is the allocator's state), then the new requests at the back of the
queue, then the cancellations. What every rank decides alike from shared facts (a stop id,
max_new_tokens, the context) happens in the step itself. Rank 0's failed sampling travels as the id -1
(`Batcher._pick_or_fail`); the other ranks do not sample.

Idle: rank 0 sends an empty tick every IDLE_TICK_S while it has no work. The other ranks wait for ticks
in a blocking broadcast, which has the process group's timeout (V4COMPILE_DIST_TIMEOUT, default 120 s):
the ticks keep an idle server from ever meeting it, cost one small broadcast a second, and find a rank that
died while the server was idle within IDLE_TICK_S. Rank 0 stopping sends a stop tick, which ends the
other ranks' loops; a failed collective (a rank gone) ends every rank's loop (`Batcher.died`).

The data-parallel attention layout (each rank owning its own sequences) plugs in at the tick: rank 0 places
each new request there (its owner rank, one more field of `new`), and each rank admits only its own.
"""

from __future__ import annotations

import json
import logging

from v4compile.errors import DeviceError

log = logging.getLogger(__name__)

IDLE_TICK_S = 1.0  # rank 0's empty tick while idle: far below any sensible collective timeout


class Lockstep:
    def __init__(self, ranks):
        self.ranks = ranks
        self.leader = ranks.rank == 0
        self.inbox: list = []  # rank 0: requests submitted since the last tick (not yet in `waiting`)
        self.cancels: list = []  # rank 0: requests cancelled since the last tick
        self.by_key: dict[int, object] = {}  # the other ranks: rank 0's key -> the request, while not done
        self.next_key = 0
        self.idle_tick_s = IDLE_TICK_S

    @property
    def pending(self) -> bool:
        """Rank 0 has something to tell (a step is due even with nothing live)."""
        return bool(self.inbox or self.cancels)

    def submit(self, req) -> None:
        """Rank 0, under the batcher's condition: `req` joins the queue at the next tick."""
        req.key, self.next_key = self.next_key, self.next_key + 1
        self.inbox.append(req)

    def exchange(self, batcher) -> bool:
        """The tick at the start of a step, under the session's lock: rank 0 sends what happened on it since
        the last tick, every rank applies it. False: rank 0 stopped (no step follows)."""
        from .batcher import Request

        if self.leader:
            with batcher.cond:
                new, self.inbox = self.inbox, []
                cancels, self.cancels = self.cancels, []
            closing = [r for r in batcher.live if r.closing is not None]
            cancels = [r for r in cancels if not r.done]
            msg = {"close": [r.key for r in closing], "new": [[r.key, r.prompt, r.max_new_tokens, sorted(r.stop_ids)]
                                                              for r in new],
                   "cancel": [r.key for r in cancels]}
            self.ranks.share_bytes(json.dumps(msg).encode() if closing or new or cancels else b"")
        else:
            data = self.ranks.share_bytes(None)
            if data is None:
                return False
            msg = json.loads(data) if data else {}
            closing = [self.by_key[k] for k in msg.get("close", ())]
            new = [Request(p, n, stop_ids=frozenset(s), key=k) for k, p, n, s in msg.get("new", ())]
            self.by_key = {k: r for k, r in self.by_key.items() if not r.done} | {r.key: r for r in new}
            cancels = [self.by_key[k] for k in msg.get("cancel", ())]
        self.apply(batcher, closing, new, cancels)
        return True

    @staticmethod
    def apply(batcher, closing: list, new: list, cancels: list) -> None:
        """A tick's facts, on every rank in this order (see the module's docstring)."""
        for r in closing:
            batcher.close(r)
        with batcher.cond:
            batcher.waiting.extend(new)
            for r in cancels:
                r.cancelled = True

    def stop(self) -> None:
        """Rank 0: the stop tick (the other ranks' loops end). A rank already gone is no error here: rank 0
        is stopping anyway."""
        try:
            self.ranks.share_bytes(None)
        except DeviceError as e:
            log.debug("the stop tick did not reach every rank: %s", e)
