"""The Bank tab's hardware what-if: what the bank's trees and policies would be on another machine.

How many drafted tokens a tree accepts at a position is a fact about the model and its heads
(the bank's traces); only what a step costs differs between machines. So each cost curve refits
the bank by exact simulation of its traces (`fit.fit_task`, the fit `calibrate` makes) and the
tab shows the front, the policies, the predicted tokens/s and the ceiling under it. The curves:
the fit measured on this machine, the bank file's shipped fit (measured on the machine it names),
the GPU check's costs (an H200, random weights of the default architecture), and an idealised
machine where each extra tree row costs r times a plain step. The first two are measured here: the
fit at calibration, and this machine now (`bank.live`: what the steps of the races lately cost, per
tree, the trees not run lately carrying the fit's shape), which moves while the machine's load does.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from entmtp.bank.bank import TopologyBank
from entmtp.bank.calibrate import tree_key
from entmtp.bank.fit import fit_task
from entmtp.bank.live import LiveCosts
from entmtp.config import BASELINE_TREE, ROOT, TREES_FILE
from entmtp.spec.topology import Tree, load_named_trees

GPU_RESULTS = ROOT / "benchmarks" / "gpu"
CHOICES = {"here": "this machine's fit", "now": "this machine, now (the steps timed lately)", "shipped": "the bank file's machine",
           "gpu": "NVIDIA H200 (GPU check)", "ideal": "idealised: an extra row costs r × a plain step"}


@dataclass(frozen=True)
class Curve:
    """What one machine charges for a step with each tree of a bank (ms), and where that comes from."""

    key: str
    machine: str  # names the machine the costs belong to
    source: str  # "measured on this machine" | "measured on <machine>" | how they were modelled
    step_ms: tuple[float, ...]  # per bank tree, in the bank's order
    baseline_ms: float  # Hydra's default tree
    prefill_ms_per_token: float
    chain_ms: tuple[float, ...]  # the heads' top-1 chain to each depth (what the path-value feature costs)


def from_fit(key: str, bank: TopologyBank, fit: dict, source: str) -> Curve:
    """The measured curve a fit carries (its `measured_ms` per tree, before any smoothing)."""
    trees = fit["trees"]
    return Curve(key, fit.get("hardware", "?"), source, tuple(trees[t.name].get("measured_ms", trees[t.name]["step_ms"]) for t in bank.trees),
                 fit["baseline"]["step_ms"], fit.get("prefill_ms_per_token", 0.0), tuple(fit.get("chain_ms") or ()))


def ideal(bank: TopologyBank, fit: dict, r: float) -> Curve:
    """This fit's plain step and overheads, with every extra row of a tree costing `r` × a plain step."""
    one = next(fit["trees"][t.name].get("measured_ms", fit["trees"][t.name]["step_ms"]) for t in bank.trees if t.n_nodes == 1)
    base = load_named_trees(TREES_FILE)[BASELINE_TREE]
    return Curve("ideal", f"an idealised {fit.get('hardware', '?')}", f"modelled: {one:.1f} ms a plain step, each extra row r = {r:.2f} of it",
                 tuple(one * (1 + r * (t.n_nodes - 1)) for t in bank.trees), one * (1 + r * (base.n_nodes - 1)),
                 fit.get("prefill_ms_per_token", 0.0), tuple(fit.get("chain_ms") or ()))


def now(bank: TopologyBank, fit: dict, live: LiveCosts) -> Curve | None:
    """This machine's costs now (`LiveCosts.costs_now`: each tree run lately at its own recent
    steps, the rest at the fit's shape scaled by node count; the prefill and the heads' chain by
    the scales of now); None before any step was timed."""
    c = live.costs_now(fit, [t.name for t in bank.trees])
    if c is None:
        return None
    return Curve("now", f"{fit.get('hardware', '?')}, now", f"timed on this machine lately ({len(c['measured'])} of the bank's trees "
                 f"from their own steps: {', '.join(c['measured']) or 'none'}; the rest carried on the fit's shape)",
                 tuple(c["step_ms"]), c["baseline_ms"], c["prefill_ms_per_token"], tuple(c["chain_ms"]))


def latest_gpu_result(folder: Path = GPU_RESULTS) -> Path | None:
    """The newest GPU check result with step costs (files are named by date)."""
    files = sorted(p for p in folder.glob("*.json") if "step_ms" in json.loads(p.read_text()))
    return files[-1] if files else None


