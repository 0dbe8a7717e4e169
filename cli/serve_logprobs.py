"""The server's per-request options beyond sampling (`n`, `logprobs` / `top_logprobs`, `echo`, `logit_bias`):
their checks, and the log-probability fields of OpenAI's responses built from the Batcher's entries.

The values (`runtime/logprobs.py`) are the float32 log-softmax over the whole vocabulary of the device's raw
logits row: before `logit_bias`, temperature and top-p, whatever the request samples with.

Shapes (OpenAI's):
  chat:         choice["logprobs"] = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                "logprob", "bytes"}]}]}, one entry per generated token (`logprobs: true`, `top_logprobs` 0..20)
  completions:  choice["logprobs"] = {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
                "text_offset"} (`logprobs` 0..5: the alternatives per token); with `echo` the prompt's tokens
                come first, the first one's log-probability null (nothing precedes it)
A token's text is its bytes as UTF-8, or `bytes:\\xNN...` when they are part of a character (OpenAI's form).
`text_offset` advances by each token's decoded text (a special token: 0; a part of a character: 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import INVALID_VALUE, InputError

MAX_N = 8  # choices per request (each its own sequence: a slot each)
MAX_CHAT_TOP = 20  # chat's top_logprobs
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's bound)
MAX_BIAS_ENTRIES = 1024
UNSUPPORTED_PARAM = "unsupported_parameter"


@dataclass(frozen=True)
class Options:
    n: int = 1
    logprobs: int | None = None  # None: not asked; k: the chosen token's and its k most likely alternatives
    echo: bool = False  # completions: the prompt in the text and its tokens' log-probabilities
    logit_bias: dict[int, float] | None = None


def options_of(body: dict, chat: bool, vocab: int) -> Options:
    """The request's options, checked: an InputError with the field as `param` for a bad one."""
    n = _int(body, "n", 1, 1, MAX_N)
    if chat:
        if body.get("echo") not in (None, False):
            raise InputError("`echo` is a completions field (chat has none)", param="echo", code=UNSUPPORTED_PARAM)
        asked = body.get("logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise InputError("`logprobs` must be true or false", found=_short(asked), param="logprobs",
                             code=INVALID_VALUE)
        top = _int(body, "top_logprobs", None, 0, MAX_CHAT_TOP)
        if top is not None and not asked:
            raise InputError("`top_logprobs` needs `logprobs: true`", param="top_logprobs", code=INVALID_VALUE)
        k = (top or 0) if asked else None
        echo = False
    else:
        if body.get("top_logprobs") is not None:
            raise InputError("`top_logprobs` is a chat field (completions give `logprobs`: an integer)",
                             param="top_logprobs", code=UNSUPPORTED_PARAM)
        k = _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise InputError("`echo` must be true or false", found=_short(echo), param="echo", code=INVALID_VALUE)
        echo = bool(echo)
    return Options(n, k, echo, _bias(body.get("logit_bias"), vocab))


def _int(body: dict, key: str, default, lo: int, hi: int):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InputError(f"`{key}` must be an integer in [{lo}, {hi}]", found=_short(v), param=key,
                         code=INVALID_VALUE)
    return v


def _bias(v, vocab: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"<token id>": bias in [-100, 100]} (JSON keys are strings)."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict) or len(v) > MAX_BIAS_ENTRIES:
        raise InputError(f"`logit_bias` must be an object of at most {MAX_BIAS_ENTRIES} token ids", param="logit_bias",
                         code=INVALID_VALUE)
    out = {}
    for key, b in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab):
            raise InputError(f"`logit_bias` keys must be token ids in [0, {vocab})", found=_short(key),
                             param="logit_bias", code=INVALID_VALUE)
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise InputError("`logit_bias` values must be numbers in [-100, 100]", found=_short(b),
                             param="logit_bias", code=INVALID_VALUE)
        out[int(key)] = float(b)
    return out


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


class Pieces:
    """Token ids -> their text and bytes for log-probability entries (cached: the same ids come back)."""

    def __init__(self, tok):
        self.tok = tok
        self.cache: dict[int, tuple[str, list[int] | None]] = {}
        self.widths: dict[int, int] = {}

    def of(self, i: int) -> tuple[str, list[int] | None]:
        hit = self.cache.get(i)
        if hit is None:
            if self.tok is None:  # ids in, ids out: no text to give
                hit = (f"token_id:{i}", None)
            else:
                b = self.tok.token_bytes(i)
                try:
                    text = b.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
                hit = (text, list(b))
            self.cache[i] = hit
        return hit

    def text(self, i: int) -> str:
        return self.of(i)[0]

    def width(self, i: int) -> int:
        """Characters the id adds to the response's text (its `text_offset` step)."""
        w = self.widths.get(i)
        if w is None:
            w = self.widths[i] = len(self.tok.decode([i])) if self.tok is not None else 0
        return w


def chat_content(entries, pieces: Pieces) -> list[dict]:
    """Chat's `logprobs.content` entries of generated tokens (`TokenLogprob`s)."""
    out = []
    for e in entries:
        text, raw = pieces.of(e.id)
        out.append({"token": text, "logprob": e.logprob, "bytes": raw,
                    "top_logprobs": [{"token": pieces.text(i), "logprob": lp, "bytes": pieces.of(i)[1]}
                                     for i, lp in e.top]})
    return out


def completion_logprobs(pairs, pieces: Pieces, offset: int) -> dict:
    """Completions' `logprobs` object of [(id, `TokenLogprob` or None: the first prompt token's, with echo)];
    `offset`: the text offset of the first token."""
    tokens, values, tops, offsets = [], [], [], []
    for i, e in pairs:
        text = pieces.text(i)
        tokens.append(text)
        values.append(None if e is None else e.logprob)
        tops.append(None if e is None else {pieces.text(j): lp for j, lp in e.top})
        offsets.append(offset)
        offset += pieces.width(i)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
