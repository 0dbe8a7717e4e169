"""`v4compile serve ARTIFACT [--host H] [--port P] [--device D] [--api-key KEY] [--allowed-hosts NAMES]
[--max-queue N] [--request-timeout S]`: an OpenAI-compatible HTTP server.

    GET  /health                 {"status": "ok", "live", "waiting", "free_slots", "finished": {reason: n},
                                  "self_check": {"passed", "max_error", "tolerance", "seconds"} or null,
                                  data parallel: "replicas_placed", the sequences each replica took}
    GET  /metrics                Prometheus' text format (cli/metrics.py; open, like /health)
    GET  /v1/models              the one model, named by --model-name (default: the artifact's directory name)
    POST /v1/completions         {"model", "prompt": text or ids, "max_tokens" (16), "temperature" (1), "top_p",
                                  "seed", "stop", "stream", "stream_options": {"include_usage"}, "n",
                                  "logprobs" (0..5), "echo", "logit_bias"}
    POST /v1/chat/completions    {"model", "messages", "max_tokens" / "max_completion_tokens" (the rest of the
                                  context), ..., "stream", "n", "logprobs", "top_logprobs" (0..20), "logit_bias"};
                                  the prompt is the artifact's chat template

`n` choices are n requests of the loop (choice i seeded seed + i: `request_seed`), each with its own prefill;
log-probabilities and their response shapes: cli/serve_logprobs.py.

One scheduler thread owns the session and runs `Batcher.run_forever` (runtime/batcher.py): a request joins
the continuous batch when a slot is free and waits in a queue otherwise; its tokens go back to the event
loop, which streams each new stable text piece as a server-sent event (or returns the whole text). A client
that goes away (streaming or not) cancels its request, which frees its slot and blocks at the next step.
Every bad request is a 4xx with OpenAI's error body {"error": {"message", "type", "param", "code"}}: a body
that is not `application/json` (415), not valid Unicode or nested too deep, a role outside ROLES, a field
asking for what the server does not do (UNSUPPORTED); the server goes on. A request whose sampling fails
ends alone with a 500 (or an error event); the scheduler goes on, and `/health` is a 503 if it ever stops.
`Guard` checks the `Host` header and the API key (`Server.refusal`) before any route; `--max-queue` bounds
the requests waiting for a slot (429 beyond), `--request-timeout` a request's time (504 or an error event
past it); `Guard` also writes the access log. SIGTERM: the scheduler stops first, each request in flight
ends with an error event, the process exits 0 (`_uvicorn_server`).

A partitioned artifact under torchrun: rank 0 alone listens and runs the server; every other rank runs the
same scheduler loop in step with it (`_follow`; runtime/lockstep.py: each step's new requests, ends and
cancellations come from rank 0, each step's inputs and sampled ids too). A rank that dies ends the server:
the requests in flight end with a 503 (a stream: an error event), rank 0 exits with one `error:` line.
SIGTERM (torchrun forwards it to every rank): rank 0 shuts down as above and its stop tick ends the other
ranks, which wait for it (their own SIGTERM is noted, not acted on); every rank exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from ..errors import INVALID_VALUE, DeviceError, InputError, V4Error
from . import serve_logprobs
from .metrics import Metrics

log = logging.getLogger("v4compile")
access_log = logging.getLogger("v4compile.access")  # one line a request (uvicorn's own is off)

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MESSAGES = 1024
MAX_DEPTH = 32  # JSON nesting: OpenAI's bodies need 5 or so; deeper is an attack on the parser
ROLES = ("system", "user", "assistant", "tool")  # what a chat template is written for; any other string
#                                                   would be pasted into the template as is (a role can
#                                                   carry the template's control tokens)

# Fields of OpenAI's API this server does not implement, each with the values that ask for nothing (accepted,
# compared with their type); any other value is refused with a 400 naming the field, never silently ignored.
# `response_format` (json_object / json_schema) would need constrained decoding, tools a tool-call parser:
# both refused. `n`, `logprobs`, `top_logprobs`, `echo`, `logit_bias`: serve_logprobs.options_of.
UNSUPPORTED = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
}


class ServerError(Exception):
    """A request the server could not finish (its clients see the message, as a 500 or an error event)."""


class RequestTimeout(ServerError):
    """A request that ran past `--request-timeout` (ended by the server: 504, or an error event)."""


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def _error(message: str, param=None, code=None, status: int = 400, kind: str = "invalid_request_error",
           headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def refused(e: V4Error, chat: bool, key: str) -> BadRequest:
    """A request the runtime refused, as the API's 400: its code and param come from the error's typed fields,
    never from its text, so a reworded message changes no response but the message. The runtime's names
    become the request's: `max_new_tokens` is `key` (max_tokens / max_completion_tokens), the prompt of a
    chat is its `messages`; an error naming no param is the prompt's."""
    prompt = "messages" if chat else "prompt"
    param = {"max_new_tokens": key, "prompt": prompt, None: prompt}.get(e.param, e.param)
    return BadRequest(str(e).replace("max_new_tokens", key), param, e.code or INVALID_VALUE)


