"""`serve`'s API beyond plain text, driven by the real `openai` client against a server run in this process
(test_serve_hostile's `serving`, so a fault can be planted): log-probabilities (chat and completions,
streamed and whole, `echo` of a 300-token prompt with `max_tokens` 0) equal the reference model's
log-softmax, `n` choices, `logit_bias`, `/metrics`, and every request isolated from the others of its batch.
Each check comes with the fault it catches planted and shown failing it.

Tolerance: the artifact (official numerics, fp32, cpu) against `ReferenceModel` (the same numerics, torch):
log-probabilities within LOGPROB_TOL (measured: 1.4e-4 at most over the 300-token prompt).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_serve_hostile import TIMEOUT, no_admission, serving

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"
LOGPROB_TOL = 1e-3
TOP = 2


@pytest.fixture(scope="module")
def served(doc_art):
    with serving(doc_art) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    """log-softmax of the reference model's logits for a list of ids ([T, V], the row of position t predicting
    token t + 1), the model loaded once."""
    import torch

    import v4compile

    model = v4compile.ReferenceModel.from_pretrained(str(EXAMPLE), numerics="official", dtype=torch.float32)
    seen: dict[tuple[int, ...], np.ndarray] = {}  # whole and streamed score the same ids

    def log_softmax(ids: list[int]) -> np.ndarray:
        if tuple(ids) not in seen:
            seen[tuple(ids)] = forward(ids)
        return seen[tuple(ids)]

    def forward(ids: list[int]) -> np.ndarray:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # its small ops: 0.5 s for 300 tokens, 20 s with a thread per (busy) core
        try:
            with torch.no_grad():
                return torch.log_softmax(model.forward(torch.tensor(ids)).float(), -1).numpy()
        finally:
            torch.set_num_threads(threads)
    return log_softmax


def client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT * 4, max_retries=0)


def long_prompt(tok, n: int = 300) -> list[int]:
    """`n` ids of real text (the package's README), as a harness's loglikelihood request sends them."""
    text = (EXAMPLE.parents[1] / "README.md").read_text()
    return tok.encode(text)[:n]


def completion_errors(ref, ids: list[int], lp, skip_first: bool) -> float:
    """Largest difference between a completions `logprobs` object (tokens `ids`, first entry null when
    `skip_first`) and the reference's values for the same ids (each token's, and the top alternatives')."""
    want = ref(ids)
    worst = 0.0
    for t in range(1 if skip_first else 0, len(ids)):
        row = want[t - 1]
        worst = max(worst, abs(lp.token_logprobs[t] - row[ids[t]]))
        best = np.sort(row)[::-1][:TOP]
        worst = max(worst, float(np.abs(np.sort(list(lp.top_logprobs[t].values()))[::-1] - best).max()))
    return worst


def generated_errors(ref, prompt: list[int], gen: list[int], values, tops) -> float:
    """The same for the log-probabilities of the tokens `gen` generated after `prompt`, and their top
    alternatives (`tops`: each token's list of values, most likely first)."""
    want = ref(prompt + gen)
    worst = 0.0
    for j, (t, v, top) in enumerate(zip(gen, values, tops, strict=True)):
        row = want[len(prompt) + j - 1]
        worst = max(worst, abs(v - row[t]), float(np.abs(np.array(top) - np.sort(row)[::-1][:TOP]).max()))
    return worst


def logprob_errors(served, reference) -> dict[str, float]:
    """Each way of asking for log-probabilities, its largest difference from the reference's: a 300-token
    echo with max_tokens 0 (the loglikelihood request), completions and chat, whole and streamed. The greedy
    ids scored are `Session.generate`'s for the same prompt."""
    server, url = served
    tok, sess = server.tok, server.sess
    eos = sorted(tok.eos_ids)
    c = client(url)
    got = {}
    long = long_prompt(tok)
    r = c.completions.create(model="tiny-doc", prompt=long, max_tokens=0, echo=True, logprobs=TOP)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(long) == 300 and lp.token_logprobs[0] is None
    assert r.usage.completion_tokens == 0 and r.choices[0].text == tok.decode(long)
    got["echo 300, max_tokens 0"] = completion_errors(reference, long, lp, skip_first=True)

    def tops(d: dict) -> list[float]:
        return sorted(d.values(), reverse=True)

    prompt = tok.encode("Return the json.dumps of")
    gen = sess.generate([prompt], 8, stop_ids=eos)[0]
    lp = c.completions.create(model="tiny-doc", prompt=prompt, max_tokens=8, temperature=0,
                              logprobs=TOP).choices[0].logprobs
    got["completions"] = generated_errors(reference, prompt, gen, lp.token_logprobs, map(tops, lp.top_logprobs))
    parts = [ch.choices[0].logprobs for ch in c.completions.create(
        model="tiny-doc", prompt=prompt, max_tokens=8, temperature=0, logprobs=TOP, stream=True) if ch.choices[0].logprobs]
    got["completions streamed"] = generated_errors(reference, prompt, gen, [v for p in parts for v in p.token_logprobs],
                                                   [tops(d) for p in parts for d in p.top_logprobs])

    msgs = [{"role": "user", "content": "json.dumps"}]
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    gen = sess.generate([prompt], 8, stop_ids=eos)[0]
    content = c.chat.completions.create(model="tiny-doc", messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                        top_logprobs=TOP).choices[0].logprobs.content
    assert [bytes(e.bytes) for e in content] == [tok.token_bytes(t) for t in gen]
    got["chat"] = generated_errors(reference, prompt, gen, [e.logprob for e in content],
                                   [[x.logprob for x in e.top_logprobs] for e in content])
    content = [e for ch in c.chat.completions.create(model="tiny-doc", messages=msgs, max_tokens=8, temperature=0,
                                                      logprobs=True, top_logprobs=TOP, stream=True)
               if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    got["chat streamed"] = generated_errors(reference, prompt, gen, [e.logprob for e in content],
                                            [[x.logprob for x in e.top_logprobs] for e in content])
    return got


def test_logprobs_equal_the_reference_log_softmax(served, reference):
    """Catches log-probabilities that are not the model's (a temperature applied to the row, planted in the
    next test) and an echo off by a position; the greedy ids' values must match within LOGPROB_TOL."""
    errors = logprob_errors(served, reference)
    assert max(errors.values()) < LOGPROB_TOL, errors


def test_logprobs_of_a_transformed_row_fail_it(served, reference, monkeypatch):
    """The planted fault: log-probabilities of the row after a temperature of 0.8 (a sampling transform)."""
    from v4compile.runtime import batcher, logprobs

    real = logprobs.token_logprob
    monkeypatch.setattr(batcher, "token_logprob", lambda row, tok, k=0: real(np.asarray(row) / 0.8, tok, k))
    server, url = served
    tok = server.tok
    r = client(url).completions.create(model="tiny-doc", prompt=long_prompt(tok, 40), max_tokens=0, echo=True,
                                       logprobs=TOP)
    assert completion_errors(reference, long_prompt(tok, 40), r.choices[0].logprobs, skip_first=True) > LOGPROB_TOL


# ---- n choices, logit_bias -------------------------------------------------------------------------

def choices(url: str, **kw) -> list[str]:
    r = client(url).completions.create(model="tiny-doc", prompt="Return the", max_tokens=6, **kw)
    return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]


def n_outcomes(url: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """(3 greedy choices, one greedy request; 3 choices sampled with seed 11, the requests seeded 11, 12, 13)."""
    return (choices(url, n=3, temperature=0), choices(url, temperature=0),
            choices(url, n=3, temperature=1, seed=11), [choices(url, temperature=1, seed=11 + i)[0] for i in range(3)])


def test_n_choices_are_single_requests_seeded_seed_plus_i(served, monkeypatch):
    """`n` = 3: greedy choices each equal the single request's text; sampled choice i equals the request
    seeded seed + i (`request_seed`). Planted: every choice given the request's seed itself (the assertion
    on the sampled choices fails: they are all alike)."""
    _server, url = served
    greedy, single, sampled, seeded = n_outcomes(url)
    assert greedy == single * 3 and sampled == seeded and len(set(sampled)) > 1, (greedy, single, sampled, seeded)
    from v4compile.runtime import session

    monkeypatch.setattr(session, "request_seed", lambda seed, index: seed)
    _greedy, _single, sampled, seeded = n_outcomes(url)
    assert sampled != seeded


def test_logit_bias_steers_the_choice(served, monkeypatch):
    """+100 on one id makes every greedy token that id; -100 on the greedy first id makes the first another.
    Planted: the bias not added (the outputs stay the unbiased greedy ones)."""
    from v4compile.cli.serve_logprobs import Pieces

    server, url = served
    tok = server.tok
    prompt = tok.encode("Return the")
    plain = server.sess.generate([prompt], 4)[0]
    target = tok.encode(" json")[-1]
    text = Pieces(tok).text

    def biased() -> tuple[list[str], str]:
        c = client(url)
        up = c.completions.create(model="tiny-doc", prompt=prompt, max_tokens=4, temperature=0,
                                  logprobs=0, logit_bias={str(target): 100}).choices[0].logprobs.tokens
        down = c.completions.create(model="tiny-doc", prompt=prompt, max_tokens=4, temperature=0,
                                    logprobs=0, logit_bias={str(plain[0]): -100}).choices[0].logprobs.tokens
        return up, down
    up, down = biased()
    assert target not in plain and up == [text(target)] * 4 and down[0] != text(plain[0]), (up, down, plain)
    from v4compile.runtime import batcher

    monkeypatch.setattr(batcher, "_biased", lambda row, bias: row)
    up, down = biased()
    assert up == down == [text(t) for t in plain]


BAD = [  # (path, body beyond the prompt, param) the server must refuse with a 400 naming the field
    ("/v1/completions", {"n": 9}, "n"), ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"), ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"), ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [5]}, "logit_bias"),
    ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
]


