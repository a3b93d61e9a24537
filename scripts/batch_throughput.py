"""Answer throughput: `train-heads`' generation before batched decoding (`train.padded_batch`:
transformers' forward over a left-padded batch, on the float32 teacher train-heads loads) against
`generate --batch N` (`model.batch.BatchDecoder` on the served kernels), on the same training
prompts, in one run on this machine, ABBA (old, new, new, old) so that the machine's drift falls on
both.

Prompts: the chat task's training split (ShareGPT openings; never evaluation or calibration
prompts), taken in train-heads' order (length-sorted blocks); each side answers all of them with
up to `--tokens` greedy tokens, stopping at EOS. Reports tokens a second of each, the ratio, and
that each side's two rounds gave the same answers. Then, on the padded side's answers, train-heads'
read-back of stored answers on its teacher, ABBA: one transformers forward an answer against one
block a sequence on the fused stack (`train.read_back`), in prompt and answer tokens a second, with
the largest difference between their states. Writes the JSON record to the path given.

    PYTHONPATH=. python scripts/batch_throughput.py [--prompts 64] [--batch 32] [--tokens 160] [out.json]
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


def abba(a_name: str, a, b_name: str, b) -> dict[str, list[tuple[float, list]]]:
    """a, b, b, a, each timed: {name: [(seconds, what it returned), (…)]}, so a drift falls on both."""
    rounds: dict[str, list[tuple[float, list]]] = {a_name: [], b_name: []}
    for name, side in ((a_name, a), (b_name, b), (b_name, b), (a_name, a)):
        t0 = time.perf_counter()
        out = side()
        rounds[name].append((time.perf_counter() - t0, out))
        print(f"{name}: {rounds[name][-1][0]:.1f} s", file=sys.stderr)
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=160, help="answer cap (train-heads' training answers: 160)")
    ap.add_argument("--old-kernels", default="packed", help="the padded side's kernels (default: packed, train-heads' float32 teacher)")
    ap.add_argument("--kernels", default=ModelConfig.kernels, help="the batched side's kernels (default: the served ones)")
    ap.add_argument("out", nargs="?", default=None)
    args = ap.parse_args()

    old_rt, new_rt = load_runtime(ModelConfig(kernels=args.old_kernels)), load_runtime(ModelConfig(kernels=args.kernels))
    ids = [new_rt.encode(p) for p in data.prompts("chat", "train", args.prompts)]
    ids = [p for p in ids if len(p) <= 512]
    ids.sort(key=len)  # train-heads answers length-sorted blocks: the least padding it can have
    eos, pad = new_rt.engine.eos, new_rt.tokenizer.pad_token_id or 0

    def old() -> list[list[int]]:
        out = []
        for i in range(0, len(ids), args.batch):
            out += [t.tolist() for _, t in train.padded_batch(old_rt.model, ids[i : i + args.batch], args.tokens, eos, pad)]
        return out

    def new() -> list[list[int]]:
        got = {a.index: a.tokens for a in BatchDecoder(new_rt.model, eos, batch=args.batch).run(ids, args.tokens)}
        return [got[i] for i in range(len(ids))]

    rounds = abba("padded_batch", old, "batch_decoder", new)

    def side_record(name: str, kernels: str) -> dict:
        (s1, a1), (s2, a2) = rounds[name]
        tokens = sum(map(len, a1)) + sum(map(len, a2))
        return {"kernels": kernels, "seconds": [round(s1, 2), round(s2, 2)], "tokens": tokens,
                "tokens_per_s": round(tokens / (s1 + s2), 1), "rounds_agree": a1 == a2}

    old_r, new_r = side_record("padded_batch", args.old_kernels), side_record("batch_decoder", args.kernels)

    # train-heads reading stored answers back teacher-forced on its float32 teacher: one transformers
    # forward an answer (before) against one block a sequence on the fused stack (`train.read_back`)
    answers = rounds["padded_batch"][0][1]

    def forward_each() -> list[torch.Tensor]:
        return [train.teacher_forced(old_rt.model, p, a)[0] for p, a in zip(ids, answers)]

    def blocks() -> list[torch.Tensor]:
        return [h for h, _ in train.read_back(old_rt.model, ids, answers)]

    reads = abba("teacher_forced", forward_each, "read_back", blocks)
    read_tokens = 2 * (sum(map(len, answers)) + sum(map(len, ids)))  # prompt and answer tokens, both rounds
    read = {name: {"seconds": [round(r[0], 2) for r in reads[name]],
                   "tokens_per_s": round(read_tokens / sum(r[0] for r in reads[name]), 1)} for name in reads}
    read["speedup"] = round(read["read_back"]["tokens_per_s"] / read["teacher_forced"]["tokens_per_s"], 2)
    read["max_abs_difference"] = max(float((a - b).abs().max()) for a, b in zip(reads["teacher_forced"][0][1], reads["read_back"][0][1]))
    record = {"probe": "answer throughput: train.padded_batch (train-heads before batched decoding) against "
                       "model.batch.BatchDecoder (generate --batch), ABBA in one run",
              "date": datetime.date.today().isoformat(), "hardware": hardware(), "served": new_rt.arithmetic,
              "prompts": len(ids), "prompt_tokens": [len(ids[0]), len(ids[-1])], "batch": args.batch,
              "max_new_tokens": args.tokens, "threads": torch.get_num_threads(),
              "padded_batch": old_r, "batch_decoder": new_r,
              "speedup": round(new_r["tokens_per_s"] / old_r["tokens_per_s"], 2),
              "read_back": {"kernels": args.old_kernels, "tokens": "prompt and answer tokens a second", **read}}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
