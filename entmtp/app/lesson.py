"""Step-through lesson mode: one decode step of EntMTP, explained.

The engine decodes the prompt from the start up to step k+1 (a step re-runs from the prompt: the
page keeps no engine state between clicks, so a ZeroGPU worker needs none either; at a fixed seed
the run is the same each time). Step k is shown with what the engine did: the tree the policy
picked and why, each drafted node with its head's probability, each node's verdict (accepted, or
the token the model chose there instead, or not reached), and the bonus token (the model's own
token after the accepted path, the next step's root). The heads' probabilities come from one
teacher-forced pass over the committed text (the heads' own arithmetic on the same inputs).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from entmtp.bank.bank import TopologyBank
from entmtp.bank.record import draft_index
from entmtp.config import GenerationConfig
from entmtp.model import forward
from entmtp.spec.engine import Strategy
from entmtp.spec.heads import head_features
from entmtp.spec.policy import LadderPolicy, Policy, StaticPolicy, TauPolicy


def why(policy: Policy, bank: TopologyBank, feature: float, current: int | None, heads_read: int = 0) -> str:
    """Why the policy picks the tree it picks at this feature value (τ: given the tree it is on);
    `heads_read`: the heads behind a path value, where the first of them already settled the choice."""
    depth = policy.depth or bank.max_depth
    name = f"`{policy.feature}`" + (f" through {policy.depth} heads" if policy.feature == "path_value" and policy.depth else "")
    if policy.feature == "path_value" and 0 < heads_read < depth:  # every deeper value is at most this one
        name = f"`{policy.feature}` after {heads_read} of {depth} heads (deeper heads can only lower it)"
    if isinstance(policy, StaticPolicy):
        return f"EntMTP* always verifies `{bank.trees[policy.tree].name}`"
    if isinstance(policy, LadderPolicy):
        rung = sum(feature > t for t in policy.thresholds)
        return (f"{name} = {feature:.3f} passes {rung} of the ladder's thresholds "
                f"({', '.join(f'{t:.3f}' for t in policy.thresholds)}) → `{bank.trees[policy.trees[rung]].name}`")
    if isinstance(policy, TauPolicy):
        small, large = bank.trees[policy.small].name, bank.trees[policy.large].name
        if current == policy.large:
            return (f"on the big tree `{large}`: {name} = {feature:.3f} "
                    + (f"≤ τ_off {policy.tau_off:.3f} → back to `{small}`" if feature <= policy.tau_off else f"> τ_off {policy.tau_off:.3f} → stays"))
        return (f"on the small tree `{small}`: {name} = {feature:.3f} "
                + (f"> τ_on {policy.tau_on:.3f} → up to `{large}`" if feature > policy.tau_on else f"≤ τ_on {policy.tau_on:.3f} → stays"))
    return f"{name} = {feature:.3f}"


@torch.inference_mode()
def head_probabilities(rt, heads, prefix: list[int], tree, draft_tokens: list[int]) -> list[float | None]:
    """Each node's probability under the head that drafted it (None for the root, the model's own)."""
    device = rt.engine.device
    hidden, _ = forward.forward(rt.model, rt.engine.new_cache(), torch.tensor([prefix], device=device),
                                torch.arange(len(prefix), device=device)[None], None)
    feature = head_features(heads, hidden)[-1:]
    index = draft_index(heads, rt.model.get_output_embeddings().weight.shape[0])
    out: list[float | None] = [None]
    for node in range(1, tree.n_nodes):
        path = tree.root_path(tree.parent[node])
        tokens = torch.tensor([[draft_tokens[i] for i in path]], device=device)
        probs = torch.softmax(heads.head_logits(len(path) - 1, feature, tokens).float(), -1)[0]
        k = int(index[draft_tokens[node]])
        out.append(float(probs[k]) if k >= 0 else 0.0)
    return out


def lesson_step(rt, bank: TopologyBank, policy: Policy, label: str, prompt_ids: list[int], gen: GenerationConfig, k: int) -> dict[str, Any]:
    """Step k (from 1) of EntMTP on this prompt, explained, as plain data for the page."""
    heads = rt.heads("hydra")
    steps = rt.engine.generate(prompt_ids, Strategy(label, bank, policy, heads, *rt.book_for(bank)), gen)
    records = list(itertools.islice(steps, k + 1))
    steps.close()
    k = min(k, len(records))
    rec, nxt = records[k - 1], (records[k] if len(records) > k else None)
    before = [t for r in records[: k - 1] for t in r.tokens]
    tree = bank.trees[rec.tree_index]
    probs = head_probabilities(rt, heads, prompt_ids + before, tree, rec.draft_tokens)
    chosen = list(rec.tokens) + ([nxt.tokens[0]] if nxt is not None and nxt.tokens else [])  # the model's token at each depth
    word = lambda t: rt.tokenizer.decode([t]).replace(" ", "␣").replace("\n", "↵") or "∅"  # noqa: E731
    nodes = []
    for i in range(tree.n_nodes):
        d, parent = tree.depth[i], tree.parent[i]
        if i in rec.accepted_nodes:
            verdict = "root: the model's own token" if i == 0 else "accepted"
        elif parent in rec.accepted_nodes and d < len(chosen):
            verdict = f"rejected: the model {'chose' if gen.temperature == 0 else 'drew'} {word(chosen[d])!r} there"
        else:
            verdict = "not reached: an ancestor was rejected" if parent not in rec.accepted_nodes else "past the end"
        nodes.append({"node": i, "depth": d, "token": word(rec.draft_tokens[i]), "p": probs[i], "verdict": verdict})
    previous = records[k - 2].tree_index if k > 1 else None
    return {
        "step": k, "done": rec.finished or nxt is None, "label": label,
        "emitted": rt.decode(before + list(rec.tokens)),
        "tree": {"name": tree.name, "paths": [list(p) for p in tree.paths]},
        "accepted_nodes": list(rec.accepted_nodes), "nodes": nodes,
        "labels": [f"{n['token'][:8]}" + ("" if n["p"] is None else f" {n['p']:.2f}") for n in nodes],
        "tokens": [word(t) for t in rec.tokens], "bonus": word(nxt.tokens[0]) if nxt is not None and nxt.tokens else None,
        "why": (why(policy, bank, rec.feature, previous, rec.heads_read) if k > 1
                else f"the first step: {why(policy, bank, rec.feature, None, rec.heads_read)}"),
        "next": None if nxt is None else {"tree": bank.trees[nxt.tree_index].name,
                                          "why": why(policy, bank, nxt.feature, rec.tree_index, nxt.heads_read)},
        "feature": rec.feature, "ms": rec.step_ms,
    }


def explain(view: dict[str, Any]) -> str:
    """The lesson's text for one step, in Markdown."""
    lines = [f"### Step {view['step']}: tree `{view['tree']['name']}` ({len(view['nodes'])} nodes)",
             f"**Why this tree:** {view['why']}.",
             "**Draft, verify, accept** (head probability; the verdict of one verify pass over the whole tree):",
             "| node | depth | drafted token | head p | verdict |", "|---|---|---|---|---|"]
    for n in view["nodes"]:
        p = "—" if n["p"] is None else f"{n['p']:.2f}"
        lines.append(f"| {n['node']} | {n['depth']} | `{n['token']}` | {p} | {n['verdict']} |")
    lines.append(f"\n**Emitted this step:** {' '.join(f'`{t}`' for t in view['tokens'])} ({len(view['tokens'])} tokens in {view['ms']:.1f} ms)"
                 + (f"; bonus: `{view['bonus']}`, the model's own token after the accepted path, is the next step's root." if view["bonus"] else "."))
    if view["next"]:
        lines.append(f"\n**Next step:** {view['next']['why']}.")
    else:
        lines.append("\n**The output is complete.**")
    return "\n".join(lines)
