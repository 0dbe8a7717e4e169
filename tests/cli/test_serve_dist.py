"""`serve` on a partitioned artifact (tiny-pro, `--tp 2 --ep 2`, with the example model's tokenizer) as 2
gloo ranks started as torchrun starts them (`dist_launch`'s environment; each rank a process of its own, so
that one can be killed and each one's exit status read), one server per device (cpu; host, the C runtime,
with the ops' reference kernels): only rank 0 listens, and 8 concurrent streaming chats through the
`openai` client give the texts of `Session.generate`'s greedy ids on the unpartitioned artifact in this
process (the single-process server's own texts: tests/cli/test_serve.py). Every step of rank 1 is checked
against rank 0's as it runs (`Ranks.step`, which ends the server on a mismatch); the lockstep's planted
faults (ends applied out of order, a cancel not told) are in tests/runtime/test_batcher.py, in one process.
The cpu server then gets SIGTERM on every rank (what torchrun forwards): each exits 0, no traceback; the
host server's rank 1 is killed mid-stream: an error event, a 503 with OpenAI's body, one `error:` line on
rank 0, no hang. Every wait has a deadline; every process is killed and reaped."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dist_launch import free_port
from v4compile.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"
NAMES = ["json.dumps", "os.path.join", "re.compile", "textwrap.dedent", "heapq.heappush", "shutil.copy",
         "functools.partial", "random.choice"]
NEW = 8
START_S = 180  # two interpreters importing torch and loading, on a busy 2-core machine
HOST_CLI = ("import functools, sys; import v4compile.runtime as rt; rt.load = functools.partial(rt.load, "
            "kernels='reference'); from v4compile.cli import main; sys.exit(main(sys.argv[1:]))")
IDLE_PAST_S = 5.5  # the cpu server's collective timeout is 0.5 s less (5 s: enough for any step here)
END_S = 60  # a shutdown or a dead rank found: the collective fails at once, the grace period is 5 s


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """(tp 2 / ep 2, unpartitioned, dp 2 / ep 2) artifacts of one seeded tiny-pro checkpoint with tiny-doc's
    tokenizer."""
    d = tmp_path_factory.mktemp("dserve")
    ckpt = d / "ckpt"
    assert main(["-q", "init-random", "--preset", "tiny-pro", "-o", str(ckpt), "--seed", "3"]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EXAMPLE / f, ckpt / f)
    out = []
    for name, layout in (("tp2", ["--tp", "2", "--ep", "2"]), ("one", []), ("dp2", ["--dp", "2", "--ep", "2"])):
        assert main(["-q", "compile", str(ckpt), "--target", "cpu", "--dtype", "fp32", "--decode-buckets", "8",
                     "--prefill-buckets", "16", *layout, "-o", str(d / name)]) == 0
        out.append(d / name)
    return out


@pytest.fixture(scope="module")
def want(arts):
    """Each chat's text from `Session.generate` on the unpartitioned artifact, run alone."""
    import v4compile

    sess = v4compile.load(arts[1], device="cpu", threads=1)
    tok = sess.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": n}], add_generation_prompt=True))
               for n in NAMES]
    # one call: a prompt's greedy ids do not depend on the batch it shares (tests/runtime/test_batcher.py)
    outs = sess.generate(prompts, NEW, stop_ids=sorted(tok.eos_ids))
    texts = [tok.decode([i for i in out if i not in tok.eos_ids]) for out in outs]
    sess.close()
    assert len(set(texts)) > 1  # the prompts lead to different texts: a mix-up between slots would show
    return texts


class Ranks:
    """`serve` as ranks 0 and 1 of a 2-rank group, torchrun's environment each; stderr to files."""

    def __init__(self, art: Path, tmp: Path, device: str, env: dict | None = None):
        port = free_port()
        # host: the ops' reference kernels (the Triton interpreter would take minutes; `load(kernels=...)`)
        cli = ["-m", "v4compile"] if device == "cpu" else ["-c", HOST_CLI]
        self.errs = [tmp / f"rank{r}.err" for r in (0, 1)]
        self.procs = []
        for r in (0, 1):
            e = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **(env or {})}
            with open(self.errs[r], "w") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *cli, "serve", str(art), "--port", "0", "--device", device,
                     "--threads", "1"], env=e, stdout=subprocess.DEVNULL, stderr=err))
        self.url = None
        deadline = time.monotonic() + START_S
        while self.url is None:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", self.err(0))
            if m:
                self.url = m.group(1)
            elif any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"serve did not start: {self.err(0)[-2000:]} {self.err(1)[-2000:]}")
            else:
                time.sleep(0.2)

    def err(self, r: int) -> str:
        return self.errs[r].read_text()

    def wait(self) -> list[int | None]:
        """Each rank's exit status, within END_S (None: still running, then killed)."""
        deadline, codes = time.monotonic() + END_S, []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def terminate(self) -> list[str]:
        """SIGTERM to every rank (what torchrun forwards): each must exit 0 with no traceback and no error line
        (asserted); every rank's stderr."""
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        codes = self.wait()
        errs = [self.err(r) for r in range(len(self.procs))]
        assert codes == [0] * len(self.procs), errs
        assert not any("Traceback" in e or "error:" in e for e in errs), errs
        return errs

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)


