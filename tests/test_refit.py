"""Refitting while serving (entmtp.bank.refit): every candidate's decode simulated once, a fit at any
costs in a product, a refit when the live costs' shape departs, probes within a bounded share, and
the engine switching policy mid-decode without changing its output."""

from __future__ import annotations

import random

import numpy as np
import pytest

from entmtp.bank import refit
from entmtp.bank.bank import load_bank
from entmtp.bank.live import LiveCosts
from entmtp.bank.refit import LiveFit, Usage
from entmtp.bank.traces import Tables, simulate
from entmtp.config import BASELINE_TREE, ROOT, TREES_FILE, GenerationConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy, path_value
from entmtp.spec.topology import compile_tree, load_named_trees
from conftest import random_heads, reference, tiny_llama

BANKS = ROOT / "banks" / "smollm2-135m-instruct"
BASE = load_named_trees(TREES_FILE)[BASELINE_TREE]


@pytest.fixture(scope="module")
def chat():
    bank = load_bank(BANKS / "chat.json")
    return bank, Usage(bank.trees, bank.traces, bank.fit["feature"], bank.fit["feature_depth"], BASE)


def _costs(bank):
    f = bank.fit
    return [f["trees"][t.name]["step_ms"] for t in bank.trees], f["chain_ms"], f["prefill_ms_per_token"], f["baseline"]["step_ms"]


def test_each_candidates_steps_price_its_decode_as_simulate_does(chat):
    """For sampled τ and ladder candidates, steps by (heads read, tree) times the costs equal
    `traces.simulate`'s milliseconds and step count on the shipped chat bank's traces."""
    bank, usage = chat
    steps, chain, _, _ = _costs(bank)
    tables = Tables(bank.trees, bank.traces)
    d = usage.depth or usage.D
    reads = ([[[path_value(p, c[:k]) for k in range(1, d + 1)] for p, c in zip(t.p0, t.chain)] for t in bank.traces],
             [None] + [[max(0.0, chain[k] - chain[t.max_depth]) for t in bank.trees] for k in range(1, usage.D + 1)])
    m = usage.cost_matrix(steps, chain)
    rng = random.Random(3)
    for fam in (usage.tau, usage.ladder):
        for k in rng.sample(range(len(fam.policies)), 6):
            out = simulate(tables, fam.policies[k].chooser, [], steps, 0.0, reads)
            counts = fam.counts[k].reshape(m.shape)
            assert counts.sum() == out.steps
            assert float((counts * m).sum()) == pytest.approx(out.ms, rel=1e-9)
    # and the policies calibration fitted (its ladder has nine rungs: no candidate), as a refit weighs them
    for name, pol in bank.policies.items():
        static = name == "static"
        out = simulate(tables, pol.chooser, [[0.0] * len(t) for t in bank.traces] if static else [], steps, 0.0, None if static else reads)
        counts = usage.counts_of(pol)
        assert counts.sum() == out.steps and float((counts * m).sum()) == pytest.approx(out.ms, rel=1e-9), name


@pytest.mark.parametrize("task", ["chat", "code", "math"])
def test_a_fit_at_calibrations_costs_finds_calibrations_tau(task):
    """At the very costs `calibrate` fitted the shipped bank at, the serving refit picks the same τ
    (trees and thresholds) and predicts the same tokens/s for it, for `ar` and for Hydra's tree."""
    bank = load_bank(BANKS / f"{task}.json")
    usage = Usage(bank.trees, bank.traces, bank.fit["feature"], bank.fit["feature_depth"], BASE)
    fit = usage.fit(*_costs(bank))
    assert fit["policies"]["tau"] == bank.fit["policies"]["tau"]
    assert fit["policies"]["static"] == bank.fit["policies"]["static"]
    for method in ("ar", "hydra", "entmtp-static", "entmtp-tau"):
        assert fit["predicted_tokens_per_s"][method] == pytest.approx(bank.fit["predicted_tokens_per_s"][method], rel=1e-4)
    assert fit["predicted_tokens_per_s"]["entmtp-ladder"] >= bank.fit["predicted_tokens_per_s"]["entmtp-static"] - 1e-6


def test_where_no_tree_pays_every_policy_runs_the_one_node_tree(chat):
    """Each extra row as dear as a whole plain step and the heads' chain dear: plain decoding wins,
    and every policy the refit chooses is the one-node tree, reading no head."""
    bank, usage = chat
    steps = [5.0 * t.n_nodes for t in bank.trees]
    fit = usage.fit(steps, [0.0, 3.0, 6.0, 9.0, 12.0], 0.2, 5.0 * BASE.n_nodes)
    assert fit["policies"]["static"] == {"tree": "n1-d0"}
    assert fit["policies"]["tau"]["small"] == fit["policies"]["tau"]["large"] == "n1-d0"
    assert fit["policies"]["tau"]["feature"] == "p0" and fit["policies"]["ladder"]["trees"] == ["n1-d0"]
    tps = fit["predicted_tokens_per_s"]
    assert tps["entmtp-tau"] == tps["entmtp-ladder"] == tps["entmtp-static"] == tps["ar"]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _feed(live, clock, costs: dict[str, tuple[int, float]], n=8):
    for _ in range(n):
        clock.t += 0.01
        for name, (nodes, ms) in costs.items():
            live.observe(name, nodes, 192, ms)


