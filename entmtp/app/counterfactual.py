"""What every tree of the bank would have done on a race's own output (temperature 0).

At temperature 0 the output is the model's greedy continuation whatever tree verifies it, so one
teacher-forced pass over the prompt and the output (`record.record`, how the bank's traces are
made) gives, at every position, the rank of each true token among each head's proposals: hence
exactly how many tokens each tree would have accepted at every step the race took, which tree a
policy with foresight would have picked there (`traces.foresight_choices` at this machine's step
costs), and what each tree and policy would have made of this prompt. The tree that ran is part
of the check: its counterfactual must equal what it accepted.
"""

from __future__ import annotations

from typing import Any

from entmtp.bank.bank import TopologyBank
from entmtp.bank.record import record
from entmtp.bank.traces import Tables, foresight, foresight_choices, simulate
from entmtp.spec.engine import StepRecord
from entmtp.spec.policy import Policy, StaticPolicy


def counterfactual(rt, bank: TopologyBank, policy: Policy, label: str, prompt_ids: list[int], ids: list[int],
                   records: list[StepRecord]) -> dict[str, Any]:
    """Plain data for the page: per race step, each tree's accepted length, the tree picked and the
    foresight pick; per tree and policy, tokens/step and tokens/s predicted at this machine's costs."""
    book, rule = rt.book_for(bank)  # drafted as the race drafted: with the bank's phrasebook where it has one
    trace = record(rt.engine, rt.heads("hydra"), prompt_ids, ids, bank.max_depth, book=book, rule=rule)
    tables = Tables(list(bank.trees), [trace])
    costs = [st.get("step_ms") or 0.0 for st in bank.stats]
    prefill = bank.fit.get("prefill_ms_per_token", 0.0)
    n = len(trace)
    best, _ = foresight_choices(tables, 0, costs)
    steps, pos = [], 0
    for rec in records:
        if pos >= n or not rec.tokens:
            break
        steps.append({"step": rec.step, "position": pos, "picked": rec.tree_index, "foresight": best[pos], "ran": len(rec.tokens),
                      "accepted": [min(tables.accepted[k][0][pos], n - pos) for k in range(len(bank.trees))]})
        pos += len(rec.tokens)

    def row(name: str, outcome) -> list:
        return [name, round(outcome.mean_accepted, 2), round(outcome.tokens_per_s, 1)]

    def run(pol: Policy):
        d = pol.depth or bank.max_depth
        return simulate(tables, pol.chooser, [trace.feature(pol.feature, d if pol.feature == "path_value" else 0)], costs, prefill)

    rows = [row(f"tree {t.name} ({t.n_nodes} nodes)", run(StaticPolicy(k))) for k, t in enumerate(bank.trees)]
    rows += [row(f"policy {name}", run(p)) for name, p in bank.policies.items()]
    rows.append(row(f"this race: {label}", run(policy)))
    rows.append(row("foresight (knew every step's outcome)", foresight(tables, costs, prefill)))
    agree = sum(s["accepted"][s["picked"]] == s["ran"] for s in steps)
    return {"trees": [t.name for t in bank.trees], "nodes": [t.n_nodes for t in bank.trees], "steps": steps, "rows": rows,
            "agree": agree, "costs": costs, "machine": bank.fit.get("hardware", "?")}