def streamed(url: str, n: int = len(NAMES), max_tokens: int = NEW, model: str = "tp2") -> list:
    """`n` concurrent streaming chats: each one's text, or the exception that ended it."""
    c, out = client(url), {}

    def stream(i: int) -> None:
        try:
            out[i] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": NAMES[i]}], temperature=0, max_tokens=max_tokens,
                stream=True) if ch.choices)
        except Exception as e:  # noqa: BLE001 (an error event or a cut connection: what the test looks at)
            out[i] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [out.get(i, "hung") for i in range(n)]



def test_cpu_ranks_serve_the_single_process_texts_and_sigterm_exits_0(arts, want, tmp_path):
    """Device cpu: only rank 0 listens; 8 concurrent streaming chats give the unpartitioned artifact's texts
    (every step's inputs checked equal to rank 0's on rank 1, `Ranks.step`); /health is rank 0's; idle past
    the collectives' timeout (rank 1 waits for rank 0's ticks), the ranks still serve; SIGTERM to both ranks (what torchrun forwards to every rank) ends
    each with status 0, no traceback, no error line."""
    import httpx

    ranks = Ranks(arts[0], tmp_path, "cpu", env={"V4COMPILE_DIST_TIMEOUT": str(IDLE_PAST_S - 0.5)})
    try:
        assert streamed(ranks.url) == want, "served by 2 ranks: not the single-process texts"
        h = httpx.get(ranks.url + "/health", timeout=30).json()
        assert h["status"] == "ok" and h["free_slots"] == 8 and h["finished"] == {"length": len(NAMES)}, h
        time.sleep(IDLE_PAST_S)  # idle past the collectives' timeout: the idle ticks keep rank 1's waits short
        assert streamed(ranks.url, 2) == want[:2]
        errs = ranks.terminate()
    finally:
        ranks.kill()
    assert "serving" not in errs[1] and "stepping with rank 0" in errs[1]


def test_host_ranks_serve_the_texts_and_a_killed_rank_ends_the_server(arts, want, tmp_path):
    """Device host (the C runtime; its collective launches on gloo): the same texts; then rank 1 killed
    (SIGKILL) while a stream and a whole-response request are in flight: the stream ends with an error
    event, the other gets a 503 with OpenAI's error body, rank 0 exits with one `error:` line naming the
    failed collective and no traceback, within END_S."""
    import httpx
    import openai

    ranks = Ranks(arts[0], tmp_path, "host")
    try:
        assert streamed(ranks.url) == want, "served by 2 host ranks: not the single-process texts"
        c, out = client(ranks.url), {}

        def whole() -> None:
            try:
                out["whole"] = c.chat.completions.create(model="tp2", messages=[{"role": "user", "content": "x"}],
                                                         temperature=0, max_tokens=200)
            except openai.APIStatusError as e:
                out["whole"] = e
        threads = [threading.Thread(target=whole)]
        threads[0].start()
        stream = iter(c.chat.completions.create(model="tp2", messages=[{"role": "user", "content": NAMES[0]}],
                                                temperature=0, max_tokens=200, stream=True))
        assert next(stream).choices  # mid-generation
        deadline = time.monotonic() + 60
        while httpx.get(ranks.url + "/health", timeout=30).json()["live"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        def rest() -> None:
            try:
                out["stream"] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            except openai.APIError as e:
                out["stream"] = e
        threads.append(threading.Thread(target=rest))
        threads[1].start()
        ranks.procs[1].kill()
        for t in threads:
            t.join(timeout=END_S)
        codes = ranks.wait()
    finally:
        ranks.kill()
    err = ranks.err(0)
    assert isinstance(out.get("stream"), openai.APIError) and "a rank died" in str(out["stream"]), out
    w = out.get("whole")
    assert isinstance(w, openai.APIStatusError) and w.status_code == 503, out
    assert w.body["type"] == "server_error" and "a rank died" in w.body["message"], w.body
    assert codes[0] == 2 and codes[1] == -signal.SIGKILL, (codes, err[-2000:])
    assert err.count("error:") == 1 and "failed (a rank died" in err and "Traceback" not in err, err[-3000:]


def test_cpu_ranks_serve_a_dp_artifact_over_both_replicas(arts, want, tmp_path):
    """`--dp 2 --ep 2` (device cpu): rank 0's server places two concurrent chats on the least-loaded replica
    each (one on each: /health's `replicas_placed`), every rank runs its replica's part of each step with the
    other ranks in lockstep, and the texts are the single-process ones; SIGTERM ends both ranks with 0."""
    import httpx

    ranks = Ranks(arts[2], tmp_path, "cpu")
    try:
        assert streamed(ranks.url, 2, model="dp2") == want[:2], "served by 2 replicas: not the single-process texts"
        h = httpx.get(ranks.url + "/health", timeout=30).json()
        assert h["replicas_placed"] == [1, 1] and h["finished"] == {"length": 2}, h
        ranks.terminate()
    finally:
        ranks.kill()
