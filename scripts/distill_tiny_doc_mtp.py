"""Train the MTP block of `examples/tiny-doc` further, the main model frozen: self-distillation for speculative
decoding. Plain torch on the CPU, seeded and single-threaded (the same Python, torch and tokenizers versions
give the same bytes); run after `scripts/train_tiny_doc.py`, three times (the example's bytes):

    python scripts/distill_tiny_doc_mtp.py --mode mixed   # 800 steps, ~15 minutes of a loaded core
    python scripts/distill_tiny_doc_mtp.py                # --mode own: 3000 steps, ~30 minutes of a loaded core
    python scripts/distill_tiny_doc_mtp.py --lr 5e-4      # the same again, a lower learning rate

`train_tiny_doc.py` trains the block on the corpus's token after next (0.3 x its cross-entropy next to the main
loss); a draft is accepted when it is what the main model itself predicts, so here the block learns the main
model's own distribution: at position t, from the backbone's streams at t and the token t + 1, the main
model's next-token distribution at t + 1 (KL divergence to it). Only `mtp.*` changes: every tensor the main model
reads keeps its bytes, so its ids (and every test that decodes with it) stay what they were. Each stage rewrites
the checkpoint's safetensors in place and prints the block's agreement with the main model's argmax before and
after on held-out text.

* `mixed`: half of each batch corpus windows of `train_tiny_doc.py` (encoded with the example's own tokenizer),
  half the main model's own greedy continuations of `--generated` corpus prompts. Agreement on held-out corpus
  windows 0.51 -> 0.64 (greedy acceptance of the first draft on bench/bench_spec.py's prompts 0.51 -> 0.80).
* `own` (speculative decoding drafts on the model's own greedy text, from a prompt's start): every batch the
  main model's greedy continuations to 80 tokens of 2048 prompts, each the first 2-12 tokens of a corpus text
  (BOS and a text's start, as bench_spec's prompts), none containing one of bench_spec.py's prompts (those
  are held out: measured, never trained on), 64 more held out for the figure. The frozen model's streams and
  log-probabilities are computed once, so a step runs the MTP block only; the loss is the KL divergence plus
  the cross-entropy to the main model's argmax (`--ce`; greedy acceptance asks for the argmax itself),
  OneCycle learning rate to 1e-3. Agreement on the held-out prompts' greedy text (= the first draft's greedy
  acceptance there) 0.789 -> 0.923, on bench_spec's prompts' 0.784 -> 0.904 (about 27 minutes on a core
  shared with ~9 other processes: 13 to generate, 14 to train); run again at 5e-4: 0.932 and 0.914. (On
  corpus windows, which speculative decoding does not draft on, the agreement falls from 0.64 to about 0.6.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny_doc import BOS, corpus, docstrings, split_experts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_spec import PROMPTS as BENCH_PROMPTS  # noqa: E402  (held out: measured, never trained on)

from v4compile import ops  # noqa: E402
from v4compile.checkpoint import write_checkpoint  # noqa: E402
from v4compile.model import ReferenceModel  # noqa: E402
from v4compile.model.blocks import StepOptions, model_step, mtp_step  # noqa: E402

SEED = 21


def windows(ids: torch.Tensor, n: int, T: int, g: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, len(ids) - T, (n,), generator=g)
    return torch.stack([ids[s: s + T] for s in start.tolist()])


@torch.no_grad()
def generated(model, prompts: torch.Tensor, T: int, batch: int = 128) -> torch.Tensor:
    """Each prompt (corpus window) continued greedily by the main model to T tokens `[n, T]`."""
    out = []
    for i in range(0, len(prompts), batch):
        p = prompts[i: i + batch]
        cache, logits = model.prefill(p.tolist(), capacity=T)
        seq = [p]
        for _ in range(T - p.shape[1]):
            nxt = logits.argmax(-1)
            seq.append(nxt[:, None])
            if sum(x.shape[1] for x in seq) < T:
                logits = model.decode(nxt, cache)
        out.append(torch.cat(seq, 1))
    return torch.cat(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", default=str(Path(__file__).resolve().parent.parent / "examples" / "tiny-doc"))
    ap.add_argument("--mode", choices=("mixed", "own"), default="own",
                    help="mixed: the first stage (corpus windows and greedy text); own: the second (greedy text only)")
    ap.add_argument("--steps", type=int, default=None, help="default 800 (mixed) or 3000 (own)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default 64 (mixed) or 80 (own)")
    ap.add_argument("--lr", type=float, default=None, help="default 2e-3 (mixed) or 1e-3 (own)")
    ap.add_argument("--generated", type=int, default=512,
                    help="mixed: corpus prompts continued greedily by the main model, half of each batch (0: corpus only)")
    ap.add_argument("--prompt", type=int, default=16, help="mixed: tokens of each of those prompts")
    ap.add_argument("--sequences", type=int, default=2048, help="own: greedy continuations trained on")
    ap.add_argument("--ce", type=float, default=1.0, help="own: weight of the cross-entropy to the main model's argmax")
    args = ap.parse_args()
    own_mode = args.mode == "own"
    steps = args.steps or (3000 if own_mode else 800)
    T = args.seq or (80 if own_mode else 64)
    lr = args.lr or (1e-3 if own_mode else 2e-3)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    ops.load_all()
    t0 = time.perf_counter()
    out = Path(args.output)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = [tok.encode(t).ids for t in corpus(docstrings())]
    model = ReferenceModel.from_pretrained(out, numerics="official")
    cfg, W = model.cfg, model.weights
    params = [v.requires_grad_(True) for n, v in W.items() if n.startswith("mtp.") and v.is_floating_point()]
    opts = StepOptions(numerics="official")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(SEED)
    B = args.batch

    def targets(x):
        """The main model's streams and its next-token log-probabilities (frozen: no gradient)."""
        with torch.no_grad():
            cache = model.new_cache(x.shape[0], x.shape[1])
            pos = torch.arange(x.shape[1]).repeat(x.shape[0], 1)
            logits, streams = model_step(model.params, cfg, x, pos, cache.layers, opts)
        return logits.float().log_softmax(-1), streams, pos, cache

    def draft(x, streams, pos, cache):
        """Lane t: the MTP block's logits for token t + 2 (from the streams at t and token t + 1)."""
        return mtp_step(model.params, cfg, 0, streams[:, :-1], x[:, 1:], pos[:, :-1], cache.mtp[0], opts)[0][:, :-1]

    if own_mode:
        train, held, bench = own_sequences(model, texts, tok, args.sequences, T, g)
        print(f"{len(train)} greedy continuations to {T} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
        data = precomputed(targets, [x for x, _ in train])

        def agreement(seqs) -> float:
            """The draft's agreement with the main model's argmax where token t + 1 is the model's own
            (after the prompt): the greedy acceptance of a first draft on that text."""
            with torch.no_grad():
                x = torch.stack([s for s, _ in seqs])
                logp, streams, pos, cache = targets(x)
                hit = draft(x, streams, pos, cache).argmax(-1) == logp[:, 1:-1].argmax(-1)
                mask = torch.stack([torch.arange(1, x.shape[1] - 1) >= n for _, n in seqs])
                return float(hit[mask].float().mean())

        def report():
            return f"held-out prompts {agreement(held):.3f}, bench_spec's prompts {agreement(bench):.3f}"
    else:
        ids = torch.tensor([i for t in texts for i in t], dtype=torch.long)
        held_w = windows(ids, 32, T, torch.Generator().manual_seed(SEED + 1))
        own = generated(model, windows(ids, args.generated, args.prompt, g), T) if args.generated else None

        def report():
            with torch.no_grad():
                logp, streams, pos, cache = targets(held_w)
                hit = draft(held_w, streams, pos, cache).argmax(-1) == logp[:, 1:-1].argmax(-1)
                return f"held-out corpus windows {float(hit.float().mean()):.3f}"

    before = report()
    print(f"MTP agreement with the main model's argmax: {before}", flush=True)
    for step in range(steps):
        if own_mode:
            pick = torch.randint(0, len(data[0]), (B,), generator=g)
            x, logp, streams = (d[pick] for d in data)
            pos = torch.arange(T).repeat(B, 1)
            cache = model.new_cache(B, T)
        else:
            x = windows(ids, B, T, g)
            if own is not None:  # half the batch the model's own greedy text, as speculative decoding drafts on
                x[B // 2:] = own[torch.randint(0, len(own), (B - B // 2,), generator=g)]
            logp, streams, pos, cache = targets(x)
        # lane t of the draft predicts token t + 2: the main model's distribution at position t + 1
        q = draft(x, streams, pos, cache).float().log_softmax(-1).reshape(-1, cfg.vocab_size)
        p = logp[:, 1:-1].reshape(-1, cfg.vocab_size)
        loss = torch.nn.functional.kl_div(q, p, log_target=True, reduction="batchmean")
        if own_mode and args.ce:  # greedy acceptance asks for the argmax itself
            loss = loss + args.ce * torch.nn.functional.nll_loss(q, p.argmax(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"MTP agreement with the main model's argmax: before {before}; after {report()}", flush=True)

    tmp = out.parent / f".{out.name}.mtp.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, cfg, split_experts(cfg, W), dtype="fp32", include_mtp=True)
    for f in tmp.iterdir():  # the weights only: config and tokenizer files stay as they are
        os.replace(f, out / f.name)
    shutil.rmtree(tmp)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


def own_sequences(model, texts: list[list[int]], tok, n: int, T: int, g: torch.Generator):
    """(train, held, bench): lists of (the main model's greedy continuation to T tokens, prompt length).
    Prompts are the first 2-12 tokens of the corpus's texts (as bench_spec's prompts: BOS and a text's start),
    in a seeded order; 64 of them held out for the agreement figure, and none trained on contains one of
    bench_spec.py's prompts (also measured, never trained on)."""
    bench_prompts = [tok.encode(BOS + p).ids for p in BENCH_PROMPTS]
    banned = [b[1:] for b in bench_prompts]  # the prompt's text without BOS, anywhere in a training prompt

    def contains(p, b):
        return any(p[i: i + len(b)] == b for i in range(len(p) - len(b) + 1))

    lengths = torch.randint(2, 13, (len(texts),), generator=g).tolist()
    order = torch.randperm(len(texts), generator=g).tolist()
    prompts = [texts[i][:lengths[i]] for i in order if len(texts[i]) >= lengths[i]]
    prompts = [p for p in prompts if not any(contains(p, b) for b in banned)]
    seen, unique = set(), []
    for p in prompts:  # each prompt once (many texts begin alike)
        if tuple(p) not in seen:
            seen.add(tuple(p))
            unique.append(p)
    held, train = unique[:64], unique[64: 64 + n]
    return generated_any(model, train, T), generated_any(model, held, T), generated_any(model, bench_prompts, T)


@torch.no_grad()
def generated_any(model, prompts: list[list[int]], T: int) -> list[tuple[torch.Tensor, int]]:
    """`generated` for prompts of several lengths: (sequence, prompt length) in the prompts' order."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: list = [None] * len(prompts)
    for n, idx in by_len.items():
        seqs = generated(model, torch.tensor([prompts[i] for i in idx]), T)
        for i, s in zip(idx, seqs):
            out[i] = (s, n)
    return out


@torch.no_grad()
def precomputed(targets, seqs: list[torch.Tensor], batch: int = 64):
    """The frozen main model's part once: (ids, next-token log-probabilities, streams) of every sequence."""
    parts = []
    for i in range(0, len(seqs), batch):
        x = torch.stack(seqs[i: i + batch])
        logp, streams, _, _ = targets(x)
        parts.append((x, logp, streams))
    return tuple(torch.cat(c) for c in zip(*parts))


if __name__ == "__main__":
    sys.exit(main())
