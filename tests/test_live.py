"""Live costs (entmtp.bank.live): a fit priced at what its trees cost on this machine now."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from entmtp.bank.live import LiveCosts
from entmtp.bank.predict import predict

COST = {"contexts": [32, 192], "nodes": [1, 64], "slope_ms_per_token": [0.01, 0.05], "prefill": [[32, 8.0], [192, 30.0]]}
FIT = {"context": 192, "context_cost": COST,
       "trees": {"n1-d0": {"step_ms": 10.0}, "n2-d1": {"step_ms": 11.0}, "n4-d3": {"step_ms": 14.0}, "n9-d4": {"step_ms": 20.0}},
       "baseline": {"name": "mc_sim_7b_63", "n_nodes": 64, "step_ms": 60.0},
       "per_method": {"ar": {"mean_accepted": 1.0, "step_ms": 10.0, "nodes": 1.0},
                      "entmtp-tau": {"mean_accepted": 2.0, "step_ms": 13.0, "nodes": 3.0}}}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_with_nothing_recent_the_fit_stands():
    live = LiveCosts(min_steps=4)
    assert live.scales(FIT) == [] and live.scale_at(FIT, 4) == 1.0 and live.prefill_scale(FIT) == 1.0
    assert live.departure(FIT) is None
    for method in ("ar", "entmtp-tau"):
        assert live.predict(FIT, method, 50, 100) == pytest.approx(predict(FIT, method, 50, 100))
    assert {v["source"] for v in live.curve(FIT).values()} == {"fitted"}


def test_trees_run_lately_are_priced_at_their_steps_and_the_rest_carry_their_scale():
    """Steps twice the fit's price for n1 and three times for n4, at contexts of their own (each
    the fit's line at its context, times 2 or 3): each
    tree's own median, brought to the fit's context along its slope; n2 (not run) carries the
    scale interpolated by node count, n9 the nearest's beyond."""
    clock = Clock()
    live = LiveCosts(clock=clock, min_steps=4)
    for ctx in (100, 150, 200, 250, 300):  # the machine 2x (3x) slower at every context
        live.observe("n1-d0", 1, ctx, 2.0 * (10.0 + 0.01 * (ctx - 192)))
        live.observe("n4-d3", 4, ctx, 3.0 * (14.0 + (0.01 + 0.04 * 3 / 63) * (ctx - 192)))
    assert live.tree_ms(FIT, "n1-d0") == pytest.approx(20.0)
    assert live.tree_ms(FIT, "n4-d3") == pytest.approx(42.0)
    assert live.tree_ms(FIT, "n2-d1") is None
    assert [(n, round(s, 6), name) for n, s, name in live.scales(FIT)] == [(1, 2.0, "n1-d0"), (4, 3.0, "n4-d3")]
    assert live.scale_at(FIT, 2) == pytest.approx(2.0 + 1.0 / 3) and live.scale_at(FIT, 9) == 3.0
    curve = live.curve(FIT)
    assert curve["n4-d3"] == {"nodes": 4, "fitted_ms": 14.0, "now_ms": 42.0, "source": "measured"}
    assert curve["n2-d1"]["source"] == "carried" and curve["n2-d1"]["now_ms"] == pytest.approx(11.0 * 7 / 3, abs=1e-3)
    assert curve["n9-d4"]["now_ms"] == pytest.approx(60.0)
    # a prediction at these costs: every step 2x (ar) or 2.67x (tau, 3 nodes) the fit's, and the
    # prefill, never observed, at the one-node step's scale
    ar = 100 / (prefill_ms(50) * 2.0 + 100 * (10.0 + 0.01 * (100 - 192)) * 2.0) * 1e3
    assert live.predict(FIT, "ar", 50, 100) == pytest.approx(ar)
    s3 = 2.0 + 2.0 / 3
    tau_step = (13.0 + (0.01 + 0.04 * 2 / 63) * (100 - 192)) * s3
    assert live.predict(FIT, "entmtp-tau", 50, 100) == pytest.approx(100 / (prefill_ms(50) * 2.0 + 50 * tau_step) * 1e3)
    # the shape departs from the fit's: n4 is 1.5x dearer relative to a plain step than the fit said
    assert live.departure(FIT) == pytest.approx(0.5)
    assert live.snapshot(FIT)["departure"] == 0.5
    # the same prediction from the fit priced now, which a page keeps while the costs move on
    for method in ("ar", "entmtp-tau"):
        priced = live.priced(FIT, method)
        assert predict(priced, method, 50, 100) == pytest.approx(live.predict(FIT, method, 50, 100))
        assert priced["live_steps"] == 10
    assert live.priced(FIT, "ar")["live_scale"] == 2.0
    # too few steps of a tree are not yet its price; old steps are not "now"
    live.observe("n9-d4", 9, 192, 100.0)
    assert live.tree_ms(FIT, "n9-d4") is None
    clock.t = 1000.0
    assert live.scales(FIT) == [] and live.scale_at(FIT, 4) == 1.0


