"""The benchmark: every method on the same prompts, interleaved, on this machine.

Per prompt the methods run one after another in a rotating order, so drift of the machine hits
all alike; with `repeats` > 1 every method runs that many times per prompt, each round in a new
rotation, and its median run counts. A warm-up pass (excluded) builds kernels and caches first. Figures per task and
method: tokens/s (new tokens over wall time, prefill included), mean accepted tokens per step,
speedup over `ar` measured in the same run, the share of each decode phase, and, for the methods
a bank fit predicts (ar, hydra, entmtp-*), the tokens/s that fit predicts on this machine for
these prompts: each run's prompt length and new tokens (`bank.predict`), or, for a fit made
before it timed cost against context, the fit's own figure for its calibration prompts.
`lossless` (token ids equal to transformers `generate`'s on the model as served, at temperature 0)
is reported when `hf` is in the run: `hf` itself is that oracle where the served arithmetic is
float32; where it is not (`--kernels q8`), an untimed `generate` on the served model is, and the
`hf` row's own `lossless` says whether stock float32 transformers decoded the same tokens. Without
`hf` the row says only whether it matched `ar` (`same_as_ar`). Beside the fit's prediction, each
run's prediction made just before it ran from the live costs of that moment (`bank.live`: every
step timed so far in the run, per tree), and how the measured figure compares with it.
"""

from __future__ import annotations

import datetime
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from entmtp.bank.live import LiveCosts
from entmtp.bank.predict import NoPrediction, predict
from entmtp.config import BenchConfig, GenerationConfig, Progress
from entmtp.spec.engine import PHASES, collect

SUMMARY_FIELDS = ("task", "method", "tokens_per_s", "mean_accepted", "speedup_vs_ar", "lossless", "same_as_ar",
                  "predicted_tokens_per_s")  # what the final JSON line keeps of each result row


def bench_items(prompts_file: str | None, tasks: list[str], prompts_per_task: int) -> list[dict]:
    """The prompts of a run: a prompt file's, else the first `prompts_per_task` of each task's eval split."""
    from entmtp.data.prompts import eval_prompt_file, read_prompt_file

    if prompts_file:
        return read_prompt_file(prompts_file)
    return [it for task in tasks for it in eval_prompt_file(task, prompts_per_task)]


def check_methods(rt, items: list[dict], methods: list[str]) -> None:
    """Build every engine method's strategy for every task up front, so a run fails before measuring anything."""
    for task in sorted({it["task"] for it in items}):
        for m in methods:
            if m not in ("hf", "hf-lookup"):
                rt.strategy(m, task)


