"""Building a bank (DESIGN.md, *Where the bank is fitted*): the portable half, once. Greedy
continuations of the calibration prompts, their per-position acceptance traces (`record`),
candidate trees grown greedily from those traces, then a first fit where it is built
(`calibrate`). Stages checkpoint to JSON in a work folder and resume."""

from __future__ import annotations

import datetime
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterable

from entmtp.bank.bank import TopologyBank, phrasebook_rule, rule_provenance
from entmtp.bank.calibrate import time_and_fit
from entmtp.bank.record import record_all
from entmtp.bank.traces import accepted_in
from entmtp.config import ROOT, BankBuildConfig, CalibrateConfig, PhrasebookRule, Progress
from entmtp.model import serve
from entmtp.spec.engine import Engine
from entmtp.spec.heads import DraftHeads
from entmtp.spec.phrasebook import Phrasebook, Reranker, Rule
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import Tree, compile_tree

RankPath = tuple[int, ...]


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
    book: Phrasebook | None = None,
    turn=None,
) -> TopologyBank:
    """Traces, candidate trees, and this machine's fit as the bank's shipped fit (resumable).

    `answers` (a `data.answers.AnswerStore`) supplies and keeps the greedy continuations. With a
    phrasebook the traces are drafted with it under `meta["provenance"]["phrasebook"]`'s rule."""
    rule = phrasebook_rule(meta["provenance"]) or PhrasebookRule()
    key = {"n_prompts": len(calib_prompts), "cfg": cfg.__dict__ | {"sizes": list(cfg.sizes)},
           "heads": meta["provenance"].get("heads_sha256"), "phrasebook": meta["provenance"].get("phrasebook")}
    if stages.load("stage0") not in (None, key):
        raise ValueError(f"{stages.work} holds a build with other settings; pass --fresh or another --work")
    stages.save("stage0", key)
    traces = record_all(engine, heads, calib_prompts, cfg.calib_new_tokens, cfg.max_depth,
                        stages.load("stage1"), lambda t: stages.save("stage1", t), progress, answers, book, rule)
    paths = [t.rank_path(i) for t in traces for i in range(len(t))]
    trees = candidates(paths, cfg)
    bank = TopologyBank(trees, [{} for _ in trees], {"static": StaticPolicy(0)}, meta, traces)
    fit = time_and_fit(engine, heads, {meta["task"]: bank}, fp, calib, baseline, progress, turn or nullcontext, book)[meta["task"]]
    bank.shipped_fit = fit
    return bank.with_fit(fit)


def calibration_prompts(task: str, prompts_file: str | None, n: int) -> tuple[list[str], str]:
    """The first `n` prompts a bank build traces (a prompt file's, else the task's calib split),
    and how the bank's provenance names them."""
    from entmtp.data.prompts import prompts, read_prompt_file

    if prompts_file:
        texts = [it["prompt"] for it in read_prompt_file(prompts_file, default_task=task)][:n]
        return texts, f"{prompts_file} (first {len(texts)} prompts)"
    if task == "chat":  # visitors type short everyday requests as well as ShareGPT's kind: half of each, alternating
        from entmtp.data import everyday

        share, own = prompts(task, "calib", n - n // 2), everyday.prompts("calib")[: n // 2]
        texts = [p for pair in zip(share, own) for p in pair] + share[len(own):]
        return texts, (f"chat calib split, first {len(share)} prompts, alternating with the first {len(own)} composed "
                       "everyday calib requests (entmtp/data/prompts.py, entmtp/data/everyday.py)")
    texts = prompts(task, "calib", n)
    return texts, f"{task} calib split, first {len(texts)} prompts (entmtp/data/prompts.py)"


def build_task_bank(rt, task: str, texts: list[str], calibration: str, cfg: BankBuildConfig, work: Path | None,
                    fresh: bool, command: str, progress: Progress | None = None,
                    rule: Rule | None = PhrasebookRule(), turn=None, answers="repository",
                    calib: CalibrateConfig | None = None) -> TopologyBank:
    """`build_bank` for a loaded runtime (`runtime.Runtime`): its Hydra heads, Hydra's
    default tree scored beside the candidates, provenance filled in. Stages checkpoint under
    `work` (default: checkpoints/bank/<model>/<task>). The default model's greedy continuations
    come from, and go to, the repository's answer store. `rule`: draft the traces with the model's
    phrasebook under it (None: the heads alone). `turn`: each block of timing runs inside it (a
    server's races go between two, `calibrate.measure_costs`); `answers`: where the greedy
    continuations come from and go to (default: the repository's store, for the default model)."""
    from entmtp.data.answers import repo_store

    heads = rt.heads("hydra")
    work = Path(work) if work else ROOT / "checkpoints" / "bank" / rt.slug / task
    provenance = {
        "model": rt.name,
        "weights": getattr(rt, "weights", ""),
        "heads_sha256": heads.provenance.get("sha256", "unknown"),
        "heads_numerics": heads.numerics,  # how the traces' heads computed (the engine drafts alike with the same kernels)
        "base_kernels": serve.label(rt.model),  # the base model's linears when the traces were recorded
        "calibration": calibration,
        "traces": f"{cfg.calib_new_tokens} greedy tokens per prompt, ranks of the true token under each head (top {16})",
        "command": command,
        "date": datetime.date.today().isoformat(),
        "hardware": "traces: any machine (the extension's arithmetic, one order on every instruction set; temperature 0); shipped fit: see fit.hardware",
    }
    book = rt.phrasebook() if rule is not None else None
    if book is not None:
        provenance["phrasebook"] = rule_provenance(rule)
        how = "its reranker's best two" if isinstance(rule, Reranker) else "its guess where the share rule lets it"
        provenance["traces"] += (f"; drafted with the phrasebook ({book.n_tokens:,} tokens of stored answers to training "
                                 f"prompts): {how} first on the spine")
    ids = [rt.encode(t) for t in texts]
    baseline = rt.strategy("hydra", task).trees[0]  # Hydra's default tree, scored for comparison
    return build_bank(rt.engine, heads, ids, cfg, Stages(work, fresh), {"model": rt.slug, "task": task, "provenance": provenance},
                      rt.fingerprint, calib or rt.calibrate_config, progress=progress, baseline=baseline,
                      answers=repo_store(rt.name, rt.arithmetic) if answers == "repository" else answers, book=book, turn=turn)
