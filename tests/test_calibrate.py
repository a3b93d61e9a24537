"""Banks that travel, on the tiny model: traces, exact simulation, candidate trees, fitting, caching."""

import json
import random

import pytest

from entmtp.bank import build
from entmtp.bank import fit as fitting
from entmtp.bank import calibrate as cal
from entmtp.bank import record as rec
from entmtp.bank import traces as tr
from entmtp.bank.bank import TopologyBank, parse_bank
from entmtp.config import BankBuildConfig, CalibrateConfig, GenerationConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy, path_value
from entmtp.spec.topology import compile_tree
from conftest import random_heads, random_tree, tiny_llama


N_NEW = 40


@pytest.fixture(scope="module", params=["hydra", "prefix-mlp", "medusa"])
def setup(request):
    m = tiny_llama(seed=5, vocab=12)
    kind = "medusa" if request.param == "medusa" else "hydra"
    kw = {"arch": "prefix-mlp", "shared_lm_head": False} if request.param == "prefix-mlp" else {}
    heads = random_heads(m, kind, **kw)
    rng = random.Random(0)
    prompts = [[rng.randrange(12) for _ in range(rng.randint(3, 9))] for _ in range(6)]
    engine = Engine(m)
    traces = rec.record_all(engine, heads, prompts, N_NEW, 4)
    return engine, heads, prompts, traces


def real_run(engine, heads, prompt, bank, policy):
    return collect(engine.generate(prompt, Strategy("t", bank, policy, heads if max(t.max_depth for t in bank) else None),
                                   GenerationConfig(max_new_tokens=N_NEW)))


def test_greedy_trees_are_nested_valid_and_gains_justified():
    rng = random.Random(1)
    paths = [tuple(rng.choice([0, 0, 0, 1, 2]) for _ in range(rng.randint(0, 4))) for _ in range(400)]
    for depth in (1, 2, 3, 4):
        seq = build.greedy_trees(paths, depth, 20)
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
            assert build.predicted_acceptance(nodes, paths) == pytest.approx(1 + sum(gains[: k + 1]))


def test_ties_prefer_smaller_rank_sum_then_shallower():
    # (0, 0), (0, 1) and (1,) are each accepted once: rank sums 0, 1, 1; then (1,) is shallower
    seq = build.greedy_trees([(0, 0), (0, 1), (1,)], 2, 4)
    assert [n[-1] for n, _ in seq] == [(0,), (0, 0), (1,), (0, 1)]


def test_traces_predict_every_tree_exactly(setup):
    """Simulated steps and accepted lengths equal a real rollout's, step by step, for any tree."""
    engine, heads, prompts, traces = setup
    rng = random.Random(7)
    trees = [compile_tree([], "ar"), compile_tree([[0], [1], [1, 0]], "late-chain")]
    trees += [compile_tree(random_tree(rng, 24, 4), f"r{i}") for i in range(6)]
    tables = tr.Tables(trees, traces)
    feats = [t.feature("p0", 4) for t in traces]
    accepted_some = False
    for k, tree in enumerate(trees):
        for j, prompt in enumerate(prompts):
            real = real_run(engine, heads, prompt, (tree,), StaticPolicy(0))
            sim = tr.simulate(tr.Tables([tree], [traces[j]]), StaticPolicy(0).chooser, [feats[j]], [1.0])
            assert sim.steps == len(real.steps) and sim.tokens == real.new_tokens, (tree.name, j)
            accepted_some |= any(r.accepted > 1 for r in real.steps)
        assert tables.accepted[k][0][0] >= 1
    assert accepted_some, "the heads must really get drafts accepted"


