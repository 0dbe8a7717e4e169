"""Text in, text out on the example model (examples/tiny-doc, compiled once, cpu target): `run --prompt`
gives `Session.generate`'s greedy ids and streams exactly their text; an artifact without a tokenizer (or
with a tokenizer path leading out) is one clear error; and `serve`, started as a subprocess on a free port
and driven by the real `openai` client: 8 chats, one at a time and concurrently streamed, give the text of
`Session.generate`'s greedy ids for each (run alone in this process), a client that disconnects frees its
slot, bad requests get a 400 with OpenAI's error body while the server goes on.
Every wait has a timeout; the server is always killed and reaped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from artifact_tamper import copy, manifest, write_manifest
from v4compile.cli import main
from v4compile.runtime.session import Session

NAMES = ["json.dumps", "os.path.join", "re.compile", "textwrap.dedent", "heapq.heappush", "shutil.copy",
         "functools.partial", "random.choice"]


@pytest.fixture(scope="module")
def art(doc_art):
    return doc_art  # tests/conftest.py: compiled once per process


def run(art, *args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["-q", "run", str(art), *args])
    r = capsys.readouterr()
    return rc, r.out, r.err


@pytest.fixture(scope="module")
def gen(art):
    """The artifact loaded in this process: `Session.generate` (checked against the reference model in
    tests/onnx) is the independent reference of what `run --prompt` and `serve` give."""
    import v4compile

    s = v4compile.load(art, device="cpu", threads=1)
    yield s
    s.close()


def prompt_ids(tok, text: str, chat: bool) -> list[int]:
    """A prompt's ids as the documented behaviour gives them: the text itself, or (chat) the single user
    message of the chat template with its generation prompt."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
                      if chat else text)


def generated(sess, ids: list[int], n: int) -> tuple[list[int], str]:
    """`Session.generate`'s greedy ids for one prompt run alone (stopping at an EOS id, included) and their
    text (without the EOS)."""
    tok = sess.tokenizer
    out = sess.generate([ids], n, stop_ids=sorted(tok.eos_ids))[0]
    return out, tok.decode([i for i in out if i not in tok.eos_ids])


def _run_prompt_texts(art, gen, capsys) -> None:
    tok = gen.tokenizer
    for chat in ([], ["--chat"]):
        args = ["--prompt", "Return the", "--max-new-tokens", "24", "--device", "cpu", *chat]
        rc, out, err = run(art, *args, "--json", capsys=capsys)
        assert rc == 0, err
        j = json.loads(out)
        ids = [i for i in j["ids"] if i not in tok.eos_ids]
        assert j["text"] == tok.decode(ids) and j["tokens_per_s"] > 0
        rc, streamed, err = run(art, *args, capsys=capsys)
        assert rc == 0 and streamed == j["text"] + "\n", err
        want_ids, want_text = generated(gen, prompt_ids(tok, "Return the", bool(chat)), 24)
        assert (j["ids"], j["text"]) == (want_ids, want_text), f"run --prompt {chat}: not Session.generate's ids"


def test_run_prompt_streams_the_decoded_ids(art, gen, capsys):
    """`run --prompt` (plain and --chat) gives `Session.generate`'s greedy ids for the same prompt ids, and
    streams exactly their text. The planted fault is the test below."""
    _run_prompt_texts(art, gen, capsys)


def test_a_wrong_first_token_fails_the_run_prompt_check(art, gen, capsys, monkeypatch):
    """The planted fault: the batcher (which `run --prompt` and `serve` step through) takes the runner-up id
    for each token. Streamed and JSON text still agree and still read as words (the old
    checks); the comparison with `Session.generate` fails."""
    from v4compile.runtime.batcher import Batcher

    pick = Batcher._pick  # the reference session (`gen`, which also steps through the Batcher) keeps its own
    monkeypatch.setattr(Batcher, "_pick", lambda self, r, row: pick(self, r, row) if self.sess is gen
                        else int(np.argsort(row)[-2]))
    with pytest.raises(AssertionError, match="not Session.generate's ids"):
        _run_prompt_texts(art, gen, capsys)


def test_a_prompt_without_a_tokenizer_is_one_clear_error(art, tmp_path, capsys):
    bare = copy(art, tmp_path / "bare")
    m = manifest(bare)
    del m["tokenizer"]
    write_manifest(bare, m)
    rc, out, err = run(bare, "--prompt", "Return the", "--device", "cpu", capsys=capsys)
    assert rc == 2 and out == "" and err.count("error:") == 1 and "no tokenizer" in err
    assert main(["-q", "run", str(bare), "--ids", "1,2", "--device", "cpu", "--max-new-tokens", "2"]) == 0


def _tokenizer_path_case(art, tmp_path, bad: str):
    """A copy of `art` whose manifest names `bad` as its tokenizer.json."""
    t = copy(art, tmp_path / f"t{len(bad)}")
    m = manifest(t)
    m["tokenizer"]["json"] = bad
    write_manifest(t, m)
    return t


