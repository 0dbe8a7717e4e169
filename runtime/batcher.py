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
prompts' seeds follow from the call's). A request's `logit_bias` is added to its row before sampling. A
partitioned artifact's ranks take rank 0's ids (`Session.share_ids`, once a step).

Log-probabilities (`runtime/logprobs.py`: the raw row's log-softmax, before bias, temperature and top-p): a
request with `logprobs` k gets each new token's and its k most likely alternatives (`token_logprobs`); with
`echo` its prompt's too (`prompt_logprobs`, the first None). Prefill returns the last position's logits only,
so an `echo` request's prompt goes in as its first token's prefill and then one prompt token per decode step
of the loop, beside the other requests (`feed`): each step's row scores the next prompt token, the last one's
is the first new token's. Such a request may ask for 0 new tokens (an evaluation harness's loglikelihood
request). A request that asks for neither costs one `is None` test per token.

`lockstep` (a partitioned artifact's server, `lockstep.Lockstep`): every rank runs this loop, in step with
rank 0's, which alone takes requests; each step starts with rank 0's tick (what happened on it since the
last step), rank 0 alone samples, and a failed collective ends the loop on every rank (`died`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from v4compile.errors import RANKS_DIVERGED, DeviceError, InputError

from .logprobs import TokenLogprob, token_logprob

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
    logprobs: int | None = None  # None: none asked; k: each new token's log-probability and its k top ids
    echo: bool = False  # score the prompt's tokens too (`prompt_logprobs`); max_new_tokens may then be 0
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling (not to `logprobs`)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    feed: deque = field(default_factory=deque)  # echo: prompt tokens not yet in the sequence
    feeding: int | None = None  # echo: the prompt token the next decode step puts in
    key: int = -1  # lockstep: rank 0's number for it, the same on every rank
    closing: tuple | None = None  # lockstep, rank 0: (reason, error) its consumer decided, applied at the next tick
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (the OpenAI usage's cached_tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Batcher:
    def __init__(self, session, *, spec=None, raise_errors: bool = False, lockstep=None):
        """`spec`: a speculative step mode (`speculative.SpecStep`) instead of decode steps. `raise_errors`:
        a request's error ends the loop (`generate`: the caller gets it) instead of that request only (the
        server's). `lockstep`: this rank's place among a partitioned artifact's serving ranks
        (`lockstep.Lockstep`; see the module's docstring)."""
        self.lockstep = lockstep
        self.sess = session
        self.spec = spec
        if spec is not None:  # its plain steps (k = 0 under "auto") are this loop's own decode step
            spec.plain = self._decode
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
              seed: int | None = None, where: str = "prompt", echo: bool = False) -> list[int]:
        """The prompt's ids, checked as `generate` checks them (an InputError names what is wrong); `echo`
        (the prompt scored) allows 0 new tokens."""
        ids = self.sess.check_request(prompt, max_new_tokens, temperature, top_p, seed, where,
                                      min_new_tokens=0 if echo else 1)
        if self.spec is not None:
            self.spec.check(top_p)
        return ids

    def submit(self, req: Request, where: str = "prompt") -> Request:
        req.prompt = self.check(req.prompt, req.max_new_tokens, req.temperature, req.top_p, req.seed, where,
                                req.echo)
        req.stop_ids = frozenset(self.sess.check_stop_ids(req.stop_ids))
        if self.spec is not None and (req.echo or req.logprobs is not None or req.logit_bias):
            raise InputError("the speculative step mode gives no log-probabilities and takes no logit bias",
                             where=where)
        req.rng = np.random.default_rng(req.seed)
        if req.echo:
            req.feed = deque(req.prompt[1:])
            req.prompt_logprobs = [None]
        with self.cond:
            if self.lockstep is not None:  # the ranks learn of it at the next tick
                self.lockstep.submit(req)
            else:
                self.waiting.append(req)
            self.cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        """End a request (a client that went away): its slot and blocks are freed at the next step."""
        with self.cond:
            if self.lockstep is not None:  # applied at the next tick, on every rank
                self.lockstep.cancels.append(req)
            else:
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
        return bool(self.waiting or self.live or (self.lockstep is not None and self.lockstep.pending))

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (those a tick has yet to announce included)."""
        return len(self.waiting) + (len(self.lockstep.inbox) if self.lockstep is not None else 0)

    # ---- the scheduler's thread ------------------------------------------------------------------
    def run_forever(self) -> None:
        """The scheduler loop: step while there is work, sleep while there is none, until `stop()`. A step's
        error that no request's handler took (a bug, not a request's fault) fails the requests in flight and
        the loop goes on: nothing a request carries may stop the scheduler. Should the loop itself end
        another way, `died` says why.

        With `lockstep`, rank 0 steps at least every `idle_tick_s` (an empty tick while idle) and the other
        ranks step on rank 0's ticks until its stop tick; an error that escapes a step (a rank gone) ends
        the loop on the spot: the ranks' states may differ from then on, so no step may follow. `died` holds
        it, the requests in flight end with it, and the loop returns (the server reports it, not a
        traceback of this thread)."""
        ls = self.lockstep
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self.busy:
                        if ls is None:
                            self.cond.wait()
                        elif not ls.leader or not self.cond.wait(ls.idle_tick_s):
                            break  # a tick is due (rank 0's, or the wait for it)
                    if self.stopping:
                        break
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001
                    if ls is not None:
                        raise
                    log.exception("a scheduler step failed; its requests end with the error")
                    self._fail_all(e)
            if ls is not None and ls.leader:
                ls.stop()
            self.abort(self.stop_error)
        except BaseException as e:
            self.died = e
            if ls is None or not isinstance(e, Exception):
                raise
            self.abort(e)

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
        if self.lockstep is not None and not self.lockstep.exchange(self):
            self.stopping = True  # rank 0's stop tick
            return
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
            r.seq = sess.open(r.prompt)  # the prompt may choose the replica (the prefix cache's)
            self.live.append(r)
            pick = 0
            try:
                if self.spec is not None:
                    tok = self.spec.prefill(r, len(self.live) + len(self.waiting))
                else:  # an echo request's prompt: its first token here, the others through decode steps
                    row = sess.extend(r.seq, r.prompt[:1] if r.echo else r.prompt)
                    pick = self._row(r, row)
                    tok = sess.share_ids([0 if pick is None else pick])[0]
            except Exception as e:  # noqa: BLE001 (the request fails, the server goes on)
                self._fail(r, e)
                continue
            r.cached_tokens = r.seq.cached
            if pick is not None:  # a shared id (not an echo prompt's placeholder): -1 is rank 0's failure
                self._sampled(r, tok)
            if r.done:  # its sampling failed (or an echo request asking no new token is done)
                continue
            if pick is None and self.spec is None:  # still scoring its prompt: live, no token yet
                joined.append(r)
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
            logits = self.sess.decode([r.seq for r in live],
                                      [r.ids[-1] if r.feeding is None else r.feeding for r in live])
        except Exception as e:  # noqa: BLE001 (the step failed: all its requests with it)
            for r in live:
                self._fail(r, e)
            return
        picks = [self._row(r, row) for r, row in zip(live, logits)]
        try:
            toks = self.sess.share_ids([0 if p is None else p for p in picks])
        except Exception as e:  # noqa: BLE001
            for r in live:
                self._fail(r, e)
            return
        for r, p, t in zip(live, picks, toks):
            if p is None:  # an echo request still scoring its prompt: no new token
                continue
            self._sampled(r, t)
            if not r.done:
                self._token(r, t)

    def _row(self, r: Request, row: np.ndarray) -> int | None:
        """What a logits row after `r`'s last token is for: the next prompt token's score (an echo request
        still feeding its prompt: None, no new token; done here if it asks for none) or its next id."""
        if not r.feed:
            r.feeding = None
            if r.max_new_tokens == 0:  # an echo request's one-token prompt: nothing to score, nothing asked
                self._finish(r, "length")
                return None
            return self._pick_or_fail(r, row)
        try:
            t = r.feed.popleft()
            r.prompt_logprobs.append(token_logprob(row, t, r.logprobs or 0))
        except Exception as e:  # noqa: BLE001 (a row it cannot score: that request fails alone)
            self._fail(r, e)
            return None
        r.feeding = t
        if not r.feed and r.max_new_tokens == 0:  # the prompt scored, nothing asked beyond it
            self._finish(r, "length")
        return None

    def _pick_or_fail(self, r: Request, row: np.ndarray) -> int:
        """`_pick`, or -1 (a placeholder the ranks share) with `r` failed: one request's sampling error (its
        parameters, its logits) ends that request only, not the others of its step. With `lockstep`, only
        rank 0 samples (the others take its ids)."""
        if self.lockstep is not None and not self.lockstep.leader:
            return 0
        try:
            return self._pick(r, row)
        except Exception as e:  # noqa: BLE001
            self._fail(r, e)
            return -1

    def _sampled(self, r: Request, tok: int) -> None:
        """A shared id of -1: rank 0's sampling failed `r` (ended there already; here on the other ranks)."""
        if tok < 0 and not r.done:
            self._fail(r, InputError("sampling this request failed on rank 0"))

    def _pick(self, r: Request, row: np.ndarray) -> int:
        """The request's next id from its logits `[V]` (plus its logit bias), with its own generator; its
        log-probability from the raw row when asked."""
        tok = self.sess.sample(_biased(row, r.logit_bias) if r.logit_bias else row, r.temperature, r.top_p, r.rng)
        if r.logprobs is not None:
            r.token_logprobs.append(token_logprob(row, tok, r.logprobs))
        return tok

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
        if r.on_token is not None and r.closing is None:
            try:
                ended = bool(r.on_token(r, tok))
            except Exception as e:  # noqa: BLE001 (a consumer's error ends its request only)
                if self.lockstep is None:
                    self._fail(r, e)
                    return
                r.closing = ("error", e)
        if ended and self.lockstep is not None:  # only rank 0 knows: every rank ends it at the next tick
            r.closing, ended = ("stop", None), False
        if ended or tok in r.stop_ids:
            self._end(r, "stop")
        elif len(r.ids) >= r.max_new_tokens:
            self._end(r, "length")

    def _end(self, r: Request, reason: str) -> None:
        """An end every rank sees here; an end its consumer decided before (`closing`) gives the reason."""
        if r.closing is not None:
            self.close(r)
        else:
            self._finish(r, reason)

    def close(self, r: Request) -> None:
        """End `r` as its consumer decided on rank 0 (`closing`; the other ranks know no reason: "stop")."""
        reason, err = r.closing or ("stop", None)
        if err is not None:
            self._fail(r, err)
        else:
            self._finish(r, reason)

    def _fail(self, r: Request, e: Exception) -> None:
        if self.raise_errors or (self.lockstep is not None and _fatal(e)):
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



def _biased(row: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    """A copy of the row with `bias` added (OpenAI's logit_bias: id -> value, added before sampling)."""
    out = np.array(row, dtype=np.float32)
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    out[ids] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    return out


def _fatal(e: Exception) -> bool:
    """An error after which a lockstep rank may not step again: a collective that failed (a rank gone) or a
    step that is not rank 0's."""
    return isinstance(e, DeviceError) or getattr(e, "code", None) == RANKS_DIVERGED
