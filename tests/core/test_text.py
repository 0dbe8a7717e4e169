"""The tokenizer layer (v4compile/tokenizer.py) on the example model's tokenizer files, no model needed:
incremental detokenisation (streamed pieces joined == decode(ids), never a broken character, never text
twice), stop strings and EOS, the sandboxed chat template (Python internals refused), and the manifest's
`tokenizer` entry confined like every other path. Each check is shown to catch the fault it guards against."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from v4compile import tokenizer as tk
from v4compile.errors import InputError, TemplateError
from v4compile.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, Tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-doc"
TEXT = "Return the café's naïve résumé: 3 € → 😀 ok\n\nDone. 日本語のテキスト"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_bytes((EXAMPLE / TOKENIZER_JSON).read_bytes(), (EXAMPLE / TOKENIZER_CONFIG).read_bytes(),
                                str(EXAMPLE))


def streamed(tok: Tokenizer, ids: list[int], stop=()) -> list[str]:
    s = tok.stream(stop)
    pieces = []
    for i in ids:
        piece, done = s.push(i)
        pieces.append(piece)
        if done:
            return pieces
    return pieces + [s.finish()]


def test_streamed_pieces_join_to_the_decoded_ids_and_never_split_a_character(tok):
    ids = tok.encode(TEXT, add_bos=False)
    assert tok.decode(ids) == TEXT
    # multi-byte characters span several byte-level tokens: the check is meaningful
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    pieces = streamed(tok, ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    rng = random.Random(20)  # seeded random ids: invalid byte sequences included
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids = [i for i in ids if i not in tok.eos_ids]
        assert "".join(streamed(tok, ids)) == tok.decode(ids)


def test_the_stream_check_catches_a_stream_that_prints_broken_characters(tok, monkeypatch):
    monkeypatch.setattr(tk, "REPLACEMENT", "")  # no hold-back: a half character is printed as U+FFFD
    pieces = streamed(tok, tok.encode(TEXT, add_bos=False))
    assert any("\ufffd" in p for p in pieces) and "".join(pieces) != TEXT


def token_bytes_join(tok: Tokenizer) -> bool:
    """Each id's bytes (log-probability entries) joined give the text's UTF-8, multi-byte characters split
    across ids included."""
    ids = tok.encode(TEXT, add_bos=False)
    return b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode("utf-8")


def test_token_bytes_join_to_the_text(tok, monkeypatch):
    """Catches a token's bytes read as its decoded text (planted: a part of a character becomes U+FFFD)."""
    assert token_bytes_join(tok) and tok.token_bytes(sorted(tok.eos_ids)[0]) == tok.eos_token.encode()
    monkeypatch.setattr(tk, "_BYTE_OF", {})
    assert not token_bytes_join(tok)


def test_stop_strings_and_eos_end_the_text_before_them(tok):
    ids = tok.encode(TEXT, add_bos=False)
    pieces = streamed(tok, ids, stop=["\n\nDone"])
    assert "".join(pieces) == TEXT[: TEXT.index("\n\nDone")]
    assert not any("\n" in p for p in pieces)  # a forming stop string is held back, never printed
    eos = next(iter(tok.eos_ids))
    s = tok.stream()
    text = "".join(s.push(i)[0] for i in ids[:5])
    piece, done = s.push(eos)
    assert done and s.finish_reason == "stop" and text + piece == tok.decode(ids[:5])
    assert s.push(ids[5]) == ("", True)
    with pytest.raises(InputError, match="stop"):
        tok.stream(stop=[""])


def test_the_chat_template_follows_hf_conventions(tok):
    msgs = [{"role": "user", "content": "json.dumps"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert text == "<|bos|><|user|>json.dumps<|assistant|>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|bos|><|user|>json.dumps"
    ids = tok.encode(text)
    assert ids[0] == tok.encode("<|bos|>", add_bos=False)[0] and ids.count(ids[0]) == 1  # BOS once, not twice
    with pytest.raises(InputError, match="messages"):
        tok.apply_chat_template([{"role": "user"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% for m in messages %}{{ m.items.__self__.__class__ }}{% endfor %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_a_template_reaching_python_internals_is_refused(tok, template):
    tok.chat_template, tok._template = template, None
    with pytest.raises(TemplateError, match="Python internals"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_the_sandbox_check_catches_the_stock_lenient_sandbox(tok, monkeypatch):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the stock sandbox renders `''.__class__` as an empty string: what the strict one refuses
    monkeypatch.setattr(tk, "_environment", lambda: ImmutableSandboxedEnvironment())
    tok.chat_template, tok._template = "{{ ''.__class__ }}x", None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_template_errors_are_one_clear_error(tok):
    for template, match in (("{% for %}", "does not render"), ("{{ raise_exception('no system role') }}",
                                                               "no system role")):
        tok.chat_template, tok._template = template, None
        with pytest.raises(TemplateError, match=match):
            tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_tokenizer_files_are_one_clear_error():
    with pytest.raises(InputError, match="tokenizers"):
        Tokenizer.from_bytes(b"{not json", None, "x")
    good = (EXAMPLE / TOKENIZER_JSON).read_bytes()
    with pytest.raises(InputError, match="not JSON"):
        Tokenizer.from_bytes(good, b"[", "x")
    with pytest.raises(InputError, match="eos_token is not in the vocabulary"):
        Tokenizer.from_bytes(good, b'{"eos_token": "<|nope|>"}', "x")