def prefill_ms(n):
    return 8.0 + (30.0 - 8.0) * (n - 32) / (192 - 32)


def test_prefills_and_the_baseline_tree_are_priced_too():
    live = LiveCosts(min_steps=4)
    for n in (32, 64, 128, 192):
        live.observe_prefill(n, 1.5 * prefill_ms(n))
        live.observe("mc_sim_7b_63", 64, 192, 90.0)
    assert live.prefill_scale(FIT) == pytest.approx(1.5)
    assert live.scales(FIT) == [(64, pytest.approx(1.5), "mc_sim_7b_63")]
    for _ in range(4):  # plain decoding's steps, named after the method, price the one-node tree
        live.observe("ar", 1, 192, 25.0)
    assert live.scales(FIT)[0] == (1, 2.5, "n1-d0") and live.scale_at(FIT, 1) == 2.5  # one pool with the one-node tree
    live.observe("n1-d0", 1, 192, 0.0)  # a zero reading is no reading
    live.observe("no-such-tree", 3, 192, 5.0)  # a tree outside the fit is kept, priced by no fit
    assert [name for _, _, name in live.scales(FIT)] == ["n1-d0", "mc_sim_7b_63"]


def test_a_decode_passes_through_observed():
    """`observe_run` yields the records unchanged, each step observed at the context it verified at
    (the prompt and the tokens emitted before it), and the prefill once."""
    live = LiveCosts(min_steps=1)
    records = [SimpleNamespace(step=k + 1, tree="n2-d1", tree_nodes=2, tokens=[7] * (k + 1), step_ms=11.0 + k, prefill_ms=30.0,
                               tree_depth=1, heads_read=k + 1) for k in range(3)]
    assert list(live.observe_run(iter(records), 192)) == records
    steps = list(live._steps["n2-d1"])
    # the first step follows no step of its tree (here: the prefill) and is not timed, as `calibrate` times none such
    assert [ctx for _, _, ctx, *_ in steps] == [193, 195] and [ms for *_, ms, _, _ in steps] == [12.0, 13.0]
    assert [(d, b) for *_, d, b in steps] == [(1, 1), (1, 2)]  # heads the feature read past the tree's depth
    # priced against a fit, a step is taken the fit's chain past the tree's depth off (its trees were timed reading none)
    chained = {**FIT, "context_cost": None, "chain_ms": [0.0, 0.3, 0.5, 0.7]}
    assert live.tree_ms(chained, "n2-d1") == pytest.approx((12.0 - 0.2 + 13.0 - 0.4) / 2)
    switched = [SimpleNamespace(**{**vars(r), "tree": t}) for r, t in zip(records, ("n4-d3", "n2-d1", "n2-d1"))]
    live = LiveCosts(min_steps=1)
    list(live.observe_run(iter(switched), 192, last="n4-d3"))  # a piece of a decode whose last step was n4-d3
    assert [ms for *_, ms, _, _ in live._steps["n4-d3"]] == [11.0] and [ms for *_, ms, _, _ in live._steps["n2-d1"]] == [13.0]
    assert live.prefill_scale(FIT) == pytest.approx(1.0) and len(live._prefills) == 1


def test_a_uniform_change_departs_nothing():
    """Every tree twice as dear: the policy's choice cannot change (every tokens/s halves), so the
    shape has not departed; the one-node tree 2x and the four-node 2.2x: it has, by 10%."""
    live = LiveCosts(min_steps=4)
    for _ in range(4):
        live.observe("n1-d0", 1, 192, 20.0)
        live.observe("n4-d3", 4, 192, 28.0)
    assert live.departure(FIT) == pytest.approx(0.0)
    for _ in range(32):
        live.observe("n4-d3", 4, 192, 30.8)
    assert live.departure(FIT) == pytest.approx(0.1)
