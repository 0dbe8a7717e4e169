"""Train `examples/tiny-doc`: the tiny preset (MTP block included) and a byte-level BPE tokenizer, on the
documentation strings of Python's standard library. Plain torch on the CPU, seeded and single-threaded
(the same Python, torch and tokenizers versions give the same bytes).

    python scripts/train_tiny_doc.py [-o examples/tiny-doc] [--steps 700]

It writes the official checkpoint layout (config.json + safetensors, fp32) plus `tokenizer.json` and
`tokenizer_config.json` (special tokens and a chat template). Training goes through the reference model's
own step (`model_step` / `mtp_step`, which are differentiable), so the checkpoint loads through the project's
loader and computes what was trained. The loss is next-token cross-entropy plus 0.3 x the MTP block's
token-after-next cross-entropy. About 6 minutes of one idle core (450 steps took 3.5 CPU-minutes; the 700
steps took 25 minutes of wall time on a shared, busy 2-core machine).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer trainer: one thread, one merge order
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from v4compile import ops  # noqa: E402
from v4compile.checkpoint import write_checkpoint  # noqa: E402
from v4compile.config import preset  # noqa: E402
from v4compile.init_random import random_source  # noqa: E402
from v4compile.model import ReferenceModel  # noqa: E402
from v4compile.model.blocks import StepOptions, model_step, mtp_step  # noqa: E402
from v4compile.model.params import experts_name  # noqa: E402
from v4compile.model.reference import build_weights  # noqa: E402
from v4compile.weights import spec_table  # noqa: E402

SEED = 20
BOS, EOS, USER, ASSISTANT, SYSTEM = "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIALS = [BOS, EOS, USER, ASSISTANT, SYSTEM]
# HF apply_chat_template conventions: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
# Pure-Python standard modules with plenty of prose, walked in this order (no module with import-time
# side effects: no antigravity, this, tkinter, idlelib).
MODULES = ("argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
           "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
           "difflib", "dis", "email.message", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
           "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
           "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "locale", "logging",
           "mailbox", "mimetypes", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil",
           "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "random", "re", "sched", "secrets",
           "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "sqlite3", "ssl",
           "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
           "timeit", "tokenize", "traceback", "types", "typing", "unittest", "urllib.parse", "urllib.request",
           "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zoneinfo")


def docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) of every module, class, function and method of MODULES, in a fixed order,
    each docstring once."""
    out, seen = [], set()

    def add(name: str, obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            out.append((name, doc))

    for mname in MODULES:
        try:
            mod = importlib.import_module(mname)
        except ImportError:
            continue
        add(mname, mod)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj):
                add(f"{mname}.{name}", obj)
                for mn, meth in sorted(vars(obj).items()):
                    if not mn.startswith("_") and callable(meth):
                        add(f"{mname}.{name}.{mn}", meth)
            elif inspect.isfunction(obj):
                add(f"{mname}.{name}", obj)
    return out


def render_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS)


def corpus(docs: list[tuple[str, str]]) -> list[str]:
    """Every docstring twice: as plain text, and as a chat answer to its name."""
    texts = []
    for name, doc in docs:
        texts.append(BOS + doc + EOS)
        texts.append(render_chat([{"role": "user", "content": name}, {"role": "assistant", "content": doc}], False))
    return texts


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"the tokenizer has {tok.get_vocab_size()} entries, the model {vocab}")
    return tok


def split_experts(cfg, W: dict[str, torch.Tensor]):
    """The checkpoint writer's `get(spec)`: one expert's matrix out of the stacked training tensors."""
    def get(spec):
        if ".ffn.experts." in spec.name:
            prefix, rest = spec.name.split("ffn.experts.")
            e, w, _ = rest.split(".")
            return W[experts_name(prefix, w)][int(e)].detach()
        return W[spec.name].detach()
    return get


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", default=str(Path(__file__).resolve().parent.parent / "examples" / "tiny-doc"))
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    ops.load_all()
    t0 = time.perf_counter()

    cfg = preset("tiny")
    texts = corpus(docstrings())
    tok = train_tokenizer(texts, cfg.vocab_size)
    ids = torch.tensor([i for t in texts for i in tok.encode(t).ids], dtype=torch.long)
    print(f"corpus: {len(texts)} texts, {len(ids)} tokens; tokenizer {time.perf_counter() - t0:.1f} s", flush=True)

    specs = spec_table(cfg)
    src = random_source(cfg, SEED)
    W = build_weights(cfg, lambda n: src(specs[n]), torch.float32)
    for n, v in W.items():
        if n.endswith("norm.weight"):  # start from the identity scale: random norm scales only slow learning
            v.fill_(1.0)
    params = [v.requires_grad_(True) for v in W.values() if v.is_floating_point()]
    model = ReferenceModel(cfg, W, numerics="official")
    opts = StepOptions(numerics="official")
    opt = torch.optim.AdamW(params, lr=5e-3, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=args.steps, pct_start=0.05)
    g = torch.Generator().manual_seed(SEED)
    B, T = args.batch, args.seq
    pos = torch.arange(T).repeat(B, 1)
    for step in range(args.steps):
        start = torch.randint(0, len(ids) - T, (B,), generator=g)
        x = torch.stack([ids[s: s + T] for s in start.tolist()])
        cache = model.new_cache(B, T)
        logits, streams = model_step(model.params, cfg, x, pos, cache.layers, opts)
        draft, _ = mtp_step(model.params, cfg, 0, streams[:, :-1], x[:, 1:], pos[:, :-1], cache.mtp[0], opts)
        ce = torch.nn.functional.cross_entropy
        main_loss = ce(logits[:, :-1].reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        mtp_loss = ce(draft[:, :-1].reshape(-1, cfg.vocab_size), x[:, 2:].reshape(-1))
        (main_loss + 0.3 * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {main_loss.item():.3f}, mtp {mtp_loss.item():.3f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)

    out = Path(args.output)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, cfg, split_experts(cfg, W), dtype="fp32", include_mtp=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "model_max_length": cfg.max_position, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    prompt = "Return the"
    with torch.no_grad():
        new = model.generate(tok.encode(BOS + prompt).ids, 24)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s; greedy: {prompt!r} -> {tok.decode(new)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
