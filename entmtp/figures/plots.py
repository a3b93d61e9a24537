"""Plotly figures shared by the app, the benchmark and bank reports.

Pure functions of step records (`engine.StepRecord`), trees (`topology.Tree`) and banks
(`bank.TopologyBank`) to `plotly.graph_objects.Figure`. Each figure carries a title and axis
labels that say what is measured, so it reads on its own.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from entmtp.bank.bank import TopologyBank, pareto
from entmtp.config import ROOT
from entmtp.spec.engine import StepRecord
from entmtp.spec.topology import Tree

# One colour per side, the same in every figure (and in the app's text panes).
COLORS = ("#e8590c", "#1c7ed6", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599")
TREE_COLORS = ("#20c997", "#7950f2", "#fab005", "#e64980", "#15aabf", "#82c91e", "#fd7e14", "#4c6ef5")  # by bank index
MUTED = "#adb5bd"
METHOD_COLORS = {  # baselines in greys and blues, EntMTP in warm colours
    "ar": "#868e96", "hf": "#495057", "hf-lookup": "#74c0fc", "medusa": "#1c7ed6", "hydra": "#364fc7",
    "entmtp-static": "#f08c00", "entmtp-ladder": "#e8590c", "entmtp-tau": "#c92a2a",
}
FONT = dict(family="Inter, system-ui, sans-serif", size=12, color="#212529")


def _layout(fig: go.Figure, title: str, height: int, subtitle: str = "", legend: str = "top", **kw) -> go.Figure:
    """Shared styling: a bold title, a one-line grey explanation, then the legend in a row above
    the plot area (`legend="bottom"`: below the axes; `"inside"`: top left inside the plot area)."""
    text = f"<b>{title}</b>" + (f"<br><span style='font-size:11px;color:#868e96'>{subtitle}</span>" if subtitle else "")
    top = dict(orientation="h", yanchor="bottom", y=1.01, xanchor="left", x=0.0, font=dict(size=11))
    bottom = dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0.0, font=dict(size=11))
    inside = dict(orientation="v", yanchor="top", y=0.98, xanchor="left", x=0.02, bgcolor="rgba(255,255,255,0.8)")
    fig.update_layout(
        title=dict(text=text, x=0.01, xanchor="left", y=1.0 - 14 / height, yanchor="top", font=dict(size=14)),
        height=height,
        margin=dict(l=56, r=20, t=100 if legend == "top" else 72, b=110 if legend == "bottom" else 48),
        font=FONT,
        plot_bgcolor="white",
        paper_bgcolor="white",
        legend={"top": top, "bottom": bottom, "inside": inside}[legend],
        hovermode="closest",
        **kw,
    )
    fig.update_xaxes(gridcolor="#f1f3f5", zeroline=False, linecolor="#ced4da", showline=True)
    fig.update_yaxes(gridcolor="#f1f3f5", zeroline=False, linecolor="#ced4da", showline=True)
    return fig


def empty_figure(title: str, note: str, height: int, subtitle: str = "") -> go.Figure:
    fig = _layout(go.Figure(), title, height, subtitle)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(text=note, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(color="#868e96"))
    return fig


def own_clock(records: Sequence[StepRecord]) -> list[float]:
    """Seconds on a side's own clock after each step: prefill plus its own step times.

    Wall time since the request started would also count whatever ran in between (in the app,
    the other side's steps), so a race sums each side's measured work instead.
    """
    if not records:
        return []
    t = records[0].prefill_ms / 1e3
    out = []
    for r in records:
        t += r.step_ms / 1e3
        out.append(t)
    return out


def race_figure(sides: dict[str, Sequence[StepRecord]], height: int = 320) -> go.Figure:
    """Tokens produced vs time on each side's own clock (the race). One marker per step."""
    title, sub = "The race: tokens vs time", "each side on its own clock: its prefill + its own decode steps"
    if not any(sides.values()):
        return empty_figure(title, "Run a race to see both sides generate.", height, sub)
    fig = go.Figure()
    for (name, recs), color in zip(sides.items(), itertools.cycle(COLORS)):
        if not recs:
            continue
        t = own_clock(recs)
        n = list(itertools.accumulate(r.accepted for r in recs))
        pre = recs[0].prefill_ms / 1e3
        rate = n[-1] / t[-1] if t[-1] > 0 else 0.0
        fig.add_trace(
            go.Scatter(
                x=[0.0, pre] + t,
                y=[0, 0] + n,
                mode="lines+markers",
                line=dict(color=color, width=2.5, shape="hv"),
                marker=dict(size=[0, 0] + [4] * len(t), color=color),
                name=f"{name}: {rate:.1f} tok/s",
                customdata=[[0, 0]] * 2 + [[r.step, r.accepted] for r in recs],
                hovertemplate="%{x:.2f} s · %{y} tokens<br>step %{customdata[0]}: +%{customdata[1]}<extra>" + name + "</extra>",
            )
        )
    fig.update_xaxes(title_text="seconds", rangemode="tozero")
    fig.update_yaxes(title_text="tokens generated", rangemode="tozero")
    return _layout(fig, title, height, sub, legend="inside")


def accepted_figure(sides: dict[str, Sequence[StepRecord]], height: int = 320) -> go.Figure:
    """Tokens emitted per step for each side; dashed lines are the means (1 = no draft accepted)."""
    title, sub = "Tokens per step", "1 = only the model's own token; dashed: mean"
    if not any(sides.values()):
        return empty_figure(title, "Accepted length per decode step appears here.", height, sub)
    fig = go.Figure()
    for (name, recs), color in zip(sides.items(), itertools.cycle(COLORS)):
        if not recs:
            continue
        mean = sum(r.accepted for r in recs) / len(recs)
        fig.add_trace(
            go.Bar(
                x=[r.step for r in recs],
                y=[r.accepted for r in recs],
                marker_color=color,
                opacity=0.85,
                name=f"{name}: mean {mean:.2f}",
                hovertemplate="step %{x}: %{y} tokens<extra>" + name + "</extra>",
            )
        )
        fig.add_hline(y=mean, line=dict(color=color, dash="dash", width=1.5))
    fig.update_layout(barmode="group", bargap=0.15)
    fig.update_xaxes(title_text="decode step", rangemode="tozero")
    fig.update_yaxes(title_text="tokens emitted", rangemode="tozero", dtick=1)
    return _layout(fig, title, height, sub)


FEATURE_NAMES = {"p0": "s = top-1 prob", "path_value": "path value g_D", "neg_entropy": "exp(-entropy)"}


def features_figure(
    records: Sequence[StepRecord], tau: tuple[float, float] | None = None, feature: str = "p0", height: int = 360,
    depth: int = 0,
) -> go.Figure:
    """Per step: the confidence s and the entropy (top), and the tree the policy picked with the
    step's wall time (bottom); a refit at the live costs (`bank.refit`) is a vertical line labelled
    with the policy it chose.

    `feature` names what the policy reads (`depth`: the heads its path value reads, 0 if unknown);
    `tau` = (tau_on, tau_off) draws its hysteresis thresholds on that feature's axis (all features
    lie in [0, 1]).
    """
    title = "What the policy sees, and the tree it picks"
    sub = ("s = the model's top-1 probability (high → bigger tree); g_D = s × the drafter's probabilities "
           "down the spine (the reranker's where the phrasebook drafts, else the heads' top-1); dotted: entropy")
    if not records:
        return empty_figure(title, "The scheduler's feature and choice per step appear here.", height, sub)
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, row_heights=[0.62, 0.38], vertical_spacing=0.06,
        specs=[[{"secondary_y": True}], [{"secondary_y": True}]],
    )
    steps = [r.step for r in records]
    fig.add_trace(
        go.Scatter(
            x=steps, y=[r.s for r in records], mode="lines+markers", name="s = top-1 prob",
            line=dict(color=COLORS[0], width=2), marker=dict(size=4),
            hovertemplate="step %{x}: s = %{y:.3f}<extra></extra>",
        ),
        row=1, col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=steps, y=[r.feature if feature == "path_value" else r.path_value for r in records], mode="lines",
            name=(f"path value g_{depth or 'd'}: the policy's feature" if feature == "path_value" else "path value g_D"),
            line=dict(color=COLORS[2], width=1.4), hovertemplate="step %{x}: g_D = %{y:.3f}<extra></extra>",
        ),
        row=1, col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=steps, y=[r.entropy for r in records], mode="lines", name="entropy (nats)",
            line=dict(color="#495057", width=1.2, dash="dot"),
            hovertemplate="step %{x}: H = %{y:.2f} nats<extra></extra>",
        ),
        row=1, col=1, secondary_y=True,
    )
    if feature == "neg_entropy":
        fig.add_trace(
            go.Scatter(
                x=steps, y=[r.feature for r in records], mode="lines", name="exp(-entropy): the policy's feature",
                line=dict(color=COLORS[3], width=1.6), hovertemplate="step %{x}: exp(-H) = %{y:.3f}<extra></extra>",
            ),
            row=1, col=1,
        )
    if tau is not None:
        on_what = FEATURE_NAMES.get(feature, feature).split(" = ")[0]
        for val, label in ((tau[0], f"τ_on ({on_what})"), (tau[1], f"τ_off ({on_what})")):
            fig.add_hline(
                y=val, row=1, col=1, line=dict(color=COLORS[0], dash="dash", width=1),
                annotation_text=f"{label} {val:.2f}", annotation_position="top left",
                annotation_font=dict(size=10, color=COLORS[0]),
            )
    for name in sorted(set(r.tree for r in records), key=lambda n: next(r.tree_index for r in records if r.tree == n)):
        sel = [r for r in records if r.tree == name]
        fig.add_trace(
            go.Bar(
                x=[r.step for r in sel], y=[r.tree_nodes for r in sel], marker_color=_tree_color(sel[0].tree_index),
                name=f"tree {name} ({sel[0].tree_nodes} nodes)",
                hovertemplate="step %{x}: " + name + ", %{y} nodes<extra></extra>",
            ),
            row=2, col=1,
        )
    fig.add_trace(
        go.Scatter(
            x=steps, y=[r.step_ms for r in records], mode="lines", name="step ms (wall time)",
            line=dict(color="#868e96", width=1.2), hovertemplate="step %{x}: %{y:.2f} ms<extra></extra>",
        ),
        row=2, col=1, secondary_y=True,
    )
    for r in records:
        if r.refit:  # the policy from this step on, along the line (its thresholds are in the stats above)
            what = (r.refit["new"] if r.refit.get("changed") else "kept " + r.refit["old"]).split(" (on ")[0]
            for row in (1, 2):
                fig.add_vline(x=r.step - 0.5, row=row, col=1, line=dict(color="#e8590c", width=1.5, dash="dash"))
            fig.add_annotation(x=r.step - 0.5, y=0.02, xref="x", yref="y domain", text=f"refit: {what}", showarrow=False,
                               textangle=-90, xanchor="right", yanchor="bottom", font=dict(size=10, color="#e8590c"))
    fig.update_layout(barmode="overlay", bargap=0.1)
    # a busy machine's steps 10x dearer stay readable beside the rest
    fig.update_yaxes(title_text="ms (log)", type="log", secondary_y=True, row=2, col=1, showgrid=False)
    fig.update_yaxes(title_text="s", range=[0, 1.05], row=1, col=1)
    top = max([r.entropy for r in records] + [1.0])
    fig.update_yaxes(title_text="entropy", secondary_y=True, row=1, col=1, showgrid=False, range=[0, 1.05 * top])
    fig.update_yaxes(title_text="tree nodes", row=2, col=1, rangemode="tozero", secondary_y=False)
    fig.update_xaxes(title_text="decode step", row=2, col=1)
    return _layout(fig, title, height, sub)