@pytest.mark.parametrize("feature,depth", [("p0", 0), ("path_value", 0), ("path_value", 1), ("path_value", 2), ("neg_entropy", 0)])
def test_traces_predict_switching_policies_exactly(setup, feature, depth):
    """A ladder and a τ policy pick the same tree at every step in simulation and in the engine
    (a path value through fewer heads than the bank's depth included)."""
    engine, heads, prompts, traces = setup
    trees = [compile_tree([], "ar"), compile_tree([[0]], "c1"), compile_tree([[0], [1], [0, 0]], "t3"),
             compile_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]], "t8")]
    bank = TopologyBank(trees, [{}] * 4, {})
    reads = depth or bank.max_depth
    values = sorted(v for t in traces for v in t.feature(feature, reads))
    q = fitting._quantiles(values, 4)
    assert len(q) == 3
    policies = [LadderPolicy((0, 1, 2, 3), tuple(q), feature, depth), TauPolicy(1, 3, q[2], q[0], feature, depth)]
    tables, early = tr.Tables(trees, traces), 0
    for policy in policies:
        for j, prompt in enumerate(prompts):
            real = real_run(engine, heads, prompt, bank, policy)
            sim = tr.simulate(tr.Tables(trees, [traces[j]]), policy.chooser, [traces[j].feature(feature, reads)], [1.0] * 4)
            assert sim.picks == [r.tree_index for r in real.steps], (policy, j)
            assert sim.tokens == real.new_tokens
            if feature == "path_value":  # the engine read g head by head through at most `reads` heads, up to the first that settles
                g = [[path_value(p, c[:d]) for d in range(1, reads + 1)] for p, c in zip(traces[j].p0, traces[j].chain)]
                starts = [sum(r.accepted for r in real.steps[:k]) for k in range(len(real.steps))]
                choose, read = policy.chooser(), []
                for i in starts:
                    d = next((d for d, v in enumerate(g[i], 1) if choose.settled(v)), reads)
                    read.append(d)
                    choose(g[i][d - 1])
                assert [r.feature for r in real.steps] == pytest.approx([g[i][d - 1] for i, d in zip(starts, read)], rel=1e-4, abs=1e-6)
                assert [r.heads_read for r in real.steps] == read
                early += sum(d < reads for d in read)
                lazy = tr.simulate(tr.Tables(trees, [traces[j]]), policy.chooser, [], [1.0] * 4, 0.0, ([g], [[0.0] * 4] * (reads + 1)))
                assert lazy.picks == sim.picks
        picks = tr.simulate(tables, policy.chooser, [t.feature(feature, reads) for t in traces], [1.0] * 4).picks
        assert len(set(picks)) > 1, "thresholds at the quantiles must make the policy switch"
    assert feature != "path_value" or reads == 1 or early, "some steps should settle before the policy's last head"