TOKENIZER_PATHS = [("../tokenizer.json", "`tokenizer.json` leaves the artifact"),
                   ("tokenizer/missing.json", "`tokenizer.json` names a file the manifest's `files` does not list")]


def _check_tokenizer_refused(t, needle: str) -> None:
    import v4compile
    from v4compile.errors import ArtifactError

    with pytest.raises(ArtifactError, match=re.escape(needle)):
        v4compile.load(t, device="cpu")


@pytest.mark.parametrize("bad,needle", TOKENIZER_PATHS)
def test_a_tokenizer_path_leading_out_of_the_artifact_is_refused(art, tmp_path, bad, needle):
    """Each path is refused by its own rule, named in the message: `../` as leaving the artifact (checked
    before the unlisted-file rule, which would refuse it too), a path inside that `files` does not list by
    that rule. A symlink out and an absolute path (listed and hashed): the tokenizer kind of
    tests/runtime/test_artifact_security.py."""
    _check_tokenizer_refused(_tokenizer_path_case(art, tmp_path, bad), needle)


def test_a_manifest_check_without_the_dotdot_rule_fails_the_tokenizer_test(art, tmp_path, monkeypatch):
    """The planted fault: `manifest.check_rel` without its `..` rule. `../tokenizer.json` is then refused by
    the unlisted-file rule only, and the test's match (the `..` rule's message) fails."""
    from v4compile import manifest as M

    real = M.check_rel
    monkeypatch.setattr(M, "check_rel", lambda rel, key: rel if isinstance(rel, str) and ".." in rel
                        else real(rel, key))
    bad, needle = TOKENIZER_PATHS[0]
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        _check_tokenizer_refused(_tokenizer_path_case(art, tmp_path, bad), needle)


# ---- serve ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(art, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "v4compile", "serve", str(art), "--port", "0", "--device", "cpu",
                              "--threads", "1"], stdout=subprocess.DEVNULL, stderr=err, env={**os.environ})
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", log.read_text())
            if m:
                url = m.group(1)
            elif p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"serve did not start: {log.read_text()[-2000:]}")
            else:
                time.sleep(0.2)
        yield url
    finally:
        p.kill()
        p.wait(timeout=30)


def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)


def health(url) -> dict:
    import httpx

    return httpx.get(url + "/health", timeout=30).json()


def chat(c, name: str, **kw):
    return c.chat.completions.create(model="tiny-doc", messages=[{"role": "user", "content": name}],
                                     temperature=0, **kw)


