"""The one generation loop: continuous batching one step at a time. `Session.generate` (plain and
speculative), `run` (`--ids` through `generate`, `--prompt` directly) and `serve` all step through it.

A `Batcher` takes requests at any time (from any thread: `submit`, `cancel`), and `step()` does one round
under the session's lock: release the sequences of cancelled requests, admit waiting requests while slots
are free (prefill, first token), then one step over every live sequence: a decode step, or, with a
speculative step mode (`speculative.SpecStep`), a verify step that accepts drafts and drafts the next
ones. Each new token goes to the request's `on_token`, which may end the request (an EOS or a stop string
found in the text); a request also ends at `max_new_tokens` or a stop id (included). `run_forever` is the
server's scheduler loop: it sleeps while there is nothing to do; `run_until_idle` is `generate`'s.

Sampling: each request draws from its own generator, `np.random.default_rng(request.seed)` (None: fresh
entropy), so its ids do not depend on which requests share its batch (`Session.generate` states how its
prompts' seeds follow from the call's). A partitioned artifact's ranks take rank 0's ids
(`Session.share_ids`, once a step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from v4compile.errors import InputError

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
    index: int = 0  # the caller's number for it (`generate`: the prompt's index; a draft source gets it)
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: Exception | None = None
    cancelled: bool = False
    first_token_at: float | None = None  # time.perf_counter() when its first token came
    seq: object = None  # its open sequence (`session.SeqState`) while live
    rng: np.random.Generator | None = None  # its own sampling generator (made at submit)
    spec: object = None  # the speculative step mode's state for it (`speculative.SpecState`)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Batcher:
    def __init__(self, session, *, spec=None, raise_errors: bool = False):
        """`spec`: a speculative step mode (`speculative.SpecStep`) instead of decode steps. `raise_errors`:
        a request's error ends the loop (`generate`: the caller gets it) instead of that request only (the
        server's)."""
        self.sess = session
        self.spec = spec
        self.max_live = getattr(session, "max_live", session.max_batch) if spec is None else spec.max_batch
        self.raise_errors = raise_errors
        self.waiting: deque[Request] = deque()
        self.live: list[Request] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.stop_error: Exception | None = None  # what the requests in flight at `stop()` end with
        self.on_step: Callable[[], None] | None = None  # after every step (a server hands its tokens over at once)
        self.died: BaseException | None = None  # why `run_forever` ended other than by `stop()` (a server's health)

    # ---- any thread ------------------------------------------------------------------------------
    def check(self, prompt, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
              seed: int | None = None, where: str = "prompt") -> list[int]:
        """The prompt's ids, checked as `generate` checks them (an InputError names what is wrong)."""
        ids = self.sess.check_request(prompt, max_new_tokens, temperature, top_p, seed, where)
        if self.spec is not None:
            self.spec.check(top_p)
        return ids

    def submit(self, req: Request, where: str = "prompt") -> Request:
        req.prompt = self.check(req.prompt, req.max_new_tokens, req.temperature, req.top_p, req.seed, where)
        req.stop_ids = frozenset(self.sess.check_stop_ids(req.stop_ids))
        req.rng = np.random.default_rng(req.seed)
        with self.cond:
            self.waiting.append(req)
            self.cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        """End a request (a client that went away): its slot and blocks are freed at the next step."""
        with self.cond:
            req.cancelled = True
            self.cond.notify()

    def stop(self, error: Exception | None = None) -> None:
        """End `run_forever` after the step under way; the requests in flight end then, with `error` (a
        server shutting down: each client is told why) or else as cancelled."""
        with self.cond:
            self.stopping = True
            self.stop_error = self.stop_error or error
            self.cond.notify()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    # ---- the scheduler's thread ------------------------------------------------------------------
    def run_forever(self) -> None:
        """The scheduler loop: step while there is work, sleep while there is none, until `stop()`. A step's
        error that no request's handler took (a bug, not a request's fault) fails the requests in flight and
        the loop goes on: nothing a request carries may stop the scheduler. Should the loop itself end
        another way, `died` says why."""
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self.busy:
                        self.cond.wait()
                    if self.stopping:
                        break
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001
                    log.exception("a scheduler step failed; its requests end with the error")
                    self._fail_all(e)
            self.abort(self.stop_error)
        except BaseException as e:
            self.died = e
            raise

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    def abort(self, error: Exception | None = None) -> None:
        """End every request not yet done (their sequences released): failed with `error`, or cancelled."""
        with self.sess.lock:
            for r in [*self.live, *self.waiting]:
                if error is not None and not r.done:
                    r.error = error
                self._finish(r, "cancelled" if error is None else "error")
            self.waiting.clear()
        if self.on_step is not None:  # their ends handed over: no step follows
            self.on_step()

    def _fail_all(self, e: Exception) -> None:
        """Fail every request in flight (after a step's unhandled error: which of them it hit is unknown)."""
        with self.cond:
            reqs, self.waiting = [*self.live, *self.waiting], deque()
        for r in reqs:
            try:
                self._fail(r, e)
            except Exception:  # noqa: BLE001 (its sequence would not release: end it anyway)
                if r in self.live:
                    self.live.remove(r)
                r.error, r.finish_reason = e, "error"
        if self.on_step is not None:  # their ends handed over now: the loop may sleep next
            self.on_step()

    def step(self) -> None:
        """One round: cancelled requests out, waiting requests in while slots are free, one decode (or
        speculative) step over the live ones."""
        try:
            with self.sess.lock:
                self._step()
        finally:
            if self.on_step is not None:
                self.on_step()

    def _step(self) -> None:
        for r in [r for r in self.live if r.cancelled]:
            self._finish(r, "cancelled")
        joined = self._admit()
        if self.spec is not None and joined:
            self._guarded(joined, lambda: self.spec.joined(joined))
        if not self.live:
            return
        if self.spec is not None:
            live = list(self.live)
            self._guarded(live, lambda: self.spec.step(live, self._tokens))
        else:
            self._decode()

    def _admit(self) -> list[Request]:
        """Waiting requests in while slots are free: each prefilled and given its first token. Returns those
        that stay live."""
        sess, joined = self.sess, []
        while True:
            with self.cond:
                while self.waiting and self.waiting[0].cancelled:
                    self._finish(self.waiting.popleft(), "cancelled")
                if not (self.waiting and sess.free_slots and len(self.live) < self.max_live):
                    break
                r = self.waiting.popleft()
            r.seq = sess.open()
            self.live.append(r)
            try:
                if self.spec is not None:
                    tok = self.spec.prefill(r)
                else:
                    tok = sess.share_ids([self._pick_or_fail(r, sess.extend(r.seq, r.prompt))])[0]
            except Exception as e:  # noqa: BLE001 (the request fails, the server goes on)
                self._fail(r, e)
                continue
            if r.done:  # its sampling failed
                continue
            self._token(r, tok)
            if not r.done:
                joined.append(r)
        if self.waiting and not self.live:  # no slot came free and none is live: another step would not progress
            err = InputError("no free sequence slot for the waiting prompts (release the session's open "
                             "sequences first)", found=f"{len(sess.seqs)} open")
            with self.cond:
                stuck, self.waiting = list(self.waiting), deque()
            for r in stuck:
                self._fail(r, err)
        return joined

    def _decode(self) -> None:
        live = list(self.live)
        try:
            logits = self.sess.decode([r.seq for r in live], [r.ids[-1] for r in live])
        except Exception as e:  # noqa: BLE001 (the step failed: all its requests with it)
            for r in live:
                self._fail(r, e)
            return
        picks = [self._pick_or_fail(r, row) for r, row in zip(live, logits)]
        try:
            toks = self.sess.share_ids(picks)
        except Exception as e:  # noqa: BLE001
            for r in live:
                self._fail(r, e)
            return
        for r, t in zip(live, toks):
            if not r.done:
                self._token(r, t)

    def _pick_or_fail(self, r: Request, row: np.ndarray) -> int:
        """`_pick`, or 0 (a placeholder the ranks share) with `r` failed: one request's sampling error (its
        parameters, its logits) ends that request only, not the others of its step."""
        try:
            return self._pick(r, row)
        except Exception as e:  # noqa: BLE001
            self._fail(r, e)
            return 0

    def _pick(self, r: Request, row: np.ndarray) -> int:
        """The request's next id from its logits `[V]`, with its own generator."""
        return self.sess.sample(row, r.temperature, r.top_p, r.rng)

    def _guarded(self, reqs: list[Request], fn) -> None:
        """`fn()`; its error fails `reqs` (the server goes on)."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            for r in reqs:
                self._fail(r, e)

    def _tokens(self, r: Request, toks: list[int]) -> int:
        """Hand `toks` to `r` one by one until it ends; how many it took."""
        n = 0
        for t in toks:
            if r.done:
                break
            self._token(r, t)
            n += 1
        return n

    def _token(self, r: Request, tok: int) -> None:
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
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
        if self.raise_errors:
            raise e
        if r.done:  # ended before the error (a step's other requests fail with it)
            return
        log.warning("request failed: %s", e)
        r.error = e
        self._finish(r, "error")

    def _finish(self, r: Request, reason: str) -> None:
        if r.done:
            return
        if r.seq is not None:
            self.sess.release(r.seq)
        if r in self.live:
            self.live.remove(r)
        r.finish_reason = reason
        if r.on_done is not None:
            try:
                r.on_done(r)
            except Exception as e:  # noqa: BLE001
                log.warning("on_done failed: %s", e)

