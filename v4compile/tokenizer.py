"""Text in, text out: the checkpoint's tokenizer, carried into the artifact.

    tok = Tokenizer.from_bytes(tokenizer_json, tokenizer_config_json)   # the `tokenizers` package
    ids = tok.encode("Return the")                 # with the BOS token when the config asks for it
    text = tok.apply_chat_template([{"role": "user", "content": "json.dumps"}], add_generation_prompt=True)
    stream = tok.stream(stop=["\n\n"])             # incremental detokenisation for one sequence
    piece, done = stream.push(token_id)            # the new stable text; done at EOS or a stop string

A checkpoint's `tokenizer.json` and `tokenizer_config.json` (HF's files) are untrusted input: read with a
size limit, parsed by `tokenizers` (Rust, no code) and plain JSON (never pickle). The chat template is a
Jinja template run in `jinja2`'s immutable sandbox following HF's `apply_chat_template` conventions
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`); a template that reaches
for an attribute the sandbox deems unsafe (`''.__class__`, `__globals__`, ...) is refused with a
`TemplateError`, not rendered as an empty string.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError, InputError, TemplateError, V4Error

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG)  # what `compile` copies into the artifact's tokenizer/
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # DeepSeek-V4's tokenizer.json is ~8 MB
MAX_TEMPLATE_CHARS = 1 << 20
MAX_STOP_STRINGS = 16
REPLACEMENT = "\ufffd"


def _token_text(v, where: str, error: type[V4Error]) -> str | None:
    """A special token in tokenizer_config.json: a string, HF's {"content": ...} form, or null."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise error("a special token must be a string or {\"content\": string}", where=where, found=repr(v)[:60])


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's table), inverted: char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(extra)}}


_BYTE_OF = _byte_level_chars()


