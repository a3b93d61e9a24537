"""Banks that travel (DESIGN.md, *Where the bank is fitted*): build once, fit on every machine.

`build_bank` records the portable half of a bank: greedy continuations of the calibration
prompts, their per-position acceptance traces (entmtp.traces), and candidate trees grown
greedily from those traces. `calibrate` does the machine's half: it times a decode step with
each candidate tree where the engine runs, then fits the throughput front, the static tree, the
ladder and τ (on each feature) by exact simulation of the traces, and caches the fit under a
hardware fingerprint. Build stages checkpoint to JSON in a work folder and resume.
`fit_table`, `fit_summary` and `bank_figure` are how `build-bank` and `calibrate` report a fit.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from .bank import TopologyBank, pareto, policies_json
from .config import ROOT, BankBuildConfig, CalibrateConfig, GenerationConfig, Progress
from .engine import Engine, Strategy
from .heads import DraftHeads
from .policy import FEATURES, LadderPolicy, Policy, StaticPolicy, TauPolicy
from .topology import Tree, compile_tree
from . import drafting, kernels
from .traces import Tables, Trace, accepted_in, foresight, record_all, simulate, spearman

RankPath = tuple[int, ...]


# -- candidate trees from the traces ------------------------------------------------------------


def prefix_counts(paths: Iterable[RankPath]) -> dict[RankPath, int]:
    """How many positions accept each rank path prefix (excluding the empty one)."""
    counts: dict[RankPath, int] = {}
    for p in paths:
        for k in range(1, len(p) + 1):
            counts[p[:k]] = counts.get(p[:k], 0) + 1
    return counts


def greedy_trees(paths: list[RankPath], max_depth: int, max_nodes: int) -> list[tuple[list[RankPath], float]]:
    """Nested trees T_1 ⊂ T_2 ⊂ ... (T_n has n drafted nodes) and the gain of each added node.

    Mean acceptance of a tree = 1 + sum of the frequencies of its nodes, so a node's gain is the
    fraction of positions whose true rank path starts with it. Ties: smaller rank sum, shallower.
    """
    counts = prefix_counts(paths)
    n = max(1, len(paths))
    tree: list[RankPath] = []
    frontier = {(0,)}
    out = []
    while len(tree) < max_nodes and frontier:
        best = min(frontier, key=lambda p: (-counts.get(p, 0), sum(p), len(p), p))
        frontier.remove(best)
        tree.append(best)
        out.append((list(tree), counts.get(best, 0) / n))
        frontier.add(best[:-1] + (best[-1] + 1,))  # next sibling
        if len(best) < max_depth:
            frontier.add(best + (0,))  # first child
    return out


def predicted_acceptance(tree_paths: Iterable[RankPath], paths: list[RankPath]) -> float:
    s = set(map(tuple, tree_paths))
    return sum(accepted_in(s, p) for p in paths) / max(1, len(paths))


def candidates(paths: list[RankPath], cfg: BankBuildConfig) -> list[Tree]:
    """Per size, the best greedy tree over max depths 1..D; only sizes that buy acceptance; spread."""
    by_size: dict[int, dict] = {}
    for depth in range(1, cfg.max_depth + 1):
        for nodes, _gain in greedy_trees(paths, depth, max(cfg.sizes)):
            n = len(nodes)
            if n not in cfg.sizes:
                continue
            acc = predicted_acceptance(nodes, paths)
            if n not in by_size or acc > by_size[n]["acc"] + 1e-12:
                by_size[n] = {"paths": nodes, "acc": acc, "depth": depth}
    front, best = [], 1.0
    for n in sorted(by_size):  # acceptance front: more nodes must buy more acceptance
        if by_size[n]["acc"] > best + 1e-9:
            front.append(by_size[n])
            best = by_size[n]["acc"]
    if len(front) > cfg.max_candidates - 1:  # keep the ends and spread the rest
        idx = sorted({round(i * (len(front) - 1) / (cfg.max_candidates - 2)) for i in range(cfg.max_candidates - 1)})
        front = [front[i] for i in idx]
    trees = [compile_tree([], "n1-d0")]
    for c in front:
        trees.append(compile_tree(c["paths"], f"n{len(c['paths']) + 1}-d{c['depth']}"))
    return trees


# -- the machine: fingerprint and step costs ---------------------------------------------------


def device_name(device: torch.device | None = None) -> str:
    if device is not None and device.type == "cuda" or device is None and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(device if device is not None else 0)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {name}, {os.cpu_count()} cores"


def hardware() -> str:
    """One line naming this machine, for reports."""
    return f"{device_name()}, torch threads {torch.get_num_threads()}"


def fingerprint(model: torch.nn.Module, kernels: str) -> dict[str, Any]:
    """What decides the cost of a step besides the tree: device, threads, precision, kernels, torch."""
    w = model.get_output_embeddings().weight
    return {
        "device": device_name(w.device),
        "threads": torch.get_num_threads() if w.device.type == "cpu" else None,
        "dtype": str(w.dtype).replace("torch.", ""),
        "kernels": kernels,
        "torch": torch.__version__,
    }


def describe(fp: dict[str, Any]) -> str:
    threads = f", {fp['threads']} threads" if fp.get("threads") else ""
    return f"{fp['device']}{threads}, {fp['dtype']}, {fp['kernels']} kernels, torch {fp['torch']}"


def tree_key(tree: Tree) -> str:
    return json.dumps(tree.as_lists())


def measure_costs(engine: Engine, heads: DraftHeads | None, trees: list[Tree], cfg: CalibrateConfig,
                  progress: Progress | None = None) -> tuple[dict[str, float], float]:
    """Median ms of one decode step with each tree (keyed by `tree_key`), and prefill ms per token.

    Real decode steps (schedule, draft, verify, accept, commit) after a `cfg.context`-token
    prompt. Within a round the trees take turns in blocks (`RoundRobin`): one untimed step, then
    `cfg.block` timed ones, so a burst of load on the machine hits every tree alike (timed a round
    per tree, two runs on this project's 2-core AMD EPYC put the 9-node tree at 140 and 113.5 ms)
    while each timed step follows a step of its own tree, as under a static policy or a τ
    switching between neighbours. (Turns of single steps timed a step right after, say, a 64-node
    one: on the AMD EPYC that made one token 9.3–11.6 ms instead of 8.8 and the 4-node tree 1.8×
    it instead of 2.1×, and a τ switching to 4 nodes measured 5–11% under its static tree.) One
    short untimed round first. EOS is ignored so every round takes its steps; the token values do
    not change the cost.
    """
    timer = Engine(engine.model)  # no EOS: every run decodes its full budget
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    unique = list({tree_key(t): t for t in trees}.values())
    bank = TopologyBank.of(*unique)
    run = cfg.block + 1  # a block: one untimed step after the previous tree, then cfg.block timed
    blocks = max(1, -(-cfg.steps // cfg.block))
    strategy = Strategy("timing", bank, RoundRobin(len(unique), run), heads if bank.max_depth else None)
    room = blocks * run * sum(t.max_depth + 1 for t in unique) + max(t.n_nodes for t in unique)
    context = max(1, min(cfg.context, engine.max_positions - room - 1))  # a small model's context may be short
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab // 8, vocab, (context,), generator=g).tolist()
    step_ms: dict[str, list[float]] = {tree_key(t): [] for t in unique}
    prefill: list[float] = []
    rounds = range(cfg.rounds + 1)
    for r in (progress(rounds, "timing trees", len(rounds)) if progress else rounds):
        n = (blocks * run if r else cfg.warm_steps) * len(unique)
        records = []
        steps = timer.generate(ids, strategy, GenerationConfig(max_new_tokens=room))
        for rec in steps:
            records.append(rec)
            if len(records) == n:
                break
        steps.close()
        if r:  # round 0 warms caches and allocators
            for i, rec in enumerate(records):
                if i % run:  # the first step of a block follows another tree
                    step_ms[tree_key(unique[rec.tree_index])].append(rec.step_ms)
            prefill.append(records[0].prefill_ms)
    missing = [k for k, v in step_ms.items() if not v]
    if missing:
        raise ValueError(f"no room to time {len(missing)} tree(s) in the model's context of {engine.max_positions}")
    costs = {k: statistics.median(v) for k, v in step_ms.items()}
    return costs, statistics.median(prefill) / context


@dataclass(frozen=True)
class RoundRobin:
    """A timing device, not a user policy: trees 0, 1, ..., count-1, 0, ... whatever the feature,
    each for `run` steps in a row."""

    count: int
    run: int = 1
    feature: str = "p0"
    depth: int = 0
    name = "round-robin"

    def chooser(self):
        turn = itertools.count()
        return lambda s: next(turn) // self.run % self.count


@torch.inference_mode()
def measure_chain(heads: DraftHeads | None, depth: int, reps: int = 15) -> list[float]:
    """Median ms of the heads' top-1 chain to each depth 0..depth (what the path-value feature costs)."""
    if heads is None or depth == 0:
        return [0.0] * (depth + 1)
    w = heads._base["lm_head"].weight
    feature = torch.randn(heads.hidden_size, dtype=w.dtype, device=w.device)
    out = [0.0]
    for d in range(1, depth + 1):
        times = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            drafting.top1_chain(heads, feature, 1, d)
            if w.device.type == "cuda":
                torch.cuda.synchronize(w.device)
            times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times[2:]))
    return out


