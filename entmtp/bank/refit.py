"""Refitting a bank's policies while serving, at the live costs, in a millisecond.

A policy's simulated decode of the bank's traces does not depend on the costs: which tree it picks
at each position, how many heads it reads there and how far it jumps follow from the traces alone.
Only the decode's milliseconds do, and they are a sum over its steps of the step cost of the tree
picked plus the heads' chain read beyond that tree's depth. So `Usage` simulates every candidate
policy once (vectorised like `traces.simulate_tau`) and keeps, per candidate, how many steps it
takes with each tree after reading each number of heads. A fit at any costs is then one
matrix-vector product and an argmax per policy: the same search as `fit.fit_task` (static over
every tree; τ over pairs of front trees and thresholds at the feature's quantiles, kept only where it
beats the static tree by `fit.TAU_MIN_GAIN`), with ladders of up to three rungs over front trees in
place of `fit_task`'s coordinate ascent. The feature and the heads it reads stay the fit's.

`LiveFit` is a bank served under live costs: every `CHECK_EVERY` steps it measures how far the costs
of now depart from the ones its policies were fitted at (`LiveCosts.departure`), and past `DEPART`
on `CONFIRM` checks in a row it refits (`refit`) and serves the new policies from the next step. The
refit's costs become the reference, so the same costs never refit twice (hysteresis). Now and then
it times a front tree no policy has run lately (`probe`), at most two steps in `PROBE_EVERY`: at
temperature 0 the tree does not change the output, and at T > 0 sampling stays exact.

No torch: arithmetic on traces and costs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from entmtp.bank.bank import TopologyBank, pareto, policies_json
from entmtp.bank.fit import TAU_MIN_GAIN, _quantiles
from entmtp.bank.live import LiveCosts
from entmtp.bank.traces import Tables, decode_with
from entmtp.spec.policy import LadderPolicy, Policy, StaticPolicy, TauPolicy, path_value
from entmtp.spec.topology import Tree

CHECK_EVERY = 16  # steps between two looks at the live costs (a look costs ~0.1 ms: ~6 µs a step)
DEPART = 0.15  # departure of the costs' shape from the fit's that calls for a refit (docs/banks.md, *Refit while serving*)
CONFIRM = 2  # looks in a row past DEPART before a refit: one noisy window does not refit
PROBE_EVERY = 64  # at most two steps in this many run a front tree not timed lately (a probe: one untimed, one timed)
ADOPT_GAIN = 0.02  # a refit's policy replaces the one served only where predicted this much faster at the costs of now
GRID = 12  # feature quantiles tried as thresholds, as `calibrate` does
LADDER_GRID = 6  # quantiles for the two thresholds of a three-rung ladder (the pairs take all of GRID)


@dataclass
class _Family:
    """Candidate policies of one kind and, per candidate, its steps by (heads read, tree)."""

    policies: list[Policy]
    trees: np.ndarray  # (C, T): whether the candidate can pick each tree
    counts: np.ndarray  # (C, D + 1, T): steps after reading d heads (0: none) with tree t

    @classmethod
    def of(cls, policies: list[Policy], picks: list[tuple[int, ...]], counts: np.ndarray, T: int) -> "_Family":
        member = np.zeros((len(policies), T), dtype=bool)
        for c, ts in enumerate(picks):
            member[c, list(ts)] = True
        return cls(policies, member, counts.reshape(len(policies), int(np.prod(counts.shape[1:]))))  # no candidate: (0, ...)


class Usage:
    """Every candidate policy of a bank, simulated once on its traces (module docstring)."""

    def __init__(self, trees: list[Tree], traces: list, feature: str, depth: int, baseline: Tree | None = None):
        self.trees, self.feature, self.depth = list(trees), feature, depth
        self.baseline = baseline
        self.D = max(t.max_depth for t in trees)
        all_trees = self.trees + ([baseline] if baseline is not None else [])
        self.tables = Tables(all_trees, traces)
        self.tokens = sum(len(t) for t in traces)
        self.prompt_tokens = sum(t.prompt_tokens for t in traces)
        T = len(self.trees)
        self.static_steps = np.array([sum(decode_with(t, tr)[1] for tr in traces) for t in all_trees], dtype=np.float64)
        reads = feature == "path_value"
        d = depth or self.D
        if reads:
            self.values = [np.array([[path_value(p, c[:k]) for k in range(1, d + 1)] for p, c in zip(t.p0, t.chain)], dtype=np.float64)
                           .reshape(len(t), d) for t in traces]
            flat = [v for t in traces for v in t.feature(feature, d)]
        else:
            self.values = [np.array(t.feature(feature, 0), dtype=np.float64) for t in traces]
            flat = [v for t in traces for v in t.feature(feature, 0)]
        grid = _quantiles(flat, GRID)
        coarse = _quantiles(flat, LADDER_GRID)
        pairs = [(a, b) for a in range(T) for b in range(a + 1, T)]
        taus = [TauPolicy(a, b, on, off, feature, depth) for a, b in pairs for on in grid for off in grid if off <= on]
        ladders = ([LadderPolicy((a, b), (x,), feature, depth) for a, b in pairs for x in grid]
                   + [LadderPolicy((a, b, c), (x, y), feature, depth) for a, b in pairs for c in range(b + 1, T)
                      for i, x in enumerate(coarse) for y in coarse[i + 1:]])
        self._known: dict[Policy, np.ndarray] = {}
        self.tau = _Family.of(taus, [(p.small, p.large) for p in taus], self._count(taus), T)
        self.ladder = _Family.of(ladders, [p.trees for p in ladders], self._count(ladders), T)
        self._index = {p: (fam, k) for fam in (self.tau, self.ladder) for k, p in enumerate(fam.policies)}

    def _count(self, pols: list[Policy]) -> np.ndarray:
        """Steps by (heads read, tree) of each policy's decode of every trace, all at once: `simulate`'s
        decode (and `simulate_tau`'s, for τ), vectorised over the policies."""
        C, T, D = len(pols), len(self.trees), self.D
        out = np.zeros(C * (D + 1) * T, dtype=np.float64)
        if not C:
            return out.reshape(C, D + 1, T)
        tau = isinstance(pols[0], TauPolicy)
        if tau:
            lo = np.array([p.small for p in pols]); hi = np.array([p.large for p in pols])
            on = np.array([p.tau_on for p in pols]); off = np.array([p.tau_off for p in pols])
        else:  # rungs and thresholds padded to the longest ladder's (a one-rung ladder settles at its first head)
            W = max(1, max(len(p.thresholds) for p in pols))
            rung = np.array([(*p.trees, *(p.trees[-1:] * (W + 1 - len(p.trees)))) for p in pols])  # (C, W + 1)
            thr = np.array([(*p.thresholds, *([np.inf] * (W - len(p.thresholds)))) for p in pols])  # (C, W)
        reads = self.feature == "path_value"
        hits = []
        for j, trace in enumerate(self.tables.traces):
            n = len(trace)
            if not n:
                continue
            accepted = np.array([self.tables.accepted[k][j] for k in range(T)])  # (T, n)
            values = self.values[j]
            pos = np.zeros(C, dtype=np.int64)
            cur = lo.copy() if tau else rung[:, 0].copy()
            live = np.arange(C)
            while live.size:
                p = pos[live]
                if reads:  # read head by head up to the first value that settles the choice (the chooser's `settled`)
                    g = values[p]  # (A, d)
                    if tau:
                        settled = g <= np.where(cur[live] == hi[live], off[live], on[live])[:, None]
                    else:
                        settled = g < thr[live, :1]
                    d = np.where(settled.any(1), settled.argmax(1) + 1, g.shape[1])
                    s = g[np.arange(live.size), d - 1]
                else:
                    s, d = values[p], np.zeros(live.size, dtype=np.int64)
                if tau:
                    t = cur[live]
                    t = np.where((t == hi[live]) & (s <= off[live]), lo[live], np.where(s > on[live], hi[live], t))
                    cur[live] = t
                else:
                    t = rung[live, (s[:, None] >= thr[live]).sum(1)]
                hits.append((live * (D + 1) + d) * T + t)
                pos[live] = p + np.minimum(accepted[t, p], n - p)
                live = live[pos[live] < n]
        if hits:
            out += np.bincount(np.concatenate(hits), minlength=out.size)
        return out.reshape(C, D + 1, T)

    def counts_of(self, policy: Policy) -> np.ndarray:
        """(D + 1, T) steps of any policy's decode, kept: what a policy served now would cost at new
        costs, to weigh a refit against. A candidate's are looked up; a static tree, or one tree on
        another feature (a refit's one-tree policies read p0), takes the static tree's steps reading no
        head; any other τ or ladder on the bank's feature is simulated as the candidates were."""
        if policy in self._known:
            return self._known[policy]
        if policy in self._index:  # a candidate: simulated already
            fam, k = self._index[policy]
            return fam.counts[k].reshape(self.D + 1, len(self.trees))
        if isinstance(policy, StaticPolicy) or (policy.feature, policy.depth) != (self.feature, self.depth):
            picks = {policy.tree} if isinstance(policy, StaticPolicy) else {policy.small, policy.large} if isinstance(policy, TauPolicy) else set(policy.trees)
            if len(picks) != 1:
                raise ValueError(f"{policy}: a policy on {policy.feature} through {policy.depth} heads, the bank's fit reads "
                                 f"{self.feature} through {self.depth}: refit the bank")
            tree = picks.pop()
            out = np.zeros((self.D + 1, len(self.trees)))
            out[0, tree] = self.static_steps[tree]
        else:
            out = self._count([policy])[0]
        self._known[policy] = out
        return out

    def cost_matrix(self, step_ms: list[float], chain_ms: list[float]) -> np.ndarray:
        """(D + 1, T): a step's ms with tree t after reading d heads: its step cost plus the chain
        read beyond its own depth (`fit_task`'s `chain_extra`)."""
        T, top = len(self.trees), len(chain_ms) - 1
        m = np.tile(np.asarray(step_ms, dtype=np.float64), (self.D + 1, 1))
        if chain_ms:
            for d in range(1, self.D + 1):
                for t, tree in enumerate(self.trees):
                    m[d, t] += max(0.0, chain_ms[min(d, top)] - chain_ms[min(tree.max_depth, top)])
        return m

    def fit(self, step_ms: list[float], chain_ms: list[float], prefill_ms_per_token: float,
            baseline_ms: float | None = None, current: dict[str, Policy] | None = None) -> dict[str, Any]:
        """Static, ladder and τ at these costs, as `fit_task` chooses them (module docstring), with
        what a prediction needs (`per_method`, `predicted_tokens_per_s`). A policy of `current`
        (served now) stays unless the new one is predicted ADOPT_GAIN faster at these costs."""
        T = len(self.trees)
        m = self.cost_matrix(step_ms, chain_ms)
        prefill = prefill_ms_per_token * self.prompt_tokens
        static_ms = prefill + self.static_steps[:T] * np.asarray(step_ms)
        static_tps = self.tokens / static_ms * 1e3
        mean_acc = self.tokens / self.static_steps
        front = sorted(pareto([(step_ms[i], mean_acc[i]) for i in range(T)]), key=lambda i: self.trees[i].n_nodes)
        allowed = np.zeros(T, dtype=bool)
        allowed[front] = True
        st = int(np.argmax(static_tps))

        def best(fam: _Family) -> tuple[int, float]:
            tps = self.tokens / (prefill + fam.counts @ m.ravel()) * 1e3
            ok = ~(fam.trees & ~allowed).any(1)  # front trees only
            if not ok.any():
                return -1, -np.inf
            tps = np.where(ok, tps, -np.inf)
            k = int(np.argmax(tps))
            return k, float(tps[k])

        k_tau, tau_tps = best(self.tau)
        k_lad, lad_tps = best(self.ladder)
        one = np.zeros((self.D + 1, T))  # a one-tree policy's steps: the static tree's, reading no head
        one[0, st] = self.static_steps[st]
        chosen = {"static": (StaticPolicy(st), float(static_tps[st]), one)}
        if lad_tps > static_tps[st] + 1e-9:
            chosen["ladder"] = (self.ladder.policies[k_lad], lad_tps, self.ladder.counts[k_lad].reshape(self.D + 1, T))
        else:
            chosen["ladder"] = (LadderPolicy((st,), (), "p0"), float(static_tps[st]), one)
        if tau_tps > static_tps[st] * (1 + TAU_MIN_GAIN) + 1e-9:
            chosen["tau"] = (self.tau.policies[k_tau], tau_tps, self.tau.counts[k_tau].reshape(self.D + 1, T))
        else:
            chosen["tau"] = (TauPolicy(st, st, 1.0, 1.0, "p0", 0), float(static_tps[st]), one)
        for name, pol in (current or {}).items():  # what the policies served now do at these costs
            counts = self.counts_of(pol)
            tps = self.tokens / (prefill + float((counts * m).sum())) * 1e3
            if name in chosen and chosen[name][1] < tps * (1 + ADOPT_GAIN):
                chosen[name] = (pol, tps, counts)
        per_method: dict[str, dict[str, float]] = {}
        predicted: dict[str, float] = {}
        if self.trees[0].n_nodes == 1:  # plain decoding: the one-node tree's steps (as `fit_task` has it)
            per_method["ar"] = {"mean_accepted": 1.0, "step_ms": round(float(step_ms[0]), 4), "nodes": 1.0}
            predicted["ar"] = round(float(static_tps[0]), 3)
        if self.baseline is not None and baseline_ms is not None:
            steps = self.static_steps[T]
            predicted["hydra"] = round(float(self.tokens / (prefill + steps * baseline_ms) * 1e3), 3)
            per_method["hydra"] = {"mean_accepted": round(self.tokens / steps, 4), "step_ms": round(baseline_ms, 4),
                                   "nodes": float(self.baseline.n_nodes)}
        nodes = np.array([t.n_nodes for t in self.trees], dtype=np.float64)
        for name, (pol, tps, counts) in chosen.items():
            steps = counts.sum()
            per_method[f"entmtp-{name}"] = {"mean_accepted": round(self.tokens / steps, 4),
                                            "step_ms": round(float((counts * m).sum()) / steps, 4),
                                            "nodes": round(float(counts.sum(0) @ nodes) / steps, 3)}
            predicted[f"entmtp-{name}"] = round(tps, 3)
        per_tree = {t.name: {"mean_accepted": round(float(mean_acc[i]), 4), "step_ms": round(float(step_ms[i]), 3),
                             "measured_ms": round(float(step_ms[i]), 3), "tokens_per_s": round(float(static_tps[i]), 3)}
                    for i, t in enumerate(self.trees)}
        return {"trees": per_tree, "front": [self.trees[i].name for i in front],
                "policies": policies_json({k: v[0] for k, v in chosen.items()}, self.trees),
                "predicted_tokens_per_s": predicted, "per_method": per_method,
                "predicted_mean_accepted": {k: v["mean_accepted"] for k, v in per_method.items() if k.startswith("entmtp-")}}


def policy_text(pol: dict[str, Any], name: str) -> str:
    """A policy as one short line: `n4-d3`, `n2-d1 < n4-d3 at 0.153`, `n2-d1 <-> n4-d3 (on 0.153, off 0.108)`."""
    p = pol[name]
    if "tree" in p:
        return p["tree"]
    if "trees" in p:
        return " < ".join(p["trees"]) + (f" at {', '.join(f'{x:.3f}' for x in p['thresholds'])}" if p["thresholds"] else "")
    if p["small"] == p["large"]:
        return p["small"]
    return f"{p['small']} <-> {p['large']} (on {p['tau_on']:.3f}, off {p['tau_off']:.3f})"


class LiveFit:
    """A bank served under live costs: the policies it serves now, refitted as the costs move
    (module docstring). One per bank in a runtime; requests read it, each decode's `Session` checks it."""

    def __init__(self, bank: TopologyBank, live: LiveCosts, baseline: Tree | None = None):
        self.bank, self.live, self.baseline = bank, live, baseline
        self.fit = bank.fit  # the fit served now: the bank's until the first refit
        self.served = bank  # the bank under it
        self.refits: list[dict[str, Any]] = []
        self.marks: list[tuple[float, str]] = []  # (the live costs' clock, what the refit chose), for a chart over time
        self.usage: Usage | None = None  # every candidate's decode of the traces, simulated once (`wait`)
        self._built = threading.Event()
        if bank.traces:  # ~0.3-0.7 s for a shipped bank: off the thread that serves, which refits once it is done
            threading.Thread(target=self._build, name="entmtp-refit-usage", daemon=True).start()
        else:
            self._built.set()
        self._above = 0  # looks in a row past DEPART
        self._lock = threading.Lock()
        self._probe_turn = 0

    def _build(self) -> None:
        f = self.bank.fit
        try:
            usage = Usage(self.bank.trees, self.bank.traces, f.get("feature", "p0"), int(f.get("feature_depth") or 0), self.baseline)
            for pol in self.bank.policies.values():  # the policies served first, weighed at the first refit: here, not in a decode
                usage.counts_of(pol)
            self.usage = usage
        finally:
            self._built.set()

    def wait(self) -> "LiveFit":
        """Until the candidates' simulation is done (a benchmark waits, outside its clocks; a race does not)."""
        self._built.wait()
        return self

    def marks_ago(self) -> list[tuple[float, str]]:
        """Each refit as (seconds ago, what it chose): `plots.step_cost_figure`'s markers."""
        now = self.live.clock()
        return [(now - t, what) for t, what in self.marks]

    def policy(self, name: str) -> Policy:
        return self.served.policy(name)

    def look(self, step: int, method: str) -> dict[str, Any] | None:
        """Every CHECK_EVERY steps: the departure now; past DEPART on CONFIRM looks in a row, a
        refit. Returns the refit's record (it is in `refits` too) or None."""
        if step % CHECK_EVERY or not self._built.is_set() or self.usage is None:
            return None
        with self._lock:
            gone = self.live.departure(self.fit)
            self._above = self._above + 1 if gone is not None and gone > DEPART else 0
            if self._above < CONFIRM:
                return None
            self._above = 0
            return self._refit(gone, method, step)

    def _refit(self, gone: float, method: str, step: int) -> dict[str, Any] | None:
        started = time.perf_counter()
        costs = self.live.costs_now(self.fit, [t.name for t in self.bank.trees])
        if costs is None:
            return None
        old = self.fit
        current = {k: self.served.policy(k) for k in ("static", "ladder", "tau")}
        new = self.usage.fit(costs["step_ms"], costs["chain_ms"], costs["prefill_ms_per_token"], costs["baseline_ms"], current)
        one, ps = costs["one_node_scale"], costs["prefill_scale"]
        cost = old.get("context_cost")
        fit = {**{k: v for k, v in old.items() if k not in ("ceiling", "features", "degenerate")}, **new,
               "prefill_ms_per_token": round(costs["prefill_ms_per_token"], 4), "chain_ms": [round(c, 3) for c in costs["chain_ms"]]}
        if cost:
            fit["context_cost"] = {**cost, "slope_ms_per_token": [v * one for v in cost["slope_ms_per_token"]],
                                   "prefill": [[n, ms * ps] for n, ms in cost["prefill"]]}
        if old.get("baseline") and costs["baseline_ms"] is not None:
            fit["baseline"] = {**old["baseline"], "step_ms": round(costs["baseline_ms"], 3),
                               "tokens_per_s": new["predicted_tokens_per_s"].get("hydra", old["baseline"].get("tokens_per_s"))}
        name = method.split("-", 1)[1] if method.startswith("entmtp-") else "tau"
        event = {"step": step, "departure": round(gone, 4), "why": f"the costs' shape departed {gone:.0%} from the fit's (> {DEPART:.0%} on {CONFIRM} looks)",
                 "measured": costs["measured"], "old": policy_text(old["policies"], name), "new": policy_text(new["policies"], name),
                 "changed": old["policies"].get(name) != new["policies"].get(name),
                 "predicted": new["predicted_tokens_per_s"].get(method), "at": time.time()}
        fit["refit"] = {k: event[k] for k in ("departure", "why", "measured", "at")}
        self.fit, self.served = fit, self.bank.with_fit(fit)
        event["refit_ms"] = round((time.perf_counter() - started) * 1e3, 3)
        self.refits.append(event)
        self.marks.append((self.live.clock(), event["new"] if event["changed"] else "kept " + event["old"]))
        return event

    def probe(self, step: int) -> int | None:
        """The tree to time at this step instead of the policy's pick, or None: at most one step in
        PROBE_EVERY, a front tree of the served fit with too few recent steps, in turns."""
        if step % PROBE_EVERY or not self.bank.traces:
            return None
        front = self.fit.get("front") or []
        cold = [n for n in front if self.live.tree_ms(self.fit, n) is None]
        if not cold:
            return None
        self._probe_turn = (self._probe_turn + 1) % len(cold)
        return self.bank.index(cold[self._probe_turn])

    def session(self, method: str) -> "Session":
        return Session(self, method)


class Session:
    """One decode's view of a `LiveFit`: the engine asks it each step whether the policy changed
    (a refit) and whether to time another tree (a probe)."""

    def __init__(self, served: LiveFit, method: str):
        self.served, self.method = served, method
        self.name = method.split("-", 1)[1]
        self._again: int | None = None

    def look(self, step: int) -> tuple[Policy | None, dict[str, Any] | None]:
        """(the policy to serve from this step on, the refit's record), or (None, None)."""
        event = self.served.look(step, self.method)
        if event is None:
            return None, None
        return (self.served.policy(self.name) if event["changed"] else None), event

    def probe(self, step: int) -> int | None:
        """A probe runs its tree two steps in a row: the first pays for the tree before it and is
        not timed (`LiveCosts.observe_run`), the second is."""
        if self._again is not None:
            idx, self._again = self._again, None
            return idx
        self._again = self.served.probe(step)
        return self._again
