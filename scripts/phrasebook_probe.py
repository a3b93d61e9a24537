"""Would the model's own stored answers guess the next token better than the first Hydra head? A probe.

At every position of the greedy continuations (128 new tokens), beside the first head's top-1
(exact, from the same teacher-forced pass `build-bank` records), the phrasebook's proposal
(`entmtp.spec.phrasebook`: the longest suffix of the prompt and the text so far, found in the text
itself or in the stored answers to training prompts, `data.answers.training_answers`).
A rule puts the proposal first when its suffix has at least M tokens, the proposal followed that
suffix at least a share S of the times, and the head's top-1 probability is below P; M, S and P
are chosen on the calibration prompts (the banks' own), then the evaluation sets are scored with
them. Reported per set: the head's top-1 rate, the rule's (what a
2-node tree would accept beyond the root), and the rate at which the true token is among the
first two of the merged ranking (a 3-node tree: the root and two guesses for the next token).

    PYTHONPATH=. python scripts/phrasebook_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entmtp.bank.build import calibration_prompts  # noqa: E402
from entmtp.bank.record import record, stored_greedy  # noqa: E402
from entmtp.config import EVAL_HEADS_PROMPTS, EVAL_SETS, TASKS  # noqa: E402
from entmtp.data.answers import repo_store, training_answers  # noqa: E402
from entmtp.data.prompts import eval_set  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.runtime.runtime import load_runtime  # noqa: E402
from entmtp.runtime.weights import cache_root  # noqa: E402
from entmtp.spec.phrasebook import Phrasebook  # noqa: E402
from entmtp.tools.evalheads import eval_store  # noqa: E402

EVAL_SIZES = dict(EVAL_HEADS_PROMPTS)  # eval-heads' sets
M_GRID = range(1, 9)
P_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)
S_GRID = (0.0, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def positions(rt, heads, book, prompts: list[list[int]], store, task: str) -> list[tuple]:
    """Per position: (head top-1 right, head top-2 right, head top-1 prob, head top-1 token, proposal, true token)."""
    rows = []
    for p in prompts:
        cont = stored_greedy(rt.engine, heads, p, 128, store, task)
        trace = record(rt.engine, heads, p, cont, 1)
        ctx = book.context(p)
        for i in range(len(cont) - 1):
            ctx.extend([cont[i]])  # the root c[i] is known when the next token is drafted
            rank = trace.ranks[i][0]
            rows.append((rank == 0, 0 <= rank <= 1, trace.chain[i][0], ctx.propose(), cont[i + 1]))
    return rows


def fires(prop, prob: float, m: int, p: float, s: float) -> bool:
    return prop is not None and prop.n >= m and prop.share >= s and prob < p


def score(rows: list[tuple], m: int, p: float, s: float) -> tuple[float, float]:
    """(first guess right, true token among the first two) under the rule (m, p, s)."""
    first = two = 0
    for top1, top2, prob, prop, true in rows:
        if fires(prop, prob, m, p, s):
            hit = prop.token == true
            first += hit
            two += hit or top1  # the head's top-1 comes second (the same token: its top-2 does)
        else:
            first += top1
            two += top2
    return first / len(rows), two / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args()
    t0 = time.time()
    rt = load_runtime()
    heads = rt.heads("hydra")
    stored = repo_store(rt.name, rt.arithmetic)
    book = Phrasebook(training_answers(rt.name, rt.encode_all))
    with torch.inference_mode():
        calib = {t: positions(rt, heads, book, [rt.encode(x) for x in calibration_prompts(t, None, 24)[0]], stored, "calib")
                 for t in TASKS}
        best = max(((m, p, s) for m in M_GRID for p in P_GRID for s in S_GRID),
                   key=lambda mps: sum(score(calib[t], *mps)[0] for t in TASKS))
        evals = eval_store(rt, cache_root())  # eval-heads' own store
        sets = {name: positions(rt, heads, book, [rt.encode(it["prompt"]) for it in eval_set(name, EVAL_SIZES[name])], evals, "eval")
                for name in EVAL_SETS}
    out = {"hardware": hardware(), "date": datetime.date.today().isoformat(), "book_tokens": book.n_tokens,
           "rule": {"min_n": best[0], "max_head_p": best[1], "min_share": best[2],
                    "chosen_on": "calibration prompts (the banks' 24 a task)"},
           "calib": {}, "eval": {}, "seconds": round(time.time() - t0, 1)}
    for split, data in (("calib", calib), ("eval", sets)):
        for name, rows in data.items():
            rule1, rule2 = score(rows, *best)
            head1, head2 = score(rows, 99, 0.0, 0.0)
            fired = sum(1 for r in rows if fires(r[3], r[2], *best)) / len(rows)
            out[split][name] = {"positions": len(rows), "head_top1": round(head1, 4), "head_top2": round(head2, 4),
                                "book_first": round(rule1, 4), "book_or_head": round(rule2, 4), "book_used": round(fired, 4)}
            print(f"{split} {name}: {len(rows)} positions, head top-1 {head1:.3f} (top-2 {head2:.3f}); phrasebook first "
                  f"{rule1:.3f}, book or head {rule2:.3f} (book used at {fired:.0%})", file=sys.stderr)
    text = json.dumps(out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
