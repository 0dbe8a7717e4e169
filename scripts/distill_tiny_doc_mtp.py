"""Train the MTP block of `examples/tiny-doc` further, the main model frozen: self-distillation for speculative
decoding. Plain torch on the CPU, seeded and single-threaded (the same Python, torch and tokenizers versions
give the same bytes); run after `scripts/train_tiny_doc.py`.

    python scripts/distill_tiny_doc_mtp.py [-o examples/tiny-doc] [--steps 800] [--generated 512]

`train_tiny_doc.py` trains the block on the corpus's token after next (0.3 x its cross-entropy next to the main
loss); a draft is accepted when it is what the main model itself predicts, so here the block learns the main
model's own distribution: at position t, from the backbone's streams at t and the token t + 1, the main
model's next-token distribution at t + 1 (KL divergence to it). Half of each batch is corpus windows of
`train_tiny_doc.py` (encoded with the example's own tokenizer), half the main model's own greedy continuations
of `--generated` corpus prompts (made once, before training): speculative decoding drafts on the model's own
greedy text, which the corpus alone does not show the block. Only `mtp.*` changes: every tensor the main model
reads keeps its bytes, so its ids (and every test that decodes with it) stay what they were. It rewrites the
checkpoint's safetensors in place and prints the block's agreement with the main model's argmax before and
after on held-out corpus windows: 0.51 -> 0.64 for the example (800 steps, about 15 minutes of a loaded core;
greedy acceptance of the first draft on bench/bench_spec.py's prompts 0.51 -> 0.80; corpus windows alone, 300
steps: 0.62 and 0.70; 1500 steps: 0.665 and 0.68).
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

from train_tiny_doc import corpus, docstrings, split_experts  # noqa: E402

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
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--generated", type=int, default=512,
                    help="corpus prompts continued greedily by the main model, half of each batch (0: corpus only)")
    ap.add_argument("--prompt", type=int, default=16, help="tokens of each of those prompts")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    ops.load_all()
    t0 = time.perf_counter()
    out = Path(args.output)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = torch.tensor([i for t in corpus(docstrings()) for i in tok.encode(t).ids], dtype=torch.long)
    model = ReferenceModel.from_pretrained(out, numerics="official")
    cfg, W = model.cfg, model.weights
    params = [v.requires_grad_(True) for n, v in W.items() if n.startswith("mtp.") and v.is_floating_point()]
    opts = StepOptions(numerics="official")
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    g = torch.Generator().manual_seed(SEED)
    B, T = args.batch, args.seq
    held = windows(ids, 32, T, torch.Generator().manual_seed(SEED + 1))
    own = generated(model, windows(ids, args.generated, args.prompt, g), T) if args.generated else None

    def targets(x):
        """The main model's streams and its next-token log-probabilities (frozen: no gradient)."""
        with torch.no_grad():
            cache = model.new_cache(x.shape[0], T)
            pos = torch.arange(T).repeat(x.shape[0], 1)
            logits, streams = model_step(model.params, cfg, x, pos, cache.layers, opts)
        return logits.float().log_softmax(-1), streams, pos, cache

    def agreement() -> float:
        with torch.no_grad():
            logp, streams, pos, cache = targets(held)
            draft, _ = mtp_step(model.params, cfg, 0, streams[:, :-1], held[:, 1:], pos[:, :-1], cache.mtp[0], opts)
            return float((draft[:, :-1].argmax(-1) == logp[:, 1:-1].argmax(-1)).float().mean())

    before = agreement()
    print(f"corpus {len(ids)} tokens; MTP agreement with the main model's argmax (held out): {before:.3f}", flush=True)
    for step in range(args.steps):
        x = windows(ids, B, T, g)
        if own is not None:  # half the batch the model's own greedy text, as speculative decoding drafts on
            x[B // 2:] = own[torch.randint(0, len(own), (B - B // 2,), generator=g)]
        logp, streams, pos, cache = targets(x)
        draft, _ = mtp_step(model.params, cfg, 0, streams[:, :-1], x[:, 1:], pos[:, :-1], cache.mtp[0], opts)
        # lane t of the draft predicts token t + 2: the main model's distribution at position t + 1
        q = draft[:, :-1].float().log_softmax(-1)
        loss = torch.nn.functional.kl_div(q.reshape(-1, cfg.vocab_size), logp[:, 1:-1].reshape(-1, cfg.vocab_size),
                                          log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step}: kl {loss.item():.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
    after = agreement()
    print(f"MTP agreement with the main model's argmax (held out): {before:.3f} -> {after:.3f}", flush=True)

    tmp = out.parent / f".{out.name}.mtp.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, cfg, split_experts(cfg, W), dtype="fp32", include_mtp=True)
    for f in tmp.iterdir():  # the weights only: config and tokenizer files stay as they are
        os.replace(f, out / f.name)
    shutil.rmtree(tmp)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
