"""Fit the phrasebook's reranker (`entmtp.spec.phrasebook.Reranker`) for the default model's Hydra heads.

At every position of the banks' calibration continuations (24 prompts a task, 128 greedy tokens,
read from the answer store) and at depths 0..3 along the true path, the candidates a node of the
drafted spine would score: the head's top 16 (exact logits, the teacher-forced pass `build-bank`
records) and every token the phrasebook names there (its text: the prompt and the continuation
so far; its book: the stored answers to training prompts, `data.answers.training_answers`).
A two-layer scorer is fitted to put the true token first (softmax over the candidates, Adam,
fixed seed), on calibration prompts only; the evaluation sets are then scored for the record
(the first-guess and first-two rates: what 2- and 3-node trees accept beyond the root), beside
the head alone and the share rule (`config.PhrasebookRule`).

    PYTHONPATH=. python scripts/fit_reranker.py [--out assets/heads/<model>/hydra/reranker.json] [--record FILE] [--score-only]
                                                [--hidden N] [--every K] [--everyday N] [--book-every K]

`--hidden`, `--every` (fit on every K-th calibration prompt of each task), `--everyday N` (fit also
on the first N of the everyday requests' calibration prompts, their continuations kept in the
repository's answer store like the tasks') and `--book-every` (the book from every K-th stored
answer) are for probing whether a wider scorer, more or other fitting data or a larger book would
pay (docs/heads.md, *The phrasebook*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entmtp.bank.build import calibration_prompts  # noqa: E402
from entmtp.bank.record import stored_greedy  # noqa: E402
from entmtp.config import EVAL_HEADS_PROMPTS, EVAL_SETS, TASKS, PhrasebookRule  # noqa: E402
from entmtp.data import everyday  # noqa: E402
from entmtp.data.answers import repo_store, training_answers  # noqa: E402
from entmtp.data.prompts import eval_set  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.model import forward  # noqa: E402
from entmtp.runtime.runtime import default_heads_dir, load_runtime  # noqa: E402
from entmtp.runtime.weights import cache_root  # noqa: E402
from entmtp.spec.heads import head_features  # noqa: E402
from entmtp.spec.phrasebook import HEAD_CANDIDATES, N_FEATURES, Phrasebook, Reranker, candidate_features, softmax  # noqa: E402
from entmtp.tools.evalheads import eval_store  # noqa: E402

EVAL_SIZES = dict(EVAL_HEADS_PROMPTS)  # eval-heads' sets
DEPTHS = 4
HIDDEN = 32


def positions(rt, heads, book, prompts: list[list[int]], store, task: str) -> list[dict]:
    """Per (position, depth): the candidates' tokens and features, the true token, the head's top-1
    and the share rule's pick."""
    rows, rule = [], PhrasebookRule()
    ids = heads.draft_vocab.tolist()
    for p in prompts:
        cont = stored_greedy(rt.engine, heads, p, 128, store, task)
        seq = torch.tensor([p + cont[:-1]])
        L, cache = len(p), rt.engine.new_cache()
        outs = [forward.forward(rt.engine.model, cache, seq[:, a:b], torch.arange(a, b)[None], None)
                for a, b in ((0, L), (L, seq.shape[1])) if b > a]
        feats = head_features(heads, torch.cat([h for h, _ in outs]))[L - 1 :]
        c, n = torch.tensor(cont), len(cont)
        top = []
        for d in range(DEPTHS):
            r = torch.arange(max(0, n - d - 1))
            z = torch.log_softmax(heads.head_logits(d, feats[r], torch.stack([c[r + j] for j in range(d + 1)], 1)).float(), -1)
            top.append(z.topk(HEAD_CANDIDATES, -1))
        ctx = book.context(p)
        for i in range(n - 1):
            ctx.extend(cont[i - 1 : i])  # the text is the prompt and c[:i]; the root c[i] and the path on come as `extra`, as when drafting
            for d in range(min(DEPTHS, n - 1 - i)):
                path = cont[i : i + d + 1]
                lp, idx = top[d][0][i].tolist(), top[d][1][i].tolist()
                head_tokens = [ids[k] for k in idx] if ids else idx
                cands, x = candidate_features(ctx.matches(path), head_tokens, lp, d)
                guess = ctx.propose(path, rule.min_n)
                ruled = guess.token if guess and guess.share >= rule.min_share and np.exp(lp[0]) < rule.max_head_p else head_tokens[0]
                rows.append({"d": d, "true": cont[i + d + 1], "cands": cands, "x": x, "head": head_tokens[:2], "rule": ruled})
    return rows