def gpu(bank: TopologyBank, task: str, path: Path) -> Curve:
    """The GPU check's step costs for this bank's trees: each tree's own where the check timed a
    tree of that name and size, else interpolated on node count (log-linear between its
    neighbours); the heads' chain from the check's schedule phase over plain decoding's."""
    r = json.loads(path.read_text())
    step, nodes, phases = r["step_ms"], r.get("nodes", {}), r.get("phase_ms", {})
    points = sorted({nodes[k]: v for k, v in step.items() if k in nodes}.items())

    def cost(t: Tree) -> float:
        for key in (f"{t.name}@{task}", t.name):
            if key in step and nodes.get(key) == t.n_nodes:
                return step[key]
        lo = max((p for p in points if p[0] <= t.n_nodes), default=points[0])
        hi = min((p for p in points if p[0] >= t.n_nodes), default=points[-1])
        if hi[0] == lo[0]:
            return lo[1]
        w = (math.log(t.n_nodes) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
        return lo[1] + w * (hi[1] - lo[1])

    ar = phases.get("ar", {}).get("schedule", 0.0)
    depths: dict[int, list[float]] = {}
    for name, ph in phases.items():  # tree names end in -d<depth>
        m = re.search(r"-d(\d+)(@|$)", name)
        if m and int(m.group(1)):
            depths.setdefault(int(m.group(1)), []).append(max(0.0, ph.get("schedule", 0.0) - ar))
    top = max(t.max_depth for t in bank.trees)
    known = {d: statistics.median(v) for d, v in depths.items()}
    chain = [0.0] + [known.get(d, max((v for k, v in known.items() if k < d), default=0.0)) for d in range(1, top + 1)]
    device = r.get("device", "GPU")
    return Curve("gpu", f"{device} ({path.stem}, random weights)", f"measured on {device} by the GPU check",
                 tuple(cost(t) for t in bank.trees), step.get(BASELINE_TREE, cost(load_named_trees(TREES_FILE)[BASELINE_TREE])),
                 r.get("prefill_ms_per_token", 0.0), tuple(chain))


_fits: dict[tuple, dict] = {}


def refit(bank: TopologyBank, curve: Curve) -> TopologyBank:
    """The bank under the fit `calibrate` would make on the curve's machine (cached per bank and curve)."""
    key = (bank.meta.get("model"), bank.meta.get("task"), tuple(tree_key(t) for t in bank.trees), curve)
    if key not in _fits:
        for old in [k for k in _fits if k[3].key == "now" and k[:3] == key[:3]] if curve.key == "now" else []:
            del _fits[old]  # the costs of now move on: one such fit a bank is kept
        base = load_named_trees(TREES_FILE)[BASELINE_TREE]
        fit = fit_task(bank.trees, bank.traces, list(curve.step_ms), curve.prefill_ms_per_token, 12,
                       (base, curve.baseline_ms), list(curve.chain_ms) or None)
        _fits[key] = {"hardware": curve.machine, "fingerprint": None, "date": curve.source, **fit}
    return bank.with_fit(_fits[key])


def summary(bank: TopologyBank, curve: Curve) -> str:
    """What the fit under this curve decides and predicts, in a few lines of Markdown."""
    fit = bank.fit
    pol, tps = fit["policies"], fit["predicted_tokens_per_s"]
    ar, hydra = tps.get("ar"), tps.get("hydra")

    def vs(v: float) -> str:
        parts = [f"{v / ar:.2f}× plain decoding" if ar else "", f"{v / hydra:.2f}× Hydra's tree" if hydra else ""]
        return ", ".join(p for p in parts if p)

    tau = pol["tau"]
    lines = [
        f"**Step costs: {curve.source}** ({curve.machine}); acceptance from the bank's traces. "
        + ("Every figure below is predicted by exact simulation of the traces at these costs."),
        f"- front: {', '.join(fit['front'])}",
        f"- EntMTP\\*: `{pol['static']['tree']}`; ladder: {' < '.join(f'`{t}`' for t in pol['ladder']['trees'])}; "
        f"τ: `{tau['small']}` ↔ `{tau['large']}` (on {tau['tau_on']:.3f}, off {tau['tau_off']:.3f}), feature `{fit['feature']}`",
        f"- predicted tokens/s: plain {ar:.1f}, Hydra's tree {hydra:.1f}; "
        + "; ".join(f"{k.replace('entmtp-', 'EntMTP-')} {v:.1f} ({vs(v)})" for k, v in tps.items() if k.startswith("entmtp")),
        f"- ceiling (a policy that knew every step's outcome): {fit['ceiling']['tokens_per_s']:.1f} tok/s"
        + (f" ({fit['ceiling']['tokens_per_s'] / ar:.2f}× plain decoding)" if ar else ""),
    ] + [f"- note: {name} {why}" for name, why in fit.get("degenerate", {}).items()]
    return "\n".join(lines)


def feature_table(fit: dict) -> list[list]:
    """How well each confidence feature ranks the accepted length of the largest tree on the traces
    (Spearman's ρ) and the best ladder and τ it gives, per feature."""
    rows = []
    for name, row in fit.get("features", {}).items():
        label = f"{name} (through {row['depth']} heads)" if name == "path_value" and row.get("depth") else name
        rows.append([label, row["spearman"], row["ladder"], row["tau"], "yes" if name == fit.get("feature") else ""])
    return sorted(rows, key=lambda r: -abs(r[1]))


def bank_tab(rt, task: str, choice: str, r: float, live: TopologyBank, fitted_here: bool) -> tuple[str, TopologyBank]:
    """(summary, bank under the chosen curve) for the Bank tab: `live` is the bank as races use it
    (this machine's fit, or the shipped one until that is measured)."""
    if live.meta.get("fallback") or "baseline" not in live.fit:
        return "The built-in fallback bank has no traces to simulate: no what-if here.", live
    if choice == "here":
        source = ("measured on this machine" if fitted_here
                  else "the bank file's shipped fit, measured on another machine (this machine's is not measured yet)")
        return summary(live, from_fit("here", live, live.fit, source)), live
    if choice == "now":
        curve = now(live, live.fit, rt.live)
        if curve is None:
            return ("No step has been timed on this machine yet: race once, and the costs of now appear here "
                    "(each tree from its own recent steps, the rest on the fit's shape)."), live
    elif choice == "shipped":
        shipped = rt.bank_from_file(task)
        curve = from_fit("shipped", shipped, shipped.shipped_fit, f"measured on {shipped.shipped_fit.get('hardware', '?')}")
    elif choice == "gpu":
        path = latest_gpu_result()
        if path is None:
            return "No GPU check result under benchmarks/gpu/.", live
        curve = gpu(live, task, path)
    elif choice == "ideal":
        curve = ideal(live, live.fit, r)
    else:
        raise ValueError(f"unknown hardware choice {choice!r} (expected one of {', '.join(CHOICES)})")
    bank = refit(live, curve)
    return summary(bank, curve), bank

