"""Which served form of the Hydra heads drafts as well for fewer bytes? A probe, without retraining.

The heads' weights stay as trained; what changes is how they are served: the GGUF block kind of
every head linear (`gguf.BlockLinear`: Q8_0 or Q4_1) and the size of the draft vocabulary (the
rows of the base model's tied LM head the heads rank: the K tokens most frequent in the stored
training answers among the shipped vocabulary, never an evaluation or calibration answer). For each
variant it scores Hydra's tree and the 2- and 4-node trees on every evaluation set from exact
traces, as `eval-heads` does (heads alone, and with the phrasebook's reranker on the spine as the
banks draft), and times the heads' top-1 chain to each depth, cold after a base-model step and
warm (`calibrate.measure_chain`), beside the bytes a chain reads. One JSON record on stdout (and
in `--out`), progress on stderr.

    PYTHONPATH=. python scripts/cheap_heads_probe.py [--variants q8_0:8192,q4_1:2048] [--out FILE]

The base model's greedy continuations come from `eval-heads`' store in the user cache (decoded
once, a few minutes on a 2-core CPU, if absent).
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

from entmtp.bank import calibrate  # noqa: E402
from entmtp.config import EVAL_HEADS_PROMPTS, GenerationConfig  # noqa: E402
from entmtp.data.answers import training_answers  # noqa: E402
from entmtp.data.prompts import eval_set  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.runtime.runtime import default_heads_dir, load_runtime, served_heads  # noqa: E402
from entmtp.runtime.weights import cache_root  # noqa: E402
from entmtp.spec.headfiles import load_heads  # noqa: E402
from entmtp.spec.phrasebook import Reranker  # noqa: E402
from entmtp.tools import evalheads  # noqa: E402
from entmtp.tools.kernelbench import chain_bytes  # noqa: E402


def ranked_vocab(rt, vocab: torch.Tensor) -> list[int]:
    """`vocab`'s tokens, most frequent in the stored training answers first (ties: smaller id)."""
    counts = collections.Counter(t for answer in training_answers(rt.name, rt.encode_all) for t in answer)
    return sorted(vocab.tolist(), key=lambda t: (-counts.get(t, 0), t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="q8_0:8192,q4_1:8192,q4_1:4096,q4_1:2048,q4_1:1024",
                    help="served forms to score, each BLOCKS:DRAFT_VOCAB_SIZE")
    ap.add_argument("--no-accept", action="store_true", help="time the chains only")
    ap.add_argument("--heads", default=None, help="the Hydra heads folder whose weights and draft vocabulary the variants "
                    "re-serve (default: the shipped heads); the shipped reranker drafts every variant (the same weights)")
    ap.add_argument("--out", default=None, help="also write the JSON record here")
    args = ap.parse_args()

    rt = load_runtime()
    folder = Path(args.heads) if args.heads else default_heads_dir(rt.name, "hydra")
    heads = load_heads(folder, rt.model.config)
    ranked = ranked_vocab(rt, heads.draft_vocab)
    reranker = Reranker.load(default_heads_dir(rt.name, "hydra") / "reranker.json")
    rt.phrasebook_rule = lambda: reranker  # the variants re-serve one set of weights: its reranker for all
    between = calibrate.forward_between(rt.engine, 192)
    items = {name: [rt.encode(it["prompt"]) for it in eval_set(name, n)] for name, n in EVAL_HEADS_PROMPTS}
    store = evalheads.eval_store(rt, cache_root())
    conts = {} if args.no_accept else {
        name: evalheads.continuations(rt, heads, ps, GenerationConfig().max_new_tokens, store) for name, ps in items.items()}
    rows = []
    for variant in args.variants.split(","):
        blocks, size = variant.split(":")
        heads = load_heads(folder, rt.model.config).bind(rt.model)  # float weights again
        heads.blocks = blocks
        heads.set_draft_vocab(torch.tensor(sorted(ranked[: int(size)])))
        rt._heads["hydra"] = served_heads(rt.model, heads)  # packed in the new form, as `resolve_heads` serves them
        started = time.time()
        per_head, lm = chain_bytes(heads)
        row = {"blocks": blocks, "draft_vocab": int(size), "numerics": heads.numerics,
               "chain_mb": round(sum(per_head) / 1e6, 2), "lm_head_mb": round(lm / 1e6, 2)}
        row["chain_cold_ms"] = [round(x, 3) for x in calibrate.measure_chain(heads, heads.num_heads, reps=25, between=between)[1:]]
        row["chain_warm_ms"] = [round(x, 3) for x in calibrate.measure_chain(heads, heads.num_heads, reps=25)[1:]]
        for book in (() if args.no_accept else (False, True)):
            label = "phrasebook" if book else "heads"
            for name, ps in items.items():
                for tree, (tokens, steps) in evalheads.accepted_on(rt, "hydra", ps, conts[name], phrasebook=book).items():
                    row[f"{label}/{name}/{tree}"] = round(sum(tokens) / max(1, sum(steps)), 4)
        rows.append(row)
        print(f"{variant}: {row} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)

    record = {"probe": "served heads: block kind and draft vocabulary", "date": datetime.date.today().isoformat(),
              "hardware": hardware(), "served": rt.arithmetic, "max_new_tokens": GenerationConfig().max_new_tokens,
              "prompts": {name: len(ps) for name, ps in items.items()}, "rows": rows}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