def fit(rows: list[dict], epochs: int = 30, seed: int = 0, hidden: int = HIDDEN) -> Reranker:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                              torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(net.parameters(), 3e-3)
    data = [(torch.tensor(r["x"], dtype=torch.float32), r["cands"].index(r["true"])) for r in rows if r["true"] in r["cands"]]
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        total = 0.0
        for b in np.array_split(rng.permutation(len(data)), max(1, len(data) // 256)):
            xs = [data[i][0] for i in b]
            s = net(torch.cat(xs)).squeeze(-1)
            offsets = np.cumsum([0] + [len(x) for x in xs])
            loss = -sum(torch.log_softmax(s[offsets[k] : offsets[k + 1]], 0)[data[i][1]] for k, i in enumerate(b)) / len(b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        print(f"epoch {epoch + 1}/{epochs}: loss {total:.1f}", file=sys.stderr)
    lin = [m for m in net if isinstance(m, torch.nn.Linear)]
    return Reranker(tuple((m.weight.detach().double().T.numpy().copy(), m.bias.detach().double().numpy().copy()) for m in lin))


def auc(score: list[float], right: list[bool]) -> float:
    """The chance a right position scores above a wrong one (ties count half)."""
    score, right = np.asarray(score, dtype=float), np.asarray(right, dtype=bool)
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(len(score))
    for v in np.unique(score):  # average ranks of ties
        tie = score == v
        ranks[tie] = ranks[tie].mean()
    pos = right.sum()
    return float((ranks[right].sum() - pos * (pos - 1) / 2) / (pos * (len(score) - pos)))


def rates(rows: list[dict], rr: Reranker, vocab: set[int] | None = None) -> dict:
    """Per depth 0 and 1: how often each source's first guess is the true token. With the heads'
    draft `vocab`, also how often the first candidate drafting can place is (it passes over tokens
    outside the vocabulary), how often the true token lies in it and among the candidates."""
    out = {}
    for d in range(2):
        sel = [r for r in rows if r["d"] == d]
        scores = [rr.scores(r["x"]) for r in sel]
        orders = [np.argsort(-s, kind="stable") for s in scores]
        picks = [[r["cands"][i] for i in o[:2]] for o, r in zip(orders, sel)]
        right = [p[0] == r["true"] for p, r in zip(picks, sel)]
        out[f"depth{d}"] = {"positions": len(sel),
                            "head_top1": round(np.mean([r["head"][0] == r["true"] for r in sel]), 4),
                            "head_top2": round(np.mean([r["true"] in r["head"] for r in sel]), 4),
                            "rule_first": round(np.mean([r["rule"] == r["true"] for r in sel]), 4),
                            "reranker_first": round(np.mean([p[0] == r["true"] for p, r in zip(picks, sel)]), 4),
                            "reranker_first_two": round(np.mean([r["true"] in p for p, r in zip(picks, sel)]), 4),
                            # how well each confidence ranks the positions where the reranker's first is right
                            "auc_head_p": round(auc([r["x"][0, 13] for r in sel], right), 4),
                            "auc_reranker_p": round(auc([float(softmax(s).max()) for s in scores], right), 4),
                            "true_among_candidates": round(np.mean([r["true"] in r["cands"] for r in sel]), 4)}
        if vocab is not None:
            placed = [next((r["cands"][i] for i in o if r["cands"][i] in vocab), None) for o, r in zip(orders, sel)]
            out[f"depth{d}"] |= {"reranker_first_draftable": round(np.mean([p == r["true"] for p, r in zip(placed, sel)]), 4),
                                 "true_in_draft_vocab": round(np.mean([r["true"] in vocab for r in sel]), 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="the reranker file (default: beside the default model's Hydra heads)")
    ap.add_argument("--record", help="write the rates on the calibration and evaluation sets here (JSON)")
    ap.add_argument("--score-only", action="store_true", help="score the reranker already at --out; fit nothing")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help=f"width of the scorer's two layers (default: {HIDDEN})")
    ap.add_argument("--every", type=int, default=1, help="fit on every K-th calibration prompt of each task (default: 1, all)")
    ap.add_argument("--everyday", type=int, default=0, metavar="N",
                    help="fit also on the first N everyday calibration prompts (default: 0, none)")
    ap.add_argument("--book-every", type=int, default=1, help="the phrasebook from every K-th stored training answer (default: 1, all)")
    args = ap.parse_args()
    t0 = time.time()
    rt = load_runtime()
    heads = rt.heads("hydra")
    book = Phrasebook(training_answers(rt.name, rt.encode_all)[:: args.book_every])
    stored = repo_store(rt.name, rt.arithmetic)
    with torch.inference_mode():
        # per prompt, so that --every picks from the rows already read
        per_prompt = {t: [positions(rt, heads, book, [rt.encode(x)], stored, "calib") for x in calibration_prompts(t, None, 24)[0]] for t in TASKS}
        if args.everyday:
            per_prompt["everyday"] = [positions(rt, heads, book, [rt.encode(x)], stored, "calib") for x in everyday.prompts("calib")[: args.everyday]]
    calib = {t: [r for rows in per_prompt[t] for r in rows] for t in per_prompt}
    fitted_on = {t: [r for rows in per_prompt[t][:: args.every] for r in rows] for t in per_prompt}
    out = Path(args.out) if args.out else default_heads_dir(rt.name, "hydra") / "reranker.json"
    if not args.score_only:
        rr = fit([r for t in fitted_on for r in fitted_on[t]], hidden=args.hidden)
        every = f", every {args.every}-th" if args.every > 1 else ""
        extra = f" and the first {args.everyday} everyday calibration prompts" if args.everyday else ""
        rr.save(out, {"fitted_on": f"the banks' calibration prompts (24 a task{every}){extra}, depths 0-3", "heads_sha256": heads.provenance.get("sha256", ""),
                      "date": datetime.date.today().isoformat()})
    rr = Reranker.load(out)
    vocab = set(heads.draft_vocab.tolist()) or None  # empty: the whole vocabulary
    print(f"wrote {out} ({rr.sha256})", file=sys.stderr)
    evals = eval_store(rt, cache_root())  # eval-heads' own store
    with torch.inference_mode():
        sets = {name: positions(rt, heads, book, [rt.encode(it["prompt"]) for it in eval_set(name, EVAL_SIZES[name])], evals, "eval")
                for name in EVAL_SETS}
    record = {"hardware": hardware(), "date": datetime.date.today().isoformat(), "reranker": rr.path, "sha256": rr.sha256,
              "calib": {t: rates(calib[t], rr, vocab) for t in calib}, "eval": {k: rates(v, rr, vocab) for k, v in sets.items()},
              "seconds": round(time.time() - t0, 1)}
    for split in ("calib", "eval"):
        for name, r in record[split].items():
            print(split, name, json.dumps(r), file=sys.stderr)
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