def _tree_color(index: int) -> str:
    return TREE_COLORS[index % len(TREE_COLORS)]


def usage_figure(records: Sequence[StepRecord], height: int = 320) -> go.Figure:
    """How often each tree was chosen, and how many tokens each produced."""
    title, sub = "Tree usage", "steps verified with each tree; label: tokens it produced"
    if not records:
        return empty_figure(title, "How often the policy used each tree appears here.", height, sub)
    stats: dict[str, list[int]] = {}  # tree -> [nodes, steps, tokens, bank index]
    for r in records:
        s = stats.setdefault(r.tree, [r.tree_nodes, 0, 0, r.tree_index])
        s[1] += 1
        s[2] += r.accepted
    names = sorted(stats, key=lambda n: stats[n][0])
    fig = go.Figure(
        go.Bar(
            x=[stats[n][1] for n in names],
            y=[f"{n} ({stats[n][0]} nodes)" for n in names],
            orientation="h",
            marker_color=[_tree_color(stats[n][3]) for n in names],
            text=[f"{stats[n][2]} tok · {stats[n][2] / stats[n][1]:.2f}/step" for n in names],
            textposition="auto",
            hovertemplate="%{y}: %{x} steps<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="steps", rangemode="tozero")
    fig.update_yaxes(automargin=True)
    return _layout(fig, title, height, sub, legend="inside", showlegend=False)


def step_cost_figure(history: Sequence[tuple[float, str, int, int, float]], fitted: dict[str, float] | None = None,
                     height: int = 320, refits: Sequence[tuple[float, str]] = ()) -> go.Figure:
    """Step cost over time on this machine (`LiveCosts.history`: seconds ago, tree, nodes, context,
    ms), one marker series per tree, dotted lines at the fit's cost of the trees that ran, and a
    vertical line at each refit at the live costs (seconds ago, what it chose)."""
    title, sub = "Step cost on this machine, over time", "every decode step timed lately, by tree; dotted: what the fit measured"
    if not history:
        return empty_figure(title, "Race once: each step's cost appears here.", height, sub)
    fig = go.Figure()
    trees = sorted({(nodes, tree) for _, tree, nodes, _, _ in history})
    for k, (nodes, tree) in enumerate(trees):
        rows = [h for h in history if h[1] == tree]
        color = _tree_color(k)
        fig.add_trace(go.Scattergl(x=[-ago for ago, *_ in rows], y=[ms for *_, ms in rows], mode="markers", name=f"{tree} ({nodes} nodes)",
                                   marker=dict(size=4, color=color),
                                   customdata=[ctx for _, _, _, ctx, _ in rows],
                                   hovertemplate=f"{tree}: %{{y:.2f}} ms at %{{customdata}} tokens of context, %{{x:.0f}} s<extra></extra>"))
        if fitted and tree in fitted:
            fig.add_hline(y=fitted[tree], line=dict(color=color, dash="dot", width=1))
    for ago, what in refits:
        fig.add_vline(x=-ago, line=dict(color="#e8590c", width=1.5, dash="dash"))
        fig.add_annotation(x=-ago, y=0.02, yref="paper", text=f"refit: {what.split(' (on ')[0]}", showarrow=False, textangle=-90,
                           xanchor="right", yanchor="bottom", font=dict(size=10, color="#e8590c"))
    fig.update_xaxes(title_text="seconds (0: now)")
    fig.update_yaxes(title_text="ms a step (log scale)", type="log")  # a busy spell's steps 10x dearer stay readable beside the rest
    return _layout(fig, title, height, sub)


def counterfactual_figure(cf: dict | None, height: int = 360) -> go.Figure:
    """Every bank tree's accepted length at every step of a race's output (a heatmap), with the tree
    the policy picked and the one a policy with foresight would have picked."""
    title = "What every tree would have accepted at each step of this output"
    sub = "colour: tokens accepted (root included); ● the policy's pick; ✕ foresight's pick at this machine's costs"
    if not cf or not cf.get("steps"):
        return empty_figure(title, "After a race at temperature 0, every tree's outcome on its output appears here.", height, sub)
    steps, names = cf["steps"], [f"{n} ({k})" for n, k in zip(cf["trees"], cf["nodes"])]
    x = [s["step"] for s in steps]
    fig = go.Figure(go.Heatmap(z=[[s["accepted"][k] for s in steps] for k in range(len(names))], x=x, y=names,
                               colorscale="Oranges", colorbar={"title": "tokens"},
                               hovertemplate="step %{x}, %{y}: %{z} tokens<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[names[s["picked"]] for s in steps], mode="markers", name="the policy's pick",
                             marker={"symbol": "circle", "size": 8, "color": COLORS[1], "line": {"width": 1, "color": "white"}}))
    fig.add_trace(go.Scatter(x=x, y=[names[s["foresight"]] for s in steps], mode="markers", name="foresight's pick",
                             marker={"symbol": "x", "size": 8, "color": "#212529"}))
    fig.update_xaxes(title_text="decode step")
    fig.update_yaxes(automargin=True, type="category")
    return _layout(fig, title, height, sub)


def _tree_coords(tree: Tree) -> list[tuple[float, float]]:
    """(depth, row) per node: leaves on consecutive rows, a parent at the mean of its children."""
    y = [0.0] * tree.n_nodes
    row = itertools.count()

    def place(n: int) -> float:
        kids = tree.children[n]
        y[n] = float(next(row)) if not kids else sum(place(c) for c in kids) / len(kids)
        return y[n]

    place(0)
    return [(float(tree.depth[i]), -y[i]) for i in range(tree.n_nodes)]


def tree_figure(
    tree: Tree, accepted_nodes: Sequence[int] = (), labels: Sequence[str] | None = None,
    title: str | None = None, subtitle: str | None = None, height: int | None = None,
) -> go.Figure:
    """A draft tree, root on the left; the accepted path is drawn bold and coloured.

    `labels` holds one string per node (the drafted token, root first).
    """
    xy = _tree_coords(tree)
    acc = set(accepted_nodes)
    leaves = sum(1 for c in tree.children if not c)
    height = height or max(320, min(680, 120 + 22 * leaves))
    labels = list(labels) if labels is not None else [""] * tree.n_nodes
    fig = go.Figure()
    for edges, color, width in (([i for i in range(1, tree.n_nodes) if i not in acc], MUTED, 1),
                                ([i for i in range(1, tree.n_nodes) if i in acc], COLORS[0], 3.5)):
        ex, ey = [], []
        for i in edges:
            p = tree.parent[i]
            ex += [xy[p][0], xy[i][0], None]
            ey += [xy[p][1], xy[i][1], None]
        fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color=color, width=width), hoverinfo="skip", showlegend=False))
    for chosen, name in ((False, "drafted, rejected or not reached"), (True, "accepted path")):
        nodes = [i for i in range(tree.n_nodes) if (i in acc) == chosen]
        if not nodes:
            continue
        fig.add_trace(
            go.Scatter(
                x=[xy[i][0] for i in nodes], y=[xy[i][1] for i in nodes], mode="markers+text",
                marker=dict(size=11 if chosen else 8, color=COLORS[0] if chosen else "white",
                            line=dict(color=COLORS[0] if chosen else "#868e96", width=1.5)),
                text=[labels[i] for i in nodes], textposition="middle right",
                textfont=dict(size=11, color="#212529" if chosen else "#868e96"),
                customdata=[[list(tree.paths[i - 1]) if i else "root", tree.depth[i]] for i in nodes],
                hovertemplate="%{text}<br>rank path %{customdata[0]} · depth %{customdata[1]}<extra></extra>",
                name=name,
            )
        )
    depth = tree.max_depth
    fig.update_xaxes(
        title_text="depth (0 = root, the model's own token; d = drafted by head d)",
        tickvals=list(range(depth + 1)), range=[-0.2, depth + 0.9], showgrid=False,
    )
    fig.update_yaxes(visible=False)
    title = title or f"Tree {tree.name}: {tree.n_nodes} nodes, {len(acc)} accepted"
    subtitle = subtitle or "one column per draft head; labels are the drafted tokens (␣ space, ↵ newline); orange = accepted"
    return _layout(fig, title, height, subtitle)


