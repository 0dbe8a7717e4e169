"""`serve` against hostile and careless clients, the server run in this process (uvicorn on a thread, an
ephemeral port on 127.0.0.1) so a test can plant a fault in it: nothing a request carries stops the
scheduler (a failing request ends alone, `/health` says when the scheduler is gone), and every bad request
is a 4xx with OpenAI's error body while the server goes on. Each check comes with the fault it catches
planted (monkeypatched) and shown failing the same assertion. Every wait has a timeout; each server is
stopped and its thread joined.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

TIMEOUT = 30


@pytest.fixture(scope="module")
def art(doc_art):
    return doc_art  # tests/conftest.py: compiled once per process


@contextlib.contextmanager
def serving(art, **options):
    """A `serve.Server` over the artifact on a free port, run by uvicorn on a thread: (server, url)."""
    import uvicorn

    import v4compile
    from v4compile.cli.serve import Server

    sess = v4compile.load(art, device="cpu", threads=1)
    server = Server(sess, "tiny-doc", **options)
    sock = socket.create_server(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="critical", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=TIMEOUT)
        sock.close()
        sess.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def served(art):
    with serving(art) as s:
        yield s


def post(url: str, body, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    if "content" not in kw:
        kw["content"] = json.dumps(body).encode()
        kw.setdefault("headers", {"content-type": "application/json"})
    return httpx.post(url + path, timeout=TIMEOUT, **kw)


def chat_body(content: str = "json.dumps", **kw) -> dict:
    return {"model": "tiny-doc", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **kw}


def answer(url: str, **kw) -> str:
    r = post(url, chat_body(**kw))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def outcome(url: str, body: dict, timeout: float = 10) -> int | str:
    """The status of one request, or "timeout" (a scheduler that no longer steps never answers)."""
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout).status_code
    except httpx.TimeoutException:
        return "timeout"


def openai_error(r: httpx.Response, status: int, param=None) -> dict:
    """The response is `status` with OpenAI's error body naming `param`; its error object."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    return err


# ---- nothing a request carries stops the scheduler ---------------------------------------------------

def old_sample(row, temperature, top_p, rng):
    """`session.sample` as it was: row / temperature first, which a tiny temperature overflows to NaN."""
    if temperature == 0:
        return int(row.argmax())
    p = row.astype(np.float64) / temperature
    p = np.exp(p - p.max())
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


def tiny_temperature_while_another_streams(url: str) -> tuple[int, str, str]:
    """A greedy stream running while a request with temperature 1e-310 (in range, tiny enough to overflow
    logits / temperature) comes and goes: (that request's status, the stream's text, a later request's)."""
    text: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=TIMEOUT,
                          json=chat_body("os.path.join", max_tokens=48, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])
                    text.append(ch["choices"][0]["delta"].get("content") or "" if ch.get("choices") else "")
    t = threading.Thread(target=stream)
    t.start()
    status = post(url, chat_body("re.compile", temperature=1e-310, max_tokens=4)).status_code
    t.join(timeout=TIMEOUT)
    return status, "".join(text), answer(url, content="re.compile", max_tokens=4)


def test_a_tiny_temperature_samples_the_argmax_and_others_go_on(served):
    """Catches the softmax overflowing to NaN at a tiny temperature (the old `sample` is planted below)."""
    _server, url = served
    greedy = answer(url, content="os.path.join", max_tokens=48)
    status, streamed, later = tiny_temperature_while_another_streams(url)
    assert status == 200
    assert streamed == greedy and later == answer(url, content="re.compile", max_tokens=4)


def test_the_old_sampling_fails_it_but_only_that_request(served, monkeypatch):
    """With the overflowing softmax planted, the tiny temperature's request fails (the assertion above), and
    fails alone: the stream beside it and a later request are whole."""
    server, url = served
    greedy = answer(url, content="os.path.join", max_tokens=48)
    monkeypatch.setattr(server.sess, "sample", old_sample)
    status, streamed, later = tiny_temperature_while_another_streams(url)
    assert status == 500
    assert streamed == greedy and later == answer(url, content="re.compile", max_tokens=4)
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"