def run_bench(rt, items: list[dict], methods: list[str], cfg: BenchConfig = BenchConfig(), progress: Progress | None = None) -> dict:
    """items: [{"prompt", "task"}]. Returns {"results": [...], "per_prompt": [...]}."""
    if "ar" not in methods:
        methods = ["ar"] + list(methods)  # the reference for speedup and losslessness
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    encoded = [(it["task"], rt.encode(it["prompt"])) for it in items]

    strategies = [rt.strategy(m, task) for task in {t for t, _ in encoded} for m in methods if m not in ("hf", "hf-lookup")]
    # every forward shape once, outside the clock (`warmup` reports the times); with CUDA graphs the drafts' graphs too
    rt.engine.warmup(sorted({1} | {tree.n_nodes for s in strategies for tree in s.trees}))
    for s in strategies:
        rt.engine.warmup_drafts(s.heads, s.trees)
    warm = GenerationConfig(max_new_tokens=cfg.warmup_new_tokens)
    for task in sorted({t for t, _ in encoded}):
        ids = next(i for t, i in encoded if t == task)
        for m in methods:
            collect(rt.run(m, task, ids, warm))

    tasks = sorted({t for t, _ in encoded}) if any(m.startswith("entmtp") for m in methods) else []
    fits = {task: rt.bank(task).fit for task in tasks}  # the banks' fits, as calibrated
    rt.reset_live()  # every timed step from here on (`rt.run` observes them): the costs of now, which
    live = rt.live   # each run's prediction reads first and the served policies are refitted at
    rows = []
    it = progress(range(len(encoded)), "bench", len(encoded)) if progress else range(len(encoded))
    for i in it:
        task, ids = encoded[i]
        runs: dict[str, list] = {}  # method -> its runs, in the first round's order
        foreseen: dict[int, float] = {}  # id(run) -> tokens/s predicted from the live costs just before it ran
        for r in range(cfg.repeats):  # each round in a new rotation: every method takes its turn early and late
            k = (i + r) % len(methods)
            for m in methods[k:] + methods[:k]:
                served = rt.served(task).wait().fit if task in fits and rt.follow_live else fits.get(task)  # its last refit, if any
                pred = _live_prediction(live, served, m, len(ids), gen.max_new_tokens)
                res = collect(rt.run(m, task, ids, gen))
                runs.setdefault(m, []).append(res)
                if pred:
                    foreseen[id(res)] = pred
        for m in runs:
            res = sorted(runs[m], key=lambda x: x.elapsed_s)[(len(runs[m]) - 1) // 2]  # the median run (the lower of two)
            if any(x.token_ids != res.token_ids for x in runs[m]):
                raise RuntimeError(f"{m} decoded different tokens in two rounds of prompt {i}")
            phases = res.phase_ms()
            rows.append(
                {
                    "prompt": i,
                    "task": task,
                    "method": m,
                    "prompt_tokens": len(ids),
                    "tokens": res.new_tokens,
                    "steps": len(res.steps),
                    "seconds": res.elapsed_s,
                    "seconds_each": [round(x.elapsed_s, 4) for x in runs[m]],
                    "prefill_ms": res.steps[0].prefill_ms if res.steps else 0.0,
                    "phase_ms": {k: phases.get(k, 0.0) for k in PHASES},
                    "token_ids": res.token_ids,
                    "probes": sum(r.probe for r in res.steps),
                    "refits": [r.refit for r in res.steps if r.refit],
                }
            )
            if id(res) in foreseen and res.new_tokens:
                rows[-1]["live_predicted_seconds"] = res.new_tokens / foreseen[id(res)]
    # the trees' costs as the timed runs ended, and every refit while serving (`bank.refit`)
    seen_live = {task: {**live.snapshot(fit), "refits": rt.served(task).refits if rt.follow_live else []} for task, fit in fits.items()}
    if "hf" in methods and rt.served_differs():  # the oracle: generate on the model as served, untimed
        for i, (task, ids) in enumerate(encoded):
            rows.append({"prompt": i, "task": task, "method": "oracle", "token_ids": collect(rt.run("oracle", task, ids, gen)).token_ids})
    for r in rows:  # the prediction for this prompt's length and this run's tokens (bank.predict)
        fit = fits.get(r["task"])
        if fit and r["method"] != "oracle" and r["tokens"]:
            try:
                r["predicted_seconds"] = r["tokens"] / predict(fit, r["method"], r["prompt_tokens"], r["tokens"])
            except NoPrediction:
                pass
    predicted = {task: fit.get("predicted_tokens_per_s", {}) for task, fit in fits.items()}
    return {"results": aggregate(rows, methods, predicted), "per_prompt": rows,
            "live_costs": seen_live}


def _live_prediction(live: LiveCosts, fit: dict | None, method: str, prompt_tokens: int, budget: int) -> float | None:
    """Tokens/s the fit predicts for `method` on this prompt at its budget, priced at the live costs
    of this moment (`LiveCosts.predict`); None where the fit predicts no such method."""
    if not fit:
        return None
    try:
        return live.predict(fit, method, prompt_tokens, budget)
    except NoPrediction:
        return None


def aggregate(rows: list[dict], methods: list[str], predicted: dict[str, dict[str, float]] | None = None) -> list[dict]:
    by = defaultdict(list)
    for r in rows:
        by[(r["task"], r["method"])].append(r)
    # losslessness means equal to transformers `generate` on the served model: an `oracle` row where
    # one ran (Q8 arithmetic), else `hf`
    oracle = "hf" if "hf" in methods else "ar"
    served = "oracle" if any(r["method"] == "oracle" for r in rows) else oracle
    ref = {(r["task"], r["prompt"]): r["token_ids"] for r in rows if r["method"] == served}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    def tps_of(rs: list[dict]) -> float:
        return sum(r["tokens"] for r in rs) / max(1e-9, sum(r["seconds"] for r in rs))

    out = []
    for task in tasks:
        ar_tps = tps_of(by[(task, "ar")])
        hf_tps = tps_of(by[(task, "hf")]) if "hf" in methods else None
        for m in methods:
            rs = by[(task, m)]
            tokens, steps, secs = sum(r["tokens"] for r in rs), sum(r["steps"] for r in rs), sum(r["seconds"] for r in rs)
            tps = tokens / max(1e-9, secs)
            ms_step = secs * 1e3 / max(1, steps)
            phase = {k: sum(r["phase_ms"][k] for r in rs) / max(1, steps) for k in PHASES}
            same = all(r["token_ids"] == ref[(task, r["prompt"])] for r in rs)
            # predicted for these prompts where every run has its own prediction, else the fit's own figure
            at_hand = bool(rs) and all("predicted_seconds" in r for r in rs)
            pred = (round(tokens / max(1e-9, sum(r["predicted_seconds"] for r in rs)), 3) if at_hand
                    else (predicted or {}).get(task, {}).get(m))
            # predicted before each run from the live costs of that moment (`bank.live`)
            live = (round(tokens / max(1e-9, sum(r["live_predicted_seconds"] for r in rs)), 3)
                    if rs and all("live_predicted_seconds" in r for r in rs) else None)
            row = {
                "task": task,
                "method": m,
                "tokens_per_s": round(tps, 3),
                "mean_accepted": round(tokens / max(1, steps), 4),
                "speedup_vs_ar": round(tps / ar_tps, 4) if ar_tps else None,
                ("lossless" if oracle == "hf" else "same_as_ar"): same,
                "predicted_tokens_per_s": pred,
                "predicted_for": "these prompts" if at_hand else ("the fit's calibration prompts" if pred else None),
                "measured_over_predicted": round(tps / pred, 4) if pred else None,
                "live_predicted_tokens_per_s": live,
                "measured_over_live": round(tps / live, 4) if live else None,
                "prompts": len(rs),
                "tokens": tokens,
                "ms_per_step": round(ms_step, 2),
                "phase_ms_per_step": {k: round(v, 2) for k, v in phase.items()},
                # (schedule + draft) / wall time per step; None where the engine's phases did not run (hf, hf-lookup)
                "draft_share": round((phase["schedule"] + phase["draft"]) / ms_step, 4) if any(phase.values()) and ms_step else None,
                # steps that timed a tree for the live costs, and refits while serving (`bank.refit`)
                "probe_share": round(sum(r.get("probes", 0) for r in rs) / max(1, steps), 4),
                "refits": sum(len(r.get("refits", ())) for r in rs),
            }
            if hf_tps is not None:
                row["speedup_vs_hf"] = round(tps / hf_tps, 4) if hf_tps else None
            if served == "oracle" and m in ("hf", "hf-lookup"):
                row["stock_float32"] = True  # its `lossless`: stock float32 decoded what the served model does
            out.append(row)
    return out


def check_cell(row: dict, check: str = "lossless") -> str:
    """A row's losslessness in a word; a stock float32 baseline beside a Q8-served model is not
    expected to match, so it reads "same" or "differs" rather than yes or NO."""
    if row.get("stock_float32"):
        return "same" if row[check] else "differs"
    return "yes" if row[check] else "NO"


def results_table(results: list[dict]) -> str:
    """A plain-text table: one row per task and method."""
    check = "lossless" if results and "lossless" in results[0] else "same_as_ar"
    head = (f"{'task':<5} {'method':<14} {'tok/s':>7} {'pred':>7} {'live':>7} {'x ar':>6} {'acc/step':>8} {check:>10} {'ms/step':>8}  "
            + " ".join(f"{p:>8}" for p in PHASES))
    lines = [head, "-" * len(head)]
    for r in results:
        ph = r["phase_ms_per_step"]
        engine = any(ph.values())
        lines.append(
            f"{r['task']:<5} {r['method']:<14} {r['tokens_per_s']:>7.2f} "
            f"{r['predicted_tokens_per_s'] if r['predicted_tokens_per_s'] is not None else '-':>7} "
            f"{r['live_predicted_tokens_per_s'] if r.get('live_predicted_tokens_per_s') is not None else '-':>7} {r['speedup_vs_ar']:>6.2f} "
            f"{r['mean_accepted']:>8.2f} {check_cell(r, check):>10} {r['ms_per_step']:>8.1f}  "
            + " ".join(f"{ph[p]:>8.2f}" if engine else f"{'-':>8}" for p in PHASES)
        )
    return "\n".join(lines)


def summary_json(rt, out: dict, items: list[dict], cfg: BenchConfig, seconds: float, command: str,
            note: str | None = None) -> dict[str, Any]:
    """The final JSON line of `bench` (DESIGN.md, *Command line*): per task and method the headline
    figures, then the machine, model, weights, fits and settings of the run."""
    import torch

    from entmtp.model import ext, serve
    from entmtp.machine import hardware

    return {
        "results": [{k: r[k] for k in SUMMARY_FIELDS if k in r} for r in out["results"]],
        "hardware": hardware(),
        "model": rt.name,
        "weights": getattr(rt, "weights", ""),
        "fit": {task: bank.fit.get("hardware") for task, bank in rt._banks.items()},
        # per task, the best any policy over the bank could do at the fit's costs (bank.fit.fit_task)
        "ceiling": {task: bank.fit["ceiling"] for task, bank in rt._banks.items() if bank.fit.get("ceiling")},
        "seconds": round(seconds, 1),
        "dtype": str(rt.model.dtype).replace("torch.", ""),
        "kernels": serve.label(rt.model),
        "max_new_tokens": cfg.max_new_tokens,
        "repeats": cfg.repeats,
        "prompts": len(items),
        "command": command,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "warmup": warmup_report(rt, ext.build_report()),
        **({"note": note} if note else {}),
    }


def warmup_report(rt, kernel_warmup: dict | None) -> dict[str, Any]:
    """What starting took, outside every clock: the whole start (`start_s`: weights, kernels,
    model), the GGUF extension within it (compiled now or loaded from its cache; null where it
    was not used), per tree size the first forward of its shapes (`per_tree_ms`), and with CUDA
    graphs the capture of each tree's draft (`draft_capture_ms`)."""
    drafts = rt.engine.drafts
    return {
        "start_s": getattr(rt, "load_s", None),
        "kernels": kernel_warmup,
        "per_tree_ms": {str(n): ms for n, ms in sorted(rt.engine.warmup_ms.items())},
        **({"draft_capture_ms": dict(drafts.capture_ms)} if drafts is not None and drafts.capture_ms else {}),
    }


def warmup_line(w: dict[str, Any]) -> str:
    """`warmup_report` in one line of text."""
    k = w.get("kernels")
    ext = "" if not k else f"; GGUF extension {'compiled' if k['built'] else 'loaded'} in {k['seconds']:.1f} s"
    trees = ", ".join(f"n{n} {ms:.0f} ms" for n, ms in w.get("per_tree_ms", {}).items())
    return f"warm-up (outside the clocks): start {w.get('start_s') or 0:.1f} s{ext}; first forward per tree size: {trees}"


def save_results(folder: str | Path, summary: dict, out: dict) -> Path:
    """results.json (the summary plus every row and prompt) and the speedup figure (HTML, and PNG
    where Chromium is installed) in `folder`; returns the results file."""
    from entmtp.figures.plots import bench_figure
    from entmtp.figures.png import save_png

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps({**summary, "detail": out["results"], "per_prompt": out["per_prompt"],
                                                "live_costs": out.get("live_costs", {})}))
    fig = bench_figure(out["results"])
    fig.write_html(d / "speedup.html", include_plotlyjs="cdn")
    save_png(fig, d / "speedup.png")
    return d / "results.json"