def _num(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"`{key}` must be {kind} in [{lo:g}, {hi:g}]", key, "invalid_value")
    return v


OPEN_PATHS = ("/health", "/metrics")  # answered without the API key: a probe or a scraper has none (cli/metrics.py)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class Server:
    def __init__(self, sess, model_name: str, *, api_key: str | None = None, allowed_hosts=("127.0.0.1",),
                 max_queue: int | None = None, request_timeout: float | None = None):
        """`api_key`: every request but OPEN_PATHS' must carry `Authorization: Bearer <it>`. `allowed_hosts`:
        the names a request's `Host` header may give (port left out; "*": any), besides LOCAL_HOSTS: a web
        page that rebinds its own name to this address sends its name, and is refused. `max_queue`: requests
        beyond this many waiting for a slot get a 429 (None: no bound). `request_timeout`: seconds a request may
        take from its arrival (waiting included) before it is ended with an error (None: no bound)."""
        from ..runtime.batcher import Batcher
        from ..runtime.lockstep import Lockstep

        self.sess = sess
        self.model = model_name
        self.self_check: dict | None = None  # the start-up self-check's figures, shown on /health
        self.api_key = api_key.encode() if api_key else None
        hosts = {f"[{h}]" if ":" in h and not h.startswith("[") else h for h in map(str.lower, allowed_hosts)}
        self.allowed_hosts = None if "*" in hosts else hosts | set(LOCAL_HOSTS)
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.tok = sess.tokenizer
        self.batcher = Batcher(sess, lockstep=Lockstep(sess.ranks) if sess.ranks is not None else None)
        self.on_died = None  # called on the scheduler's thread when a lockstep scheduler ends for good
        self.metrics = Metrics(self)
        self.finished: Counter[str] = Counter()
        self.pending: list = []  # (queue, event) of the step under way, handed to the event loop in one call
        self.loop = None
        self.batcher.on_step = self._hand_over
        self.thread = threading.Thread(target=self._schedule, name="v4compile-scheduler", daemon=True)

    def _schedule(self) -> None:
        try:
            self.batcher.run_forever()
        finally:  # a partitioned artifact's ranks that no longer step together: nothing more can be served
            if self.batcher.died is not None and self.batcher.lockstep is not None and self.on_died is not None:
                self.on_died()

    def _hand_over(self) -> None:
        """On the scheduler's thread, after each step: one wake-up of the event loop for all its tokens (one
        per token would cost the loop a wake-up and the scheduler the GIL hand-over, 8 times a step)."""
        if self.pending:
            items, self.pending = self.pending, []
            self.loop.call_soon_threadsafe(_deliver, items)

    def scheduler_dead(self) -> str | None:
        """Why the scheduler thread is gone (None while it runs): no request would ever be answered."""
        if self.batcher.died is not None and self.batcher.lockstep is not None:  # told before the thread ends
            return f"the scheduler stopped: {self.batcher.died}"
        if self.thread.is_alive() or not self.thread.ident:  # not started yet: the lifespan starts it
            return None
        return f"the scheduler stopped: {self.batcher.died!r}" if self.batcher.died else "the scheduler stopped"

    def _expire(self, req, expired: list) -> None:
        """On the event loop, at a request's timeout: end it (its `on_done` tells it why)."""
        if not req.done:
            expired.append(True)
            self.batcher.cancel(req)

    def refusal(self, path: str, headers: dict[str, str]):
        """The error response for a request whose `Host` is not this server's or that lacks the API key; None
        if it may go on."""
        if self.allowed_hosts is not None and _host_name(headers.get("host", "")) not in self.allowed_hosts:
            return _error(f"the Host header {_shown(headers.get('host', ''))} is not one of this server's names "
                          "(serve --allowed-hosts adds names)", None, "invalid_host")
        if self.api_key is None or path in OPEN_PATHS:
            return None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key):
            return _error("a missing or incorrect API key (give it as `Authorization: Bearer KEY`)", None,
                          "invalid_api_key", 401, headers={"WWW-Authenticate": "Bearer"})
        return None

    # ---- requests ---------------------------------------------------------------------------------
    async def body(self, request) -> dict:
        _check_media(request.headers.get("content-type", ""))
        size = 0
        chunks = []
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BadRequest(f"request body larger than {MAX_BODY_BYTES} bytes", None, "body_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise BadRequest(f"the request body is not valid JSON: {str(e)[:120]}", None, "invalid_json") from None
        except RecursionError:
            raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object", None, "invalid_json")
        _check_values(body, "", 0)
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(f"the model {_shown(model)} does not exist (this server has `{self.model}`)",
                             "model", "model_not_found")
        _check_fields(body)
        return body

    def prompt_of(self, body: dict, chat: bool) -> list[int]:
        if self.tok is None and (chat or isinstance(body.get("prompt"), str)):
            raise BadRequest("the artifact has no tokenizer: give the prompt as token ids", "prompt",
                             "no_tokenizer")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or len(msgs) > MAX_MESSAGES:
                raise BadRequest("`messages` must be a non-empty list", "messages", "invalid_value")
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ROLES:
                    role = m.get("role") if isinstance(m, dict) else m
                    raise BadRequest(f"messages[{i}]: the role must be one of {', '.join(ROLES)} (found "
                                     f"{_shown(role)})", "messages", "invalid_value")
            msgs = [{"role": m["role"], "content": _content(m.get("content"))} for m in msgs]
            try:
                return self.tok.encode(self.tok.apply_chat_template(msgs, add_generation_prompt=True))
            except V4Error as e:
                raise BadRequest(str(e), "messages", "invalid_value") from None
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):  # a batch of one
            p = p[0]
        if isinstance(p, str):
            return self.tok.encode(p)
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise BadRequest("`prompt` must be a string or a list of token ids", "prompt", "invalid_value")

    def stops_of(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("`stop` must be a string or a list of up to 4 non-empty strings", "stop", "invalid_value")
        return stop

    async def handle(self, request, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse

        from ..runtime.batcher import Request
        from ..runtime.session import request_seed

        arrived = time.perf_counter()
        dead = self.scheduler_dead()
        if dead:
            return _error(dead, status=503, kind="server_error")
        if self.batcher.stopping:
            return _error("the server is shutting down", status=503, kind="server_error")
        try:
            body = await self.body(request)
            # off the event loop: a long prompt's tokenization would stall every other client
            ids = await asyncio.to_thread(self.prompt_of, body, chat)
            try:
                opts = serve_logprobs.options_of(body, chat, self.sess.vocab)
            except InputError as e:
                raise BadRequest(str(e), e.param, e.code) from None
            ctx = self.sess.max_context
            key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
            default = max(1, ctx - len(ids)) if chat else 16
            max_tokens = body.get(key)
            least = 0 if opts.echo else 1  # echo + max_tokens 0: the prompt's log-probabilities only
            if max_tokens is None:
                max_tokens = default
            elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < least:
                raise BadRequest(f"`{key}` must be an integer >= {least}", key, "invalid_value")
            temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
            top_p = _num(body, "top_p", 1.0, 0.0, 1.0)
            if top_p == 0:
                raise BadRequest("`top_p` must be in (0, 1]", "top_p", "invalid_value")
            seed = _num(body, "seed", None, 0, 2 ** 63 - 1, integer=True)
            stops = self.stops_of(body)
            stream = bool(body.get("stream"))
            so = body.get("stream_options") or {}
            usage_chunk = isinstance(so, dict) and bool(so.get("include_usage"))
            if self.max_queue is not None and self.batcher.queued + opts.n > self.max_queue:
                raise BadRequest(f"the server is busy: {self.batcher.queued} requests wait for a slot "
                                 "(serve --max-queue); try again", None, "queue_full", 429)
            try:
                self.batcher.check(ids, max_tokens, temperature, top_p, seed, echo=opts.echo)
            except InputError as e:
                raise refused(e, chat, key) from None
        except BadRequest as e:
            if e.status == 429:
                return _error(str(e), e.param, e.code, 429, "rate_limit_error", {"Retry-After": "1"})
            return _error(str(e), e.param, e.code, e.status)

        self.loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        texts = [self.tok.stream(stops) if self.tok is not None else None for _ in range(opts.n)]
        expired: list[bool] = []  # set by the timer below, on the event loop, before it cancels the requests
        ended = [0]  # choices done (on the scheduler's thread)

        def on_token(r, tok: int) -> bool:  # events: ("token", choice, stable text, tokens so far)
            text = texts[r.index]
            if text is None:
                self.pending.append((q, ("token", r.index, "", len(r.ids))))
                return False
            piece, done = text.push(tok)
            self.pending.append((q, ("token", r.index, piece, len(r.ids))))
            return done

        def on_done(r) -> None:  # ("end", choice, the text held back, request); after the last: ("done", ...)
            if r.finish_reason == "cancelled" and expired:  # told as the error it is, not as a plain end
                r.error = RequestTimeout(f"the request ran past the server's --request-timeout "
                                         f"({self.request_timeout:g} s)")
            text = texts[r.index]
            tail = text.finish() if text is not None and r.finish_reason == "length" else ""
            self.finished[r.finish_reason] += 1
            if self.metrics is not None:
                self.metrics.finished(r, arrived)
            self.pending.append((q, ("end", r.index, tail, r)))
            ended[0] += 1
            if ended[0] == len(reqs):
                self.pending.append((q, ("done", None, "", None)))

        eos = self.tok.eos_ids if self.tok is not None else frozenset()
        # choice i samples from its own generator, seeded request_seed(seed, i) = seed + i (as `generate`'s
        # prompt i): choice 0 is the request with n = 1, and no choice depends on another
        reqs = [Request(ids, max_tokens, temperature, top_p, request_seed(seed, i), stop_ids=eos, on_token=on_token,
                        on_done=on_done, index=i, logprobs=opts.logprobs, echo=opts.echo, logit_bias=opts.logit_bias)
                for i in range(opts.n)]
        if self.metrics is not None:
            self.metrics.prompt(len(ids))
        for req in reqs:
            self.batcher.submit(req)
        timer = self.loop.call_later(self.request_timeout, lambda: [self._expire(r, expired) for r in reqs]) \
            if self.request_timeout is not None else None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        pieces = serve_logprobs.Pieces(self.tok) if opts.logprobs is not None else None
        prompt_text = ""
        if opts.echo:
            p = body.get("prompt")
            p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)) else p
            prompt_text = p if isinstance(p, str) else self.tok.decode(ids) if self.tok is not None else ""

        def logprobs(r, start: int, stop: int, offset: int, echo: bool = False):
            """The choice's log-probability field for its tokens [start, stop) (and its prompt's: echo)."""
            if pieces is None or (start >= stop and not echo):
                return None
            if chat:
                return {"content": serve_logprobs.chat_content(r.token_logprobs[start:stop], pieces)}
            pairs = list(zip(ids, r.prompt_logprobs)) if echo else []
            pairs += [(e.id, e) for e in r.token_logprobs[start:stop]]
            return serve_logprobs.completion_logprobs(pairs, pieces, offset)

        def choice(i: int, piece: str, finish, first: bool = False, lp=None) -> dict:
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece or first else {})
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"index": i, "text": piece, "logprobs": lp, "finish_reason": finish}

        def usage() -> dict:  # the prompt once, the completion tokens of every choice
            n = sum(len(r.ids) for r in reqs)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
                    "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens}}

        def finish_reason(r) -> str:
            return "stop" if r.finish_reason == "stop" else "length"

        if stream:
            async def events():
                def chunk(c: dict) -> str:
                    return "data: " + json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj,
                                                  "created": created, "model": self.model, "choices": [c]}) + "\n\n"
                try:
                    first = [True] * len(reqs)
                    sent = [0] * len(reqs)  # tokens whose log-probabilities were sent, per choice
                    offset = [0] * len(reqs)  # completions' text_offset so far
                    echoed = [not opts.echo] * len(reqs)
                    while True:
                        kind, i, piece, x = await q.get()
                        if kind == "done":
                            break
                        r = reqs[i]
                        if kind == "end" and x.error is not None:
                            err = {"error": {"message": str(x.error), "type": "server_error", "param": None,
                                             "code": None}}
                            yield f"data: {json.dumps(err)}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        if not echoed[i]:  # the prompt first, scored by now (its first token or its end came)
                            echoed[i], offset[i] = True, len(prompt_text)
                            yield chunk(choice(i, prompt_text, None, False, logprobs(r, 0, 0, 0, echo=True)))
                        if kind == "end":
                            n = len(r.token_logprobs)
                            yield chunk(choice(i, piece, finish_reason(x), first[i], logprobs(r, sent[i], n, offset[i])))
                            continue
                        if piece or first[i]:
                            lp = logprobs(r, sent[i], x, offset[i])
                            if lp is not None and not chat:
                                offset[i] += sum(pieces.width(e.id) for e in r.token_logprobs[sent[i]:x])
                            sent[i] = x
                            yield chunk(choice(i, piece, None, first[i], lp))
                            first[i] = False
                    if usage_chunk:  # OpenAI's stream_options.include_usage: a last chunk, no choices
                        yield "data: " + json.dumps({"id": rid, "object": obj + ".chunk" if chat else obj,
                                                     "created": created, "model": self.model, "choices": [],
                                                     "usage": usage()}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client went away (or the stream ended): free the slots now, not at max_tokens
                    if timer is not None:
                        timer.cancel()
                    for r in reqs:
                        if not r.done:
                            self.batcher.cancel(r)

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            if not await _until_done(request, q):
                return _error("the client disconnected", status=499)
        finally:  # the client went away (or the handler was cancelled): free the slots now, not at max_tokens
            if timer is not None:
                timer.cancel()
            for r in reqs:
                if not r.done:
                    self.batcher.cancel(r)
        failed = next((r.error for r in reqs if r.error is not None), None)
        if isinstance(failed, RequestTimeout):
            return _error(str(failed), None, "timeout", 504, "server_error")
        if failed is not None and failed is self.batcher.died:  # a rank gone: the server is ending
            return _error(str(failed), None, None, 503, "server_error")
        if failed is not None:
            return _error(str(failed), None, None, status=500)
        choices = []
        for r, text in zip(reqs, texts):
            out = text.text if text is not None else ""
            lp = logprobs(r, 0, len(r.token_logprobs), 0, echo=opts.echo)  # (echo: the text starts with the prompt)
            if chat:
                c = {"index": r.index, "message": {"role": "assistant", "content": out}, "logprobs": lp,
                     "finish_reason": finish_reason(r)}
            else:
                c = {"index": r.index, "text": prompt_text + out, "logprobs": lp, "finish_reason": finish_reason(r)}
                if text is None:
                    c["token_ids"] = r.ids
            choices.append(c)
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model, "choices": choices,
                             "usage": usage()})

    # ---- the app ----------------------------------------------------------------------------------
    def app(self):
        from contextlib import asynccontextmanager

        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        @asynccontextmanager
        async def lifespan(_app):
            self.thread.start()
            try:
                yield
            finally:
                self.batcher.stop()
                self.thread.join(timeout=10)

        app = FastAPI(title="v4compile", lifespan=lifespan)
        app.add_middleware(Guard, server=self)

        @app.get("/health")
        async def health():
            b = self.batcher
            dead = self.scheduler_dead()
            state = {"status": "error" if dead else "ok", "live": len(b.live), "waiting": b.queued,
                     "free_slots": len(self.sess.free_slots), "finished": dict(self.finished),
                     "self_check": self.self_check,
                     "prefix_cache": self.sess.prefix_cache_stats()}
            if self.sess.dp > 1:  # data parallel: the sequences each replica took so far (`Session.place`)
                state["replicas_placed"] = list(self.sess.placed)
            if dead:  # a load balancer's probe must see it: 503, and why
                state["error"] = dead
                return JSONResponse(state, status_code=503)
            return state

        @app.get("/metrics")
        async def metrics():
            from fastapi.responses import Response

            data, kind = self.metrics.text()
            return Response(data, media_type=kind)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                "owned_by": "v4compile"}]}

        async def completions(request):  # Starlette routes: the raw request, parsed and checked in `handle`
            return await self.handle(request, chat=False)

        async def chat_completions(request):
            return await self.handle(request, chat=True)

        app.add_route("/v1/completions", completions, methods=["POST"])
        app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

        from fastapi.exceptions import RequestValidationError
        from starlette.exceptions import HTTPException

        @app.exception_handler(HTTPException)
        async def http_error(_request, exc: HTTPException):
            return _error(str(exc.detail), status=exc.status_code, code="not_found" if exc.status_code == 404 else None,
                          headers=exc.headers)  # a 405's `Allow`

        @app.exception_handler(RequestValidationError)
        async def validation_error(_request, exc):
            return _error(str(exc)[:300])

        return app


