"""Would a larger draft vocabulary lift the small trees on chat? A probe, without retraining.

The shipped Hydra heads rank 8,192 tokens (their draft vocabulary: rows of the base model's tied
LM head), and on the everyday requests the true next token lies outside it at ~9% of positions.
The heads' hidden state meets the LM head's rows, so any row can be scored without training:
this widens the vocabulary by the tokens most frequent in the stored training answers (never an
evaluation or calibration answer: `data.answers.training_answers`), repacks the heads as served,
and scores the 2- and 4-node trees on the chat evaluation sets from exact traces, as `eval-heads`
does, with the heads alone and with the phrasebook's reranker on the spine. One JSON record on
stdout (and in `--out`), progress on stderr.

    PYTHONPATH=. python scripts/draft_vocab_probe.py [--extra 0,8192,all] [--out FILE]

The base model's greedy continuations come from `eval-heads`' store in the user cache (decoded
once, ~2 minutes on a 2-core CPU, if absent).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entmtp.config import EVAL_HEADS_PROMPTS, GenerationConfig  # noqa: E402
from entmtp.data.answers import training_answers  # noqa: E402
from entmtp.data.prompts import eval_set  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.runtime.runtime import load_runtime, served_heads  # noqa: E402
from entmtp.runtime.weights import cache_root  # noqa: E402
from entmtp.tools import evalheads  # noqa: E402

SETS = ("chat", "everyday")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", default="0,8192,all", help="tokens added to the draft vocabulary, per variant ('all': every token)")
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    args = ap.parse_args()

    rt = load_runtime()
    heads = rt.heads("hydra")
    shipped = heads.draft_vocab.clone()
    inside = set(shipped.tolist())
    counts = collections.Counter(t for answer in training_answers(rt.name, rt.encode_all) for t in answer)
    ranked = [t for t, _ in counts.most_common() if t not in inside]
    items = {name: [rt.encode(it["prompt"]) for it in eval_set(name, dict(EVAL_HEADS_PROMPTS)[name])] for name in SETS}  # eval-heads' own sets
    store = evalheads.eval_store(rt, cache_root())
    conts = {name: evalheads.continuations(rt, heads, ps, GenerationConfig().max_new_tokens, store) for name, ps in items.items()}
    trees = {name: tree for name, tree in evalheads.eval_trees().items() if name in evalheads.SMALL_TREES}

    rows = []
    for extra in args.extra.split(","):
        vocab = torch.empty(0, dtype=torch.long) if extra == "all" else torch.cat([shipped, torch.tensor(ranked[: int(extra)], dtype=torch.long)])
        heads.set_draft_vocab(vocab)
        served_heads(rt.model, heads)  # repacked over the new vocabulary, as `resolve_heads` serves them
        size = int(vocab.numel()) or heads.vocab_size
        for book in (False, True):
            started, row = time.time(), {"draft_vocab": size, "phrasebook": book}
            for name, ps in items.items():
                for tree, (tokens, steps) in evalheads.accepted_on(rt, "hydra", ps, conts[name], trees, phrasebook=book).items():
                    row[f"{name}/{tree}"] = round(sum(tokens) / max(1, sum(steps)), 4)
            rows.append(row)
            print(f"{size} tokens{' + phrasebook' if book else ''}: {row} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)

    record = {"probe": "draft vocabulary", "date": datetime.date.today().isoformat(), "hardware": hardware(),
              "served": rt.arithmetic, "max_new_tokens": GenerationConfig().max_new_tokens,
              "prompts": {name: len(ps) for name, ps in items.items()}, "trees": evalheads.SMALL_TREES, "rows": rows}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
