"""This machine's half of a bank (DESIGN.md, *Where the bank is fitted*): time a decode step with
each candidate tree where the engine runs, fit the policies (`fit.fit_task`), and cache the fit
under the machine's fingerprint (`machine.fingerprint`), so each machine measures once."""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from entmtp.bank.bank import TopologyBank
from entmtp.bank.fit import fit_task
from entmtp.config import CalibrateConfig, GenerationConfig, PhrasebookRule, Progress
from entmtp.machine import describe_fingerprint
from entmtp.model import forward
from entmtp.spec import drafting, verify
from entmtp.spec.engine import Engine, Strategy
from entmtp.spec.heads import DraftHeads
from entmtp.spec.phrasebook import Phrasebook, Reranker, Rule, forcer
from entmtp.spec.topology import Tree, compile_tree


def tree_key(tree: Tree) -> str:
    return json.dumps(tree.as_lists())


Turn = Callable[[], ContextManager]  # entered around each block of timed work: the machine is ours inside


def measure_costs(engine: Engine, heads: DraftHeads | None, trees: list[Tree], cfg: CalibrateConfig,
                  progress: Progress | None = None, turn: Turn = nullcontext,
                  book: Phrasebook | None = None, rule: Rule | None = None) -> tuple[dict[str, float], float, int]:
    """Median ms of one decode step with each tree (keyed by `tree_key`), prefill ms per token,
    and the context they were timed at (`cfg.context`, less where the model's positions run short).

    Real decode steps (schedule, draft, verify, accept, commit) after a `cfg.context`-token
    prompt. Within a round the trees take turns in blocks (`RoundRobin`): one untimed step, then
    `cfg.block` timed ones, so a burst of load on the machine hits every tree alike (timed a round
    per tree, two runs on this project's 2-core AMD EPYC put the 9-node tree at 140 and 113.5 ms)
    while each timed step follows a step of its own tree, as under a static policy or a τ
    switching between neighbours. (Turns of single steps timed a step right after, say, a 64-node
    one: on the AMD EPYC that made one token 9.3–11.6 ms instead of 8.8 and the 4-node tree 1.8×
    it instead of 2.1×, and a τ switching to 4 nodes measured 5–11% under its static tree.) One
    short untimed round first. EOS is ignored so every round takes its steps; the token values do
    not change the cost (with `book`, the phrasebook is asked at every node of the spine as when
    decoding, whatever it answers: under `rule` where it is a reranker, which runs at every node anyway). Each block runs inside `turn()`: a server lets its races in between blocks,
    never within one (a block's first step is untimed, so a pause costs no accuracy).
    """
    timer = Engine(engine.model)  # no EOS: every run decodes its full budget
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    unique = list({tree_key(t): t for t in trees}.values())
    bank = TopologyBank.of(*unique)
    run = cfg.block + 1  # a block: one untimed step after the previous tree, then cfg.block timed
    blocks = max(1, -(-cfg.steps // cfg.block))
    strategy = Strategy("timing", bank, RoundRobin(len(unique), run), heads if bank.max_depth else None, book, timing_rule(rule))
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
        block = [None]
        while block and len(records) < n:
            with turn():
                block = list(itertools.islice(steps, min(run, n - len(records))))
            records += block
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
    return costs, statistics.median(prefill) / context, context


def measure_context_cost(engine: Engine, heads: DraftHeads | None, trees: list[Tree], cfg: CalibrateConfig,
                         turn: Turn = nullcontext, book: Phrasebook | None = None, rule: Rule | None = None) -> dict[str, Any]:
    """How a step's cost grows with its context (`bank.predict`): the plain step and the largest
    tree timed at `cfg.context` and at `cfg.short_context`, the two contexts taking turns round by
    round (long, short, short, long, ...) so that the machine's drift hits both alike; per tree
    size, ms per extra context token (never below 0), and the prefill of either context's prompt.
    (Timed one context after the other, two calibrations on the 2-core AMD EPYC read the 64-node
    tree 1-2 ms *cheaper* at 192 tokens than at 32, when interleaved runs put it ~8 ms dearer.)"""
    small, big = min(trees, key=lambda t: t.n_nodes), max(trees, key=lambda t: t.n_nodes)
    pair = [small, big] if tree_key(small) != tree_key(big) else [small]
    runs: dict[str, list[tuple[dict[str, float], float, int]]] = {"long": [], "short": []}
    long_ctx = cfg.context
    for r in range(max(1, cfg.rounds)):
        for which in (("long", "short") if r % 2 == 0 else ("short", "long")):
            context = cfg.context if which == "long" else min(cfg.short_context, long_ctx - 1)
            runs[which].append(measure_costs(engine, heads, pair, replace(cfg, context=context, rounds=1), None, turn, book, rule))
            if which == "long":
                long_ctx = runs["long"][-1][2]  # the context the model had room for

    def median(which: str) -> tuple[dict[str, float], float, int]:
        got = runs[which]
        costs = {k: statistics.median(run[0][k] for run in got) for k in got[0][0]}
        return costs, statistics.median(run[1] for run in got), got[0][2]

    (long_ms, long_prefill, long_ctx), (short_ms, short_prefill, short_ctx) = median("long"), median("short")
    span = max(1, long_ctx - short_ctx)
    slopes = [max(0.0, (long_ms[tree_key(t)] - short_ms[tree_key(t)]) / span) for t in (small, big)]
    return {"contexts": [short_ctx, long_ctx], "nodes": [small.n_nodes, big.n_nodes],
            "slope_ms_per_token": [round(x, 5) for x in slopes],
            "prefill": [[short_ctx, round(short_prefill * short_ctx, 3)], [long_ctx, round(long_prefill * long_ctx, 3)]]}


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


def timing_rule(rule: Rule | None) -> Rule:
    """The rule a timing run drafts under: a bank's reranker (it runs at every node anyway), else a
    share rule that asks the phrasebook at every node, as a real text's might."""
    return rule if isinstance(rule, Reranker) else PhrasebookRule(max_head_p=2.0, min_share=0.0)


def forward_between(engine: Engine, context: int = 192) -> Callable[[], None]:
    """One base-model step (a single-token verification after `context` cached tokens, its entry
    dropped again): what runs between two decode steps' drafting, and leaves the caches as it does."""
    model = engine.model
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_output_embeddings().weight.device
    context = max(1, min(context, engine.max_positions - 2))
    ids = torch.randint(vocab // 8, vocab, (1, context), generator=torch.Generator().manual_seed(1)).to(device)
    cache = engine.new_cache()
    with torch.inference_mode():
        forward.forward(model, cache, ids, torch.arange(context, device=device)[None], None)
    one = compile_tree([], "n1")

    @torch.inference_mode()
    def step() -> None:
        verify.tree_forward(model, cache, one, ids[0, -1:], context)
        forward.commit(cache, context, [], 1)

    return step


@torch.inference_mode()
def measure_chain(heads: DraftHeads | None, depth: int, reps: int = 15, book: Phrasebook | None = None,
                  rule: Rule | None = None, between: Callable[[], None] | None = None) -> list[float]:
    """Median ms of the heads' top-1 chain to each depth 0..depth (what the path-value feature costs),
    run as the engine reads it: in one call to that depth (`drafting.top1_chain`; the engine's
    policy reads its heads in one call that stops itself where the value settles the choice), each
    call after `between()` (untimed; `forward_between`: a base-model step, as in a decode loop,
    where the heads' weights then come partly from memory: back to back they stay cached, on the
    2-core AMD EPYC ~0.2 ms a head against ~0.5 in the loop). With `book`, asking it at every node
    as drafting does (under `rule` where it is a reranker, else a share rule that always asks),
    over a text of random tokens."""
    if heads is None or depth == 0:
        return [0.0] * (depth + 1)
    w = heads._base["lm_head"].weight
    feature = torch.randn(heads.hidden_size, dtype=w.dtype, device=w.device)
    force = None
    if book is not None:
        g = torch.Generator().manual_seed(0)
        text = book.context(torch.randint(1, w.shape[0], (128,), generator=g).tolist())
        force = forcer(text, timing_rule(rule), heads.draft_vocab)
    times: list[list[float]] = [[] for _ in range(depth + 1)]
    for rep in range(reps + 2):
        for d in range(1, depth + 1):
            if between is not None:
                between()
            t0 = time.perf_counter()
            drafting.top1_chain(heads, feature, 1, d, None, force)
            if w.device.type == "cuda":
                torch.cuda.synchronize(w.device)
            if rep >= 2:
                times[d].append((time.perf_counter() - t0) * 1e3)
    return [0.0] + [statistics.median(t) for t in times[1:]]


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
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")  # a server's threads may save at once
    tmp.write_text(json.dumps(fit, indent=1))
    tmp.replace(path)


def time_and_fit(engine: Engine, heads: DraftHeads, banks: dict[str, TopologyBank], fp: dict[str, Any],
              cfg: CalibrateConfig = CalibrateConfig(), baseline: Tree | None = None,
              progress: Progress | None = None, turn: Turn = nullcontext, book: Phrasebook | None = None) -> dict[str, dict[str, Any]]:
    """Time every candidate tree of `banks` (and `baseline`) here and fit each task. -> {task: fit}.
    `book`: the phrasebook the banks draft with (steps are timed asking it)."""
    t0 = time.perf_counter()
    trees = [t for b in banks.values() for t in b.trees] + ([baseline] if baseline else [])
    rule = next((b.phrasebook_rule for b in banks.values() if b.phrasebook_rule is not None), None)
    costs, prefill, context = measure_costs(engine, heads, trees, cfg, progress, turn, book, rule)
    context_cost = measure_context_cost(engine, heads, trees, cfg, turn, book, rule)
    with turn():
        chain = measure_chain(heads, max(t.max_depth for t in trees), book=book, rule=rule, between=forward_between(engine, cfg.context))
    measured_s = time.perf_counter() - t0
    out = {}
    for task, bank in banks.items():
        t1 = time.perf_counter()
        fit = fit_task(bank.trees, bank.traces, [costs[tree_key(t)] for t in bank.trees], prefill, cfg.grid,
                       (baseline, costs[tree_key(baseline)]) if baseline else None, chain)
        fit_s = time.perf_counter() - t1
        out[task] = {
            "hardware": describe_fingerprint(fp),
            "fingerprint": fp,
            "date": datetime.date.today().isoformat(),
            "seconds": round(measured_s * len(bank.trees) / max(1, len(trees)) + fit_s, 2),
            "context": context,
            **fit,
            "context_cost": context_cost,
        }
    return out


def known_fit(bank: TopologyBank, fp: dict[str, Any], cache_root: Path, mode: str = "auto") -> dict[str, Any] | None:
    """The fit `resolve_fits` would use without timing anything, or None when it must calibrate."""
    if mode == "shipped" or mode == "auto" and bank.shipped_fit.get("fingerprint") == fp:
        return bank.shipped_fit
    return load_fit(fit_cache_file(cache_root, bank, fp)) if mode == "auto" else None


def resolve_fits(engine: Engine, heads: DraftHeads, banks: dict[str, TopologyBank], fp: dict[str, Any], cache_root: Path,
                 mode: str = "auto", cfg: CalibrateConfig = CalibrateConfig(), baseline: Tree | None = None,
                 progress: Progress | None = None, turn: Turn = nullcontext, book: Phrasebook | None = None) -> dict[str, TopologyBank]:
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
        for task, fit in time_and_fit(engine, heads, missing, fp, cfg, baseline, progress, turn, book).items():
            save_fit(fit_cache_file(cache_root, missing[task], fp), fit)
            out[task] = missing[task].with_fit(fit)
    return out