# -- fitting the policies by exact simulation -------------------------------------------------


def _quantiles(values: list[float], n: int) -> list[float]:
    """About n-1 thresholds at the feature's quantiles, each halfway between two distinct values.

    Halfway, so that no recorded value sits on a threshold: the engine's own feature differs
    from the stored one in the last digits, and must fall on the same side.
    """
    v = sorted(set(values))
    if len(v) < 2:
        return [0.5]
    picks = {min(len(v) - 2, int(len(v) * q / n)) for q in range(1, n)}
    return sorted(round((v[k] + v[k + 1]) / 2, 7) for k in picks)


def monotone_costs(trees: list[Tree], step_ms: list[float]) -> list[float]:
    """Measured step costs made non-decreasing in tree size, where the bank's trees grow in nodes
    and depth together (pool adjacent violators, a tie broken by depth): a bigger tree does more
    work, so a cheaper median is timing noise that a fit would otherwise exploit. Other banks keep
    their medians as measured."""
    order = sorted(range(len(trees)), key=lambda i: (trees[i].n_nodes, trees[i].max_depth))
    if any(trees[a].max_depth > trees[b].max_depth for a, b in zip(order, order[1:])):
        return list(step_ms)
    blocks: list[list] = []  # [sum, count, members]
    for i in order:
        blocks.append([step_ms[i], 1, [i]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n, members = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
            blocks[-1][2] += members
    out = list(step_ms)
    for total, n, members in blocks:
        for i in members:
            out[i] = total / n
    return out


def fit_task(trees: list[Tree], traces: list[Trace], step_ms: list[float], prefill_ms_per_token: float,
             grid: int = 12, baseline: tuple[Tree, float] | None = None, chain_ms: list[float] | None = None) -> dict[str, Any]:
    """Front, static, ladder and τ for one task from its traces and the measured step costs.

    Every candidate is scored by simulating the decode of every trace; the ladder runs over the
    front, τ over pairs of front trees, each on every feature; the feature with the best
    predicted throughput is kept. `baseline` (Hydra's tree and its step cost) is scored too.
    `chain_ms[d]` is the cost of the heads' top-1 chain to depth d: a policy on the path value
    through d heads runs it every step, so a shallower tree then costs the difference; every d
    from 1 to the bank's depth is fitted and the best kept (`features.path_value.depth`).
    """
    measured, step_ms = list(step_ms), monotone_costs(trees, step_ms)
    all_trees = trees + ([baseline[0]] if baseline else [])
    costs = step_ms + ([baseline[1]] if baseline else [])
    tables = Tables(all_trees, traces)
    depth = max(t.max_depth for t in trees)
    # the path value may read fewer heads than the bank's depth: g_d for d = 1..depth each
    options = [(f, 0) for f in FEATURES if f != "path_value"] + [("path_value", d) for d in range(1, depth + 1)]
    feats = {(f, d): [t.feature(f, d or depth) for t in traces] for f, d in options}

    def chain_extra(d: int) -> list[float]:
        """Per tree, the heads a path-value feature through depth d runs beyond the tree's own."""
        if not chain_ms:
            return [0.0] * len(all_trees)
        top = len(chain_ms) - 1
        return [max(0.0, chain_ms[min(d, top)] - chain_ms[min(t.max_depth, top)]) for t in all_trees]

    deep = {d: [c + e for c, e in zip(costs, chain_extra(d))] for d in range(1, depth + 1)}

    def run(policy: Policy):
        d = policy.depth or depth
        cost = deep[d] if policy.feature == "path_value" and not isinstance(policy, StaticPolicy) else costs
        return simulate(tables, policy.chooser, feats[(policy.feature, d if policy.feature == "path_value" else 0)], cost,
                        prefill_ms_per_token)

    static_runs = [run(StaticPolicy(i)) for i in range(len(trees))]
    per_tree = {t.name: {"mean_accepted": round(o.mean_accepted, 4), "step_ms": round(step_ms[i], 3),
                         "measured_ms": round(measured[i], 3), "tokens_per_s": round(o.tokens_per_s, 3)}
                for i, (t, o) in enumerate(zip(trees, static_runs))}
    front = sorted(pareto([(step_ms[i], static_runs[i].mean_accepted) for i in range(len(trees))]), key=lambda i: trees[i].n_nodes)
    static = StaticPolicy(max(range(len(trees)), key=lambda i: static_runs[i].tokens_per_s))
    static_tps = static_runs[static.tree].tokens_per_s

    # accepted length at each position with the largest candidate: what the features should predict
    big = max(range(len(trees)), key=lambda i: trees[i].n_nodes)
    acc_big = [a for row in tables.accepted[big] for a in row]
    by_feature: dict[str, dict[str, Any]] = {}
    best_feature, best_depth, best_score, fitted = "p0", 0, float("-inf"), {}
    for f, d in options:
        values = [v for row in feats[(f, d)] for v in row]
        grid_f = _quantiles(values, grid)
        ladder, ladder_tps = _fit_ladder(front, grid_f, f, run, d, static.tree)
        tau, tau_tps = _fit_tau(front, grid_f, f, static, static_tps, run, d)
        row = {"spearman": round(spearman(values, acc_big), 4), "ladder": round(ladder_tps, 3), "tau": round(tau_tps, 3)}
        if f == "path_value":  # each depth under "depths"; the feature's own row is its best depth's
            entry = by_feature.setdefault(f, {"depths": {}})
            entry["depths"][str(d)] = row
            if "depth" not in entry or max(ladder_tps, tau_tps) > max(entry["ladder"], entry["tau"]) + 1e-9:
                entry.update(row, depth=d)
        else:
            by_feature[f] = row
        if max(ladder_tps, tau_tps) > best_score + 1e-9:
            best_feature, best_depth, best_score, fitted = f, d, max(ladder_tps, tau_tps), {"ladder": ladder, "tau": tau}
    policies = {"static": static, **fitted}
    outcomes = {name: run(p) for name, p in policies.items()}
    degenerate = {}
    for name in ("ladder", "tau"):
        used = sorted(set(outcomes[name].picks))
        if len(used) == 1:
            degenerate[name] = f"settles on one tree ({trees[used[0]].name}) on the traces: it never switches"
    predicted = {"ar": round(static_runs[0].tokens_per_s, 3) if trees[0].n_nodes == 1 else None}
    if baseline:
        predicted["hydra"] = round(run(StaticPolicy(len(trees))).tokens_per_s, 3)
    for name, o in outcomes.items():
        predicted[f"entmtp-{name}"] = round(o.tokens_per_s, 3)
    fit = {
        "trees": per_tree,
        "front": [trees[i].name for i in front],
        "feature": best_feature,
        "feature_depth": best_depth,  # heads the path value reads (0: the feature is not the path value)
        "features": by_feature,
        "policies": policies_json(policies, trees),
        "degenerate": degenerate,
        "predicted_tokens_per_s": {k: v for k, v in predicted.items() if v is not None},
        "predicted_mean_accepted": {f"entmtp-{k}": round(o.mean_accepted, 4) for k, o in outcomes.items()},
        "prefill_ms_per_token": round(prefill_ms_per_token, 4),
        "chain_ms": [round(c, 3) for c in (chain_ms or [])],
    }
    best = foresight(tables, costs, prefill_ms_per_token, among=range(len(trees)))  # what no policy can beat
    fit["ceiling"] = {"tokens_per_s": round(best.tokens_per_s, 3), "mean_accepted": round(best.mean_accepted, 4),
                      "over_ar": round(best.tokens_per_s / predicted["ar"], 3) if predicted["ar"] else None}
    if baseline:
        b = run(StaticPolicy(len(trees)))
        fit["baseline"] = {"name": baseline[0].name, "n_nodes": baseline[0].n_nodes, "step_ms": round(baseline[1], 3),
                           "mean_accepted": round(b.mean_accepted, 4), "tokens_per_s": round(b.tokens_per_s, 3)}
    return fit


def _fit_ladder(front: list[int], grid: list[float], feature: str, run, depth: int = 0,
                static: int | None = None) -> tuple[LadderPolicy, float]:
    """Thresholds over the front trees (by size) by coordinate ascent on the feature's quantiles,
    from two starts: thresholds spread evenly over the quantiles, and the static tree's ladder
    (every step on `static`, which the ascent can only improve on). The better result is kept."""
    k = len(front)
    make = lambda t: LadderPolicy(tuple(front), tuple(t), feature, depth)  # noqa: E731
    starts = [[grid[min(len(grid) - 1, round((i + 1) * len(grid) / k) - 1)] for i in range(k - 1)] if k > 1 else []]
    if static in front and k > 1:
        at = front.index(static)
        starts.append([-0.5] * at + [1.5] * (k - 1 - at))

    def ascend(thr: list[float]) -> tuple[list[float], float]:
        score = run(make(thr)).tokens_per_s
        for _ in range(3):
            changed = False
            for i in range(len(thr)):
                lo = thr[i - 1] if i else -1.0
                hi = thr[i + 1] if i + 1 < len(thr) else 2.0
                for g in [x for x in grid + [-0.5, 1.5] if lo <= x <= hi and x != thr[i]]:
                    trial = thr[:i] + [g] + thr[i + 1 :]
                    trial_score = run(make(trial)).tokens_per_s
                    if trial_score > score + 1e-9:
                        score, thr, changed = trial_score, trial, True
            if not changed:
                break
        return thr, score

    thr, best = max((ascend(t) for t in starts), key=lambda r: r[1])  # the first start on a tie
    return make(thr), best


TAU_MIN_GAIN = 0.01  # a switching τ must beat the static tree by this share of its predicted tok/s


def _fit_tau(front: list[int], grid: list[float], feature: str, static: StaticPolicy, static_tps: float, run,
             depth: int = 0) -> tuple[TauPolicy, float]:
    """Every pair small < large of front trees, τ_off <= τ_on on the grid; the static tree unless one
    beats it by TAU_MIN_GAIN (a smaller predicted gain is within the resolution of the measured step
    costs: on the AMD EPYC such a τ measured 6–10% below its static tree)."""
    best_pol, best = TauPolicy(static.tree, static.tree, 1.0, 1.0, feature, depth), static_tps
    bar = static_tps * (1 + TAU_MIN_GAIN)
    for a, small in enumerate(front):
        for large in front[a + 1 :]:
            for on in grid:
                for off in [g for g in grid if g <= on]:
                    cand = TauPolicy(small, large, on, off, feature, depth)
                    score = run(cand).tokens_per_s
                    if score > max(best, bar) + 1e-9:
                        best, best_pol = score, cand
    return best_pol, best


# -- calibrate: this machine's fit, cached ------------------------------------------------------


def fit_cache_file(cache_root: Path, bank: TopologyBank, fp: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps([fp, bank.portable_key()], sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_root) / "fits" / f"{bank.meta.get('model', 'model')}-{bank.meta.get('task', 'task')}-{key}.json"


def load_fit(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save_fit(path: Path, fit: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(fit, indent=1))
    tmp.replace(path)


def calibrate(engine: Engine, heads: DraftHeads, banks: dict[str, TopologyBank], fp: dict[str, Any],
              cfg: CalibrateConfig = CalibrateConfig(), baseline: Tree | None = None,
              progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """Time every candidate tree of `banks` (and `baseline`) here and fit each task. -> {task: fit}."""
    t0 = time.perf_counter()
    trees = [t for b in banks.values() for t in b.trees] + ([baseline] if baseline else [])
    costs, prefill = measure_costs(engine, heads, trees, cfg, progress)
    chain = measure_chain(heads, max(t.max_depth for t in trees))
    measured_s = time.perf_counter() - t0
    out = {}
    for task, bank in banks.items():
        t1 = time.perf_counter()
        fit = fit_task(bank.trees, bank.traces, [costs[tree_key(t)] for t in bank.trees], prefill, cfg.grid,
                       (baseline, costs[tree_key(baseline)]) if baseline else None, chain)
        fit_s = time.perf_counter() - t1
        out[task] = {
            "hardware": describe(fp),
            "fingerprint": fp,
            "date": datetime.date.today().isoformat(),
            "seconds": round(measured_s * len(bank.trees) / max(1, len(trees)) + fit_s, 2),
            "context": cfg.context,
            **fit,
        }
    return out


def known_fit(bank: TopologyBank, fp: dict[str, Any], cache_root: Path, mode: str = "auto") -> dict[str, Any] | None:
    """The fit `resolve_fits` would use without timing anything, or None when it must calibrate."""
    if mode == "shipped" or mode == "auto" and bank.shipped_fit.get("fingerprint") == fp:
        return bank.shipped_fit
    return load_fit(fit_cache_file(cache_root, bank, fp)) if mode == "auto" else None


def resolve_fits(engine: Engine, heads: DraftHeads, banks: dict[str, TopologyBank], fp: dict[str, Any], cache_root: Path,
                 mode: str = "auto", cfg: CalibrateConfig = CalibrateConfig(), baseline: Tree | None = None,
                 progress: Progress | None = None) -> dict[str, TopologyBank]:
    """Each bank under the fit for this machine.

    mode "shipped": the fit saved in the bank file, wherever it was measured. "auto": the file's
    fit when it was measured on a machine with this fingerprint, else this machine's cached fit,
    else calibrate now (once) and cache. "refit": calibrate now whatever is cached.
    """
    if mode not in ("auto", "shipped", "refit"):
        raise ValueError(f"unknown fit mode {mode!r} (expected auto, shipped or refit)")
    out, missing = {}, {}
    for task, bank in banks.items():
        fit = known_fit(bank, fp, cache_root, mode)
        try:
            out[task] = bank.with_fit(fit) if fit else None
        except ValueError:  # a stale or damaged cache entry: measure again
            out[task] = None
        if out[task] is None:
            missing[task] = bank
    if missing:
        for task, fit in calibrate(engine, heads, missing, fp, cfg, baseline, progress).items():
            save_fit(fit_cache_file(cache_root, missing[task], fp), fit)
            out[task] = missing[task].with_fit(fit)
    return out


# -- a fit as the CLI reports it ------------------------------------------------------------------


def through_heads(fit: dict) -> str:
    """" through N head(s)" when the fit's feature is the path value through N heads, else ""."""
    return f" through {fit['feature_depth']} head(s)" if fit.get("feature") == "path_value" and fit.get("feature_depth") else ""


def fit_table(fit: dict) -> str:
    """The fit of one task as text: per tree, then the policies and their predicted throughput."""
    lines = [f"fitted on {fit['hardware']} ({fit['date']})",
             f"{'tree':<10} {'acc/step':>8} {'step ms':>8} {'pred tok/s':>10}  front"]
    for name, st in fit["trees"].items():
        mark = "*" if name in fit["front"] else ""
        lines.append(f"{name:<10} {st['mean_accepted']:>8.3f} {st['step_ms']:>8.1f} {st['tokens_per_s']:>10.2f}  {mark}")
    if fit.get("baseline"):
        b = fit["baseline"]
        lines.append(f"{b['name']:<10} {b['mean_accepted']:>8.3f} {b['step_ms']:>8.1f} {b['tokens_per_s']:>10.2f}  (hydra's tree, not in the bank)")
    pol = fit["policies"]
    lines.append(f"feature: {fit['feature']}{through_heads(fit)}  (rank correlation with accepted length: "
                 + ", ".join(f"{k} {v['spearman']:+.2f}" for k, v in fit["features"].items()) + ")")
    lines.append(f"static: {pol['static']['tree']}; ladder: {' < '.join(pol['ladder']['trees'])} at {pol['ladder']['thresholds']}; "
                 f"tau: {pol['tau']['small']} <-> {pol['tau']['large']} on {pol['tau']['tau_on']:.3f} / off {pol['tau']['tau_off']:.3f}")
    for name, why in fit.get("degenerate", {}).items():
        lines.append(f"note: {name} {why}")
    lines.append("predicted tok/s: " + ", ".join(f"{k} {v:.2f}" for k, v in fit["predicted_tokens_per_s"].items()))
    if fit.get("ceiling"):
        lines.append(f"ceiling: {ceiling_text(fit)}")
    return "\n".join(lines)


def ceiling_text(fit: dict) -> str:
    """The fit's ceiling in words: what a policy that knew every step's outcome would reach."""
    c = fit["ceiling"]
    over = f" ({c['over_ar']:.2f}× ar)" if c.get("over_ar") else ""
    return (f"{c['tokens_per_s']:.1f} tok/s{over} for a policy over this bank that knew each step's accepted "
            f"length beforehand ({c['mean_accepted']:.2f} tokens/step); no policy on these traces and costs beats it")


def fit_summary(fit: dict) -> dict:
    """What the JSON lines of `build-bank` and `calibrate` hold of a task's fit."""
    pol = fit["policies"]
    return {"trees": list(fit["trees"]), "front": fit["front"], "static": pol["static"]["tree"], "ladder": pol["ladder"],
            "tau": pol["tau"], "feature": fit["feature"], "degenerate": fit.get("degenerate", {}),
            "features": fit["features"], "predicted_tokens_per_s": fit["predicted_tokens_per_s"],
            "ceiling": fit.get("ceiling")}


def bank_figure(bank: TopologyBank, slug: str, task: str) -> Path:
    """The bank's front saved as assets/bank-<model>-<task>.png (.html where Chromium is missing); its path."""
    from .plots import front_figure
    from .png import save_png

    fig = front_figure(bank, bank.fit.get("baseline"))
    figure = ROOT / "assets" / f"bank-{slug}-{task}.png"
    if not save_png(fig, figure):
        figure = figure.with_suffix(".html")  # no Chromium here: keep the interactive figure
        fig.write_html(figure, include_plotlyjs="cdn")
    return figure


# -- the whole build -------------------------------------------------------------------------------


class Stages:
    """JSON checkpoints of each stage in a work folder, so a killed build resumes."""

    def __init__(self, work: Path, fresh: bool = False):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        if fresh:
            for f in work.glob("stage*.json"):
                f.unlink()

    def load(self, name: str):
        p = self.work / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def save(self, name: str, obj) -> None:
        p = self.work / f"{name}.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj))
        tmp.replace(p)


def build_bank(
    engine: Engine,
    heads: DraftHeads,
    calib_prompts: list[list[int]],
    cfg: BankBuildConfig,
    stages: Stages,
    meta: dict,
    fp: dict[str, Any],
    calib: CalibrateConfig = CalibrateConfig(),
    progress: Progress | None = None,
    baseline: Tree | None = None,
    answers=None,
) -> TopologyBank:
    """Traces, candidate trees, and this machine's fit as the bank's shipped fit (resumable).

    `answers` (an entmtp.answers.AnswerStore) supplies and keeps the greedy continuations."""
    key = {"n_prompts": len(calib_prompts), "cfg": cfg.__dict__ | {"sizes": list(cfg.sizes)},
           "heads": meta["provenance"].get("heads_sha256")}
    if stages.load("stage0") not in (None, key):
        raise ValueError(f"{stages.work} holds a build with other settings; pass --fresh or another --work")
    stages.save("stage0", key)
    traces = record_all(engine, heads, calib_prompts, cfg.calib_new_tokens, cfg.max_depth,
                        stages.load("stage1"), lambda t: stages.save("stage1", t), progress, answers)
    paths = [t.rank_path(i) for t in traces for i in range(len(t))]
    trees = candidates(paths, cfg)
    bank = TopologyBank(trees, [{} for _ in trees], {"static": StaticPolicy(0)}, meta, traces)
    fit = calibrate(engine, heads, {meta["task"]: bank}, fp, calib, baseline, progress)[meta["task"]]
    bank.shipped_fit = fit
    return bank.with_fit(fit)


def calibration_prompts(task: str, prompts_file: str | None, n: int) -> tuple[list[str], str]:
    """The first `n` prompts a bank build traces (a prompt file's, else the task's calib split),
    and how the bank's provenance names them."""
    from .data import prompts, read_prompt_file

    if prompts_file:
        texts = [it["prompt"] for it in read_prompt_file(prompts_file, default_task=task)][:n]
        return texts, f"{prompts_file} (first {len(texts)} prompts)"
    texts = prompts(task, "calib", n)
    return texts, f"{task} calib split, first {len(texts)} prompts (entmtp/data.py)"


def build_task_bank(rt, task: str, texts: list[str], calibration: str, cfg: BankBuildConfig, work: Path | None,
                    fresh: bool, command: str, progress: Progress | None = None) -> TopologyBank:
    """`build_bank` for a loaded runtime (`entmtp.loading.Runtime`): its Hydra heads, Hydra's
    default tree scored beside the candidates, provenance filled in. Stages checkpoint under
    `work` (default: checkpoints/bank/<model>/<task>). The default model's greedy continuations
    come from, and go to, the repository's answer store."""
    from .answers import repo_store

    heads = rt.heads("hydra")
    work = Path(work) if work else ROOT / "checkpoints" / "bank" / rt.slug / task
    provenance = {
        "model": rt.name,
        "weights": getattr(rt, "weights", ""),
        "heads_sha256": heads.provenance.get("sha256", "unknown"),
        "heads_numerics": heads.numerics,  # how the traces' heads computed (the engine drafts alike with the same kernels)
        "base_kernels": kernels.label(rt.model),  # the base model's linears when the traces were recorded
        "calibration": calibration,
        "traces": f"{cfg.calib_new_tokens} greedy tokens per prompt, ranks of the true token under each head (top {16})",
        "command": command,
        "date": datetime.date.today().isoformat(),
        "hardware": "traces: any machine (machine-independent at temperature 0); shipped fit: see fit.hardware",
    }
    ids = [rt.encode(t) for t in texts]
    baseline = rt.strategy("hydra", task).bank[0]  # Hydra's default tree, scored for comparison
    return build_bank(rt.engine, heads, ids, cfg, Stages(work, fresh), {"model": rt.slug, "task": task, "provenance": provenance},
                      rt.fingerprint, progress=progress, baseline=baseline, answers=repo_store(rt.name, rt.arithmetic))
