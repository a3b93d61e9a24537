"""Would the first Hydra head guess better if it also read earlier layers' states? A probe.

The first head (the one the CPU's 2-node trees live on) reads the base model's final state at t
and the embedding of the token drafted at t+1. EAGLE-3 feeds its draft low, middle and high
layers' states instead. This trains, from scratch and on the same batches, the first head as
shipped (`final`) beside the same head given more layers' states (each RMS-normalised, no weights),
on a sample of the training corpus's answers, and reports top-1 agreement with the base model's
greedy token on answers it never trained on: the held-out calibration answers and other training
shards. One JSON line on stdout, progress on stderr; the states are kept in the work folder, so a
second run only trains.

    PYTHONPATH=. python scripts/head_feature_probe.py --work checkpoints/heads/r8 [--every 8] [--steps 600]

`--work` is a `train-heads` work folder whose corpus shards exist (they give the prompts, answers
and final states); the other layers' states are recomputed teacher-forced with the float32 model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entmtp.config import DEFAULT_MODEL, ModelConfig  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.runtime.runtime import default_heads_dir, load_runtime  # noqa: E402
from entmtp.spec.headfiles import load_heads  # noqa: E402
from entmtp.spec.heads import ResBlock  # noqa: E402
from entmtp.tools.train import Flat  # noqa: E402

VARIANTS = {"final": (), "final+16": (16,), "final+8,16,24": (8, 16, 24)}


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.inference_mode()
def states(model, encode, shards: list[Path], layers: list[int], desc: str) -> dict[str, torch.Tensor]:
    """Per answer position: final state (as the shard holds it), the chosen layers' states, the token."""
    final, extra, tokens, remaining = [], {k: [] for k in layers}, [], []
    for shard in tqdm(shards, desc=desc, file=sys.stderr):
        part = torch.load(shard, weights_only=True)
        for prompt, hidden, answer in zip(part["prompts"], part["hidden"], part["tokens"]):
            if len(answer) < 2:
                continue
            p = encode(prompt)
            out = model.base_model(input_ids=torch.tensor([p + answer.tolist()]), output_hidden_states=True)
            n = len(answer)
            if not torch.allclose(out.last_hidden_state[0, len(p) - 1 : len(p) - 1 + n], hidden, atol=1e-3, rtol=1e-3):
                raise SystemExit(f"{shard}: recomputed final states differ from the shard's")
            final.append(hidden)
            for k in layers:
                extra[k].append(rms(out.hidden_states[k][0, len(p) - 1 : len(p) - 1 + n].float()))
            tokens.append(answer.long())
            remaining.append(torch.arange(n - 1, -1, -1))
    return {"final": torch.cat(final), "tokens": torch.cat(tokens), "remaining": torch.cat(remaining),
            **{f"L{k}": torch.cat(v) for k, v in extra.items()}}


class FirstHead(torch.nn.Module):
    """Hydra's first head, its first block widened to read `n_states` states and the token embedding."""

    def __init__(self, hidden: int, n_states: int):
        super().__init__()
        self.blocks = torch.nn.Sequential(ResBlock(hidden, n_states), ResBlock(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def inputs(data: dict[str, torch.Tensor], t: torch.Tensor, layers: tuple[int, ...], embed) -> torch.Tensor:
    return torch.cat([data["final"][t], *(data[f"L{k}"][t] for k in layers), embed(data["tokens"][t]).float()], -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--every", type=int, default=8, help="train on every n-th training shard")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    rt = load_runtime(ModelConfig(kernels="packed"))
    model = rt.model
    vocab = load_heads(default_heads_dir(DEFAULT_MODEL, "hydra"), model.config).draft_vocab.long()
    lm = model.get_output_embeddings().weight.detach().float()[vocab]  # (K, H): the draft vocabulary's rows
    embed = model.get_input_embeddings()
    layers = sorted({k for v in VARIANTS.values() for k in v})
    shards = sorted((Path(args.work) / "corpus" / "train").glob("*.pt"))
    cache = Path(args.work) / f"probe-states-every{args.every}.pt"  # the states once: they take longest
    if cache.exists():
        train, other, calib = torch.load(cache, weights_only=True)
    else:
        train = states(model, rt.encode, shards[:: args.every], layers, "train states")
        other = states(model, rt.encode, shards[args.every // 2 :: args.every * 8], layers, "other shards")
        calib = states(model, rt.encode, sorted((Path(args.work) / "corpus" / "calib").glob("*.pt")), layers, "calib states")
        torch.save((train, other, calib), cache)
    flat = Flat(train["final"], train["tokens"], train["remaining"], (train["remaining"] >= 1).nonzero().flatten())
    flat.add_teacher(lm, 32)  # the teacher, as train-heads makes it: top-32 over the draft vocabulary
    ti, tp, anchors = flat.teacher_idx.long(), flat.teacher_p, flat.anchors
    full_lm = model.get_output_embeddings().weight.detach().float()
    result = {"hardware": hardware(), "train_tokens": len(train["tokens"]), "steps": args.steps, "lr": args.lr,
              "batch": args.batch, "variants": {}}
    for name, extra in VARIANTS.items():
        torch.manual_seed(0)
        head = FirstHead(lm.shape[1], len(extra) + 1)
        opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
        t0 = time.perf_counter()
        for step in tqdm(range(args.steps), desc=name, file=sys.stderr):
            g = torch.Generator().manual_seed(step)
            t = anchors[torch.randint(len(anchors), (args.batch,), generator=g)]
            frac = step / args.steps
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
            with torch.no_grad():
                x = inputs(train, t, extra, embed)
            logp = torch.log_softmax(head(x) @ lm.T, -1)
            loss = -(tp[t + 1] * logp.gather(1, ti[t + 1])).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
        seconds = time.perf_counter() - t0
        row = {"seconds": round(seconds, 1), "params": sum(p.numel() for p in head.parameters())}
        with torch.no_grad():
            for split, data in (("train_sample", train), ("other_shards", other), ("calib", calib)):
                a = (data["remaining"] >= 1).nonzero().flatten()
                if split == "train_sample":
                    a = a[torch.randperm(len(a), generator=torch.Generator().manual_seed(1))[:20000]]
                target = torch.cat([(c @ full_lm.T).argmax(-1) for c in data["final"][a + 1].split(4096)])  # greedy token
                guess = torch.cat([vocab[(head(inputs(data, c, extra, embed)) @ lm.T).argmax(-1)] for c in a.split(4096)])
                row[split] = {"top1": round(float((guess == target).float().mean()), 4), "n": len(a)}
        result["variants"][name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
