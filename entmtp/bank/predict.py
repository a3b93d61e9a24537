"""Tokens/s predicted for the prompt at hand: its length and its budget, at this machine's costs.

A fit's own `predicted_tokens_per_s` carries its calibration: steps timed at `context` tokens and
the traces' prompt lengths for the prefill. A visitor's prompt is shorter or longer, and a step's
cost grows with the context it attends to. `calibrate` therefore also times the plain step and
the largest tree at a second, short context (`context_cost`): a line per tree size through the
two contexts (its slope interpolated linearly between 1 and N nodes, as the attention work is
rows × context), and the prefill as a line through its two lengths. `fit_task` keeps, per method,
the mean accepted length, the mean step cost at `context` and the mean tree size of its steps on
the traces (`per_method`). Then, for L prompt tokens and n new tokens:

    steps = n / accepted,  c = L + n / 2  (the mean context of a step)
    ms    = prefill(L) + steps * (step_ms + slope(nodes) * (c - context))
    tok/s = n / ms * 1000
"""

from __future__ import annotations

from typing import Any


class NoPrediction(ValueError):
    """The fit lacks what a prediction for the prompt at hand needs (a fit made before it existed)."""


def slope(cost: dict[str, Any], nodes: float) -> float:
    """ms per extra context token of a step verifying `nodes` rows (linear in rows)."""
    (n1, nn), (s1, sn) = cost["nodes"], cost["slope_ms_per_token"]
    if nn == n1:
        return s1
    return s1 + (sn - s1) * (nodes - n1) / (nn - n1)


def prefill_ms(cost: dict[str, Any], prompt_tokens: int) -> float:
    """Prefill of `prompt_tokens`, on the line through the two timed prompt lengths (never below 0)."""
    (l1, m1), (l2, m2) = cost["prefill"]
    if l2 == l1:
        return max(0.0, m1 * prompt_tokens / max(1, l1))
    return max(0.0, m1 + (m2 - m1) * (prompt_tokens - l1) / (l2 - l1))


def predict(fit: dict[str, Any], method: str, prompt_tokens: int, new_tokens: int) -> float:
    """Predicted tokens/s of `method` ("ar", "hydra", "entmtp-static", ...) for this prompt."""
    cost, per = fit.get("context_cost"), (fit.get("per_method") or {}).get(method)
    if not cost or not per:
        raise NoPrediction(f"the fit has no {'per-method costs' if cost else 'context cost'} for {method}: refit the bank")
    n = max(1, new_tokens)
    context = prompt_tokens + n / 2
    step = per["step_ms"] + slope(cost, per["nodes"]) * (context - fit["context"])
    ms = prefill_ms(cost, prompt_tokens) + n / per["mean_accepted"] * max(step, 1e-3)
    return n / ms * 1e3

