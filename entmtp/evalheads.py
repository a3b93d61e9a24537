"""`eval-heads`: held-out accuracy of each draft head, and the mean accepted length per task.

Accuracy is read on self-generated answers to the calibration split (the same held-out corpus
`train-heads` reports on); the accepted length comes from decoding the evaluation split with the
heads' own method (`hydra` or `medusa`, on Hydra's default tree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .config import BASELINE_TREE, GenerationConfig, TrainConfig


def evaluate(rt, kinds: list[str], tasks: list[str], prompts_per_task: int, max_new_tokens: int, work: Path,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Evaluate the runtime's heads of each kind; `log` receives the human-readable lines.

    Returns {"heldout": {kind: per-head accuracy}, "accepted": {kind: {task: row}}, "max_new_tokens"}.
    """
    log = log or (lambda line: print(line, flush=True))
    from .data import eval_prompt_file
    from .engine import collect
    from .loading import eos_ids
    from .train import build_corpus, head_accuracy

    tok = rt.tokenizer
    eos = set(eos_ids(rt.model, tok))
    end = min(eos) if eos else 0
    heldout = build_corpus(rt.model, rt.encode, lambda a: tok(a, add_special_tokens=False)["input_ids"] + [end], eos,
                           end, TrainConfig(), work, "calib")
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    report: dict[str, Any] = {"heldout": {}, "accepted": {}, "max_new_tokens": max_new_tokens}
    for kind in kinds:
        heads = rt.heads(kind)
        acc = head_accuracy(heads, heldout)
        report["heldout"][kind] = acc
        log(f"{kind} heads ({heads.provenance.get('sha256', '?')}), held-out calib answers, per head:")
        for i, h in enumerate(acc):
            log(f"  head {i}: top-1 {h['top1']:.3f}  top-5 {h['top5']:.3f}  (n={h['n']})")
        report["accepted"][kind] = {}
        for task in tasks:
            tokens = steps = 0
            per_prompt = []
            for item in eval_prompt_file(task, prompts_per_task):
                res = collect(rt.run(kind, task, rt.encode(item["prompt"]), gen))
                tokens, steps = tokens + res.new_tokens, steps + len(res.steps)
                per_prompt.append(res.mean_accepted)
            row = {"prompts": len(per_prompt), "tokens": tokens, "steps": steps,
                   "mean_accepted": round(tokens / max(1, steps), 4),
                   "mean_accepted_per_prompt": round(sum(per_prompt) / max(1, len(per_prompt)), 4)}
            report["accepted"][kind][task] = row
            log(f"  {kind} ({BASELINE_TREE}) on {task} eval: {row['mean_accepted']:.3f} tokens/step "
                f"({tokens} tokens, {steps} steps, {len(per_prompt)} prompts)")
    return report
