"""Acceptance traces: the machine-independent half of a bank, and exact decode simulation on them.

At temperature 0 the output does not depend on the tree, and a Hydra/Medusa head's draft at a
position depends only on the base model's state there and the tokens along the path. So for a
greedy continuation c[0..N-1] of a prompt, step position i (c[:i] committed, root c[i], feature h
at the last committed token) is described by

    ranks[i][d]  rank of the true token c[i+d+1] under head d, given h and the true path c[i..i+d]
                 (-1: not among the first `width`, outside the draft vocabulary, or past the end)
    p0[i]        the base model's top-1 probability at i (its argmax is c[i])
    entropy[i]   the entropy of that distribution
    chain[i][d]  top-1 probability of head d along the heads' own top-1 path (g_D = p0 * prod)

A tree accepts at i the root plus the longest prefix of ranks[i] that is one of its rank paths,
so a whole decode under any tree or policy follows exactly: i -> i + accepted(i). Only the cost
of a step with each tree depends on the machine (`bank.calibrate` measures it); `bank.record`
records traces through the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from entmtp.spec.policy import FEATURES, TauPolicy, path_value
from entmtp.spec.topology import Tree

WIDTH = 16  # ranks kept per head; no tree of ours has a node of rank >= 16


@dataclass
class Trace:
    """One calibration prompt's continuation, position by position (see the module docstring)."""

    prompt_tokens: int
    ranks: list[list[int]]  # (N, D)
    p0: list[float]  # (N,)
    entropy: list[float]  # (N,)
    chain: list[list[float]]  # (N, D)

    def __len__(self) -> int:
        return len(self.p0)

    def feature(self, name: str, depth: int) -> list[float]:
        """The policy's input at every position; each lies in [0, 1], larger = more confident."""
        if name == "p0":
            return list(self.p0)
        if name == "neg_entropy":
            return [math.exp(-h) for h in self.entropy]
        if name == "path_value":
            return [path_value(p, c[:depth]) for p, c in zip(self.p0, self.chain)]  # the engine's arithmetic, factor by factor
        raise ValueError(f"unknown feature {name!r} (expected one of {', '.join(FEATURES)})")

    def rank_path(self, i: int) -> tuple[int, ...]:
        out = []
        for r in self.ranks[i]:
            if r < 0:
                break
            out.append(r)
        return tuple(out)

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "ranks": self.ranks,
            "p0": [round(x, 7) for x in self.p0],
            "entropy": [round(x, 6) for x in self.entropy],
            "chain": [[round(x, 6) for x in row] for row in self.chain],
        }

    @classmethod
    def from_json(cls, raw: dict) -> "Trace":
        return cls(int(raw["prompt_tokens"]), [list(map(int, r)) for r in raw["ranks"]], list(map(float, raw["p0"])),
                   list(map(float, raw["entropy"])), [list(map(float, r)) for r in raw["chain"]])


def decode_with(tree: Tree, trace: Trace) -> tuple[int, int]:
    """(tokens, steps) of a decode with one static tree along `trace`."""
    have = set(tree.paths)
    n, i, tokens, steps = len(trace), 0, 0, 0
    while i < n:
        a = min(accepted_in(have, trace.rank_path(i)), n - i)
        tokens, steps, i = tokens + a, steps + 1, i + a
    return tokens, steps


# -- simulation -------------------------------------------------------------------------------------


@dataclass
class Tables:
    """Per tree and trace: tokens accepted at every position; features per trace."""

    trees: list[Tree]
    traces: list[Trace]
    accepted: list[list[list[int]]] = field(default_factory=list)  # [tree][trace][i]

    def __post_init__(self):
        paths = [[t.rank_path(i) for i in range(len(t))] for t in self.traces]
        for tree in self.trees:
            have = set(tree.paths)
            self.accepted.append([[accepted_in(have, p) for p in tp] for tp in paths])


def accepted_in(tree_paths: set, path: tuple[int, ...]) -> int:
    """Tokens a tree accepts at a position whose true rank path is `path` (root included)."""
    k = 0
    while k < len(path) and path[: k + 1] in tree_paths:
        k += 1
    return k + 1


@dataclass
class Outcome:
    tokens: int
    steps: int
    ms: float  # steps' cost plus prefill
    picks: list[int]  # tree index of every step, all traces in order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, self.ms) * 1e3

    @property
    def mean_accepted(self) -> float:
        return self.tokens / max(1, self.steps)