class Guard:
    """ASGI middleware: `Server.refusal` before any route, and the access log line after each request (a
    plain ASGI layer, not Starlette's BaseHTTPMiddleware, which would sit between a stream and its client)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]

        async def sent(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = self.server.refusal(scope["path"], headers)
            await (refused if refused is not None else self.app)(scope, receive, sent)
        finally:  # the client's address, the request line (no query, no body: they may carry secrets; the
            #        path escaped: a newline in it would forge a log line), the status (-: none sent)
            if self.server.metrics is not None:
                self.server.metrics.answered(scope["path"], status[0])
            client = scope.get("client") or ("-", 0)
            access_log.info('%s "%s %s" %s %.3fs', client[0], scope["method"], repr(scope["path"][:200])[1:-1],
                            status[0] or "-", time.perf_counter() - start)


GRACE_S = 5  # after SIGTERM: how long open connections may take to end before uvicorn cuts them


def _uvicorn_server():
    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn's server, whose shutdown signal first stops the scheduler: each request in flight ends at
        once with an error (a stream: an error event, then [DONE]), so the grace period closes finished
        connections instead of cutting streams (a traceback each). SIGTERM is the way a server is asked to
        stop: it exits 0 (uvicorn would raise the signal again once done); Ctrl-C stays an interruption."""

        def __init__(self, config, server: Server):
            super().__init__(config)
            self.v4 = server

        def handle_exit(self, sig, frame) -> None:
            self.v4.batcher.stop(ServerError("the server is shutting down"))
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in getattr(self, "_captured_signals", ()):
                self._captured_signals.remove(sig)

        async def shutdown(self, sockets=None) -> None:
            """uvicorn's, and the app's own shutdown also after a second Ctrl-C (uvicorn's force exit skips it,
            and the lifespan task left waiting dies with a traceback when the interruption is raised again)."""
            await super().shutdown(sockets)
            if self.force_exit:
                await self.lifespan.shutdown()

    return Uvicorn