class Tokenizer:
    def __init__(self, tok, config: dict, where: str, error: type[V4Error] = InputError):
        self._tok = tok
        self.where = where
        self.bos_token = _token_text(config.get("bos_token"), f"{where} bos_token", error)
        self.eos_token = _token_text(config.get("eos_token"), f"{where} eos_token", error)
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token is not None
        tmpl = config.get("chat_template")
        if isinstance(tmpl, list):  # HF's named-templates form: [{"name": "default", "template": ...}, ...]
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if tmpl is not None and (not isinstance(tmpl, str) or len(tmpl) > MAX_TEMPLATE_CHARS):
            raise error("chat_template must be a string", where=where, expected=f"<= {MAX_TEMPLATE_CHARS} characters",
                        found=type(tmpl).__name__)
        self.chat_template = tmpl
        eos = set()
        for name in (self.eos_token,):
            if name is not None:
                i = tok.token_to_id(name)
                if i is None:
                    raise error("eos_token is not in the vocabulary", where=where, found=repr(name)[:60])
                eos.add(int(i))
        self.eos_ids = frozenset(eos)
        self._template = None

    @classmethod
    def from_bytes(cls, tokenizer_json: bytes, config_json: bytes | None, where: str,
                   error: type[V4Error] = InputError) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_str(tokenizer_json.decode("utf-8"))
        except (UnicodeDecodeError, Exception) as e:  # the Rust parser raises a plain Exception
            raise error(f"{TOKENIZER_JSON} is not a tokenizer the `tokenizers` package reads: {str(e)[:120]}",
                        where=where) from None
        config = {}
        if config_json is not None:
            try:
                config = json.loads(config_json.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                raise error(f"{TOKENIZER_CONFIG} is not JSON: {str(e)[:120]}", where=where) from None
            if not isinstance(config, dict):
                raise error(f"{TOKENIZER_CONFIG} must be a JSON object", where=where, found=type(config).__name__)
        return cls(tok, config, where, error)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # ---- text <-> ids ------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Ids of `text`; special tokens written in it are recognised (a chat template's output)."""
        if not isinstance(text, str):
            raise InputError("a prompt must be a string", found=type(text).__name__)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_token is not None and not text.startswith(self.bos_token):
            ids = [self._tok.token_to_id(self.bos_token), *ids]
        return [int(i) for i in ids]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens left out."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, i: int) -> bytes:
        """The bytes id `i` stands for alone (a byte-level BPE token may be part of a character; a special
        token: its text), for log-probability entries."""
        s = self._tok.id_to_token(int(i))
        if s is None:
            return b""
        if type(self._tok.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF for c in s):
            return bytes(_BYTE_OF[c] for c in s)
        return self._tok.decode([int(i)], skip_special_tokens=False).encode("utf-8")

    def stream(self, stop: list[str] | tuple[str, ...] = ()) -> "TextStream":
        return TextStream(self, stop)

    # ---- chat --------------------------------------------------------------------------------------
    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (HF conventions). A template error or an unsafe access in the
        template is a `TemplateError`; bad messages an `InputError`."""
        if self.chat_template is None:
            raise InputError("the tokenizer has no chat template", where=self.where,
                             expected="a `chat_template` in tokenizer_config.json")
        check_messages(messages)
        import jinja2

        try:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=bool(add_generation_prompt),
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"the chat template reaches for Python internals: {e}", where=self.where) from None
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the chat template does not render: {e}", where=self.where) from None


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list", found=type(messages).__name__)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError("each message must be {\"role\": string, \"content\": string}", where=f"messages[{i}]")


def _environment():
    """Jinja's immutable sandbox, made strict: an unsafe attribute raises at once (the stock sandbox returns
    an undefined that prints as an empty string until someone looks further)."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Strict(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj, attribute):
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def raise_exception(message):
        raise TemplateError(f"the chat template refused the messages: {str(message)[:200]}")

    env = Strict(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env


class TextStream:
    """Incremental detokenisation of one sequence: `push(id)` returns the text that became stable (no broken
    multi-byte character: a trailing U+FFFD is held back until the next id decides it; no text twice: the
    growing id list is decoded and only its new suffix printed) and whether the sequence is done (an EOS id,
    or a stop string: the text ends before it). The pieces joined equal `decode(ids)` without stop strings."""

    def __init__(self, tok: Tokenizer, stop=()):
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS or not all(
                isinstance(s, str) and s for s in stop):
            raise InputError("stop must be a list of non-empty strings", expected=f"<= {MAX_STOP_STRINGS} strings",
                             found=repr(stop)[:60])
        self.tok = tok
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string may still be forming
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.done = False
        self.finish_reason: str | None = None

    def push(self, token: int) -> tuple[str, bool]:
        if self.done:
            return "", True
        if int(token) in self.tok.eos_ids:
            self.done, self.finish_reason = True, "stop"
            return self._emit(self.tok.decode(self.ids), final=True), True
        self.ids.append(int(token))
        full = self.tok.decode(self.ids)
        for s in self.stop:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                self.done, self.finish_reason = True, "stop"
                return self._emit(full[:at], final=True), True
        return self._emit(full, final=False), False

    def finish(self) -> str:
        """The text held back, at the end of the sequence (max tokens)."""
        if self.done:
            return ""
        self.done, self.finish_reason = True, "length"
        return self._emit(self.tok.decode(self.ids), final=True)

    def _emit(self, full: str, final: bool) -> str:
        stable = full
        if not final:
            stable = stable.rstrip(REPLACEMENT)
            stable = stable[: len(stable) - self._partial_stop(stable)]
        piece = stable[len(self.text):]  # (a decoder never rewrites earlier text; if one did, it stays printed)
        self.text += piece
        return piece

    def _partial_stop(self, text: str) -> int:
        """Characters at the end of `text` that begin a stop string (held back: the stop may be forming)."""
        for k in range(min(self.hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0


def copy_tokenizer(checkpoint: str | Path | None, dst: Path, prefix: str = "tokenizer") -> dict | None:
    """Copy a checkpoint directory's tokenizer files into `dst` (the artifact's `tokenizer/`), after checking
    that they load; returns the manifest's `tokenizer` entry (paths relative to the artifact), or None when
    the checkpoint has no tokenizer.json."""
    from .files import read_bytes

    if checkpoint is None or not Path(checkpoint).is_dir() or not (Path(checkpoint) / TOKENIZER_JSON).exists():
        return None
    root = Path(checkpoint)
    data = {name: read_bytes(root / name, CheckpointError, name, MAX_TOKENIZER_BYTES)
            for name in TOKENIZER_FILES if (root / name).exists()}
    Tokenizer.from_bytes(data[TOKENIZER_JSON], data.get(TOKENIZER_CONFIG), str(root), CheckpointError)
    dst.mkdir(parents=True, exist_ok=True)
    entry = {}
    for name, raw in data.items():
        (dst / name).write_bytes(raw)
        entry["json" if name == TOKENIZER_JSON else "config"] = f"{prefix}/{name}"
    return entry
