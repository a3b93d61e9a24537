"""Offline bank building (DESIGN.md, *Building a bank*): rollouts, greedy trees, recalibration, fronts, policies.

Stages, each resumable from a JSON checkpoint in the work folder:
1. joint rollout: decode the calibration prompts with a superset tree and record, per step, the
   accepted rank path and s. A subtree would have accepted the longest prefix of that path
   inside it.
2. greedy construction for max depth D = 1..4: add the frontier node (next contiguous child of a
   node) with the largest gain in mean acceptance; ties -> smaller rank sum, then shallower.
3+4. recalibration and throughput: a real rollout with each candidate tree (interleaved per
   prompt so drift hits all alike) measures its mean acceptance, step time and tokens/s.
5. bank = Pareto front over (step time down, acceptance up); policies fitted by simulating them
   on the stage-1 steps with measured per-tree step times.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from .bank import TopologyBank
from .config import GenerationConfig
from .engine import Engine, Strategy, collect
from .heads import DraftHeads
from .policy import LadderPolicy, Policy, StaticPolicy, TauPolicy
from .topology import Tree, compile_tree

RankPath = tuple[int, ...]
Progress = Callable[[Iterable, str, int], Iterable]


def _no_progress(it: Iterable, desc: str = "", total: int = 0) -> Iterable:
    return it


@dataclass(frozen=True)
class BankBuildConfig:
    """Budget of one bank build (defaults sized for a 2-core CPU)."""

    calib_prompts: int = 24
    calib_new_tokens: int = 96
    measure_prompts: int = 10
    measure_new_tokens: int = 64
    max_depth: int = 4
    sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # candidate drafted-node counts
    max_candidates: int = 8  # trees measured in stages 3+4, the root-only tree included
    warmup_new_tokens: int = 8


# -- stage 1: joint rollout ---------------------------------------------------------------------


def superset_tree(max_depth: int = 4, widths: Sequence[int] = (10, 6, 4, 3)) -> Tree:
    """A wide tree holding every candidate: rank r at depth d has widths[d] children if r is small."""
    paths: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    for d in range(max_depth):
        nxt = []
        for p in level:
            # only the best-ranked nodes get children: the rest are rarely on an accepted path
            if p and sum(p) > 3:
                continue
            for r in range(widths[d] if sum(p) == 0 else max(1, widths[d] // 2)):
                nxt.append(p + (r,))
        paths += nxt
        level = nxt
    return compile_tree(paths, "superset")


def rank_path(tree: Tree, accepted_nodes: list[int]) -> RankPath:
    return tuple(tree.rank[n] for n in accepted_nodes[1:])


def joint_rollout(engine: Engine, heads: DraftHeads, prompts: list[list[int]], tree: Tree, new_tokens: int, progress: Progress = _no_progress) -> list[list[dict]]:
    """Per prompt, per step: {"path": accepted rank path, "s": feature}."""
    strategy = Strategy("superset", TopologyBank.of(tree), StaticPolicy(0), heads)
    out = []
    for ids in progress(prompts, "joint rollout", len(prompts)):
        steps = engine.generate(ids, strategy, GenerationConfig(max_new_tokens=new_tokens))
        # the last step may be truncated by the budget: its path says nothing about the tree
        out.append([{"path": list(rank_path(tree, r.accepted_nodes)), "s": r.s} for r in steps if not r.finished])
    return out


# -- stage 2: greedy construction ----------------------------------------------------------------


def prefix_counts(paths: Iterable[RankPath]) -> dict[RankPath, int]:
    """How many steps accepted each rank path prefix (excluding the empty one)."""
    counts: dict[RankPath, int] = {}
    for p in paths:
        for k in range(1, len(p) + 1):
            counts[p[:k]] = counts.get(p[:k], 0) + 1
    return counts


def accepted_in(tree_paths: set[RankPath], path: RankPath) -> int:
    """Tokens a tree accepts at a step whose full accepted rank path is `path` (root included)."""
    k = 0
    while k < len(path) and path[: k + 1] in tree_paths:
        k += 1
    return k + 1


def greedy_trees(paths: list[RankPath], max_depth: int, max_nodes: int) -> list[tuple[list[RankPath], float]]:
    """Nested trees T_1 ⊂ T_2 ⊂ ... (T_n has n drafted nodes) and the gain of each added node.

    Mean acceptance of a tree = 1 + sum of the frequencies of its nodes, so a node's gain is the
    fraction of steps whose accepted path starts with it.
    """
    counts = prefix_counts(paths)
    n_steps = max(1, len(paths))
    tree: list[RankPath] = []
    frontier = {(0,)}
    out = []
    while len(tree) < max_nodes and frontier:
        best = min(frontier, key=lambda p: (-counts.get(p, 0), sum(p), len(p), p))
        frontier.remove(best)
        tree.append(best)
        out.append((list(tree), counts.get(best, 0) / n_steps))
        frontier.add(best[:-1] + (best[-1] + 1,))  # next sibling
        if len(best) < max_depth:
            frontier.add(best + (0,))  # first child
    return out


def predicted_acceptance(tree_paths: Iterable[RankPath], paths: list[RankPath]) -> float:
    s = set(map(tuple, tree_paths))
    return sum(accepted_in(s, p) for p in paths) / max(1, len(paths))


def candidates(paths: list[RankPath], cfg: BankBuildConfig) -> list[dict]:
    """Per size, the best greedy tree over max depths 1..D (ties -> shallower), on the acceptance front."""
    by_size: dict[int, dict] = {}
    for depth in range(1, cfg.max_depth + 1):
        for nodes, _gain in greedy_trees(paths, depth, max(cfg.sizes)):
            n = len(nodes)
            if n not in cfg.sizes:
                continue
            acc = predicted_acceptance(nodes, paths)
            if n not in by_size or acc > by_size[n]["predicted"] + 1e-12:
                by_size[n] = {"paths": [list(p) for p in nodes], "predicted": acc, "max_depth": depth}
    front, best = [], 1.0
    for n in sorted(by_size):  # acceptance front: more nodes must buy more acceptance
        if by_size[n]["predicted"] > best + 1e-9:
            front.append({"n_drafted": n, **by_size[n]})
            best = by_size[n]["predicted"]
    if len(front) > cfg.max_candidates - 1:  # keep the ends and spread the rest
        idx = sorted({round(i * (len(front) - 1) / (cfg.max_candidates - 2)) for i in range(cfg.max_candidates - 1)})
        front = [front[i] for i in idx]
    return [{"n_drafted": 0, "paths": [], "predicted": 1.0, "max_depth": 0}] + front


# -- stages 3+4: recalibration and throughput ------------------------------------------------


def measure(
    engine: Engine,
    heads: DraftHeads,
    prompts: list[list[int]],
    trees: list[Tree],
    new_tokens: int,
    done: dict | None = None,
    save: Callable[[dict], None] | None = None,
    progress: Progress = _no_progress,
) -> dict[str, list[dict]]:
    """Real rollouts with every tree, interleaved per prompt. Per tree, per prompt: tokens, steps, seconds."""
    results = done or {t.name: [] for t in trees}
    for t in trees:
        results.setdefault(t.name, [])
    strategies = [Strategy(t.name, TopologyBank.of(t), StaticPolicy(0), heads if t.n_nodes > 1 else None) for t in trees]
    engine.warmup([t.n_nodes for t in trees])
    for i, ids in enumerate(progress(prompts, "measure trees", len(prompts))):
        for st in strategies:
            if len(results[st.name]) > i:
                continue  # resumed
            res = collect(engine.generate(ids, st, GenerationConfig(max_new_tokens=new_tokens)))
            results[st.name].append(
                {
                    "tokens": res.new_tokens,
                    "steps": len(res.steps),
                    "seconds": res.elapsed_s,
                    "step_ms": statistics.median(r.step_ms for r in res.steps),
                }
            )
        if save:
            save(results)
    return results


def summarize(rows: list[dict]) -> dict[str, float]:
    tokens = sum(r["tokens"] for r in rows)
    return {
        "mean_accepted": round(tokens / max(1, sum(r["steps"] for r in rows)), 4),
        "step_ms": round(statistics.median(r["step_ms"] for r in rows), 3),
        "tokens_per_s": round(tokens / max(1e-9, sum(r["seconds"] for r in rows)), 3),
    }


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated (smaller or equal x and larger y), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


# -- stage 5: policy fitting by simulation ------------------------------------------------------


def simulate(policy: Policy, rollouts: list[list[dict]], trees: list[Tree], step_ms: list[float]) -> dict:
    """Tokens per second a policy would reach on the recorded steps, and the trees it picks."""
    sets = [set(t.paths) for t in trees]
    tokens, ms, picks = 0, 0.0, []
    for steps in rollouts:
        choose = policy.chooser()
        row = []
        for st in steps:
            k = choose(st["s"])
            row.append(k)
            tokens += accepted_in(sets[k], tuple(st["path"]))
            ms += step_ms[k]
        picks.append(row)
    return {"tokens_per_s": tokens / max(1e-9, ms) * 1e3, "picks": picks}


def _quantiles(values: list[float], n: int) -> list[float]:
    v = sorted(values)
    return sorted({round(v[min(len(v) - 1, int(len(v) * q / n))], 6) for q in range(1, n)})


def fit_policies(rollouts: list[list[dict]], trees: list[Tree], step_ms: list[float], measured_tps: list[float]) -> tuple[dict[str, Policy], dict[str, float]]:
    """static = measured tokens/s argmax; ladder and tau = best simulated over a grid of s quantiles."""
    static = StaticPolicy(max(range(len(trees)), key=lambda i: measured_tps[i]))
    s_values = [st["s"] for steps in rollouts for st in steps]
    grid = _quantiles(s_values, 12) if s_values else [0.5]
    scores: dict[str, float] = {"static": simulate(static, rollouts, trees, step_ms)["tokens_per_s"]}

    # ladder over all bank trees (sorted by size): coordinate ascent on the thresholds
    k = len(trees)
    thr = [grid[min(len(grid) - 1, round((i + 1) * len(grid) / k) - 1)] for i in range(k - 1)] if k > 1 else []
    best = simulate(LadderPolicy(tuple(range(k)), tuple(thr)), rollouts, trees, step_ms)["tokens_per_s"]
    for _ in range(3):
        for i in range(len(thr)):
            lo = thr[i - 1] if i else -1.0
            hi = thr[i + 1] if i + 1 < len(thr) else 2.0
            for g in [x for x in grid + [-0.5, 1.5] if lo <= x <= hi]:
                trial = thr[:i] + [g] + thr[i + 1 :]
                score = simulate(LadderPolicy(tuple(range(k)), tuple(trial)), rollouts, trees, step_ms)["tokens_per_s"]
                if score > best + 1e-9:
                    best, thr = score, trial
    ladder = LadderPolicy(tuple(range(k)), tuple(thr))
    scores["ladder"] = best

    # tau: every (small < large) pair and tau_off <= tau_on on the grid
    tau, best = TauPolicy(static.tree, static.tree, 2.0, 2.0), scores["static"]
    for small in range(k):
        for large in range(small + 1, k):
            for on in grid:
                for off in [g for g in grid if g <= on]:
                    cand = TauPolicy(small, large, on, off)
                    score = simulate(cand, rollouts, trees, step_ms)["tokens_per_s"]
                    if score > best + 1e-9:
                        best, tau = score, cand
    scores["tau"] = best
    return {"static": static, "ladder": ladder, "tau": tau}, scores


# -- the whole build ----------------------------------------------------------------------------


def hardware() -> str:
    if torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(0)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {name}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


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
    provenance: dict,
    meta: dict,
    progress: Progress = _no_progress,
    baseline: Tree | None = None,
) -> tuple[TopologyBank, dict]:
    """Run (or resume) all stages and return the bank and a report of what each stage found.

    `baseline` (Hydra's default tree) is measured alongside the candidates, for comparison only.
    """
    key = {"n_prompts": len(calib_prompts), "cfg": cfg.__dict__ | {"sizes": list(cfg.sizes)}, "heads": provenance.get("heads_sha256")}
    if stages.load("stage0") not in (None, key):
        raise ValueError(f"{stages.work} holds a build with other settings; pass --fresh or another --work")
    stages.save("stage0", key)

    rollouts = stages.load("stage1")
    if rollouts is None:
        sup = superset_tree(cfg.max_depth)
        engine.warmup([sup.n_nodes])
        rollouts = joint_rollout(engine, heads, calib_prompts, sup, cfg.calib_new_tokens, progress)
        stages.save("stage1", rollouts)
    paths = [tuple(st["path"]) for steps in rollouts for st in steps]

    cands = stages.load("stage2")
    if cands is None:
        cands = candidates(paths, cfg)
        stages.save("stage2", cands)
    trees = [compile_tree(c["paths"], f"n{c['n_drafted'] + 1}-d{c['max_depth']}") for c in cands]

    measured = measure(
        engine,
        heads,
        calib_prompts[: cfg.measure_prompts],
        trees + ([baseline] if baseline is not None else []),
        cfg.measure_new_tokens,
        stages.load("stage3"),
        lambda r: stages.save("stage3", r),
        progress,
    )
    stats = []
    for t, c in zip(trees, cands):
        stats.append({"n_nodes": t.n_nodes, "predicted": round(c["predicted"], 4), **summarize(measured[t.name])})
    front = sorted(pareto([(s["step_ms"], s["mean_accepted"]) for s in stats]), key=lambda i: stats[i]["n_nodes"])
    bank_trees = [trees[i] for i in front]
    bank_stats = [{k: stats[i][k] for k in ("mean_accepted", "step_ms", "tokens_per_s")} for i in front]
    policies, scores = fit_policies(
        rollouts, bank_trees, [s["step_ms"] for s in bank_stats], [s["tokens_per_s"] for s in bank_stats]
    )
    provenance = {**provenance, "date": datetime.date.today().isoformat(), "hardware": hardware()}
    meta = {**meta, "provenance": provenance, "simulated_tokens_per_s": {k: round(v, 3) for k, v in scores.items()}}
    report = {"candidates": [{"id": t.name, **s} for t, s in zip(trees, stats)], "front": [trees[i].name for i in front], "simulated": scores}
    if baseline is not None:
        meta["baseline"] = {"name": baseline.name, "n_nodes": baseline.n_nodes, **summarize(measured[baseline.name])}
        report["baseline"] = meta["baseline"]
    return TopologyBank(bank_trees, bank_stats, policies, meta), report