def bad_statuses(url: str) -> list[tuple[int, str | None]]:
    out = []
    for path, extra, _param in BAD:
        base = ({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
        r = httpx.post(url + path, json={**base, "max_tokens": 2, **extra}, timeout=TIMEOUT)
        out.append((r.status_code, r.json()["error"]["param"] if r.status_code >= 400 else None))
    return out


def test_bad_option_values_are_400s_naming_the_field(served, monkeypatch):
    """Catches an option value taken as given (`options_of` planted out: none of these is a 400 any more;
    `max_tokens` 0 without echo still is, its check being the request's)."""
    _server, url = served
    assert bad_statuses(url) == [(400, param) for _p, _e, param in BAD]
    from v4compile.cli import serve_logprobs

    monkeypatch.setattr(serve_logprobs, "options_of", lambda *a: serve_logprobs.Options())
    got = bad_statuses(url)
    assert [s for s, _ in got].count(400) == 1, got


# ---- /metrics -----------------------------------------------------------------------------------------

def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client's own parser: sample name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metric_moves(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """Two chats and one bad request: (how much each counter moved, what the requests' usage says it should)."""
    before = scrape(url)
    c = client(url)
    usage = [c.chat.completions.create(model="tiny-doc", messages=[{"role": "user", "content": w}], max_tokens=3,
                                       temperature=0).usage for w in ("json.dumps", "re.compile")]
    httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=TIMEOUT)
    after = scrape(url)
    keys = ["v4compile_requests_total{path=/v1/chat/completions,status=200}",
            "v4compile_requests_total{path=/v1/chat/completions,status=400}", "v4compile_prompt_tokens_total",
            "v4compile_generation_tokens_total", "v4compile_time_to_first_token_seconds_count",
            "v4compile_time_per_output_token_seconds_count"]
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    want = dict(zip(keys, [2, 1, sum(u.prompt_tokens for u in usage), sum(u.completion_tokens for u in usage),
                           2, sum(u.completion_tokens > 1 for u in usage)]))
    for gauge in ("v4compile_queue_length", "v4compile_live_sequences", "v4compile_pool_blocks_used"):
        assert after[gauge] == 0, (gauge, after[gauge])  # idle now
    assert after["v4compile_pool_blocks"] > 0
    return moved, want


def test_metrics_parse_and_move_by_the_requests_made(served, monkeypatch):
    """Catches counters that miss requests (the scheduler's per-choice report planted out: the token counts
    and histograms stay)."""
    server, url = served
    moved, want = metric_moves(url)
    assert moved == want
    monkeypatch.setattr(server.metrics, "finished", lambda r, arrived: None)
    moved, want = metric_moves(url)
    assert moved != want and moved["v4compile_generation_tokens_total"] == 0


# ---- isolation: a request's tokens depend on itself and its seed only -------------------------------------

PROMPTS = ["json.dumps", "os.path.join", "re.compile", "textwrap.dedent", "heapq.heappush", "shutil.copy",
           "functools.partial", "random.choice"]


def sampled(url: str, i: int) -> str:
    body = {"prompt": PROMPTS[i], "max_tokens": 8, "temperature": 1, "seed": 1000 + i}
    r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT * 4)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def together_and_alone(server, url: str, monkeypatch) -> tuple[list[str], list[str]]:
    """8 seeded sampled requests, all admitted in one step (admission held until the 8 wait) and so decoded in
    the same steps, then each alone: their texts."""
    together: dict[int, str] = {}
    with no_admission(monkeypatch, server.batcher):
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, sampled(url, i))) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while len(server.batcher.waiting) < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    for t in threads:
        t.join(timeout=TIMEOUT * 4)
    return [together.get(i) for i in range(8)], [sampled(url, i) for i in range(8)]


def test_sampled_requests_are_isolated_from_their_batch(served, monkeypatch):
    """Catches requests drawing from one shared generator (planted below: the texts then depend on the
    batch and its order)."""
    server, url = served
    together, alone = together_and_alone(server, url, monkeypatch)
    assert together == alone and len(set(alone)) == 8, (together, alone)
    from v4compile.runtime.batcher import Batcher

    shared = np.random.default_rng(0)
    submit = Batcher.submit

    def one_generator(self, req, where="prompt"):
        submit(self, req, where)
        req.rng = shared
        return req
    monkeypatch.setattr(Batcher, "submit", one_generator)
    together, alone = together_and_alone(server, url, monkeypatch)
    assert together != alone


# ---- a second Ctrl-C ---------------------------------------------------------------------------------------

def app_shut_down_after_force_exit(uvicorn_server_class) -> bool:
    """Whether the server's shutdown, after a second Ctrl-C (uvicorn's force exit), still runs the app's
    lifespan shutdown (which stops the scheduler; left pending, its task dies with a traceback once the
    interruption is raised again: seen with 4 live streams and two SIGINTs, 2 tracebacks)."""
    import asyncio

    import uvicorn

    called = []

    class Lifespan:
        async def shutdown(self):
            called.append(True)
    u = uvicorn_server_class(uvicorn.Config(app=None), None)
    u.lifespan, u.servers, u.force_exit = Lifespan(), [], True
    asyncio.run(u.shutdown())
    return bool(called)


def test_a_second_ctrl_c_still_shuts_the_app_down():
    """Catches uvicorn's own shutdown (planted: the subclass's override left out)."""
    import uvicorn

    from v4compile.cli import serve

    cls = serve._uvicorn_server()
    assert app_shut_down_after_force_exit(cls)
    assert not app_shut_down_after_force_exit(type("Plain", (cls,), {"shutdown": uvicorn.Server.shutdown}))