def _host_name(host: str) -> str:
    """The name of a `Host` header, its port left out (`[::1]:8000`: `[::1]`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _until_done(request, q: asyncio.Queue) -> bool:
    """Wait for a whole response's "done" event: True, or False as soon as its client disconnects (told by
    the server's `receive`, not polled)."""
    async def done() -> None:
        while (await q.get())[0] != "done":
            pass

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    tasks = [asyncio.ensure_future(done()), asyncio.ensure_future(gone())]
    try:
        finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
    return tasks[0] in finished


def _deliver(items: list) -> None:
    for q, event in items:
        q.put_nowait(event)


def _check_media(content_type: str) -> None:
    media = content_type.split(";")[0].strip().lower()
    if media != "application/json":  # a form or text/plain body is what a web page may send cross-site
        raise BadRequest(f"the request body must be application/json (found content-type "
                         f"{_shown(media or 'none')})", None, "unsupported_media_type", 415)


def _check_fields(body: dict) -> None:
    """No field asks for what the server does not do (UNSUPPORTED); `stream` a boolean."""
    for key, accepted in UNSUPPORTED.items():
        v = body.get(key)
        if v is not None and not any(type(v) is type(a) and v == a for a in accepted):
            raise BadRequest(f"`{key}` is not supported by this server (found {_shown(v)}; leave it out)",
                             key, "unsupported_parameter")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise BadRequest(f"`stream` must be true or false (found {_shown(body['stream'])})", "stream",
                         "invalid_type")