def simulate(tables: Tables, choose_factory: Callable[[], Callable[[float], int]], features: list[list[float]],
             step_ms: Sequence[float], prefill_ms_per_token: float = 0.0,
             reads: tuple[list[list[list[float]]], list[list[float]]] | None = None) -> Outcome:
    """Decode every trace under a policy: at i pick a tree from features[trace][i], jump by its acceptance.

    `reads` = (g, extra) for a policy on the path value, read as the engine reads it (up to the
    first value that settles the choice): g[trace][i] = [g_1, ..., g_d] at position i, and
    extra[k][tree] the cost of the chain through k heads beyond the tree's own; the policy reads up to the first g_k its chooser calls settled
    (`policy.Chooser`) and the step costs step_ms[tree] + extra[k][tree]. `features` is then unread.
    """
    tokens = steps = 0
    ms = 0.0
    picks: list[int] = []
    for j, trace in enumerate(tables.traces):
        choose, n, i = choose_factory(), len(trace), 0
        settled = getattr(choose, "settled", None)
        ms += prefill_ms_per_token * trace.prompt_tokens
        while i < n:
            if reads is None:
                k, cost = choose(features[j][i]), 0.0
            else:
                g = reads[0][j][i]
                d = next((d for d, v in enumerate(g, 1) if settled is not None and settled(v)), len(g))
                k = choose(g[d - 1])
                cost = reads[1][d][k]
            a = min(tables.accepted[k][j][i], n - i)
            picks.append(k)
            tokens, steps, ms, i = tokens + a, steps + 1, ms + step_ms[k] + cost, i + a
    return Outcome(tokens, steps, ms, picks)


def simulate_tau(tables: Tables, policies: Sequence[TauPolicy], features: list[list[float]], step_ms: Sequence[float],
                 prefill_ms_per_token: float = 0.0,
                 reads: tuple[list[list[list[float]]], list[list[float]]] | None = None) -> list[float]:
    """`simulate(...).ms` of every τ policy in `policies` at once, bit for bit: one decode per
    policy, vectorised over the policies (each keeps its own position, tree and ms), trace by trace
    and step by step with the same float additions in the same order. `features` and `reads` as in
    `simulate`. (The tokens of any decode are the traces' lengths.) A fit scores ~2,400 τ
    candidates per feature; one by one in Python that was most of a task's fit."""
    if not policies:
        return []
    small = np.array([p.small for p in policies])
    large = np.array([p.large for p in policies])
    on = np.array([p.tau_on for p in policies], dtype=np.float64)
    off = np.array([p.tau_off for p in policies], dtype=np.float64)
    cost = np.array(step_ms, dtype=np.float64)  # (T,)
    extra = None if reads is None else np.array(reads[1][1:], dtype=np.float64)  # (D, T): row d-1 for d heads read
    ms = np.zeros(len(policies))
    for j, trace in enumerate(tables.traces):
        n = len(trace)
        ms += prefill_ms_per_token * trace.prompt_tokens
        if not n:
            continue
        accepted = np.array([tables.accepted[k][j] for k in range(len(tables.trees))])  # (T, n)
        values = np.array(features[j] if reads is None else reads[0][j], dtype=np.float64)  # (n,) or (n, D)
        pos, tree = np.zeros(len(policies), dtype=np.int64), small.copy()
        live = np.arange(len(policies))
        while live.size:
            p, t = pos[live], tree[live]
            if reads is None:
                s = values[p]
            else:  # read head by head up to the first g_d that settles the choice (TauPolicy.chooser)
                g = values[p]  # (A, D)
                settled = g <= np.where(t == large[live], off[live], on[live])[:, None]
                d = np.where(settled.any(1), settled.argmax(1) + 1, g.shape[1])
                s = g[np.arange(len(live)), d - 1]
            t = np.where((t == large[live]) & (s <= off[live]), small[live], np.where(s > on[live], large[live], t))
            step = ms[live] + cost[t]
            ms[live] = step if reads is None else step + extra[d - 1, t]
            pos[live], tree[live] = p + np.minimum(accepted[t, p], n - p), t
            live = live[pos[live] < n]
    return ms.tolist()


def foresight_choices(tables: Tables, j: int, step_ms: Sequence[float], among: Sequence[int] | None = None) -> tuple[list[int], float]:
    """(tree at every position, ms of the fastest decode) of trace `j` for a policy that knew each
    step's accepted length before choosing: backwards over positions, best[i] = min over trees k of
    step_ms[k] + best[i + accepted(k, i)]; the first of `among` (default: every tree) on a tie."""
    among = list(range(len(tables.trees))) if among is None else list(among)
    n = len(tables.traces[j])
    best, choice = [0.0] * (n + 1), [0] * n
    for i in range(n - 1, -1, -1):
        best[i], choice[i] = min(((step_ms[k] + best[min(n, i + tables.accepted[k][j][i])], k) for k in among), key=lambda c: c[0])
    return choice, best[0]


def foresight(tables: Tables, step_ms: Sequence[float], prefill_ms_per_token: float = 0.0,
              among: Sequence[int] | None = None) -> Outcome:
    """The fastest decode of every trace that any per-step choice among the tables' trees (or the
    trees `among`) allows (`foresight_choices`): a ceiling on every policy over those trees, not a policy."""
    tokens, ms = 0, 0.0
    picks: list[int] = []
    for j, trace in enumerate(tables.traces):
        n = len(trace)
        choice, fastest = foresight_choices(tables, j, step_ms, among)
        ms += prefill_ms_per_token * trace.prompt_tokens + fastest
        i = 0
        while i < n:
            picks.append(choice[i])
            i = min(n, i + tables.accepted[choice[i]][j][i])
        tokens += n
    return Outcome(tokens, len(picks), ms, picks)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Rank correlation (average ranks for ties)."""

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(x) < 2:
        return 0.0
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else 0.0
