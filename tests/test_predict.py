"""Predictions for the prompt at hand (entmtp.bank.predict): the formula, its agreement with the
fit's own simulation, and what calibrate measures for it."""

from __future__ import annotations

import pytest

from entmtp.bank import fit as fitting
from entmtp.bank.predict import NoPrediction, predict, prefill_ms, slope
from entmtp.spec.topology import compile_tree
from test_calibrate import synthetic

COST = {"contexts": [32, 192], "nodes": [1, 64], "slope_ms_per_token": [0.01, 0.05], "prefill": [[32, 8.0], [192, 30.0]]}


def test_formula():
    fit = {"context": 192, "context_cost": COST,
           "per_method": {"ar": {"mean_accepted": 1.0, "step_ms": 10.0, "nodes": 1.0},
                          "entmtp-tau": {"mean_accepted": 2.0, "step_ms": 14.0, "nodes": 32.5}}}
    assert slope(COST, 1) == 0.01 and slope(COST, 64) == 0.05 and slope(COST, 32.5) == pytest.approx(0.03)
    assert prefill_ms(COST, 32) == 8.0 and prefill_ms(COST, 112) == pytest.approx(19.0)
    # 32 prompt tokens, 100 new: mean context 82, a plain step 10 + 0.01 * (82 - 192) = 8.9 ms
    assert predict(fit, "ar", 32, 100) == pytest.approx(100 / (8.0 + 100 * 8.9) * 1e3)
    step = 14.0 + 0.03 * (82 - 192)
    assert predict(fit, "entmtp-tau", 32, 100) == pytest.approx(100 / (8.0 + 50 * step) * 1e3)
    assert predict(fit, "ar", 32, 100) > predict(fit, "ar", 600, 100)  # a long prompt: dearer steps and prefill
    with pytest.raises(NoPrediction, match="refit"):
        predict({"context": 192, "per_method": fit["per_method"]}, "ar", 32, 100)
    with pytest.raises(NoPrediction, match="per-method"):
        predict({**fit, "per_method": {}}, "ar", 32, 100)


def test_at_the_calibration_prompts_it_is_the_fits_own_prediction():
    """With no cost growth over context and the prefill proportional to length, the prediction for
    a trace's prompt length and token count is exactly what the fit's simulation predicts."""
    trees = [compile_tree([], "n1-d0"), compile_tree([[0]], "n2-d1"), compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3")]
    traces = synthetic()  # four traces of 60 positions, 10 prompt tokens each
    fit = fitting.fit_task(trees, traces, [10.0, 11.0, 20.0], 0.5, grid=12, baseline=(trees[2], 20.0))
    fit["context"] = 192
    fit["context_cost"] = {**COST, "slope_ms_per_token": [0.0, 0.0], "prefill": [[10, 5.0], [20, 10.0]]}
    assert set(fit["per_method"]) == {"ar", "hydra", "entmtp-static", "entmtp-ladder", "entmtp-tau"}
    for method, tps in fit["predicted_tokens_per_s"].items():
        assert predict(fit, method, 10, 60) == pytest.approx(tps, rel=1e-3), method
    tau = fit["per_method"]["entmtp-tau"]
    assert 1 < tau["nodes"] < 4 and tau["mean_accepted"] == fit["predicted_mean_accepted"]["entmtp-tau"]