def front_figure(bank: TopologyBank, baseline: dict | None = None, height: int = 440) -> go.Figure:
    """The bank's trees: mean accepted length and measured tokens/s against tree size.

    `baseline` = {"name", "n_nodes", and optionally "mean_accepted", "tokens_per_s"} marks a
    reference tree (Hydra's default); without measurements it is a vertical line.
    """
    title, sub = "Bank: acceptance and speed vs tree size", "line = Pareto front; filled = used by a policy"
    measured = [i for i, st in enumerate(bank.stats) if st.get("tokens_per_s")]
    if not measured:
        return empty_figure(title, "This bank has no measurements (built-in fallback): build one with `python -m entmtp build-bank`.", height, sub)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("mean accepted tokens per step", "tokens / s (step cost × traced acceptance)"))
    widest = max([bank.trees[i].n_nodes for i in measured] + [baseline["n_nodes"] if baseline else 1])
    used: dict[int, list[str]] = {}
    for name, pol in bank.policies.items():
        for idx in getattr(pol, "trees", None) or [getattr(pol, "tree", None), getattr(pol, "small", None), getattr(pol, "large", None)]:
            if idx is not None:
                used.setdefault(idx, []).append(name)
    for col, key in ((1, "mean_accepted"), (2, "tokens_per_s")):
        pts = [(bank.trees[i].n_nodes, bank.stats[i][key]) for i in measured]
        front = [measured[j] for j in pareto(pts)]
        fig.add_trace(
            go.Scatter(
                x=[bank.trees[i].n_nodes for i in front], y=[bank.stats[i][key] for i in front], mode="lines",
                line=dict(color=COLORS[0], width=2), name="Pareto front", showlegend=col == 1, hoverinfo="skip",
            ),
            row=1, col=col,
        )
        fig.add_trace(
            go.Scatter(
                x=[bank.trees[i].n_nodes for i in measured], y=[bank.stats[i][key] for i in measured],
                mode="markers+text", text=[bank.trees[i].name for i in measured], textposition="top center",
                textfont=dict(size=10),
                marker=dict(size=[13 if i in used else 8 for i in measured],
                            color=[COLORS[0] if i in used else "white" for i in measured],
                            line=dict(color=COLORS[0], width=1.5)),
                customdata=[", ".join(used.get(i, [])) or "-" for i in measured],
                hovertemplate="%{text}: %{x} nodes, %{y:.2f}<br>policies: %{customdata}<extra></extra>",
                name="bank tree (filled = used by a policy)", showlegend=col == 1,
            ),
            row=1, col=col,
        )
        if baseline:
            if baseline.get(key) is not None:
                fig.add_trace(
                    go.Scatter(x=[baseline["n_nodes"]], y=[baseline[key]], mode="markers+text",
                               marker=dict(symbol="x", size=11, color=COLORS[1]), text=[baseline["name"]],
                               textposition="bottom left", name=baseline["name"], showlegend=col == 1),
                    row=1, col=col,
                )
            else:  # unmeasured: a dashed vertical line across the measured range
                ys = [bank.stats[i][key] for i in measured]
                fig.add_trace(
                    go.Scatter(x=[baseline["n_nodes"]] * 2, y=[min(ys), max(ys)], mode="lines",
                               line=dict(color=COLORS[1], dash="dash", width=1.5),
                               name=f"size of {baseline['name']} ({baseline['n_nodes']} nodes, the baseline's tree)",
                               showlegend=col == 1, hoverinfo="skip"),
                    row=1, col=col,
                )
        fig.update_xaxes(title_text="tree nodes (tokens verified per step), log scale", type="log", row=1, col=col,
                         tickvals=[1, 2, 4, 8, 16, 32, 64, 128], range=[math.log10(0.7), math.log10(1.5 * widest)])
    return _layout(fig, title, height, sub, legend="bottom")