def test_concurrent_streaming_chats_equal_sequential_greedy_runs(server, art, gen, capsys):
    """8 concurrent streaming chats and the same chats one at a time each give the text of
    `Session.generate`'s greedy ids for that chat's prompt, run alone in this process (the server's own
    sequential runs are no reference: they step through the same scheduler). That requests share decode
    steps, and the sampled branch with several requests live, is tests/runtime/test_batcher.py (no thread
    timing there); the fault of a scheduler giving wrong ids is planted in
    `test_a_wrong_first_token_fails_the_run_prompt_check` (the same batcher)."""
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny-doc"]
    want = [generated(gen, prompt_ids(gen.tokenizer, n, chat=True), 16)[1] for n in NAMES]
    assert len(set(want)) > 1  # the prompts lead to different texts: a mix-up between slots would show
    seq = [chat(c, n, max_tokens=16).choices[0].message.content for n in NAMES]
    assert seq == want, "served one at a time: not Session.generate's texts"
    out: dict[int, str] = {}

    def stream(i: int) -> None:
        out[i] = "".join(ch.choices[0].delta.content or "" for ch in chat(c, NAMES[i], max_tokens=16, stream=True)
                         if ch.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(NAMES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [out.get(i) for i in range(len(NAMES))] == want, "streamed concurrently: not Session.generate's texts"
    done = c.completions.create(model="tiny-doc", prompt="Return the", max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens <= 8
    assert done.choices[0].text == generated(gen, prompt_ids(gen.tokenizer, "Return the", chat=False), 8)[1]


def test_a_disconnected_stream_frees_its_slot(server):
    import httpx

    before = health(server)["finished"].get("cancelled", 0)
    body = {"messages": [{"role": "user", "content": "json.loads"}], "max_tokens": 200, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as h:
        for _ in range(8):  # every slot: a slot that is not freed would hold the next request back
            with h.stream("POST", server + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first event, then the client goes away
    deadline = time.monotonic() + 60
    while (h := health(server))["finished"].get("cancelled", 0) < before + 8 or h["live"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    assert h["free_slots"] == 8 and h["waiting"] == 0
    assert h["prefix_cache"]["lookups"] >= 8 and h["prefix_cache"]["snapshot_bytes"] >= 0  # the cache's figures
    r = chat(client(server), "json.loads", max_tokens=4)  # admitted at once
    assert r.choices[0].message.content is not None


def test_bad_requests_get_a_400_with_an_openai_error_body(server):
    import httpx
    import openai

    c = client(server)
    url = server + "/v1/chat/completions"
    r = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in r.json()["error"]["message"]
    cases = [
        (dict(model="gpt-4", max_tokens=4), "model"),
        (dict(model="tiny-doc", max_tokens=-1), "max_tokens"),
        (dict(model="tiny-doc", max_tokens=10_000), "max_tokens"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # an over-long prompt
        c.completions.create(model="tiny-doc", prompt="Return the value. " * 200, max_tokens=4)
    assert "context" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny-doc", messages=[{"role": "user"}], max_tokens=4)
    assert chat(c, "json.dumps", max_tokens=4).choices[0].message.content is not None  # still serving
    assert health(server)["live"] == 0


# ---- error codes from typed fields: in process, a stand-in session (no artifact, no scheduler thread) ----

class _Tokenizer:
    """Text to ids one character each, so a chat's prompt length is its content's."""

    eos_ids = frozenset()

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % self.vocab for ch in text]

    def apply_chat_template(self, msgs, add_generation_prompt: bool) -> str:
        return "".join(m["content"] for m in msgs)


class _Session:
    """What the server reads of a session before it submits a request; the checks are the real ones."""

    check_prompt, check_request, check_context = Session.check_prompt, Session.check_request, Session.check_context
    check_stop_ids = Session.check_stop_ids
    max_batch = 1
    ranks = None  # one process

    def __init__(self, vocab: int, max_context: int):
        self.vocab, self.max_context, self.tokenizer = vocab, max_context, _Tokenizer(vocab)


def _refusals(seed: int) -> list[tuple[str, dict]]:
    """Seeded requests the runtime refuses: over the context (completion and chat), an id outside the
    vocabulary, an empty prompt, an empty chat."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab, ctx = int(rng.integers(50, 500)), int(rng.integers(16, 64))
    n = int(rng.integers(1, ctx))
    ids = rng.integers(0, vocab, n).tolist()
    over = ctx - n + int(rng.integers(1, 8))
    bad = list(ids)
    bad[int(rng.integers(0, n))] = vocab + int(rng.integers(0, 100))
    text = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, n))
    return (vocab, ctx), [
        ("/v1/completions", {"prompt": ids, "max_tokens": over}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_completion_tokens": over}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": over}),
        ("/v1/completions", {"prompt": bad, "max_tokens": 1}),
        ("/v1/completions", {"prompt": [], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 1}),
    ]


def _responses(monkeypatch, seed: int, reword: bool) -> list[tuple]:
    """(status, error body) of each refused request; `reword`: every V4Error's message replaced by one that
    shares no word with it (the same for every error, so nothing can be read from it)."""
    from starlette.testclient import TestClient

    from v4compile.cli import serve
    from v4compile.errors import V4Error

    (vocab, ctx), cases = _refusals(seed)
    if reword:
        monkeypatch.setattr(V4Error, "_render", lambda self: "refused")
    server = serve.Server(_Session(vocab, ctx), "stand-in")

    def never(req):
        raise AssertionError(f"a request the runtime refuses was submitted: {req.prompt}")

    monkeypatch.setattr(server.batcher, "submit", never)
    out = []
    http = TestClient(server.app(), base_url="http://127.0.0.1")  # not entered: no lifespan, no scheduler thread
    try:
        for path, body in cases:
            r = http.post(path, json=body)
            out.append((r.status_code, r.json()["error"]))
    finally:
        http.close()
        monkeypatch.undo()
    return out


def _without_message(responses: list[tuple]) -> list[tuple]:
    return [(status, {k: v for k, v in e.items() if k != "message"}) for status, e in responses]


def _by_text(e, chat: bool, key: str):
    """The mapping as it was: param and code read from the message."""
    from v4compile.cli.serve import BadRequest

    param = key if "max_new_tokens" in str(e) else "messages" if chat else "prompt"
    return BadRequest(str(e), param, "context_length_exceeded" if "context" in str(e) else "invalid_value")


@pytest.mark.parametrize("seed", [0, 1])
def test_error_codes_come_from_typed_fields_not_the_message(monkeypatch, seed):
    """A reworded message changes no HTTP response but its message: status, type, param and code are the
    same. Fault caught (`test_a_mapping_by_message_text_is_caught`): the server reading param and code from
    the message (`"context" in str(e)`), as it did."""
    plain = _responses(monkeypatch, seed, reword=False)
    reworded = _responses(monkeypatch, seed, reword=True)
    assert [e["message"] for _, e in reworded] == ["refused"] * len(plain)  # the rewording took effect
    assert _without_message(reworded) == _without_message(plain)
    codes = {(e["param"], e["code"]) for _, e in plain}  # each kind of refusal is in the cases
    assert {("max_tokens", "context_length_exceeded"), ("max_completion_tokens", "context_length_exceeded"),
            ("prompt", "invalid_value"), ("messages", "invalid_value")} <= codes, codes
    assert {s for s, _ in plain} == {400}


def test_a_mapping_by_message_text_is_caught(monkeypatch):
    from v4compile.cli import serve

    plain = _responses(monkeypatch, 0, reword=False)
    monkeypatch.setattr(serve, "refused", _by_text)
    reworded = _responses(monkeypatch, 0, reword=True)
    assert _without_message(reworded) != _without_message(plain)