def test_non_finite_logits_are_one_clear_error():
    """Catches NaN logits surfacing as numpy's own complaint (the old `sample`, which raises a bare
    ValueError, fails the `pytest.raises` below); a finite row at a tiny temperature gives its argmax."""
    from v4compile.errors import DeviceError
    from v4compile.runtime.session import sample

    rng = np.random.default_rng(5)
    row = rng.standard_normal(512).astype(np.float32)
    assert sample(row, 1e-310, 1.0, rng) == int(row.argmax())
    for bad in (np.nan, np.inf):
        broken = row.copy()
        broken[rng.integers(0, 512)] = bad
        with pytest.raises(DeviceError, match="not finite"):
            sample(broken, 0.7, 0.9, rng)
        with pytest.raises(Exception) as e, np.errstate(all="ignore"):
            old_sample(broken, 0.7, 0.9, rng)
        assert not isinstance(e.value, DeviceError)


def plant_step_fault(monkeypatch, batcher) -> None:
    """A decode step that raises outside every request's handler, once (a bug in the loop itself)."""
    decode = type(batcher)._decode
    fired = []

    def faulty(self):
        if not fired:
            fired.append(1)
            raise RuntimeError("planted fault in a step")
        return decode(self)
    monkeypatch.setattr(type(batcher), "_decode", faulty)


def test_a_step_error_fails_its_requests_and_the_scheduler_goes_on(served, monkeypatch):
    """Catches a scheduler thread that dies of an error no request's handler took (the guard is removed
    below): the request in the failed step gets a 500, the next one its answer, `/health` stays ok."""
    server, url = served
    plant_step_fault(monkeypatch, server.batcher)
    assert outcome(url, chat_body(max_tokens=4)) == 500
    assert outcome(url, chat_body(max_tokens=4)) == 200
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"


