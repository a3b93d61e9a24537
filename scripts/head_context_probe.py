"""Would the first Hydra head guess better if it could attend over the context? A probe.

The first head (the one the CPU's 2-node trees live on) reads the base model's final state at t
and the embedding of the token drafted at t+1, nothing earlier. This trains, from scratch and on
the same batches (whole answers with their prompts), three first heads and reports their top-1
agreement with the base model's greedy token on answers none of them trained on:

- `final`: the head as shipped, `[h_t ; E(x_t+1)]` -> 2 ResBlocks -> the shared LM head's rows;
- `prefix`: Hydra++ (`--arch prefix-mlp`, which the engine serves): one decoder layer of the base
  model's shape runs causally over the base states of prompt and answer, and the same head reads
  its output `z_t` instead of `h_t`;
- `fused`: EAGLE-style, one decoder layer over `fc([h_j ; E(x_j+1)])` for every j <= t, then one
  ResBlock.

Each step draws the same `--answers` whole answers for every variant; the anchors are their
positions (at most `--batch`). The corpus is a `train-heads --arch prefix-mlp` work folder (its
shards keep the prompts' states); every `--holdout`-th answer of it is held out, beside the
corpus's calibration answers. One JSON line per variant on stdout, progress on stderr.

    python -m entmtp train-heads --kind hydra --arch prefix-mlp --work checkpoints/probe --corpus-only ...
    PYTHONPATH=. python scripts/head_context_probe.py --work checkpoints/probe --variants final,prefix,fused
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entmtp.config import DEFAULT_MODEL, ModelConfig  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.runtime.runtime import default_heads_dir, load_runtime  # noqa: E402
from entmtp.spec.headfiles import load_heads  # noqa: E402
from entmtp.spec.heads import ResBlock, state_layer  # noqa: E402
from entmtp.tools.train import Corpus, Flat, prefix_features  # noqa: E402

VARIANTS = ("final", "prefix", "fused")


def read_split(folder: Path, encode) -> list[dict]:
    """Per answer: source, prompt ids, prompt states (P-1, H), answer states (n, H), answer tokens (n,)."""
    out = []
    for shard in sorted(folder.glob("*.pt")):
        part = torch.load(shard, weights_only=True)
        source = "-".join(shard.name.split("-")[:2])
        for text, ph, h, tok in zip(part["prompts"], part["prompt_hidden"], part["hidden"], part["tokens"]):
            if len(tok) >= 2:
                out.append({"source": source, "ids": encode(text), "prompt_hidden": ph.float(), "hidden": h.float(),
                            "tokens": tok.long()})
    return out


class Probe(nn.Module):
    def __init__(self, variant: str, hidden: int, base_config, embed: nn.Module):
        super().__init__()
        self.variant, self.embed = variant, embed  # embed: the base model's, frozen, not a parameter here
        if variant == "fused":
            self.fc = nn.Linear(2 * hidden, hidden)
            self.layer = state_layer(base_config)
            self.head = ResBlock(hidden)
        else:
            self.layer = state_layer(base_config) if variant == "prefix" else None
            self.head = nn.Sequential(ResBlock(hidden, 1), ResBlock(hidden))

    def forward(self, a: dict, t: torch.Tensor, context: int | None = None) -> torch.Tensor:
        """Head outputs (len(t), H) at answer positions t of answer `a`; `context`: prompt states kept."""
        h, tok = a["hidden"], a["tokens"]
        with torch.no_grad():
            e_answer = self.embed(tok).float()
        if self.variant == "final":
            return self.head(torch.cat([h[t], e_answer[t]], -1))
        ph, ids = a["prompt_hidden"], a["ids"]
        keep = len(ph) if context is None else min(context, len(ph))
        seq = torch.cat([ph[len(ph) - keep :], h])  # states at prompt positions, then the answer's
        at = keep + t  # answer position t in seq
        if self.variant == "prefix":
            z = prefix_features(self.layer, seq)
            return self.head(torch.cat([z[at], e_answer[t]], -1))
        with torch.no_grad():  # fused: the token that followed each position (prompt ids, then answer)
            e_prompt = self.embed(torch.tensor(ids[len(ids) - keep :], dtype=torch.long)).float()
        o = prefix_features(self.layer, self.fc(torch.cat([seq, torch.cat([e_prompt, e_answer])], -1)))
        return self.head(o[at])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--answers", type=int, default=8, help="whole answers a step")
    ap.add_argument("--batch", type=int, default=512, help="anchors a step, at most")
    ap.add_argument("--context", type=int, default=256, help="prompt states a training sequence keeps")
    ap.add_argument("--holdout", type=int, default=9, help="every n-th training answer is held out")
    ap.add_argument("--hard", action="store_true", help="train on the teacher's argmax, not its top-32 distribution")
    ap.add_argument("--train-every", type=int, default=1, help="train on every n-th of the other answers (a smaller corpus)")
    ap.add_argument("--out", help="append each variant's JSON line to this file too")
    args = ap.parse_args()
    rt = load_runtime(ModelConfig(kernels="packed"))
    model = rt.model
    vocab = load_heads(default_heads_dir(DEFAULT_MODEL, "hydra"), model.config).draft_vocab.long()
    full_lm = model.get_output_embeddings().weight.detach().float()
    lm = full_lm[vocab]  # (K, H): the draft vocabulary's rows
    embed = model.get_input_embeddings()
    work = Path(args.work)
    every = read_split(work / "corpus" / "train", rt.encode)
    train = [a for i, a in enumerate(every) if i % args.holdout != args.holdout // 2][:: args.train_every]
    other = [a for i, a in enumerate(every) if i % args.holdout == args.holdout // 2]
    calib = read_split(work / "corpus" / "calib", rt.encode)
    with torch.no_grad():  # the teacher at every answer position (as train-heads makes it), and the greedy token
        flat = Flat.of(Corpus([a["hidden"] for a in every + calib], [a["tokens"] for a in every + calib]))
        flat.add_teacher(lm, 32)
        # in large blocks: per-answer (n x vocab) logits would fragment the heap
        greedy = torch.cat([(c @ full_lm.T).argmax(-1) for c in flat.hidden.split(4096)])
        for a, s, e in zip(every + calib, flat.starts[:-1].tolist(), flat.starts[1:].tolist()):
            a["teacher"], a["greedy"] = (flat.teacher_idx[s:e].long(), flat.teacher_p[s:e]), greedy[s:e]
        del flat
    n_tok = sum(len(a["tokens"]) for a in train)
    print(f"train {len(train)} answers / {n_tok} tokens; held out {len(other)} answers, calib {len(calib)}",
          file=sys.stderr)
    for name in args.variants.split(","):
        torch.manual_seed(0)
        probe = Probe(name, lm.shape[1], model.config, embed)
        params = [p for n, p in probe.named_parameters() if not n.startswith("embed.")]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        t0 = time.perf_counter()
        bar = tqdm(range(args.steps), desc=name, file=sys.stderr)
        for step in bar:
            g = torch.Generator().manual_seed(step)
            picks = torch.randint(len(train), (args.answers,), generator=g).tolist()
            anchors = [(a, torch.arange(len(train[a]["tokens"]) - 1)) for a in picks]  # t with t+1 in the answer
            total = sum(len(t) for _, t in anchors)
            if total > args.batch:  # the same subsample for every variant
                keep = torch.randperm(total, generator=g)[: args.batch].sort().values
                flat = torch.cat([torch.full((len(t),), j) for j, (_, t) in enumerate(anchors)])
                pos = torch.cat([t for _, t in anchors])
                anchors = [(a, pos[keep][flat[keep] == j]) for j, (a, _) in enumerate(anchors)]
            frac = step / args.steps
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
            outs, tis, tps = [], [], []
            for a, t in anchors:
                if len(t):
                    outs.append(probe(train[a], t, args.context))
                    ti, tp = train[a]["teacher"]
                    tis.append(ti[t + 1])
                    tps.append(tp[t + 1])
            logp = torch.log_softmax(torch.cat(outs) @ lm.T, -1)
            if args.hard:
                loss = -logp.gather(1, torch.cat(tis)[:, :1]).mean()
            else:
                loss = -(torch.cat(tps) * logp.gather(1, torch.cat(tis))).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        seconds = time.perf_counter() - t0
        row = {"variant": name, "seconds": round(seconds, 1), "steps": args.steps, "lr": args.lr,
               "answers_per_step": args.answers, "batch": args.batch, "context": args.context, "targets": "hard" if args.hard else "soft",
               "params": sum(p.numel() for p in params), "train_every": args.train_every, "train_answers": len(train), "train_tokens": n_tok}
        probe.eval()
        with torch.no_grad():
            sample = [train[i] for i in torch.randperm(len(train), generator=torch.Generator().manual_seed(1))[:len(other)]]
            for split, data in (("train_sample", sample), ("other", other), ("calib", calib)):
                by: dict[str, list[int]] = {}
                for a in data:
                    t = torch.arange(len(a["tokens"]) - 1)
                    guess = vocab[(probe(a, t) @ lm.T).argmax(-1)]
                    hit = (guess == a["greedy"][t + 1]).long()
                    for key in ("all", a["source"]):
                        s = by.setdefault(key, [0, 0])
                        s[0] += int(hit.sum())
                        s[1] += len(hit)
                row[split] = {k: {"top1": round(h / n, 4), "n": n} for k, (h, n) in sorted(by.items())}
        row["hardware"] = hardware()
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