def _check_values(v, where: str, depth: int) -> None:
    """Every string of the body valid Unicode text (a lone surrogate, which JSON's \\ud800 escape can write,
    breaks the tokenizer and the JSON encoder of an error that quotes it), nested at most MAX_DEPTH deep."""
    if depth > MAX_DEPTH:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels", _param(where), "invalid_json")
    if isinstance(v, str):
        _check_text(v, f"`{where[:80]}`", where)
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_text(k, f"a key of `{where[:80]}`" if where else "a key of the body", where)
            _check_values(x, f"{where}.{k}" if where else k, depth + 1)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_values(x, f"{where}[{i}]", depth + 1)


def _check_text(s: str, what: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{what} is not valid Unicode text (a lone surrogate at character {e.start})",
                         _param(where), "invalid_value") from None


def _param(where: str) -> str | None:
    """The top-level field a path inside the body lies in (`messages[2].content`: `messages`)."""
    return where.split(".")[0].split("[")[0][:80] or None


def _shown(v) -> str:
    """A request's value quoted in an error message: short, and JSON (the checks above made it encodable)."""
    r = json.dumps(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _content(c):
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    return c


def cmd_serve(args) -> int:
    import uvicorn

    from ..runtime import load

    sess = load(args.artifact, device=args.device, threads=args.threads, prefix_cache=not args.no_prefix_cache)
    # on every rank of a partitioned artifact: the check's steps are collective, its verdict the worst rank's
    checked = startup_self_check(sess) if args.self_check else None
    if sess.ranks is not None and sess.ranks.rank > 0:
        return _follow(sess)
    name = args.model_name or Path(args.artifact).resolve().name
    key = args.api_key or os.environ.get("V4COMPILE_API_KEY") or None
    hosts = [args.host, *(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())]
    server = Server(sess, name, api_key=key, allowed_hosts=hosts, max_queue=args.max_queue,
                    request_timeout=args.request_timeout)
    server.self_check = checked
    sess.warmup(1, sess.max_batch)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise InputError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    port = sock.getsockname()[1]
    if args.host in ("0.0.0.0", "::") and not args.allowed_hosts:  # reachable by addresses the Host check refuses
        log.warning("listening on every interface, but only requests that name this server localhost, "
                    "127.0.0.1, [::1] or %s are served: give the names clients use with --allowed-hosts", args.host)
    ranks = f", {sess.ranks.world} ranks" if sess.ranks is not None else ""
    log.info("serving %s on http://%s:%d (%s device, %d slots%s)", name, args.host, port, args.device, sess.max_batch,
             ranks)
    sys.stderr.flush()
    config = uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=GRACE_S, lifespan="on")
    uv = _uvicorn_server()(config, server)
    server.on_died = lambda: setattr(uv, "should_exit", True)
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
        sess.close()
    return _died(server.batcher)


