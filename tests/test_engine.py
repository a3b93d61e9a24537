"""The key invariant: greedy output == transformers `generate`, for every tree, heads and policy;
plus exact tree logits, exact KV commit and the exact sampling distribution."""

import itertools
import math
import random

import pytest
import torch

from entmtp.model import forward
from entmtp.model import kv
from entmtp.spec import verify
from entmtp.config import TREES_FILE, GenerationConfig
from entmtp.spec.engine import Engine, GenerationError, Strategy, collect
from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy
from entmtp.spec.topology import Tree, chain_paths, compile_tree, load_named_trees
from conftest import random_heads, random_tree, reference, tiny_llama

NAMED = load_named_trees(TREES_FILE)


def run(model, prompt, tree_or_bank, heads=None, policy=None, n=30, eos=(), **gen):
    trees = (tree_or_bank,) if isinstance(tree_or_bank, Tree) else tuple(tree_or_bank)
    strategy = Strategy("t", trees, policy or StaticPolicy(0), heads if max(t.max_depth for t in trees) else None)
    return collect(Engine(model, eos).generate(prompt, strategy, GenerationConfig(max_new_tokens=n, **gen)))


def fixed_trees():
    trees = [compile_tree([], "ar"), compile_tree([[0]], "one")]
    trees += [compile_tree(chain_paths(d), f"chain{d}") for d in (2, 3, 4)]
    trees += [NAMED["mc_sim_7b_63"], compile_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0]], "small")]
    return trees


@pytest.fixture(scope="module")
def small_vocab_model():
    """Vocabulary 12: random heads guess right often, so long accepted paths get exercised."""
    return tiny_llama(seed=5, vocab=12)


@pytest.mark.parametrize("kind, kw", [("hydra", {}), ("hydra", {"num_layers": 2}), ("medusa", {})])
def test_greedy_equals_generate_fixed_trees(model, small_vocab_model, prompts, kind, kw):
    for m in (model, small_vocab_model):
        heads = random_heads(m, kind, **kw)
        for prompt in prompts:
            prompt = [t % m.config.vocab_size for t in prompt]
            ref = reference(m, prompt, 30)
            for tree in fixed_trees():
                got = run(m, prompt, tree, heads).token_ids
                assert got == ref, (kind, tree.name, prompt)


def test_greedy_equals_generate_random_trees(model, small_vocab_model, prompts):
    rng = random.Random(7)
    for m in (model, small_vocab_model):
        heads = {k: random_heads(m, k) for k in ("hydra", "medusa")}
        for i in range(12):
            tree = compile_tree(random_tree(rng, max_nodes=30), f"r{i}")
            prompt = [t % m.config.vocab_size for t in prompts[i % len(prompts)]]
            ref = reference(m, prompt, 24)
            for kind in ("hydra", "medusa"):
                assert run(m, prompt, tree, heads[kind], n=24).token_ids == ref, (kind, tree.paths)


def test_drafts_are_really_accepted(small_vocab_model, prompts):
    """Guards against a vacuous equality: with vocab 12 the big tree accepts several tokens per step."""
    m = small_vocab_model
    res = run(m, [t % 12 for t in prompts[1]], NAMED["mc_sim_7b_63"], random_heads(m, "hydra"), n=60)
    assert res.mean_accepted > 1.5
    assert max(r.accepted for r in res.steps) >= 3


def test_prefix_mlp_and_own_lm_head(small_vocab_model, prompts):
    m = small_vocab_model
    heads = random_heads(m, "hydra", arch="prefix-mlp", shared_lm_head=False)
    for prompt in prompts:
        prompt = [t % 12 for t in prompt]
        ref = reference(m, prompt, 30)
        for tree in (NAMED["mc_sim_7b_63"], compile_tree(chain_paths(3))):
            assert run(m, prompt, tree, heads).token_ids == ref


def test_draft_vocabulary_keeps_output_exact(model, prompts):
    heads = random_heads(model, "hydra")
    heads.set_draft_vocab(torch.arange(0, 48, 3))
    ref = reference(model, prompts[0], 30)
    res = run(model, prompts[0], NAMED["mc_sim_7b_63"], heads)
    assert res.token_ids == ref
    drafted = {t for r in res.steps for t in r.draft_tokens[1:]}
    assert drafted and drafted <= set(range(0, 48, 3))


