"""`eval-heads`: held-out accuracy of each draft head, and the mean accepted length per task.

Accuracy is read on self-generated answers to the calibration split (the same held-out corpus
`train-heads` reports on), beside the training-sample accuracy the heads' provenance records.

The accepted length is that of the heads' own method (`hydra` or `medusa`) on Hydra's default
tree, and on the small trees the CPU fits keep (`SMALL_TREES`), over each evaluation set (each
task's eval split, and chat's everyday requests: `config.EVAL_SETS`), computed exactly from
acceptance traces (`bank.traces`): at temperature 0 a decode with any tree follows from the greedy continuation and the heads' ranks
along it, position by position (tests check trace simulation against real rollouts). The
greedy continuations depend on the base model only, so they are kept in the user cache
(`<cache>/eval-answers/<model>.jsonl.gz`, never read by training) and a second evaluation, of
new heads say, costs one teacher-forced forward per prompt. Each task's figure comes with a 95%
bootstrap interval over prompts.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

from entmtp.config import BASELINE_TREE, TREES_FILE, TrainConfig

BOOTSTRAP = 2000  # resamples of the prompts for the interval


def bootstrap_ci(tokens: list[int], steps: list[int], reps: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of sum(tokens)/sum(steps) when prompts are resampled with replacement."""
    if not tokens:
        return (0.0, 0.0)
    rng = random.Random(seed)
    n, values = len(tokens), []
    for _ in range(reps):
        pick = [rng.randrange(n) for _ in range(n)]
        values.append(sum(tokens[i] for i in pick) / max(1, sum(steps[i] for i in pick)))
    values.sort()
    return (values[int(0.025 * reps)], values[min(reps - 1, int(0.975 * reps))])


def eval_store(rt, root: Path):
    """The store of the served model's greedy continuations of evaluation prompts, under the user
    cache `root` (`weights.cache_root`): never read by training."""
    from entmtp.data.answers import AnswerStore

    return AnswerStore(root / "eval-answers" / f"{rt.slug}.jsonl.gz", rt.name + rt.arithmetic)


def continuations(rt, heads, prompts: list[list[int]], new_tokens: int, store, progress: Callable | None = None) -> list[list[int]]:
    """The base model's greedy continuation of each prompt, from `store` or decoded (and stored)."""
    from entmtp.bank.record import stored_greedy

    it = range(len(prompts))
    return [stored_greedy(rt.engine, heads, prompts[i], new_tokens, store, "eval")
            for i in (progress(it, "greedy continuations", len(prompts)) if progress else it)]


# the small trees the CPU fits keep (every bank holds both): the first head alone, and the 3-deep chain
SMALL_TREES = {"2-node": [[0]], "4-node": [[0], [0, 0], [0, 0, 0]]}


def eval_trees() -> dict[str, Any]:
    """Hydra's default tree, then SMALL_TREES, by name."""
    from entmtp.spec.topology import compile_tree, load_named_trees

    return {BASELINE_TREE: load_named_trees(TREES_FILE)[BASELINE_TREE],
            **{name: compile_tree(paths) for name, paths in SMALL_TREES.items()}}


def accepted_on(rt, kind: str, prompts: list[list[int]], conts: list[list[int]], trees: dict[str, Any] | None = None,
                phrasebook: bool = False) -> dict[str, tuple[list[int], list[int]]]:
    """Per tree, per prompt (tokens, steps) of `kind`'s heads, from exact traces (one record per
    prompt); `phrasebook`: drafting with the model's phrasebook first on the spine (under `Runtime.phrasebook_rule`, as new banks do)."""
    from entmtp.bank.record import record
    from entmtp.bank.traces import decode_with

    trees = trees or eval_trees()
    depth = max(t.max_depth for t in trees.values())
    heads = rt.heads(kind)
    book = rt.phrasebook() if phrasebook else None
    rule = rt.phrasebook_rule() if book is not None else None
    traces = [record(rt.engine, heads, p, c, depth, book=book, rule=rule) for p, c in zip(prompts, conts)]
    out = {}
    for name, tree in trees.items():
        pairs = [decode_with(tree, tr) for tr in traces]
        out[name] = ([t for t, _ in pairs], [s for _, s in pairs])
    return out