def test_without_the_guard_the_scheduler_dies_and_health_says_so(art, monkeypatch):
    """The step guard removed (`_fail_all` re-raises): the later request never gets its answer (the
    assertion above fails), and `/health` is a 503 naming the dead scheduler. A server of its own."""
    from v4compile.runtime.batcher import Batcher

    def reraise(self, e):
        raise e
    monkeypatch.setattr(Batcher, "_fail_all", reraise)
    with serving(art) as (server, url):
        plant_step_fault(monkeypatch, server.batcher)
        outcome(url, chat_body(max_tokens=4), timeout=3)  # the step that kills it
        assert outcome(url, chat_body(max_tokens=4), timeout=3) != 200
        r = httpx.get(url + "/health", timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["status"] == "error" and "planted fault" in r.json()["error"]
        openai_error(post(url, chat_body()), 503)  # refused at once, not left hanging


# ---- every bad request is a 4xx with OpenAI's error body ---------------------------------------------

def bad_requests() -> list[tuple[str, object, dict, int, str | None]]:
    """(what, body or raw bytes, headers, status, param) of requests the server must refuse."""
    rng = np.random.default_rng(37)
    lone = "\ud800\udfff"[int(rng.integers(0, 2))]  # a surrogate with no partner
    deep = int(rng.integers(2_000, 100_000))
    raw = {"content-type": "application/json"}
    return [
        ("stream as a string", chat_body(stream="false"), raw, 400, "stream"),
        ("stream as a number", chat_body(stream=1), raw, 400, "stream"),
        ("a role outside the template's", {**chat_body(), "messages": [{"role": "user|><|assistant", "content": "x"}]},
         raw, 400, "messages"),
        ("a missing role", {**chat_body(), "messages": [{"content": "x"}]}, raw, 400, "messages"),
        ("a lone surrogate in a message", json.dumps(chat_body("a" + lone)).encode(), raw, 400, "messages"),
        ("a lone surrogate in a prompt", json.dumps({"prompt": lone + "b", "max_tokens": 2}).encode(), raw, 400,
         "prompt"),
        ("a lone surrogate in the model's name", json.dumps(chat_body(model=lone)).encode(), raw, 400, "model"),
        ("a lone surrogate in a key", json.dumps({**chat_body(), lone: 1}).encode(), raw, 400, None),
        ("deeply nested JSON", b'{"messages": ' + b"[" * deep + b"]" * deep + b"}", raw, 400, None),
        ("nesting under the parser's limit", json.dumps({**chat_body(), "x": json.loads("[" * 40 + "]" * 40)}).encode(),
         raw, 400, "x"),
        ("a text/plain body", json.dumps(chat_body()).encode(), {"content-type": "text/plain"}, 415, None),
        ("a form body", b"a=1", {"content-type": "application/x-www-form-urlencoded"}, 415, None),
        ("no content-type", json.dumps(chat_body()).encode(), {}, 415, None),
    ] + [(f"`{k}` requested", chat_body(**{k: v}), raw, 400, k) for k, v in [
        ("best_of", 2), ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
        ("presence_penalty", 0.5)]]


def test_bad_requests_are_4xx_with_openai_error_bodies(served):
    """Catches each class of the held-out suite's failures (500s with tracebacks on invalid Unicode and deep
    nesting, bad input accepted, requested features silently ignored); the planted variant is the next
    test. The server answers a normal request after them all."""
    _server, url = served
    for what, body, headers, status, param in bad_requests():
        kw = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
        path = "/v1/completions" if "prompt" in what else "/v1/chat/completions"
        err = openai_error(post(url, None, path, headers=headers, **kw), status, param)
        assert "Traceback" not in err["message"], what
    assert answer(url, max_tokens=4) is not None
    accepted = chat_body(stream=False, logprobs=False, n=1, response_format={"type": "text"}, presence_penalty=0)
    assert post(url, accepted).status_code == 200  # the values that ask for nothing are fine


def test_without_the_checks_they_are_accepted_or_500(served, monkeypatch):
    """The body checks planted out (content-type, Unicode and depth, fields, roles): the cases above no longer
    get their 4xx (the assertion above fails), bar those another layer refuses too."""
    from v4compile.cli import serve

    for check in ("_check_media", "_check_values", "_check_fields"):
        monkeypatch.setattr(serve, check, lambda *a: None)
    monkeypatch.setattr(serve, "ROLES", type("Any", (), {"__contains__": lambda self, x: True})())
    _server, url = served
    wrong = []
    for what, body, headers, status, _param in bad_requests():
        kw = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
        path = "/v1/completions" if "prompt" in what else "/v1/chat/completions"
        if post(url, None, path, headers=headers, **kw).status_code != status:
            wrong.append(what)
    # still refused: the model's name (not this server's), deep nesting (the JSON parser's recursion limit,
    # caught)
    assert {b[0] for b in bad_requests()} - set(wrong) == {"a lone surrogate in the model's name",
                                                          "deeply nested JSON"}, wrong
    assert answer(url, max_tokens=4) is not None


def test_a_405_says_which_methods_are_allowed(served):
    """Catches a 405 without its `Allow` header (the exception handler dropping the exception's headers)."""
    _server, url = served
    r = httpx.get(url + "/v1/chat/completions", timeout=TIMEOUT)
    openai_error(r, 405)
    assert r.headers.get("allow") == "POST"


def test_a_405_without_the_handler_s_headers_fails_it(served, monkeypatch):
    """The error handler dropping the exception's headers (as it did): no `Allow`, the assertion above fails."""
    from v4compile.cli import serve

    error = serve._error
    monkeypatch.setattr(serve, "_error", lambda *a, headers=None, **kw: error(*a, **kw))
    _server, url = served
    r = httpx.get(url + "/v1/chat/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and r.headers.get("allow") != "POST"


# ---- operators' needs: a key, the Host header, a bounded queue, a client that leaves ------------------

def auth(key: str | None) -> dict:
    return {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}


def key_outcomes(url: str, key: str) -> dict[str, int]:
    """Statuses: no key, a wrong key (the right one with its last character changed), the right key (as the
    `openai` client sends it), /health and /metrics without a key (both open, as vLLM's)."""
    import openai

    wrong = key[:-1] + ("a" if key[-1] != "a" else "b")
    got = {what: post(url, chat_body(max_tokens=2), headers=auth(k)).status_code
           for what, k in (("none", None), ("wrong", wrong))}
    c = openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)
    got["right"] = 200 if c.chat.completions.create(**chat_body(max_tokens=2)).choices else 0
    got["health"] = httpx.get(url + "/health", timeout=TIMEOUT).status_code
    got["metrics"] = httpx.get(url + "/metrics", timeout=TIMEOUT).status_code
    return got


def test_an_api_key_is_required_but_not_by_health(art, monkeypatch):
    """Catches a server that serves without the key (the check planted out below fails the first assertion)
    and a 401 without OpenAI's error body."""
    key = "sk-" + np.random.default_rng(7).bytes(12).hex()
    with serving(art, api_key=key) as (server, url):
        assert key_outcomes(url, key) == {"none": 401, "wrong": 401, "right": 200, "health": 200, "metrics": 200}
        err = openai_error(post(url, chat_body(), headers=auth("nope")), 401)
        assert err["code"] == "invalid_api_key" and key not in json.dumps(err)
        monkeypatch.setattr(server, "api_key", None)  # the planted fault: no key asked for
        assert key_outcomes(url, key) == {"none": 200, "wrong": 200, "right": 200, "health": 200, "metrics": 200}


def host_outcomes(url: str) -> dict[str, int]:
    port = url.rsplit(":", 1)[1]
    return {h: httpx.get(url + "/v1/models", headers={"host": h}, timeout=TIMEOUT).status_code
            for h in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"rebound.example:{port}",
                      "rebound.example")}