def test_a_departure_refits_once_after_two_looks_and_the_policy_follows(chat):
    bank, _ = chat
    clock = Clock()
    live = LiveCosts(clock=clock)
    served = LiveFit(bank, live, BASE).wait()
    fit = bank.fit
    ms = {t.name: fit["trees"][t.name]["step_ms"] for t in bank.trees}
    tau = bank.policies["tau"]
    small, large = bank.trees[tau.small], bank.trees[tau.large]  # the trees the fitted τ serves
    # the machine as fitted, a uniform 2x slower: no departure of the shape, no refit
    _feed(live, clock, {"ar": (1, 2 * ms["n1-d0"]), small.name: (small.n_nodes, 2 * ms[small.name]),
                        large.name: (large.n_nodes, 2 * ms[large.name])})
    assert live.departure(fit) == pytest.approx(0.0, abs=1e-3)
    assert all(served.look(s, "entmtp-tau") is None for s in range(1, 200))
    # now the trees cost 3x a plain step's share more: every look past DEPART, a refit on the second
    clock.t += 500  # the old steps age out
    _feed(live, clock, {"ar": (1, ms["n1-d0"]), small.name: (small.n_nodes, 3 * ms[small.name]),
                        large.name: (large.n_nodes, 3 * ms[large.name])})
    assert served.look(refit.CHECK_EVERY, "entmtp-tau") is None  # one look is not enough
    event = served.look(2 * refit.CHECK_EVERY, "entmtp-tau")
    assert event is not None and event["departure"] > refit.DEPART
    assert event["old"].startswith(f"{small.name} <-> {large.name}") and event["changed"] and event["new"] == "n1-d0"
    assert served.policy("tau") == TauPolicy(0, 0, 1.0, 1.0, "p0", 0)  # plain decoding pays best at these costs
    assert served.fit["refit"]["departure"] == event["departure"] and event["refit_ms"] < 50
    # the refit's costs are the reference now: the same costs never refit again
    assert live.departure(served.fit) == pytest.approx(0.0, abs=1e-3)
    assert all(served.look(s, "entmtp-tau") is None for s in range(2 * refit.CHECK_EVERY + 1, 400))
    assert len(served.refits) == 1 and served.marks_ago()[0][1] == "n1-d0"


def test_probes_time_cold_front_trees_in_a_bounded_share(chat):
    bank, _ = chat
    clock = Clock()
    live = LiveCosts(clock=clock)
    served = LiveFit(bank, live, BASE).wait()
    probed = [p for s in range(1, 64 * 20 + 1) if (p := served.probe(s)) is not None]
    assert 0 < len(probed) <= 20 and len(set(probed)) > 1
    assert all(bank.trees[p].name in bank.fit["front"] for p in probed)
    # once every front tree has recent steps there is nothing to probe
    _feed(live, clock, {t.name: (t.n_nodes, 5.0) for t in bank.trees})
    assert all(served.probe(s) is None for s in range(1, 64 * 5))


class Scripted:
    """A serving session that switches policy at set steps and probes trees at random: what a
    `refit.Session` may do, at its most restless."""

    def __init__(self, switches: dict, n_trees: int, seed: int):
        self.switches, self.rng, self.n = switches, random.Random(seed), n_trees

    def look(self, step):
        pol = self.switches.get(step)
        return (pol, {"step": step, "old": "-", "new": "-", "changed": True}) if pol is not None else (None, None)

    def probe(self, step):
        return self.rng.randrange(self.n) if self.rng.random() < 0.3 else None


def _bank():
    return (compile_tree([], "ar"), compile_tree([[0], [1]], "two"), compile_tree([[0], [0, 0], [0, 0, 0], [1]], "deep"))


def test_a_policy_switched_mid_decode_and_probes_keep_greedy_output_exact(model, prompts):
    for m in (model, tiny_llama(seed=5, vocab=12)):
        heads = random_heads(m, "hydra")
        for i, prompt in enumerate(prompts):
            prompt = [t % m.config.vocab_size for t in prompt]
            switches = {3: TauPolicy(1, 2, 0.5, 0.2, "path_value", 2), 7: LadderPolicy((0, 2), (0.3,), "p0"), 11: StaticPolicy(1)}
            strategy = Strategy("t", _bank(), TauPolicy(0, 2, 0.6, 0.3), heads, serving=Scripted(switches, 3, i))
            res = collect(Engine(m).generate(prompt, strategy, GenerationConfig(max_new_tokens=30)))
            assert res.token_ids == reference(m, prompt, 30)
            assert any(r.probe for r in res.steps) and [r.step for r in res.steps if r.refit] == [s for s in switches if s <= len(res.steps)]
            assert all(r.trace().get("refit") == r.refit for r in res.steps)
            assert all(r.heads_read == 0 for r in res.steps if r.probe)  # a probe times its tree alone, as calibrate does


def test_probes_and_switches_keep_sampling_exact():
    """At T > 0 a decode whose tree changes at random (probes) and whose policy switches mid-way
    still draws from the model's own distribution (the chi-square test of test_engine)."""
    from test_engine import _chi2, _exact_distribution

    m = tiny_llama(seed=2, vocab=6)
    heads = random_heads(m, "hydra", seed=4)
    prompt = [1, 4, 2, 5]
    probs = _exact_distribution(m, prompt, 3, 1.0)
    eng, counts, n = Engine(m), {}, 2000
    for seed in range(n):
        strategy = Strategy("s", _bank(), StaticPolicy(2), heads, serving=Scripted({2: StaticPolicy(1)}, 3, seed))
        res = collect(eng.generate(prompt, strategy, GenerationConfig(max_new_tokens=3, temperature=1.0, seed=seed)))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
    stat, crit = _chi2(counts, probs, n)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: probes or a switch biased the sampler"