def bench_figure(results: Sequence[dict], height: int = 420) -> go.Figure:
    """Speedup over plain decoding per method, one group of bars per task (benchmark results)."""
    tasks = list(dict.fromkeys(r["task"] for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    fig = go.Figure()
    for i, m in enumerate(methods):
        rows = {r["task"]: r for r in results if r["method"] == m}
        fig.add_bar(
            name=m,
            x=tasks,
            y=[rows[t]["speedup_vs_ar"] if t in rows else None for t in tasks],
            text=[f"{rows[t]['speedup_vs_ar']:.2f}×" if t in rows else "" for t in tasks],
            textposition="outside",
            marker_color=METHOD_COLORS.get(m, TREE_COLORS[i % len(TREE_COLORS)]),
            customdata=[[rows[t]["tokens_per_s"], rows[t]["mean_accepted"]] if t in rows else [None, None] for t in tasks],
            hovertemplate="%{x} · " + m + "<br>%{y:.2f}× plain decoding<br>%{customdata[0]:.1f} tok/s, %{customdata[1]:.2f} tokens/step<extra></extra>",
        )
    fig.add_hline(y=1.0, line_dash="dot", line_color=MUTED)
    _layout(fig, "Speedup over plain decoding (ar), measured in one run", height,
            "batch 1, greedy; tokens/s of each method over tokens/s of ar on the same prompts")
    fig.update_layout(barmode="group", yaxis_title="× ar", xaxis_title="task")
    return fig


def bank_figure(bank: TopologyBank, slug: str, task: str, shipped: bool = True, beside: Path | None = None) -> Path:
    """The bank's front saved as assets/bank-<model>-<task>.png for a shipped bank, else beside the
    bank's own file `beside` (<bank>.png), so that a bank built elsewhere leaves the shipped
    figures alone (.html where Chromium is missing); its path."""
    from entmtp.figures.png import save_png

    fig = front_figure(bank, bank.fit.get("baseline"))
    figure = ROOT / "assets" / f"bank-{slug}-{task}.png" if shipped or beside is None else beside.with_suffix(".png")
    if not save_png(fig, figure):
        figure = figure.with_suffix(".html")  # no Chromium here: keep the interactive figure
        fig.write_html(figure, include_plotlyjs="cdn")
    return figure