def _follow(sess) -> int:
    """A rank > 0 of a partitioned artifact: the scheduler loop in step with rank 0's until its stop tick
    (runtime/lockstep.py). A shutdown signal is noted only: rank 0, which torchrun signals too, decides
    when the ranks stop, and one rank leaving mid-step would end the others with an error."""
    from ..runtime.batcher import Batcher
    from ..runtime.lockstep import Lockstep

    got: list[int] = []
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, lambda signum, _frame: got.append(signum))
    rank = sess.ranks.rank  # (the session's ranks are gone once it is closed)
    batcher = Batcher(sess, lockstep=Lockstep(sess.ranks))
    sess.warmup(1, sess.max_batch)
    log.info("rank %d of %d: stepping with rank 0's server", rank, sess.ranks.world)
    try:
        batcher.run_forever()
    finally:
        sess.close()
    if got and batcher.died is not None:  # shutting down: rank 0 went before its stop tick came
        log.info("rank %d: rank 0 ended during the shutdown", rank)
        return 0
    return _died(batcher)


def _died(batcher) -> int:
    """A lockstep scheduler's end for good as the command's error (one line); 0 otherwise."""
    died = batcher.died
    if died is None or batcher.lockstep is None:
        return 0
    if isinstance(died, V4Error):
        raise died
    raise DeviceError(f"the scheduler stopped: {died}")