def synthetic(n_traces: int = 4, n: int = 60) -> list[tr.Trace]:
    """Positions alternate between confident (p0 0.9: the chain (0,0,0) is right) and unsure
    (p0 0.2: nothing is accepted) in runs of five."""
    out = []
    for _ in range(n_traces):
        ranks, p0 = [], []
        for i in range(n):
            sure = (i // 5) % 2 == 0
            ranks.append([0, 0, 0, 0] if sure else [3, -1, -1, -1])
            p0.append(0.9 if sure else 0.2)
        out.append(tr.Trace(10, ranks, p0, [0.5] * n, [[0.9] * 4 for _ in range(n)]))
    return out


def test_fit_switches_where_switching_pays():
    """Big trees cost twice a small one: τ must go big exactly on confident positions and beat static."""
    trees = [compile_tree([], "n1-d0"), compile_tree([[0]], "n2-d1"), compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3")]
    costs = [10.0, 11.0, 20.0]
    fit = fitting.fit_task(trees, synthetic(), costs, 0.0, grid=12)
    pol = fit["policies"]
    assert pol["static"]["tree"] == "n2-d1"  # static: one cheap draft beats paying 20 ms on unsure steps
    assert {pol["tau"]["small"], pol["tau"]["large"]} == {"n2-d1", "n4-d3"} or pol["tau"]["small"] == "n1-d0"
    assert fit["predicted_tokens_per_s"]["entmtp-tau"] > 1.2 * fit["predicted_tokens_per_s"]["entmtp-static"]
    assert fit["predicted_tokens_per_s"]["entmtp-ladder"] > 1.2 * fit["predicted_tokens_per_s"]["entmtp-static"]
    assert not fit["degenerate"]
    assert fit["features"]["p0"]["spearman"] > 0.9  # p0 predicts acceptance perfectly here
    # the path value costs the heads' chain through the bank's depth every step: when that chain
    # is dear, a policy on it pays for it in the prediction and another feature wins
    dear = fitting.fit_task(trees, synthetic(), costs, 0.0, grid=12, chain_ms=[0.0, 30.0, 30.0, 30.0])
    assert dear["feature"] != "path_value" and dear["chain_ms"] == [0.0, 30.0, 30.0, 30.0]
    assert dear["features"]["path_value"]["tau"] < dear["features"]["p0"]["tau"]
    # a chain that is cheap for one head and dear beyond: read head by head, a policy on g_3 stops
    # at the first head where g_1 already settles its choice (the unsure runs) and reads on only
    # where it then drafts the deep tree, which runs those heads anyway; so every depth predicts
    # what g_1 does (read to the end on every step, g_3 would pay 29.5 ms on each unsure one)
    shallow = fitting.fit_task(trees, synthetic(), costs, 0.0, grid=12, chain_ms=[0.0, 0.5, 30.0, 30.0])
    pv = shallow["features"]["path_value"]
    assert set(pv["depths"]) == {"1", "2", "3"}
    assert pv["depths"]["3"]["tau"] == pytest.approx(pv["depths"]["1"]["tau"], rel=1e-6)
    assert pv["tau"] > 1.2 * shallow["predicted_tokens_per_s"]["entmtp-static"]
    # with the big tree as cheap as the small one nothing is worth switching for: τ says so
    flat = fitting.fit_task(trees, synthetic(), [10.0, 10.0, 10.0], 0.0, grid=12)
    assert flat["policies"]["static"]["tree"] == "n4-d3"
    assert "tau" in flat["degenerate"] and "never switches" in flat["degenerate"]["tau"]


def test_a_cheaper_median_for_a_bigger_tree_is_pooled_as_noise():
    """Costs become non-decreasing in tree size (pool adjacent violators); the medians stay beside."""
    trees = [compile_tree([], "n1-d0"), compile_tree([[0]], "n2-d1"), compile_tree([[0], [0, 0]], "n3-d2"),
             compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3")]
    assert fitting.monotone_costs(trees, [10.0, 14.0, 12.0, 20.0]) == [10.0, 13.0, 13.0, 20.0]
    assert fitting.monotone_costs(trees, [10.0, 11.0, 12.0, 13.0]) == [10.0, 11.0, 12.0, 13.0]
    assert fitting.monotone_costs(trees, [13.0, 12.0, 11.0, 10.0]) == [11.5] * 4
    fit = fitting.fit_task(trees, synthetic(2, 20), [10.0, 14.0, 12.0, 20.0], 0.0)
    assert [fit["trees"][t.name]["step_ms"] for t in trees] == [10.0, 13.0, 13.0, 20.0]
    assert [fit["trees"][t.name]["measured_ms"] for t in trees] == [10.0, 14.0, 12.0, 20.0]
    wide = [compile_tree([], "n1-d0"), compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3"), compile_tree([[0], [1], [2], [3], [4]], "n6-d1")]
    assert fitting.monotone_costs(wide, [10.0, 30.0, 20.0]) == [10.0, 30.0, 20.0]  # depth falls as nodes grow: left as measured


def test_fit_prices_each_tree_by_its_traces():
    trees = [compile_tree([], "n1-d0"), compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3")]
    fit = fitting.fit_task(trees, synthetic(2, 20), [10.0, 20.0], 1.0)
    # per trace (20 positions, runs of 5): steps at 0, 4 (sure: +4 each), 8, 9 (unsure: +1), 10, 14, 18, 19
    n4 = fit["trees"]["n4-d3"]
    assert n4["mean_accepted"] == pytest.approx(40 / 16)
    assert n4["tokens_per_s"] == pytest.approx(40 / (16 * 20.0 + 2 * 10 * 1.0) * 1e3, rel=1e-3)
    assert fit["trees"]["n1-d0"]["tokens_per_s"] == pytest.approx(40 / (40 * 10.0 + 20.0) * 1e3, rel=1e-3)


def tiny_bank(setup, tmp_path, fp):
    engine, heads, prompts, _ = setup
    cfg = BankBuildConfig(calib_new_tokens=24, max_candidates=5)
    prov = {"model": "tiny", "heads_sha256": "x", "calibration": "random", "command": "test", "date": "d", "hardware": "h"}
    calib = CalibrateConfig(context=16, rounds=1, steps=2)
    return build.build_bank(engine, heads, prompts, cfg, build.Stages(tmp_path / "work"),
                          {"model": "tiny", "task": "chat", "provenance": prov}, fp, calib)


def test_build_bank_end_to_end_and_resume(setup, tmp_path):
    engine, heads, prompts, _ = setup
    fp = {"device": "cpu test", "threads": 1, "dtype": "float32", "kernels": "stock", "torch": "x"}
    bank = tiny_bank(setup, tmp_path, fp)
    assert bank.trees[0].n_nodes == 1 and len(bank.trees) >= 3 and len(bank.traces) == len(prompts)
    assert bank.fit["fingerprint"] == fp and bank.shipped_fit is bank.fit
    back = parse_bank(json.loads(json.dumps(bank.to_json())))  # the written file passes its own validation
    assert [t.paths for t in back.trees] == [t.paths for t in bank.trees]
    assert back.fit == bank.fit and back.policies == bank.policies
    # the candidates are nested by acceptance: more nodes, more accepted tokens on the traces
    acc = [bank.fit["trees"][t.name]["mean_accepted"] for t in bank.trees]
    assert acc == sorted(acc) and acc[-1] > acc[0]
    # resuming reuses the traces: no greedy decode runs again (only the timing steps)
    calls = []
    orig = build.record_all.__globals__["record"]
    build.record_all.__globals__["record"] = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        again = tiny_bank(setup, tmp_path, fp)
    finally:
        build.record_all.__globals__["record"] = orig
    assert not calls and [t.paths for t in again.trees] == [t.paths for t in bank.trees]


def test_fits_are_cached_per_machine(setup, tmp_path, monkeypatch):
    engine, heads, *_ = setup
    fp_a = {"device": "cpu A", "threads": 1, "dtype": "float32", "kernels": "stock", "torch": "x"}
    fp_b = {**fp_a, "device": "cpu B"}
    bank = tiny_bank(setup, tmp_path, fp_a)
    calib = CalibrateConfig(context=16, rounds=1, steps=2)
    timed = []
    real = cal.time_and_fit
    monkeypatch.setattr(cal, "time_and_fit", lambda *a, **k: timed.append(1) or real(*a, **k))
    # on the machine that built it, the shipped fit is this machine's: nothing is timed
    got = cal.resolve_fits(engine, heads, {"chat": bank}, fp_a, tmp_path / "cache", "auto", calib)
    assert got["chat"].fit is bank.shipped_fit and not timed
    # elsewhere: timed once, cached, then read back
    got = cal.resolve_fits(engine, heads, {"chat": bank}, fp_b, tmp_path / "cache", "auto", calib)
    assert len(timed) == 1 and got["chat"].fit["fingerprint"] == fp_b
    # and cost against context, for predictions at the prompt at hand: two contexts, the smallest
    # and largest trees, the prefill at either length
    cc = got["chat"].fit["context_cost"]
    assert cc["contexts"][0] < cc["contexts"][1] == got["chat"].fit["context"] <= 16
    assert cc["nodes"] == [min(t.n_nodes for t in bank.trees), max(t.n_nodes for t in bank.trees)]
    assert all(s >= 0 for s in cc["slope_ms_per_token"]) and [p[0] for p in cc["prefill"]] == cc["contexts"]
    assert all(p[1] > 0 for p in cc["prefill"])
    assert cal.fit_cache_file(tmp_path / "cache", bank, fp_b).exists()
    again = cal.resolve_fits(engine, heads, {"chat": bank}, fp_b, tmp_path / "cache", "auto", calib)
    assert len(timed) == 1 and again["chat"].fit == got["chat"].fit
    # --no-calibrate: the shipped fit whatever the machine; refit: timed again
    assert cal.resolve_fits(engine, heads, {"chat": bank}, fp_b, tmp_path / "cache", "shipped", calib)["chat"].fit is bank.shipped_fit
    cal.resolve_fits(engine, heads, {"chat": bank}, fp_b, tmp_path / "cache", "refit", calib)
    assert len(timed) == 2


def test_tau_must_beat_the_static_tree_by_a_margin():
    """A switching τ whose predicted gain is under TAU_MIN_GAIN stays the static tree."""
    from entmtp.bank.fit import TAU_MIN_GAIN, _fit_tau
    from entmtp.spec.policy import StaticPolicy

    for gain, switches in ((TAU_MIN_GAIN / 2, False), (TAU_MIN_GAIN * 2, True)):
        score = lambda pols, g=gain: [100.0 * (1 + g) if p.small != p.large else 100.0 for p in pols]  # noqa: E731
        pol, tps = _fit_tau([0, 1], [0.3, 0.6], "p0", StaticPolicy(1), 100.0, score)
        assert (pol.small != pol.large) == switches
        assert tps == pytest.approx(100.0 * (1 + gain) if switches else 100.0)


def test_tau_candidates_at_once_equal_simulate_bit_for_bit():
    """`traces.simulate_tau` (every τ candidate of a fit in one vectorised decode) gives each
    candidate's ms exactly as `simulate` does one by one: on every feature, the path value read
    head by head at every depth with a chain cost per head, traces of different lengths (one
    empty), candidates whose trees are equal, and thresholds that sit on recorded values."""
    rng = random.Random(11)
    trees = [compile_tree([], "n1-d0"), compile_tree([[0]], "n2-d1"), compile_tree([[0], [1], [0, 0]], "n3-d2"),
             compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3")]
    traces = []
    for n in (0, 1, 9, 40, 23):
        ranks = [[rng.choice([0, 0, 0, 1, -1]) for _ in range(3)] for _ in range(n)]
        chain = [[rng.choice([0.25, 0.5, 0.9, rng.random()]) for _ in range(3)] for _ in range(n)]
        p0 = [rng.choice([0.5, rng.random()]) for _ in range(n)]
        traces.append(tr.Trace(rng.randrange(3, 30), ranks, p0, [rng.random() * 3 for _ in range(n)], chain))
    tables = tr.Tables(trees, traces)
    costs = [9.7, 11.3, 14.1, 19.9]
    grid = [0.0, 0.1, 0.25, 0.5, 0.6, 0.9, 1.5]
    chain_ms = [0.0, 0.4, 1.1, 2.3]
    extra = [None] + [[max(0.0, chain_ms[d] - chain_ms[t.max_depth]) for t in trees] for d in range(1, 4)]
    for feature, depth in (("p0", 0), ("neg_entropy", 0), ("path_value", 1), ("path_value", 2), ("path_value", 3)):
        cands = [TauPolicy(a, b, on, off, feature, depth) for a in range(4) for b in range(a, 4) for on in grid for off in grid if off <= on]
        if feature == "path_value":
            reads = ([[[path_value(p, c[:k]) for k in range(1, depth + 1)] for p, c in zip(t.p0, t.chain)] for t in traces], extra)
            want = [tr.simulate(tables, c.chooser, [], costs, 0.37, reads).ms for c in cands]
            got = tr.simulate_tau(tables, cands, [], costs, 0.37, reads)
        else:
            feats = [t.feature(feature, 0) for t in traces]
            want = [tr.simulate(tables, c.chooser, feats, costs, 0.37).ms for c in cands]
            got = tr.simulate_tau(tables, cands, feats, costs, 0.37)
        assert got == want, feature
        assert len(set(want)) > 20  # the candidates really decode differently
    assert tr.simulate_tau(tables, [], [], costs) == []


def test_timing_turns_come_in_blocks():
    """`calibrate` times trees in blocks: each tree keeps the turn for `run` steps, so all but the
    first step of a block follow a step of the same tree."""
    choose = cal.RoundRobin(3, 2).chooser()
    assert [choose(0.5) for _ in range(8)] == [0, 0, 1, 1, 2, 2, 0, 0]
    choose = cal.RoundRobin(2).chooser()
    assert [choose(0.5) for _ in range(4)] == [0, 1, 0, 1]


def test_the_ceiling_is_the_best_any_sequence_of_choices_reaches():
    """`foresight` equals a brute force over every sequence of trees on short traces, and no fitted
    policy or static tree beats the ceiling the fit reports."""
    import itertools

    rng = random.Random(3)
    trees = [compile_tree([], "n1-d0"), compile_tree([[0]], "n2-d1"), compile_tree([[0], [0, 0], [0, 0, 0]], "n4-d3")]
    costs = [10.0, 13.0, 21.0]
    for _ in range(5):
        n = 7
        ranks = [[rng.choice([0, 0, 1, -1]) for _ in range(4)] for _ in range(n)]
        trace = tr.Trace(5, ranks, [0.5] * n, [0.5] * n, [[0.5] * 4 for _ in range(n)])
        tables = tr.Tables(trees, [trace])
        best = float("inf")
        for seq in itertools.product(range(3), repeat=n):  # every step may pick any tree
            i, ms, k = 0, 0.0, 0
            while i < n:
                ms += costs[seq[k]]
                i += tables.accepted[seq[k]][0][i]
                k += 1
            best = min(best, ms)
        got = tr.foresight(tables, costs, 2.0)
        assert got.ms == pytest.approx(best + 2.0 * 5) and got.tokens == n
        assert sum(costs[k] for k in got.picks) == pytest.approx(best)  # the picks it reports realise it
        only_small = tr.foresight(tables, costs, 2.0, among=[0])
        assert only_small.ms == pytest.approx(10.0 * n + 10.0) and only_small.steps == n
    fit = fitting.fit_task(trees, synthetic(), costs, 1.0, grid=12)
    ceiling = fit["ceiling"]["tokens_per_s"]
    assert all(v <= ceiling + 1e-6 for k, v in fit["predicted_tokens_per_s"].items() if k != "hydra")
    assert all(st["tokens_per_s"] <= ceiling + 1e-6 for st in fit["trees"].values())
    # with no feature to pay for, the ladder starts from the static tree's and can only improve on it
    assert fit["predicted_tokens_per_s"]["entmtp-ladder"] >= fit["predicted_tokens_per_s"]["entmtp-static"] - 1e-6
    assert fit["ceiling"]["over_ar"] == pytest.approx(ceiling / fit["predicted_tokens_per_s"]["ar"], rel=1e-3)
    fit.update(hardware="h", date="d")  # what `calibrate` adds
    assert "ceiling:" in fitting.fit_table(fit) and fitting.fit_summary(fit)["ceiling"] == fit["ceiling"]


def test_context_cost_interleaves_the_two_contexts(monkeypatch):
    """The two contexts take turns round by round and each tree's slope comes from the medians:
    a machine that slows down during the calibration cannot pass for a context that costs less."""
    small, big = compile_tree([], "n1"), compile_tree([[0], [1], [0, 0]], "n4")
    order, clock = [], iter(range(100))

    def fake(engine, heads, trees, cfg, progress=None, turn=None, book=None, rule=None):
        order.append(cfg.context)
        drift = next(clock)  # the machine gets 1 ms slower with every run
        cost = {cal.tree_key(small): 10.0 + drift + 0.01 * cfg.context, cal.tree_key(big): 20.0 + drift + 0.05 * cfg.context}
        return cost, 0.5, cfg.context

    monkeypatch.setattr(cal, "measure_costs", fake)
    got = cal.measure_context_cost(None, None, [small, big], CalibrateConfig(context=192, short_context=32, rounds=4))
    assert order == [192, 32, 32, 192, 192, 32, 32, 192]
    assert got["contexts"] == [32, 192] and got["nodes"] == [1, 4]
    assert got["slope_ms_per_token"] == pytest.approx([0.01, 0.05])
