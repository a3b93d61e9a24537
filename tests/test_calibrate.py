"""Offline bank building on the tiny model: greedy trees, exact predictions, real recalibration, policies."""

import random

import pytest

from entmtp import calibrate as cal
from entmtp.bank import TopologyBank, parse_bank
from entmtp.config import GenerationConfig
from entmtp.engine import Engine, Strategy, collect
from entmtp.policy import StaticPolicy
from entmtp.topology import compile_tree
from conftest import random_heads, tiny_llama


@pytest.fixture(scope="module")
def setup():
    m = tiny_llama(seed=5, vocab=12)
    heads = random_heads(m, "hydra")
    rng = random.Random(0)
    prompts = [[rng.randrange(12) for _ in range(rng.randint(3, 9))] for _ in range(6)]
    return Engine(m), heads, prompts


def test_greedy_trees_are_nested_valid_and_gains_justified():
    rng = random.Random(1)
    paths = [tuple(rng.choice([0, 0, 0, 1, 2]) for _ in range(rng.randint(0, 4))) for _ in range(400)]
    for depth in (1, 2, 3, 4):
        seq = cal.greedy_trees(paths, depth, 20)
        prev: set = set()
        gains = []
        for nodes, gain in seq:
            compile_tree(nodes)  # prefix-closed and gap-free, or it raises
            assert prev < set(nodes) and len(nodes) == len(prev) + 1
            assert max(len(p) for p in nodes) <= depth
            prev = set(nodes)
            gains.append(gain)
        # a gain may only grow when the previous node opened the new one (gap-free ranks force
        # (1,) before (2,)); otherwise greedy would have taken the bigger gain first
        for k in range(1, len(seq)):
            if gains[k] > gains[k - 1]:
                new, prev_node = seq[k][0][-1], seq[k - 1][0][-1]
                assert new in (prev_node[:-1] + (prev_node[-1] + 1,), prev_node + (0,)), (new, prev_node)
        assert any(a > b for a, b in zip(gains, gains[1:])), "data should make some gains fall"
        # acceptance = 1 + sum of the gains taken so far
        for k, (nodes, _) in enumerate(seq):
            assert cal.predicted_acceptance(nodes, paths) == pytest.approx(1 + sum(gains[: k + 1]))


def test_ties_prefer_smaller_rank_sum_then_shallower():
    # (0, 0), (0, 1) and (1,) are each accepted once: rank sums 0, 1, 1; then (1,) is shallower
    seq = cal.greedy_trees([(0, 0), (0, 1), (1,)], 2, 4)
    assert [n[-1] for n, _ in seq] == [(0,), (0, 0), (1,), (0, 1)]


def test_joint_rollout_predictions_are_exact(setup):
    engine, heads, prompts = setup
    sup = cal.superset_tree(4)
    rollouts = cal.joint_rollout(engine, heads, prompts, sup, 40)
    paths = [tuple(s["path"]) for steps in rollouts for s in steps]
    assert cal.predicted_acceptance(sup.paths, paths) > 1.5, "drafts must really be accepted"
    # the superset predicts its own acceptance exactly
    st = Strategy("sup", TopologyBank.of(sup), StaticPolicy(0), heads)
    real = [collect(engine.generate(p, st, GenerationConfig(max_new_tokens=40))) for p in prompts]
    assert paths == [cal.rank_path(sup, r.accepted_nodes) for res in real for r in res.steps if not r.finished]
    # at a prompt's first step every subtree sees the same state: the prediction is exact there
    for sub in ([[0]], [[0], [1], [0, 0]], [[0], [0, 0], [0, 0, 0]]):
        tree = compile_tree(sub)
        st = Strategy("sub", TopologyBank.of(tree), StaticPolicy(0), heads)
        for p, steps in zip(prompts, rollouts):
            first = next(iter(engine.generate(p, st, GenerationConfig(max_new_tokens=40))))
            assert first.accepted == cal.accepted_in(set(tree.paths), tuple(steps[0]["path"]))


def test_build_bank_end_to_end(setup, tmp_path):
    engine, heads, prompts = setup
    cfg = cal.BankBuildConfig(calib_new_tokens=32, measure_prompts=3, measure_new_tokens=24, max_candidates=5)
    prov = {"model": "tiny", "heads_sha256": "x", "calibration": "random", "command": "test"}
    stages = cal.Stages(tmp_path / "work")
    bank, report = cal.build_bank(engine, heads, prompts, cfg, stages, prov, {"model": "tiny", "task": "chat"})
    assert len(bank) >= 2 and bank.trees[0].n_nodes == 1
    assert [t.n_nodes for t in bank.trees] == sorted(t.n_nodes for t in bank.trees)
    back = parse_bank(bank.to_json())  # the written file passes its own validation
    assert [t.paths for t in back.trees] == [t.paths for t in bank.trees]

    # recalibrated acceptance and throughput come from real rollouts with that tree
    for t, st in zip(bank.trees, bank.stats):
        strategy = Strategy(t.name, TopologyBank.of(t), StaticPolicy(0), heads if t.n_nodes > 1 else None)
        runs = [collect(engine.generate(p, strategy, GenerationConfig(max_new_tokens=24))) for p in prompts[:3]]
        tokens, steps = sum(r.new_tokens for r in runs), sum(len(r.steps) for r in runs)
        assert st["mean_accepted"] == pytest.approx(tokens / steps, abs=1e-4)

    # resuming reuses every stage: the same bank comes back without decoding again
    calls = []
    orig = engine.generate
    engine.generate = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        again, _ = cal.build_bank(engine, heads, prompts, cfg, cal.Stages(tmp_path / "work"), prov, {"model": "tiny", "task": "chat"})
    finally:
        engine.generate = orig
    assert not calls and [t.paths for t in again.trees] == [t.paths for t in bank.trees]


def test_fitted_policies_reproduce_their_simulated_choices(setup):
    engine, heads, prompts = setup
    trees = [compile_tree([], "ar"), compile_tree([[0]], "c1"), compile_tree([[0], [1], [0, 0]], "t3"), cal.superset_tree(3)]
    rollouts = cal.joint_rollout(engine, heads, prompts, cal.superset_tree(4), 32)
    step_ms = [10.0, 14.0, 16.0, 40.0]
    policies, scores = cal.fit_policies(rollouts, trees, step_ms, [1.0, 2.0, 3.0, 1.5])
    assert policies["static"].tree == 2
    bank = TopologyBank(trees, [{}] * 4, policies)
    for name, policy in policies.items():
        sim = cal.simulate(policy, rollouts, trees, step_ms)
        assert sim["tokens_per_s"] == pytest.approx(scores[name])
        for steps, picks in zip(rollouts, sim["picks"]):  # the chooser replays the same picks
            choose = policy.chooser()
            assert [choose(s["s"]) for s in steps] == picks
        # and in a real run the engine follows the policy on its own features
        res = collect(engine.generate(prompts[0], Strategy(name, bank, policy, heads), GenerationConfig(max_new_tokens=32)))
        choose = policy.chooser()
        assert [r.tree_index for r in res.steps] == [choose(r.s) for r in res.steps]
    assert scores["tau"] >= scores["static"] - 1e-9
