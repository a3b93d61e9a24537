"""The heads' top-1 chain in two served forms, interleaved: whole widened ResBlocks (as served
until 2026-12-06) against parted ones (`gguf.PartedLinear`, token parts kept), cold after a base
step, to each depth, with and without the phrasebook's reranker at every node.

The chains start where a decode's steps start: the (hidden state, next token) pairs of greedy
decodes of calibration prompts (never evaluation prompts), taken in turn, so that the parted
chain keeps and reuses token parts as often as a decode does (counted from an empty store). Per
pair and depth the two forms take turns, the first swapped every pair, each after its own base
step. Medians in ms; writes the record as JSON to the path given (default: stdout only).

    PYTHONPATH=. python scripts/chain_compare.py [--prompts 4] [--tokens 64] [out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from entmtp.bank import calibrate  # noqa: E402
from entmtp.data import prompts as data  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.model.batch import MAX_BATCH, BatchDecoder  # noqa: E402
from entmtp.runtime.runtime import default_heads_dir, load_runtime, served_heads  # noqa: E402
from entmtp.spec.headfiles import load_heads  # noqa: E402
from entmtp.spec.phrasebook import forcer  # noqa: E402
from entmtp.tools.kernelbench import chain_bytes  # noqa: E402


def decode_states(rt, prompts: list[list[int]], n: int) -> list[tuple[torch.Tensor, int]]:
    """(final hidden state, the next token it gives) at each of n greedy steps from each prompt."""
    answers = BatchDecoder(rt.model, (), batch=min(len(prompts), MAX_BATCH), keep_hidden=True).run(prompts, n)
    return [(h, t) for a in sorted(answers, key=lambda a: a.index) for h, t in zip(a.hidden, a.tokens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="calibration prompts a task (code, math, chat)")
    ap.add_argument("--tokens", type=int, default=64, help="decode states taken from each")
    ap.add_argument("out", nargs="?", default=None)
    args = ap.parse_args()

    rt = load_runtime()
    shipped = rt.heads("hydra")
    forms = {}
    for name, parted in (("whole", False), ("parted", True)):
        heads = load_heads(default_heads_dir(rt.name, "hydra"), rt.model.config).bind(rt.model)
        heads.blocks, heads.parted = shipped.blocks, parted
        heads.set_draft_vocab(shipped.draft_vocab)
        forms[name] = served_heads(rt.model, heads)
    forms["parted"]._chain.clear_kept()
    states = decode_states(rt, [rt.encode(p) for task in ("code", "math", "chat") for p in data.prompts(task, "calib")[: args.prompts]],
                           args.tokens)
    bank = rt.bank("chat")
    book, rule = rt.book_for(bank)
    between = calibrate.forward_between(rt.engine, 192)
    depth = shipped.num_heads
    times = {(name, booked): [[] for _ in range(depth)] for name in forms for booked in (False, True)}
    text = book.context(rt.encode(data.prompts("chat", "calib")[0])) if book is not None else None
    started = time.time()
    with torch.inference_mode():
        for i, (feature, root) in enumerate(states):
            order = list(forms) if i % 2 == 0 else list(forms)[::-1]
            for d in range(1, depth + 1):
                for booked in (False, True) if book is not None else (False,):
                    for name in order:
                        heads = forms[name]
                        force = forcer(text, rule, heads.draft_vocab) if booked else None
                        if force is not None:
                            force.sync()  # the text into the extension's forcer, untimed
                        between()
                        t0 = time.perf_counter()
                        heads.top1_on_blocks(feature, torch.tensor([[root]]), d, force)
                        times[(name, booked)][d - 1].append((time.perf_counter() - t0) * 1e3)
    entries, hits, misses = forms["parted"]._chain.kept()
    rows = []
    for (name, booked), per in times.items():
        if per[0]:
            per_head, lm = chain_bytes(forms[name])
            rows.append({"form": name, "numerics": forms[name].numerics, "reranker": booked,
                         "cold_ms": [round(statistics.median(t), 3) for t in per],
                         "reads_mb": [round((sum(per_head[:d]) + lm) / 1e6, 2) for d in range(1, depth + 1)]})
            print(f"{name:7s} {'+reranker' if booked else 'heads':9s} cold ms to depth 1..{depth}: "
                  + " / ".join(f"{x:.3f}" for x in rows[-1]["cold_ms"]), file=sys.stderr)
    record = {"probe": "heads' chain, whole against parted widened ResBlocks, interleaved", "date": datetime.date.today().isoformat(),
              "hardware": hardware(), "served": rt.arithmetic, "draft_vocab": int(shipped.draft_vocab.numel()),
              "states": len(states), "prompts": f"calib split, {args.prompts} a task, {args.tokens} greedy steps each",
              "kept": {"entries": entries, "hits": hits, "misses": misses}, "seconds": round(time.time() - started, 1), "rows": rows}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