def startup_self_check(sess) -> dict | None:
    """Before listening: the artifact's golden on this device (`Session.self_check`). A failure refuses to start
    (one `error:` line, exit 2); an artifact without a golden starts with a warning. /health's `self_check`."""
    from ..errors import DeviceError

    if "golden" not in sess.art.manifest:
        log.warning("self-check skipped: the artifact carries no golden (compiled with --no-golden)")
        return None
    r = sess.self_check()
    if not r.passed:
        where = ", ".join(f"{k} {v}" for k, v in (("rank", r.first_rank), ("step", r.first_step),
                                                   ("lane", r.first_lane), ("layer", r.first_layer)) if v is not None)
        raise DeviceError(f"self-check FAILED on {r.device}: {r.reason}" + (f" (first departure: {where})" if where
                                                                             else "") + "; not serving "
                          "(--no-self-check skips the check)")
    log.info("self-check passed on %s: logit error %.3g of their scale, tolerance %.3g (%.2f s)", r.device,
             r.max_error, r.tolerance, r.seconds)
    return {"passed": True, "max_error": r.max_error, "tolerance": r.tolerance, "seconds": round(r.seconds, 3)}


def add_command(sub) -> None:
    from ..runtime.session import DEVICES
    from .args import threads_arg

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a compiled artifact")
    s.add_argument("artifact", metavar="ARTIFACT", help="artifact directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--self-check", action=argparse.BooleanOptionalAction, default=True,
                   help="before listening, run the artifact's golden on the device and refuse to start if it departs "
                        "(default on; --no-self-check skips it); /health shows the result")
    s.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port, printed)")
    s.add_argument("--device", choices=DEVICES, default="auto")
    s.add_argument("--threads", type=threads_arg, default=None, help="CPU threads")
    s.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt whole (no prefix cache)")
    s.add_argument("--model-name", default=None, help="the model's name in the API (default: the directory name)")
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every request but "
                   "/health (default: $V4COMPILE_API_KEY; neither: no key)")
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated names the Host header may give besides --host, localhost, 127.0.0.1 "
                   "and [::1] ('*': any; needed with --host 0.0.0.0, for the names clients use)")
    s.add_argument("--max-queue", type=_queue, default=None, metavar="N",
                   help="requests waiting for a slot beyond N get a 429 (default: no bound)")
    s.add_argument("--request-timeout", type=_seconds, default=None, metavar="S",
                   help="end a request S seconds after it came (waiting included) with an error: a 504, or a "
                   "stream's error event (default: no bound)")
    s.set_defaults(func=cmd_serve)


def _seconds(text: str) -> float:
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, found {text[:40]!r}") from None
    if not (math.isfinite(v) and 0 < v <= 1e6):
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 1e6], found {text[:40]}")
    return v


def _queue(text: str) -> int:
    from .args import int_arg

    return int_arg(0, 1 << 20)(text)


def _port(text: str) -> int:
    from .args import int_arg

    return int_arg(0, 65535)(text)
