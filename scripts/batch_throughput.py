"""Answer throughput: `train-heads`' batched generation (`train.generate_batch`: transformers' forward
over a left-padded batch) against the engine's batched decoding (`model.batch.BatchDecoder`, what
`generate --batch N` runs), on the same training prompts, in one run on this machine.

Prompts: the chat task's training split (ShareGPT openings; never evaluation or calibration
prompts), taken in train-heads' order (length-sorted blocks); each side answers all of them with
up to `--tokens` greedy tokens, stopping at EOS. Reports tokens a second of each, the ratio, and
how many answers the two agree on (the batched decoder's are the served model's alone, bit for
bit; transformers' padded batch need not be). Writes the JSON record to the path given.

    PYTHONPATH=. python scripts/batch_throughput.py [--prompts 64] [--batch 32] [--tokens 128] [out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from entmtp.config import ModelConfig  # noqa: E402
from entmtp.data import prompts as data  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.model.batch import BatchDecoder  # noqa: E402
from entmtp.runtime.runtime import load_runtime  # noqa: E402
from entmtp.tools import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kernels", default="packed", help="the runtime's kernels (default: packed, train-heads' float32 teacher)")
    ap.add_argument("out", nargs="?", default=None)
    args = ap.parse_args()

    rt = load_runtime(ModelConfig(kernels=args.kernels))
    ids = [rt.encode(p) for p in data.prompts("chat", "train", args.prompts)]
    ids = [p for p in ids if len(p) <= 512]
    ids.sort(key=len)  # train-heads answers length-sorted blocks: the least padding it can have
    eos, pad = rt.engine.eos, rt.tokenizer.pad_token_id or 0
    t0 = time.perf_counter()
    old = []
    for i in range(0, len(ids), args.batch):
        old += [t.tolist() for _, t in train.generate_batch(rt.model, ids[i : i + args.batch], args.tokens, eos, pad)]
    old_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    new = {a.index: a.tokens for a in BatchDecoder(rt.model, eos, batch=args.batch).run(ids, args.tokens)}
    new_s = time.perf_counter() - t0
    new = [new[i] for i in range(len(ids))]
    old_tokens, new_tokens = sum(map(len, old)), sum(map(len, new))
    record = {"probe": "answer throughput: train.generate_batch against model.batch.BatchDecoder", "date": datetime.date.today().isoformat(),
              "hardware": hardware(), "served": rt.arithmetic, "prompts": len(ids), "prompt_tokens": [len(ids[0]), len(ids[-1])],
              "batch": args.batch, "max_new_tokens": args.tokens, "threads": torch.get_num_threads(),
              "generate_batch": {"seconds": round(old_s, 2), "tokens": old_tokens, "tokens_per_s": round(old_tokens / old_s, 1)},
              "batch_decoder": {"seconds": round(new_s, 2), "tokens": new_tokens, "tokens_per_s": round(new_tokens / new_s, 1)},
              "speedup": round((new_tokens / new_s) / (old_tokens / old_s), 2),
              "answers_equal": sum(a == b for a, b in zip(old, new))}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
