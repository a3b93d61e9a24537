"""Fitting a bank's policies to this machine's step costs by exact simulation of its traces:
the throughput front, the static tree, the ladder and τ on each feature, and the ceiling of any
policy (`traces.foresight`); and a fit as the CLI reports it. No torch: a fit is arithmetic on
traces and costs."""

from __future__ import annotations

from typing import Any

from entmtp.bank.bank import pareto, policies_json
from entmtp.bank.traces import Tables, Trace, foresight, simulate, simulate_tau, spearman
from entmtp.spec.policy import FEATURES, LadderPolicy, Policy, StaticPolicy, TauPolicy, path_value
from entmtp.spec.topology import Tree


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
    through d heads runs it until the value settles its choice (at most d heads, in one call, as
    the engine does), so a tree shallower than the heads read costs the difference; every d from 1
    to the bank's depth is fitted and the best kept (`features.path_value.depth`).
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

    extra = [None] + [chain_extra(d) for d in range(1, depth + 1)]  # extra[d][tree]
    partial = [[[path_value(p, c[:d]) for d in range(1, depth + 1)] for p, c in zip(t.p0, t.chain)] for t in traces]

    def inputs(policy: Policy) -> tuple[list[list[float]], tuple | None]:
        """(features, reads) a simulation of `policy` takes (`traces.simulate`)."""
        d = policy.depth or depth
        if policy.feature == "path_value" and not isinstance(policy, StaticPolicy):  # read head by head, as the engine does
            return [], ([[g[:d] for g in t] for t in partial], extra)
        return feats[(policy.feature, d if policy.feature == "path_value" else 0)], None

    def run(policy: Policy):
        features, reads = inputs(policy)
        return simulate(tables, policy.chooser, features, costs, prefill_ms_per_token, reads)

    tokens = sum(len(t) for t in traces)

    def score_tau(cands: list[TauPolicy]) -> list[float]:
        """`run(c).tokens_per_s` of every τ candidate, at once (they share one feature and depth)."""
        if not cands:
            return []
        features, reads = inputs(cands[0])
        ms = simulate_tau(tables, cands, features, costs, prefill_ms_per_token, reads)
        return [tokens / max(1e-9, m) * 1e3 for m in ms]  # Outcome.tokens_per_s

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
        tau, tau_tps = _fit_tau(front, grid_f, f, static, static_tps, score_tau, d)
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
    by_method = {"ar": static_runs[0]} if trees[0].n_nodes == 1 else {}
    if baseline:
        by_method["hydra"] = run(StaticPolicy(len(trees)))
    by_method.update({f"entmtp-{name}": o for name, o in outcomes.items()})
    predicted = {m: round(o.tokens_per_s, 3) for m, o in by_method.items()}
    prefill_total = prefill_ms_per_token * sum(t.prompt_tokens for t in traces)
    per_method = {m: {"mean_accepted": round(o.mean_accepted, 4),  # what the prompt at hand's prediction reads (bank.predict)
                      "step_ms": round((o.ms - prefill_total) / max(1, o.steps), 4),
                      "nodes": round(sum(all_trees[k].n_nodes for k in o.picks) / max(1, len(o.picks)), 3)}
                  for m, o in by_method.items()}
    fit = {
        "trees": per_tree,
        "front": [trees[i].name for i in front],
        "feature": best_feature,
        "feature_depth": best_depth,  # heads the path value reads (0: the feature is not the path value)
        "features": by_feature,
        "policies": policies_json(policies, trees),
        "degenerate": degenerate,
        "predicted_tokens_per_s": predicted,
        "per_method": per_method,
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


def _fit_tau(front: list[int], grid: list[float], feature: str, static: StaticPolicy, static_tps: float, score,
             depth: int = 0) -> tuple[TauPolicy, float]:
    """Every pair small < large of front trees, τ_off <= τ_on on the grid; the static tree unless one
    beats it by TAU_MIN_GAIN (a smaller predicted gain is within the resolution of the measured step
    costs: on the AMD EPYC such a τ measured 6–10% below its static tree). `score(candidates)`: their
    predicted tok/s; the first of equals wins. The static tree as a τ reads no head (p0), as a refit
    writes it (`refit.Usage.fit`)."""
    best_pol, best = TauPolicy(static.tree, static.tree, 1.0, 1.0, "p0", 0), static_tps
    bar = static_tps * (1 + TAU_MIN_GAIN)
    cands = [TauPolicy(small, large, on, off, feature, depth)
             for a, small in enumerate(front) for large in front[a + 1 :] for on in grid for off in grid if off <= on]
    for cand, tps in zip(cands, score(cands)):
        if tps > max(best, bar) + 1e-9:
            best, best_pol = tps, cand
    return best_pol, best


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
