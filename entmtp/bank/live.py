"""Live costs: what a decode step costs on this machine now, not at calibration.

A fit prices each tree at the step cost `calibrate` measured (`fit["trees"][name]["step_ms"]` at
`fit["context"]` cached tokens, its slope per context token from `context_cost`) and the prefill on
a line through two prompt lengths. On a shared machine those costs move 2-3x within minutes, so a
prediction from the fit alone is off by as much (docs/banks.md, *Live costs*).

`LiveCosts` keeps the last steps the engine ran, per tree, on this machine (any task, any method:
a step's cost depends on its tree and its context, not on the task), and the last prefills. A
fit's tree is priced now at the median of its recent steps, each brought to the fit's context along
the fit's slope; its ratio to the fit's price is the tree's *scale*. A tree not run lately carries
the fitted curve's shape, scaled by the trees that were: the scale interpolated by node count
between them, the nearest one's beyond. With nothing recent at all, the fit stands (scale 1).

No torch: arithmetic on step records (`observe` takes what a `StepRecord` holds).
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from collections import deque
from typing import Any, Callable

from entmtp.bank.predict import NoPrediction, predict, prefill_ms, slope

WINDOW = 32  # steps kept per tree
HISTORY = 4000  # steps kept in order, for a chart of step cost over time
MIN_STEPS = 4  # a tree's own median needs this many recent steps; fewer, and it carries the others' scale
MAX_AGE_S = 120.0  # steps older than this are not "now"


class LiveCosts:
    """Recent step and prefill costs on this machine, and fits priced by them (thread-safe: the
    app's two racing decodes observe into one)."""

    def __init__(self, window: int = WINDOW, min_steps: int = MIN_STEPS, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.window, self.min_steps, self.max_age_s, self.clock = window, min_steps, max_age_s, clock
        self._steps: dict[str, deque] = {}  # tree name -> (t, nodes, context, ms, depth, heads read past it)
        self._prefills: deque = deque(maxlen=window)  # (t, prompt tokens, ms)
        self._history: deque = deque(maxlen=HISTORY)  # (t, tree, nodes, context, ms), every step in order
        self._lock = threading.Lock()

    # -- what ran ----------------------------------------------------------------------------------
    def observe(self, tree: str, nodes: int, context: int, step_ms: float, depth: int = 0, beyond: int = 0) -> None:
        """One decode step: its tree, the tokens it attended to, its wall time; `depth`: the tree's,
        `beyond`: heads the policy's feature read past it (their chain is taken off when the step is
        priced against a fit, whose trees were timed reading none)."""
        if step_ms <= 0:
            return
        with self._lock:
            t = self.clock()
            self._steps.setdefault(tree, deque(maxlen=self.window)).append((t, int(nodes), int(context), float(step_ms), int(depth), int(beyond)))
            self._history.append((t, tree, int(nodes), int(context), float(step_ms)))

    def observe_prefill(self, prompt_tokens: int, ms: float) -> None:
        if ms > 0 and prompt_tokens > 0:
            with self._lock:
                self._prefills.append((self.clock(), int(prompt_tokens), float(ms)))

    def observe_run(self, records, prompt_tokens: int, produced: int = 0, last: str | None = None):
        """Pass a decode's step records through (a generator), observing each: the steps' costs,
        each at the context it verified at, and the prefill's. A step right after a step of another
        tree is not observed (it pays for that tree's leftovers in the caches; `calibrate` does not
        time it either). `produced`: tokens the decode emitted before these records, `last`: the tree
        of the step before them (records that arrive in pieces, from another process)."""
        for r in records:
            if r.step == 1:
                self.observe_prefill(prompt_tokens, r.prefill_ms)
            if r.tree == last:
                depth = getattr(r, "tree_depth", 0)
                self.observe(r.tree, r.tree_nodes, prompt_tokens + produced, r.step_ms, depth, max(0, getattr(r, "heads_read", 0) - depth))
            last, produced = r.tree, produced + len(r.tokens)
            yield r

    def clear(self) -> None:
        """Forget every step and prefill timed so far."""
        with self._lock:
            self._steps.clear()
            self._prefills.clear()
            self._history.clear()

    def history(self) -> list[tuple[float, str, int, int, float]]:
        """Every step kept, in order: (seconds ago, tree, nodes, context, ms)."""
        with self._lock:
            now = self.clock()
            return [(now - t, tree, nodes, ctx, ms) for t, tree, nodes, ctx, ms in self._history]

    def _recent(self, rows) -> list:
        now = self.clock()
        return [row for row in rows if now - row[0] <= self.max_age_s]

    # -- a fit priced now ----------------------------------------------------------------------------
    def tree_ms(self, fit: dict[str, Any], tree: str) -> float | None:
        """The tree's step cost now at the fit's context: the median of its recent steps, each
        without the heads its policy read past the tree's depth and moved to that context by the
        fit's line (times the fit's cost there over the line's at the step's context, so that a
        machine twice as slow is twice as slow at every context, and no long context makes a cost
        negative); None where it has fewer than `min_steps` recent ones."""
        one = _one_node(fit)
        with self._lock:  # plain decoding's steps and the one-node tree's are one pool: the same step (docs/banks.md)
            pool = [*self._steps.get(one, ()), *self._steps.get("ar", ())] if one is not None and tree in (one, "ar") else self._steps.get(tree, ())
            rows = self._recent(pool)
        if len(rows) < self.min_steps:
            return None
        cost, at, chain = fit.get("context_cost"), fit.get("context", 0), fit.get("chain_ms") or [0.0]
        top = len(chain) - 1
        fitted = self.fitted_ms(fit, tree)

        def heads(depth: int, beyond: int) -> float:  # the chain past the tree's depth, at the fit's cost
            return chain[min(depth + beyond, top)] - chain[min(depth, top)] if beyond else 0.0

        base, per = (fitted[1], slope(cost, fitted[0])) if cost and fitted else (1.0, 0.0)  # the fit's line: base + per * (ctx - at)
        return statistics.median((ms - heads(d, b) if b else ms) * base / max(0.1 * base, base + per * (ctx - at))
                                 for _, _, ctx, ms, d, b in rows)

    def fitted_ms(self, fit: dict[str, Any], tree: str) -> tuple[int, float] | None:
        """(nodes, the fit's step cost) of a tree of the fit: its bank's, its Hydra baseline, or `ar`
        (plain decoding's steps, named after the method: the one-node tree at `ar`'s cost)."""
        base = fit.get("baseline") or {}
        if tree == base.get("name"):
            return int(base["n_nodes"]), float(base["step_ms"])
        plain = (fit.get("per_method") or {}).get("ar")
        if tree == "ar" and plain:  # plain decoding's steps are named after the method: the one-node tree
            return 1, float(plain["step_ms"])
        row = (fit.get("trees") or {}).get(tree)
        if row is None:
            return None
        with self._lock:
            seen = self._steps.get(tree)
            nodes = row.get("nodes") or (seen[-1][1] if seen else None) or _nodes_of(tree)
        return (int(nodes), float(row["step_ms"])) if nodes else None

    def scales(self, fit: dict[str, Any]) -> list[tuple[int, float, str]]:
        """(nodes, now / fitted, tree) for each of the fit's trees run lately, by node count."""
        plain = [] if _one_node(fit) is not None else ["ar"]  # `ar` is the one-node tree's pool where the fit has one
        names = dict.fromkeys([*(fit.get("trees") or {}), *([fit["baseline"]["name"]] if fit.get("baseline") else []), *plain])
        out = []
        for name in names:
            fitted, now = self.fitted_ms(fit, name), self.tree_ms(fit, name)
            if fitted and now is not None and fitted[1] > 0:
                out.append((fitted[0], now / fitted[1], name))
        return sorted(out)

    def scale_at(self, fit: dict[str, Any], nodes: float, known: list[tuple[int, float, str]] | None = None) -> float:
        """The scale of a tree of `nodes` nodes now: interpolated by node count between the trees run
        lately, the nearest one's beyond them; 1 (the fit stands) with none."""
        known = self.scales(fit) if known is None else known
        if not known:
            return 1.0
        xs = [n for n, _, _ in known]
        i = bisect.bisect_left(xs, nodes)
        if i < len(xs) and xs[i] == nodes:
            return known[i][1]
        if i == 0:
            return known[0][1]
        if i == len(xs):
            return known[-1][1]
        (n0, s0, _), (n1, s1, _) = known[i - 1], known[i]
        return s0 + (s1 - s0) * (nodes - n0) / (n1 - n0)

    def prefill_scale(self, fit: dict[str, Any], known: list[tuple[int, float, str]] | None = None) -> float:
        """Recent prefills over the fit's line for their lengths (median); else the one-node step's
        scale (`known`: the fit's `scales`, where the caller has them)."""
        cost = fit.get("context_cost")
        with self._lock:
            rows = self._recent(self._prefills)
        if cost and len(rows) >= self.min_steps:
            return statistics.median(ms / max(1e-6, prefill_ms(cost, n)) for _, n, ms in rows)
        return self.scale_at(fit, 1, known)

    def curve(self, fit: dict[str, Any], known: list[tuple[int, float, str]] | None = None) -> dict[str, dict[str, Any]]:
        """Per tree of the fit: its fitted step cost, its cost now, and whether that is measured
        (run lately) or carried (the fitted shape scaled by the trees that were; `known`: the fit's
        `scales`, where the caller has them)."""
        known = self.scales(fit) if known is None else known
        mine = {name: s for _, s, name in known}
        out = {}
        for name in fit.get("trees") or {}:
            priced = self.fitted_ms(fit, name)
            if priced is None:  # a tree whose size this fit does not say and that has not run: unpriced
                continue
            nodes, fitted = priced
            s = mine.get(name)
            out[name] = {"nodes": nodes, "fitted_ms": round(fitted, 3),
                         "now_ms": round(fitted * (s if s is not None else self.scale_at(fit, nodes, known)), 3),
                         "source": "measured" if s is not None else ("carried" if known else "fitted")}
        return out

    def predict(self, fit: dict[str, Any], method: str, prompt_tokens: int, new_tokens: int) -> float:
        """`bank.predict` at the costs of now: tokens/s of `method` for this prompt, its steps at
        the fit's per-method cost scaled by the trees' recent scale, its prefill by the prefills'
        (the fit as `priced` prices it)."""
        return predict(self.priced(fit, method), method, prompt_tokens, new_tokens)

    def priced(self, fit: dict[str, Any], method: str) -> dict[str, Any]:
        """What `bank.predict` needs of the fit for `method`, priced at the costs of this moment: its
        per-method step cost and the context slope times the step scale at its mean tree size, the
        prefill line times the prefills' scale (what `self.predict` reads now, kept as it was while
        the costs move on). `live_steps`: the recent steps it rests on."""
        cost, per = fit.get("context_cost"), (fit.get("per_method") or {}).get(method)
        if not cost or not per:
            raise NoPrediction(f"the fit has no {'per-method costs' if cost else 'context cost'} for {method}: refit the bank")
        s, ps = self.scale_at(fit, per["nodes"]), self.prefill_scale(fit)
        with self._lock:
            steps = sum(len(self._recent(rows)) for rows in self._steps.values())
        return {"context": fit["context"],
                "context_cost": {**cost, "slope_ms_per_token": [v * s for v in cost["slope_ms_per_token"]],
                                 "prefill": [[n, ms * ps] for n, ms in cost["prefill"]]},
                "per_method": {method: {**per, "step_ms": per["step_ms"] * s}},
                "live_steps": steps, "live_scale": round(s, 4)}

    def costs_now(self, fit: dict[str, Any], trees: list[str]) -> dict[str, Any] | None:
        """What `fit.fit_task` needs to refit at the costs of now: per tree of `trees` (names, in the
        bank's order) its step cost now (`curve`), Hydra's baseline tree's, the prefill per token and
        the heads' chain to each depth scaled by the one-node step's scale; which trees were measured;
        the two scales; None before any step of the fit's trees was timed."""
        known = self.scales(fit)
        if not known:
            return None
        curve, base = self.curve(fit, known), fit.get("baseline") or {}
        one, prefill = self.scale_at(fit, 1, known), self.prefill_scale(fit, known)
        return {"step_ms": [curve[name]["now_ms"] for name in trees],
                "baseline_ms": base["step_ms"] * self.scale_at(fit, base["n_nodes"], known) if base else None,
                "prefill_ms_per_token": fit.get("prefill_ms_per_token", 0.0) * prefill,
                "chain_ms": [c * one for c in (fit.get("chain_ms") or ())],
                "measured": [name for name in trees if curve[name]["source"] == "measured"],
                "one_node_scale": one, "prefill_scale": prefill}

    def departure(self, fit: dict[str, Any]) -> float | None:
        """How far the shape of the costs now is from the fit's: the largest relative change, over the
        trees run lately, of their cost over a plain step's (each scale over the one-node scale,
        measured or carried). A uniform change of every cost leaves it 0 and changes no policy (every
        tokens/s scales alike); a refit can only pay where this is large. None with fewer than two
        trees run lately."""
        known = self.scales(fit)
        if len({n for n, _, _ in known}) < 2:
            return None
        one = self.scale_at(fit, 1, known)
        return max(abs(s / one - 1) for _, s, _ in known)

    def snapshot(self, fit: dict[str, Any]) -> dict[str, Any]:
        """What a record or the page shows: the trees' costs now beside the fit's, the scales, and
        how far their shape departs from the fit's."""
        gone = self.departure(fit)
        return {"trees": self.curve(fit), "scales": {name: round(s, 4) for _, s, name in self.scales(fit)},
                "prefill_scale": round(self.prefill_scale(fit), 4), "departure": None if gone is None else round(gone, 4)}


def _one_node(fit: dict[str, Any]) -> str | None:
    """The fit's one-node tree (plain decoding inside a bank), or None."""
    for name, row in (fit.get("trees") or {}).items():
        if (row.get("nodes") or _nodes_of(name)) == 1:
            return name
    return None


def _nodes_of(name: str) -> int | None:
    """A bank tree's node count from its name (`n4-d3` -> 4), where the fit does not say it and the
    tree has not run."""
    if name.startswith("n") and "-d" in name:
        try:
            return int(name[1:name.index("-d")])
        except ValueError:
            return None
    return None
