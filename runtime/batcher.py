"""Continuous batching one step at a time, for callers that see tokens as they come (`run --prompt`,
`serve`).

`Session.generate` runs a fixed list of prompts to the end. A `Batcher` takes requests at any time (from
any thread: `submit`, `cancel`), and `step()` does one round on the thread that owns the session: release
the sequences of cancelled requests, admit waiting requests while slots are free (prefill, first token),
then one decode step over every live sequence. Each new token goes to the request's `on_token`, which
may end the request (an EOS or a stop string found in the text); a request also ends at
`max_new_tokens` or a stop id. `run_forever` is the server's scheduler loop: it sleeps while there is
nothing to do. The admission order and the decode steps are the ones `generate` makes, so the ids are the
same for the same greedy requests.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from v4compile.errors import CONTEXT_LENGTH_EXCEEDED, InputError

from .session import Session, _is_int, check_ids, check_sampling

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    on_token: Callable[["Request", int], bool] | None = None  # True: the request is done (stop string, EOS)
    on_done: Callable[["Request"], None] | None = None  # called once, on the scheduler's thread
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: Exception | None = None
    cancelled: bool = False
    _seq: object = None
    _rng: np.random.Generator | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Batcher:
    def __init__(self, session: Session):
        self.sess = session
        self.waiting: deque[Request] = deque()
        self.live: list[Request] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.on_step: Callable[[], None] | None = None  # after every step (a server hands its tokens over at once)

    # ---- any thread ------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
              seed: int | None = None, where: str = "prompt") -> list[int]:
        """The prompt's ids, checked as `generate` checks them (an InputError names what is wrong)."""
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise InputError("max_new_tokens must be an integer >= 1", found=repr(max_new_tokens)[:40],
                             param="max_new_tokens")
        check_sampling(temperature, top_p, seed)
        ids = self.sess.check_prompt(prompt, where)
        if len(ids) + max_new_tokens > self.sess.max_context:
            raise InputError("prompt + max_new_tokens exceed the compiled maximum context", where=where,
                             expected=f"<= {self.sess.max_context} tokens", found=len(ids) + max_new_tokens,
                             code=CONTEXT_LENGTH_EXCEEDED, param="max_new_tokens")
        return ids

    def submit(self, req: Request) -> Request:
        req.prompt = self.check(req.prompt, req.max_new_tokens, req.temperature, req.top_p, req.seed)
        req.stop_ids = frozenset(check_ids(sorted(req.stop_ids), "stop_ids"))
        req._rng = np.random.default_rng(req.seed)
        with self.cond:
            self.waiting.append(req)
            self.cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        """End a request (a client that went away): its slot and blocks are freed at the next step."""
        with self.cond:
            req.cancelled = True
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    # ---- the session's thread --------------------------------------------------------------------
    def run_forever(self) -> None:
        """The scheduler loop: step while there is work, sleep while there is none, until `stop()`."""
        while True:
            with self.cond:
                while not self.stopping and not self.busy:
                    self.cond.wait()
                if self.stopping:
                    break
            self.step()
        for r in [*self.live, *self.waiting]:
            self._finish(r, "cancelled")

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    def step(self) -> None:
        """One round: cancelled requests out, waiting requests in while slots are free, one decode step."""
        try:
            self._step()
        finally:
            if self.on_step is not None:
                self.on_step()

    def _step(self) -> None:
        sess = self.sess
        for r in [r for r in self.live if r.cancelled]:
            self._finish(r, "cancelled")
        while True:
            with self.cond:
                while self.waiting and self.waiting[0].cancelled:
                    self._finish(self.waiting.popleft(), "cancelled")
                if not (self.waiting and sess.free_slots and len(self.live) < sess.max_batch):
                    break
                r = self.waiting.popleft()
            r._seq = sess.open()
            self.live.append(r)
            try:
                logits = sess.extend(r._seq, r.prompt)[None]
            except Exception as e:  # noqa: BLE001 (the request fails, the server goes on)
                self._fail(r, e)
                continue
            self._token(r, self._sample(r, logits)[0])
        if not self.live:
            return
        live = list(self.live)
        try:
            logits = sess.decode([r._seq for r in live], [r.ids[-1] for r in live])
        except Exception as e:  # noqa: BLE001
            for r in live:
                self._fail(r, e)
            return
        if all(r.temperature == 0 for r in live):
            toks = [int(t) for t in logits.argmax(-1)]
        else:
            toks = [self._sample(r, logits[i: i + 1])[0] for i, r in enumerate(live)]
        for r, t in zip(live, toks):
            self._token(r, t)

    def _sample(self, r: Request, logits: np.ndarray) -> list[int]:
        return self.sess._next_ids(logits, r.temperature, r.top_p, r._rng)  # a partitioned artifact: rank 0's

    def _token(self, r: Request, tok: int) -> None:
        r.ids.append(tok)
        ended = False
        if r.on_token is not None:
            try:
                ended = bool(r.on_token(r, tok))
            except Exception as e:  # noqa: BLE001 (a consumer's error ends its request only)
                self._fail(r, e)
                return
        if ended or tok in r.stop_ids:
            self._finish(r, "stop")
        elif len(r.ids) >= r.max_new_tokens:
            self._finish(r, "length")

    def _fail(self, r: Request, e: Exception) -> None:
        log.warning("request failed: %s", e)
        r.error = e
        self._finish(r, "error")

    def _finish(self, r: Request, reason: str) -> None:
        if r.done:
            return
        if r._seq is not None:
            self.sess.release(r._seq)
        if r in self.live:
            self.live.remove(r)
        r.finish_reason = reason
        if r.on_done is not None:
            try:
                r.on_done(r)
            except Exception as e:  # noqa: BLE001
                log.warning("on_done failed: %s", e)