def test_a_foreign_host_header_is_refused(served, monkeypatch):
    """Catches DNS rebinding: a page whose name now points here sends its own name as Host (the check
    planted out serves it: the last assertion)."""
    server, url = served
    port = url.rsplit(":", 1)[1]
    assert host_outcomes(url) == {f"localhost:{port}": 200, f"127.0.0.1:{port}": 200, f"[::1]:{port}": 200,
                                  f"rebound.example:{port}": 400, "rebound.example": 400}
    r = httpx.get(url + "/v1/models", headers={"host": "rebound.example"}, timeout=TIMEOUT)
    assert openai_error(r, 400)["code"] == "invalid_host"
    monkeypatch.setattr(server, "allowed_hosts", server.allowed_hosts | {"rebound.example"})  # --allowed-hosts
    assert host_outcomes(url)["rebound.example"] == 200
    monkeypatch.setattr(server, "allowed_hosts", None)  # the planted fault: any Host served
    assert host_outcomes(url)[f"rebound.example:{port}"] == 200


@contextlib.contextmanager
def no_admission(monkeypatch, batcher):
    """The scheduler admits nothing while inside (requests pile up waiting), then everything again."""
    admit = type(batcher)._admit
    held = threading.Event()
    held.set()

    def holding(self):
        if held.is_set():
            time.sleep(0.01)  # not a busy loop on the lock
            return []
        return admit(self)
    monkeypatch.setattr(type(batcher), "_admit", holding)
    try:
        yield
    finally:
        held.clear()


def queue_outcomes(server, url: str, monkeypatch) -> list[int | str]:
    """Statuses of 3 requests sent while nothing is admitted: 2 fill a queue of 2, the third comes after."""
    got: dict[int, int | str] = {}
    with no_admission(monkeypatch, server.batcher):
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, outcome(url, chat_body(max_tokens=2))))
                   for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while len(server.batcher.waiting) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        got[2] = outcome(url, chat_body(max_tokens=2), timeout=3)
    for t in threads:
        t.join(timeout=TIMEOUT)
    return [got.get(i) for i in range(3)]