def _bank(rng, n=4):
    trees = [compile_tree([], "ar")] + [compile_tree(random_tree(rng, max_nodes=8 * (i + 1)), f"t{i}") for i in range(n - 1)]
    return trees


@pytest.mark.parametrize("policy_kind", ["ladder", "tau"])
def test_policies_switch_trees_and_stay_exact(model, small_vocab_model, prompts, policy_kind):
    rng = random.Random(11)
    for m in (model, small_vocab_model):
        heads = random_heads(m, "hydra")
        for prompt in prompts:
            prompt = [t % m.config.vocab_size for t in prompt]
            bank = _bank(rng)
            s_values = sorted(r.s for r in run(m, prompt, bank, heads).steps)
            q = [s_values[int(len(s_values) * f)] for f in (0.25, 0.5, 0.75)]
            if policy_kind == "ladder":
                policy = LadderPolicy((0, 1, 2, 3), tuple(q))
            else:
                policy = TauPolicy(1, 3, tau_on=q[2], tau_off=q[0])
            res = run(m, prompt, bank, heads, policy)
            assert res.token_ids == reference(m, prompt, 30)
            assert len({r.tree for r in res.steps}) >= 2, "the policy never switched trees"


def test_eos_and_budget_truncate_inside_a_step(small_vocab_model, prompts):
    m = small_vocab_model
    heads = random_heads(m, "hydra")
    prompt = [t % 12 for t in prompts[2]]
    free = reference(m, prompt, 40)
    eos = free[17]  # a token that really occurs: generation must stop right after it
    m.generation_config.eos_token_id = eos
    try:
        ref = reference(m, prompt, 40)
    finally:
        m.generation_config.eos_token_id = None
    res = run(m, prompt, NAMED["mc_sim_7b_63"], heads, n=40, eos=[eos])
    assert res.token_ids == ref and res.token_ids[-1] == eos and res.steps[-1].stop_reason == "eos"
    for n in (1, 5, 7, 13):
        res = run(m, prompt, NAMED["mc_sim_7b_63"], heads, n=n)
        assert res.token_ids == free[:n] and res.steps[-1].stop_reason == "length"


def test_tree_logits_equal_sequential_logits(model, prompts):
    torch.manual_seed(0)
    tree = NAMED["mc_sim_7b_63"]
    prompt = prompts[1]
    tokens = torch.randint(0, 48, (tree.n_nodes,))
    eng = Engine(model)
    with torch.inference_mode():
        cache = eng.new_cache()
        forward.forward(model, cache, torch.tensor([prompt]), torch.arange(len(prompt))[None], None)
        _, tree_logits = verify.tree_forward(model, cache, tree, tokens, len(prompt))
        for node in range(tree.n_nodes):
            path = [n for n in range(tree.n_nodes) if tree.ancestor_mask[node, n]]
            seq = torch.tensor([prompt + tokens[path].tolist()])
            want = model(seq).logits[0, -1]
            torch.testing.assert_close(tree_logits[node], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("moves", ["tensor-ops", "extension"])
def test_cache_after_commit_equals_recompute(model, prompts, moves, monkeypatch):
    """`kv.commit` keeps what a fresh forward over the accepted tokens makes, whether the moves
    are tensor operations or the extension's `keep_entries` (used once the extension is loaded)."""
    from entmtp.model import ext

    if moves == "extension":
        if ext.extension() is None:
            pytest.skip(f"the extension does not load here: {ext.extension_error()}")
    else:
        monkeypatch.setattr(ext, "loaded", lambda: None)
    torch.manual_seed(1)
    tree = NAMED["mc_sim_7b_63"]
    prompt = prompts[0]
    eng = Engine(model)
    leaves = tree.leaf_paths
    for accepted in ([0], leaves[0][:2], leaves[5], leaves[-1], max(leaves, key=len)):
        assert accepted[0] == 0 and len(accepted) > 1 or accepted == [0]
        tokens = torch.randint(0, 48, (tree.n_nodes,))
        with torch.inference_mode():
            cache = eng.new_cache()
            forward.forward(model, cache, torch.tensor([prompt]), torch.arange(len(prompt))[None], None)
            verify.tree_forward(model, cache, tree, tokens, len(prompt))
            kv.commit(cache, len(prompt), accepted, tree.n_nodes)
            fresh = eng.new_cache()
            seq = prompt + tokens[accepted].tolist()
            forward.forward(model, fresh, torch.tensor([seq]), torch.arange(len(seq))[None], None)
        assert cache.get_seq_length() == len(seq)
        for a, b in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


# -- sampling: the tree sampler must reproduce the target distribution exactly -----------------


def _exact_distribution(model, prompt, n_tokens, temperature):
    """P(x_1..x_n) by enumeration over a tiny vocabulary."""
    v = model.config.vocab_size
    probs = {}
    with torch.inference_mode():
        for seq in itertools.product(range(v), repeat=n_tokens):
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : -1]
            lp = torch.log_softmax(logits.double() / temperature, -1)
            probs[seq] = math.exp(sum(float(lp[i, t]) for i, t in enumerate(seq)))
    return probs