def evaluate(rt, kinds: list[str], prompts_per_task: dict[str, int], max_new_tokens: int, work: Path, cache_root: Path,
             log: Callable[[str], None] | None = None, progress: Callable | None = None, phrasebook: bool = False) -> dict[str, Any]:
    """Evaluate the runtime's heads of each kind; `log` receives the human-readable lines.

    Returns {"heldout": {kind: per-head accuracy}, "train_sample": {kind: per-head accuracy or None},
    "accepted": {kind: {task: row}}, "max_new_tokens"}; with `phrasebook`, also
    "phrasebook": {kind: {"accepted": ..., "small_trees": ...}} for Hydra heads drafting with the
    model's phrasebook first on the spine (what the shipped banks record).
    """
    log = log or (lambda line: print(line, flush=True))
    from entmtp.data.prompts import eval_set
    from entmtp.runtime.weights import eos_ids
    from entmtp.data.answers import repo_store
    from entmtp.tools.train import build_corpus, head_accuracy

    tok = rt.tokenizer
    eos = set(eos_ids(rt.model, tok))
    end = min(eos) if eos else 0
    prefix = any(getattr(rt.heads(k), "arch", "mlp") == "prefix-mlp" for k in kinds)  # Hydra++ reads the prompts' states too
    heldout = build_corpus(rt.model, rt.encode, lambda a: tok(a, add_special_tokens=False)["input_ids"] + [end], eos,
                           end, TrainConfig(arch="prefix-mlp" if prefix else "mlp"), work, "calib", progress is not None,
                           repo_store(rt.name))
    store = eval_store(rt, cache_root)
    items = {name: [rt.encode(it["prompt"]) for it in eval_set(name, n)] for name, n in prompts_per_task.items()}
    conts = {task: continuations(rt, rt.heads(kinds[0]), ps, max_new_tokens, store, progress) for task, ps in items.items()}
    report: dict[str, Any] = {"heldout": {}, "train_sample": {}, "accepted": {}, "small_trees": {},
                              "max_new_tokens": max_new_tokens, "tree": BASELINE_TREE, "trees": SMALL_TREES,
                              "method": "exact trace simulation at temperature 0"}
    for kind in kinds:
        heads = rt.heads(kind)
        acc = head_accuracy(heads, heldout)
        seen = (heads.provenance.get("train_sample") or {}).get("per_head")
        report["heldout"][kind], report["train_sample"][kind] = acc, seen
        log(f"{kind} heads ({heads.provenance.get('sha256', '?')}), held-out calib answers, per head"
            + (" (beside: training answers, from the heads' provenance)" if seen else "") + ":")
        for i, h in enumerate(acc):
            beside = f"   training top-1 {seen[i]['top1']:.3f}" if seen and i < len(seen) else ""
            log(f"  head {i}: top-1 {h['top1']:.3f}  top-5 {h['top5']:.3f}  (n={h['n']}){beside}")
        report["accepted"][kind], report["small_trees"][kind] = {}, {}
        books = [False, True] if phrasebook and kind == "hydra" else [False]
        for book in books:
            into = report["accepted"][kind], report["small_trees"][kind]
            if book:
                into = ({}, {})
                report.setdefault("phrasebook", {})[kind] = {"accepted": into[0], "small_trees": into[1]}
            for name, prompts in items.items():
                for tree, (tokens, steps) in accepted_on(rt, kind, prompts, conts[name], phrasebook=book).items():
                    lo, hi = bootstrap_ci(tokens, steps)
                    row = {"prompts": len(prompts), "tokens": sum(tokens), "steps": sum(steps),
                           "mean_accepted": round(sum(tokens) / max(1, sum(steps)), 4), "ci95": [round(lo, 4), round(hi, 4)]}
                    if tree == BASELINE_TREE:
                        into[0][name] = row
                    else:
                        into[1].setdefault(tree, {})[name] = row
                    log(f"  {kind}{' + phrasebook' if book else ''} ({tree}) on {name} eval: {row['mean_accepted']:.3f} tokens/step, "
                        f"95% CI [{lo:.3f}, {hi:.3f}] ({row['tokens']} tokens, {row['steps']} steps, {len(prompts)} prompts)")
    return report


def record_in(folder: Path, kind: str, report: dict[str, Any], served: str) -> Path:
    """Write `kind`'s accepted lengths from `report` into `folder/heads.json`'s provenance
    ("evaluation"), where docs/heads.md reads them; the weights file is not touched."""
    import json
    import time

    from entmtp.spec.headfiles import CONFIG_FILE

    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --record writes into heads in our format")
    meta = json.loads(path.read_text())
    if meta.get("kind") != kind:
        raise ValueError(f"{path} holds {meta.get('kind')} heads, not {kind}")
    meta.setdefault("provenance", {})["evaluation"] = {
        "date": time.strftime("%Y-%m-%d"), "served": served, "method": report["method"],
        "max_new_tokens": report["max_new_tokens"], "tree": report["tree"], "trees": report["trees"],
        "accepted": report["accepted"][kind], "small_trees": report["small_trees"][kind],
        "heldout": report["heldout"][kind],
    }
    if kind in report.get("phrasebook", {}):
        meta["provenance"]["evaluation"]["phrasebook"] = report["phrasebook"][kind]
    path.write_text(json.dumps(meta, indent=1) + "\n")
    return path


def beside_before(report: dict[str, Any], kind: str, before: dict[str, Any]) -> str:
    """A table of the accepted lengths just measured beside those the heads recorded for the form
    they were served in before (heads.json `provenance.served_before.evaluation`, as `record_in`
    wrote it), per evaluation set, tree and drafting (heads alone, with the phrasebook): the
    change in percent. Sets or trees either side lacks are left out."""
    ev = before.get("evaluation") or {}
    rows = [f"{kind}: accepted tokens per step now against as served before ({before.get('blocks', '?')} blocks, "
            f"{before.get('draft_vocab', '?')} draft tokens; recorded {ev.get('date', '?')})",
            f"{'drafting':<11} {'set':<9} {'tree':<13} {'before':>7} {'now':>7} {'change':>8}"]
    sources = [("heads", report.get("accepted", {}).get(kind, {}), report.get("small_trees", {}).get(kind, {}), ev)]
    if kind in report.get("phrasebook", {}) and ev.get("phrasebook"):
        pb = report["phrasebook"][kind]
        sources.append(("phrasebook", pb.get("accepted", {}), pb.get("small_trees", {}), ev["phrasebook"]))
    for label, accepted, small, old in sources:
        trees = [(ev.get("tree", "hydra"), accepted, old.get("accepted", {}))]
        trees += [(name, small.get(name, {}), old.get("small_trees", {}).get(name, {})) for name in SMALL_TREES]
        for tree, now, was in trees:
            for name, row in now.items():
                if name in was:
                    a, b = was[name]["mean_accepted"], row["mean_accepted"]
                    rows.append(f"{label:<11} {name:<9} {tree:<13} {a:>7.3f} {b:>7.3f} {100 * (b / a - 1):>+7.1f}%")
    return "\n".join(rows)