def test_a_full_queue_gives_429(served, monkeypatch):
    """Catches an unbounded queue (`max_queue` planted out: the third request waits instead of a 429)."""
    server, url = served
    monkeypatch.setattr(server, "max_queue", 2)
    assert queue_outcomes(server, url, monkeypatch) == [200, 200, 429]
    with no_admission(monkeypatch, server.batcher):
        threads = [threading.Thread(target=outcome, args=(url, chat_body(max_tokens=2))) for _ in range(2)]
        for t in threads:
            t.start()
        while len(server.batcher.waiting) < 2:
            time.sleep(0.02)
        r = post(url, chat_body())
        assert openai_error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
    for t in threads:
        t.join(timeout=TIMEOUT)
    monkeypatch.setattr(server, "max_queue", None)  # the planted fault
    assert queue_outcomes(server, url, monkeypatch)[2] == "timeout"


def idle(server) -> None:
    """Wait until no request is in flight (an earlier test's requests would blur the counts)."""
    deadline = time.monotonic() + TIMEOUT
    while server.batcher.busy:
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


def finished(url: str) -> dict[str, int]:
    return httpx.get(url + "/health", timeout=TIMEOUT).json()["finished"]


def leave_a_whole_response(server, url: str, monkeypatch) -> tuple[int, int]:
    """A non-streaming client that gives up after 1 s of a request that needs over 6 s (decode steps slowed
    to 0.06 s): (cancelled, ran to its length) of the finished requests, 3 s after it left."""
    decode = type(server.batcher)._decode

    def slow(self):
        time.sleep(0.06)
        return decode(self)
    monkeypatch.setattr(type(server.batcher), "_decode", slow)
    idle(server)
    before = finished(url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/chat/completions", json=chat_body(max_tokens=100), timeout=1)
    time.sleep(3)
    after = finished(url)
    return (after.get("cancelled", 0) - before.get("cancelled", 0), after.get("length", 0) - before.get("length", 0))


def test_a_whole_response_client_that_leaves_is_cancelled(served, monkeypatch):
    """Catches a non-streaming request that runs on to max_tokens after its client left (the disconnect
    check planted out below: the request is not cancelled, the assertion fails)."""
    server, url = served
    assert leave_a_whole_response(server, url, monkeypatch) == (1, 0)
    from v4compile.cli import serve

    async def until_done(_request, q):  # the planted fault: deaf to the client
        while (await q.get())[0] != "done":
            pass
        return True
    monkeypatch.setattr(serve, "_until_done", until_done)
    assert leave_a_whole_response(server, url, monkeypatch)[0] == 0
    for r in list(server.batcher.live):  # end it now, not at its length: the next test wants an idle server
        server.batcher.cancel(r)
    idle(server)


# ---- SIGTERM: streams end with an error event, the server exits 0 ------------------------------------

PLANT_NO_HOOK = ("import sys, uvicorn; from v4compile.cli import main, serve; "
                 "serve._uvicorn_server = lambda: (lambda config, _server: uvicorn.Server(config)); ")


def sigterm_with_open_streams(art, tmp_path, plant: str = "") -> tuple[int | None, float, list[str], str]:
    """A `serve` process with 4 open greedy streams (250 tokens each: seconds of work) gets SIGTERM after
    each stream's first event: (exit status, seconds to exit, each stream's last event, stderr)."""
    import signal
    import subprocess
    import sys

    log = tmp_path / "serve.log"
    code = plant + "from v4compile.cli import main; sys.exit(main(sys.argv[1:]))"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-c", "import sys; " + code, "serve", str(art), "--port", "0",
                              "--device", "cpu", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while not (m := __import__("re").search(r"on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        url = m.group(1)
        last: dict[int, str] = {}
        started = threading.Barrier(5, timeout=TIMEOUT)

        def stream(i: int) -> None:
            body = {"prompt": "Return the", "max_tokens": 250, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                waiting = True
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        last[i] = line
                        if waiting:
                            waiting = False
                            started.wait()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        for t in threads:
            t.join(timeout=TIMEOUT)
        return rc, took, [last.get(i, "") for i in range(4)], log.read_text()
    finally:
        p.kill()
        p.wait(timeout=30)


def test_sigterm_ends_every_stream_with_an_error_event_and_exits_0(art, tmp_path):
    """Catches a shutdown that leaves the streams to uvicorn's grace period (the hook planted out below):
    streams must end at once with an error event, the process exit 0 within 10 s, no traceback."""
    rc, took, last, err = sigterm_with_open_streams(art, tmp_path)
    assert rc == 0 and took < 10, (rc, took, err[-2000:])
    assert all(json.loads(e[6:]).get("error", {}).get("message") == "the server is shutting down" for e in last), last
    assert "Traceback" not in err, err[-3000:]


def test_without_the_shutdown_hook_streams_run_on(art, tmp_path):
    """uvicorn's own handling (the hook planted out): the streams are not told (the assertion above fails:
    they run on to their length or are cut) and SIGTERM is raised again (exit 128 + 15)."""
    rc, _took, last, _err = sigterm_with_open_streams(art, tmp_path, PLANT_NO_HOOK)
    assert rc != 0
    assert not any("error" in json.loads(e[6:]) for e in last if e), last


# ---- a per-request timeout, the access log -------------------------------------------------------------

def past_the_timeout(server, url: str, monkeypatch) -> tuple[int, str]:
    """With --request-timeout 1 and decode steps slowed to 0.06 s, 40 new tokens (2.4 s and more): a whole
    response's status, and a stream's last event."""
    decode = type(server.batcher)._decode

    def slow(self):
        time.sleep(0.06)
        return decode(self)
    monkeypatch.setattr(type(server.batcher), "_decode", slow)
    monkeypatch.setattr(server, "request_timeout", 1.0)
    status = post(url, chat_body(max_tokens=40)).status_code
    last = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(max_tokens=40, stream=True),
                      timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = line
    return status, last


def test_a_request_past_its_timeout_ends_with_an_error(served, monkeypatch):
    """Catches a request that runs on past --request-timeout (the timer planted out below: a 200)."""
    server, url = served
    status, last = past_the_timeout(server, url, monkeypatch)
    assert status == 504 and "request-timeout" in json.loads(last[6:])["error"]["message"], (status, last)
    err = openai_error(post(url, chat_body(max_tokens=40)), 504)
    assert err["code"] == "timeout"
    from v4compile.cli import serve

    monkeypatch.setattr(serve.Server, "_expire", lambda *a: None)  # the planted fault
    status, last = past_the_timeout(server, url, monkeypatch)
    assert status == 200 and "error" not in json.loads(last[6:])


def test_every_request_has_an_access_log_line(served, monkeypatch):
    """Catches requests that leave no trace (the access logger planted silent below), and a path that
    could forge a log line (its newline is escaped). The records are caught by a handler on the access
    logger itself, not pytest's caplog, which sees only what propagates to the root logger (the CLI's
    logging set-up, run by other tests in this process, may stop that)."""
    import logging

    from v4compile.cli import serve

    class Caught(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def caught_while(send, lines: int = 1) -> list[str]:
        """The access lines while `send` runs, waiting (up to 5 s) for `lines` of them: the middleware writes a
        request's line once its response is sent, so the client can have it before the line exists."""
        import time

        h, log = Caught(), logging.getLogger("v4compile.access")
        level = log.level
        log.addHandler(h)
        log.setLevel(logging.INFO)
        try:
            send()
            end = time.monotonic() + 5
            while len(h.lines) < lines and time.monotonic() < end:
                time.sleep(0.02)
        finally:
            log.removeHandler(h)
            log.setLevel(level)
        return h.lines

    _server, url = served

    def three():
        post(url, chat_body(max_tokens=2))
        post(url, chat_body(), headers={"content-type": "text/plain"})
        httpx.get(url + "/x%0Aforged", timeout=TIMEOUT)
    lines = caught_while(three, lines=3)
    assert any('"POST /v1/chat/completions" 200' in x for x in lines), lines
    assert any('"POST /v1/chat/completions" 415' in x for x in lines), lines
    assert any('"GET /x\\nforged" 404' in x and "\n" not in x for x in lines), lines
    monkeypatch.setattr(serve, "access_log", logging.getLogger("v4compile.silent"))  # the planted fault
    assert not caught_while(lambda: post(url, chat_body(max_tokens=2)))