def _chi2(counts, probs, n):
    """Chi-square statistic and its 0.1% critical value, pooling cells expected below 5."""
    stat, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, -1
    for seq, p in probs.items():
        exp = p * n
        if exp < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += exp
            continue
        stat += (counts.get(seq, 0) - exp) ** 2 / exp
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    z = 3.09  # Wilson-Hilferty approximation of the chi-square quantile at 0.999
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


@pytest.fixture(scope="module")
def sampling_setup():
    m = tiny_llama(seed=2, vocab=6)
    heads = random_heads(m, "hydra", seed=4)
    tree = compile_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "sampler")
    prompt = [1, 4, 2, 5]
    return m, heads, tree, prompt, _exact_distribution(m, prompt, 3, 1.0)


def _sample_counts(m, heads, tree, prompt, n, **gen):
    eng = Engine(m)
    strategy = Strategy("s", (tree,), StaticPolicy(0), heads)
    counts, multi = {}, 0
    for seed in range(n):
        res = collect(eng.generate(prompt, strategy, GenerationConfig(max_new_tokens=3, temperature=1.0, seed=seed, **gen)))
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        multi += any(r.accepted > 1 for r in res.steps)
    return counts, multi


def test_tree_sampling_reproduces_the_target_distribution(sampling_setup):
    m, heads, tree, prompt, probs = sampling_setup
    n = 2500
    counts, multi = _sample_counts(m, heads, tree, prompt, n)
    assert multi > n // 4, "drafts were rarely accepted: the test would not exercise the tree sampler"
    stat, crit = _chi2(counts, probs, n)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: the sampler is biased"


def test_typical_acceptance_fails_the_same_test(sampling_setup):
    """Power check: the lossy typical acceptance, with the shipped epsilon and alpha
    (GenerationConfig's defaults, as Hydra's and Medusa's), must be detected by the test above."""
    m, heads, tree, prompt, probs = sampling_setup
    n = 2500
    counts, _ = _sample_counts(m, heads, tree, prompt, n, typical=True)
    stat, crit = _chi2(counts, probs, n)
    assert stat > crit, f"chi2 {stat:.1f} <= {crit:.1f}: typical acceptance went undetected"


def test_bad_requests_are_refused(model):
    eng = Engine(model)
    st = Strategy("ar", (compile_tree([]),), StaticPolicy(0))
    with pytest.raises(GenerationError, match="empty"):
        eng.generate([], st)
    with pytest.raises(GenerationError, match="positive"):
        eng.generate([1], st, GenerationConfig(max_new_tokens=0))
    with pytest.raises(GenerationError, match="temperature"):
        eng.generate([1], st, GenerationConfig(temperature=-1))
    with pytest.raises(GenerationError, match="context"):
        eng.generate([1] * 300, st)
    with pytest.raises(ValueError, match="needs 4 heads"):
        Strategy("x", (NAMED["mc_sim_7b_63"],), StaticPolicy(0), random_heads(model, num_heads=3))
