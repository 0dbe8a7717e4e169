"""`v4compile run DIR --prompt TEXT [--chat] [--stop S]`: text in, text streamed out.

The prompt is encoded with the artifact's tokenizer (with `--chat`, as the single user message of its chat
template, with the generation prompt), generated through the same continuous-batching step the server uses
(`runtime/batcher.py`), and printed as it comes: each token's new stable text (`Tokenizer.stream`), so no
broken multi-byte character and no text twice. An EOS id or a stop string ends the sequence. `--json`
prints one object instead: "text", "ids", "tokens_per_s", "finish_reason" and the timings of `--ids`.
"""

from __future__ import annotations

import json
import sys
import time

from ..errors import InputError


def prompt_ids(sess, prompt: str, chat: bool, where: str = "--prompt") -> list[int]:
    """The ids of a prompt (a chat turn with `chat`), with one clear error when the artifact has no tokenizer."""
    tok = sess.tokenizer
    if tok is None:
        raise InputError("the artifact has no tokenizer: a text prompt needs one", where=str(sess.art.path),
                         expected="an artifact compiled from a checkpoint with tokenizer.json (or --ids)")
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True) if chat \
        else prompt
    ids = tok.encode(text)
    if not ids:
        raise InputError("empty prompt", where=where, expected="text that encodes to at least one token")
    return ids


def run_prompt(args) -> int:
    from ..runtime import load
    from ..runtime.batcher import Batcher, Request

    t_load = time.perf_counter()
    sess = load(args.artifact, device=args.device, threads=args.threads, prefix_cache=not args.no_prefix_cache)
    t_load = time.perf_counter() - t_load
    ids = prompt_ids(sess, args.prompt, args.chat)
    stream = sess.tokenizer.stream(args.stop or ())
    batcher = Batcher(sess)
    out = sys.stdout

    def on_token(_req, tok: int) -> bool:
        piece, done = stream.push(tok)
        if piece and not args.json:
            out.write(piece)
            out.flush()
        return done

    req = Request(ids, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                  stop_ids=sess.tokenizer.eos_ids, on_token=on_token)
    batcher.check(ids, args.max_new_tokens, where="--prompt")
    t_warm = time.perf_counter()
    sess.warmup(len(ids))
    t_warm = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    batcher.submit(req)
    batcher.run_until_idle()
    dt = time.perf_counter() - t0
    if req.error is not None:
        raise req.error
    tail = stream.finish()
    tps = len(req.ids) / dt if dt > 0 else 0.0
    if args.json:
        print(json.dumps({"text": stream.text, "ids": req.ids, "finish_reason": stream.finish_reason or req.finish_reason,
                          "tokens_per_s": round(tps, 2), "load_s": round(t_load, 4), "warmup_s": round(t_warm, 4)}))
    else:
        out.write(tail + "\n")
        out.flush()
        print(f"{len(req.ids)} tokens in {dt:.3f} s ({tps:.1f} tokens/s, prefill included) on {args.device}",
              file=sys.stderr)
    return 0
