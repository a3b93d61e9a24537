"""Two sets of heads and banks on the same prompts, interleaved, on this machine: one JSON line.

    python scripts/compare_heads.py --old /tmp/old [--new .] [--methods entmtp-tau,hydra] [--prompts-per-task 8] [--split calib]

`--old` and `--new` are folders holding `assets/heads/<model>/{hydra,medusa}/` and `banks/`
(a checkout, or `git archive <rev> assets/heads banks | tar -x -C DIR`). Each loads the model
and runs through its banks' fit for this machine (calibrated first where the shipped fit is
another machine's; `--refit`: both timed now, so that neither fit carries another moment of the
machine). Per prompt the two alternate, starting side swapped every prompt, after an
untimed warm-up of each; a method's figure is its tokens over its wall time per task, and its
token ids must equal `ar`'s (the greedy output). Prompts: the evaluation split, or with `--split
calib` the calibration split (for a choice to ship: never chosen on evaluation prompts). Figures
hold for this machine only: it is named.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entmtp.config import DEFAULT_MODEL, TASKS, GenerationConfig, ModelConfig  # noqa: E402
from entmtp.data.prompts import eval_prompt_file, prompts  # noqa: E402
from entmtp.machine import hardware  # noqa: E402
from entmtp.runtime.runtime import load_runtime  # noqa: E402
from entmtp.runtime.weights import model_slug  # noqa: E402
from entmtp.spec.engine import collect  # noqa: E402


def runtime(root: Path, refit: bool, tasks: list[str]):
    heads = root / "assets" / "heads" / model_slug(DEFAULT_MODEL)
    rt = load_runtime(ModelConfig(), str(heads / "hydra"), str(heads / "medusa"), root / "banks", fit_mode="auto")
    rt.banks(tasks, mode="refit" if refit else None)  # once, before anything is timed
    return rt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, type=Path)
    ap.add_argument("--new", default=Path("."), type=Path)
    ap.add_argument("--methods", default="entmtp-tau")
    ap.add_argument("--prompts-per-task", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--split", choices=("eval", "calib"), default="eval", help="prompts: the evaluation split, or the calibration split")
    ap.add_argument("--refit", action="store_true", help="time and fit both sides' banks now, in one moment of the machine")
    args = ap.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in TASKS]:
        ap.error(f"--tasks: unknown task {unknown[0]!r} (expected some of {', '.join(TASKS)})")
    methods = [m for m in args.methods.split(",") if m]
    sides = {"old": runtime(args.old, args.refit, tasks), "new": runtime(args.new, args.refit, tasks)}
    gen, warm = GenerationConfig(max_new_tokens=args.max_new_tokens), GenerationConfig(max_new_tokens=16)
    if args.split == "calib":
        items = [(t, p) for t in tasks for p in prompts(t, "calib", args.prompts_per_task)]
    else:
        items = [(t, it["prompt"]) for t in tasks for it in eval_prompt_file(t, args.prompts_per_task)]
    ref = sides["new"]
    for task in tasks:  # untimed: kernels, caches and each tree size once
        ids = ref.encode(next(p for t, p in items if t == task))
        for rt in sides.values():
            for m in methods:
                collect(rt.run(m, task, ids, warm))
    totals: dict = {}
    for i, (task, prompt) in enumerate(items):
        ids = ref.encode(prompt)
        greedy = collect(ref.run("ar", task, ids, gen)).token_ids
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        for m in methods:
            for name in order:
                res = collect(sides[name].run(m, task, ids, gen))
                assert list(res.token_ids) == list(greedy), f"{name} {m} differs from ar on {task} prompt {i}"
                row = totals.setdefault((task, m, name), {"tokens": 0, "seconds": 0.0, "steps": 0, "ms": {}, "trees": {}})
                for r in res.steps:
                    row["trees"][r.tree] = row["trees"].get(r.tree, 0) + 1
                row["tokens"] += res.new_tokens
                row["seconds"] += res.elapsed_s
                row["steps"] += len(res.steps)
                for k, v in res.phase_ms().items():
                    row["ms"][k] = row["ms"].get(k, 0.0) + v
        print(f"{i + 1}/{len(items)}", file=sys.stderr, flush=True)
    out = []
    for task in tasks:
        for m in methods:
            o, n = totals[(task, m, "old")], totals[(task, m, "new")]
            tps = {k: r["tokens"] / r["seconds"] for k, r in (("old", o), ("new", n))}
            out.append({"task": task, "method": m, "old_tokens_per_s": round(tps["old"], 2), "new_tokens_per_s": round(tps["new"], 2),
                        "new_over_old": round(tps["new"] / tps["old"], 4),
                        "old_tokens_per_step": round(o["tokens"] / o["steps"], 3),
                        "new_tokens_per_step": round(n["tokens"] / n["steps"], 3),
                        "trees": {"old": o["trees"], "new": n["trees"]},
                        "phase_ms_per_step": {k: {p: round(v / r["steps"], 3) for p, v in r["ms"].items()} for k, r in (("old", o), ("new", n))},
                        "same_as_ar": True})
            print(f"{task:5} {m:14} old {tps['old']:6.1f} tok/s ({out[-1]['old_tokens_per_step']:.2f}/step)  new {tps['new']:6.1f} "
                  f"tok/s ({out[-1]['new_tokens_per_step']:.2f}/step)  new/old {out[-1]['new_over_old']:.3f}", file=sys.stderr)
    print(json.dumps({"hardware": hardware(), "refit": args.refit, "split": args.split, "prompts_per_task": args.prompts_per_task, "max_new_tokens": args.max_new_tokens,
                      "fits": {k: {t: rt.bank(t).fit.get("hardware") for t in tasks} for k, rt in sides.items()}, "results": out}))


if __name__ == "__main__":
    main()
