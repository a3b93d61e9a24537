"""Drafting: every token `expand` drafts equals a direct drafting, node by node, from its own path."""

import copy
import random

import pytest
import torch

from entmtp.model import gguf
from entmtp.spec.drafting import _top1, expand, top1_chain
from entmtp.spec.topology import compile_tree
from conftest import random_heads, random_tree

# trees whose chain node (0, ..., 0) is not expanded at some depth where other nodes are
ODD_TREES = [
    [[0], [1], [1, 0]],
    [[0], [1], [2], [2, 0], [2, 1], [1, 0], [1, 0, 0]],
    [[0], [1], [0, 0], [1, 0], [1, 1], [1, 1, 0], [1, 1, 1]],
    [[0], [0, 0], [0, 1], [0, 1, 0], [0, 1, 0, 0]],
]
# trees expanded along the rank-0 chain alone (`Tree.chain_ks`: `expand` takes each depth's top-k
# straight from the chain's logits), the shapes the fitted banks hold
CHAIN_TREES = [[[0]], [[0], [0, 0], [0, 0, 0]], [[0], [1], [0, 0], [0, 0, 0]], [[0], [0, 0], [0, 1], [0, 0, 0]],
               [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]]
KINDS = [("hydra", {}), ("hydra", {"arch": "prefix-mlp"}), ("medusa", {})]


def reference_draft(tree, heads, feature, root):
    """One head call per node with children, on that node's own path: root..node."""
    tokens = [root] + [None] * (tree.n_nodes - 1)
    for node in range(tree.n_nodes):  # node ids are ordered by depth: parents come first
        kids = tree.children[node]
        if not kids:
            continue
        path, j = [], node
        while j >= 0:
            path.append(tokens[j])
            j = tree.parent[j]
        path = torch.tensor([path[::-1]])  # (1, depth+1)
        logits = heads.head_logits(tree.depth[node], feature[None], path)[0]
        top = heads.to_token_ids(torch.topk(logits, len(kids)).indices).tolist()
        for child in kids:
            tokens[child] = top[tree.rank[child]]
    return tokens


def chain_skipped(tree) -> bool:
    """Some depth expands nodes but not the chain node (0, ..., 0)."""
    return any(tree.paths[int(p.parents[0]) - 1] != (0,) * d for d, p in enumerate(tree.plans) if d)


def features(model, heads, n):
    """(root, feature) at each of n positions of a random sequence, as the engine gets them."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
    out = model.model(ids)
    hidden = out.last_hidden_state[0]  # (n, H)
    roots = model.lm_head(hidden).argmax(-1).tolist()
    ctx = heads.new_context()
    return [(roots[t], ctx.observe(hidden[t : t + 1])) for t in range(n)]


@pytest.mark.parametrize("kind, kw", KINDS)
def test_expand_equals_reference_drafting(model, kind, kw):
    heads = random_heads(model, kind, **kw)
    rng = random.Random(11)
    trees = [compile_tree(t, f"odd{i}") for i, t in enumerate(ODD_TREES)]
    trees += [compile_tree(t, f"chain{i}") for i, t in enumerate(CHAIN_TREES)]
    while len(trees) < 50:
        trees.append(compile_tree(random_tree(rng, max_nodes=24), f"r{len(trees)}"))
    assert sum(chain_skipped(t) for t in trees) >= 10 and sum(t.chain_ks is not None for t in trees) >= len(CHAIN_TREES)
    with torch.no_grad():
        for tree, (root, feature) in zip(trees, features(model, heads, len(trees))):
            chain, _ = top1_chain(heads, feature, root, tree.max_depth)
            got = expand(tree, heads, feature, root, chain).tolist()
            assert got == reference_draft(tree, heads, feature, root), tree.as_lists()


def test_expand_with_a_draft_vocabulary(model):
    heads = random_heads(model, "hydra")
    heads.set_draft_vocab(torch.arange(5, 45, 2))
    tree = compile_tree(ODD_TREES[1])
    with torch.no_grad():
        for root, feature in features(model, heads, 5):
            chain, _ = top1_chain(heads, feature, root, tree.max_depth)
            got = expand(tree, heads, feature, root, chain).tolist()
            assert got == reference_draft(tree, heads, feature, root)
            assert all(t in range(5, 45, 2) for t in got[1:])


@pytest.mark.parametrize("packed", [False, True])
def test_a_chain_tree_drafts_the_spine_without_ranking_a_row_again(model, packed, monkeypatch):
    """A chain of one child a depth is the root and the tokens the top-1 chain went through
    (`expand(..., spine=Chain.tokens)`): the same tokens as ranking each row again, taken with no
    top-k; with a forcer the spine's tokens are the forced ones, an outside token included. Other
    trees ignore the spine."""
    heads = random_heads(model, "hydra")
    heads.blocks = "q4_1"
    heads.set_draft_vocab(torch.arange(3, 47, 2))  # odd ids 3..45: every even id lies outside
    if packed:
        ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
        heads = copy.deepcopy(heads).bind(model).pack((torch.randn(60, model.config.hidden_size), ids))
        assert heads._chain is not None

    def force(path, head_p, row):  # an index first at even depths, an outside token at depth 1
        depth = len(path) - 1
        return ([-1 - 12, 2], 0.5) if depth == 1 else (([5], 0.25) if depth % 2 == 0 else ([], -1.0))

    topks = []
    with torch.inference_mode():
        for forcer in (None, force):
            for root, feature in features(model, heads, 6):
                chain = top1_chain(heads, feature, root, 4, force=forcer)
                outside = heads.outside(chain.tokens)
                for d in range(1, 5):
                    tree = compile_tree([[0] * k for k in range(1, d + 1)], f"chain{d}")
                    ranked = expand(tree, heads, feature, root, chain[0], outside).tolist()
                    original = torch.topk
                    monkeypatch.setattr(torch, "topk", lambda *a, **k: topks.append(1) or original(*a, **k))
                    got = expand(tree, heads, feature, root, chain[0], outside, chain.tokens).tolist()
                    monkeypatch.setattr(torch, "topk", original)
                    assert got == ranked == [root] + chain.tokens[:d]
                    if forcer is not None and d >= 2:
                        assert got[2] == 12  # the outside token the forcer put first at depth 1
                wide = compile_tree([[0], [1], [0, 0]], "wide")
                assert expand(wide, heads, feature, root, chain[0], outside, chain.tokens).tolist() == \
                    expand(wide, heads, feature, root, chain[0], outside).tolist()
    assert not topks


@pytest.mark.parametrize("kind, kw", KINDS)
def test_a_chain_continued_from_a_shorter_one_is_the_same_chain(model, kind, kw):
    """The engine runs the top-1 chain to the policy's depth, then on to the tree's: the heads it
    already ran are not run again, and the result is the chain run in one go."""
    heads = random_heads(model, kind, **kw).requires_grad_(False)
    for root, feature in features(model, heads, 4):
        whole = top1_chain(heads, feature, root, 4)
        for d in range(5):
            calls = []
            short = top1_chain(heads, feature, root, d)
            original = heads.head_logits
            heads.head_logits = lambda i, *a: calls.append(i) or original(i, *a)
            try:
                logits, probs = resumed = top1_chain(heads, feature, root, 4, short)
                # a bare (logits, probs) prefix picks its tokens again from the logits: the same chain
                again = top1_chain(heads, feature, root, 4, tuple(short))
            finally:
                del heads.head_logits
            assert calls == list(range(d, 4)) * 2
            assert probs == whole[1] and all(torch.equal(a, b) for a, b in zip(logits, whole[0]))
            assert resumed.tokens == again.tokens == whole.tokens and len(whole.tokens) == 4
            assert again[1] == whole[1] and all(torch.equal(a, b) for a, b in zip(again[0], whole[0]))


@pytest.mark.parametrize("blocks, lm_blocks", [("q8_0", "q8_0"), ("q4_1", "q8_0"), ("q4_1", "q4_1")])
@pytest.mark.parametrize("kind, kw", KINDS)
def test_chain_on_blocks_is_the_modules_chain_bit_for_bit(model, kind, kw, blocks, lm_blocks):
    """Heads on GGUF blocks (Q8_0 or Q4_1 ResBlocks; the LM head in Q8_0, or in Q4_1 with its best
    rows refined in Q8_0) run the top-1 chain in one extension call (`top1_on_blocks`, a widened
    ResBlock's two linears as one product): the same logits and probabilities as the modules, op
    by op, from the root or from a longer path, with and without a draft vocabulary, so the engine
    drafts what a bank's traces recorded."""
    heads = random_heads(model, kind, **kw)
    heads.blocks, heads.lm_blocks = blocks, lm_blocks
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
    for vocab in (None, torch.arange(3, 47, 2)):
        heads.set_draft_vocab(vocab)
        packed = copy.deepcopy(heads).bind(model).pack((torch.randn(60, model.config.hidden_size), ids))
        assert packed.numerics.startswith("q8-blocks" if blocks == "q8_0" else "q4_1-blocks") and packed._chain is not None
        assert packed.numerics.endswith("-lm-q4_1-top16-q8") == (lm_blocks == "q4_1")
        assert all(lin.kind == blocks for i in range(packed.num_heads) for b in packed.head_blocks(i)
                   for lin in (b.linear, b.res_connection) if isinstance(lin, gguf.BlockLinear))
        with torch.inference_mode():
            for root, feature in features(model, packed, 6):
                for start in ([root], [root, 5], [root, 5, 7]):
                    path = torch.tensor([start])
                    fast = packed.top1_on_blocks(feature, path, 4)
                    chain, packed._chain = packed._chain, None
                    try:
                        slow = _top1(packed, feature, path, 4)
                    finally:
                        packed._chain = chain
                    assert len(fast[0]) == len(slow[0]) == 4 - len(start) + 1
                    # the extension's lists: its probabilities the float32 values, exactly
                    assert fast[1] == slow[1].tolist() and all(torch.equal(a, b) for a, b in zip(fast[0], slow[0]))
                    assert fast[2] == slow[2].tolist()  # the tokens the path went on through


@pytest.mark.parametrize("kind, kw", KINDS)
def test_a_token_from_outside_the_draft_vocabulary_goes_first_on_the_spine(model, kind, kw):
    """A forcer may name a token outside the draft vocabulary first (`-1 - token`,
    `phrasebook.spine_first`): the chain goes on through it, the row keeps the rest of the forced
    order, the extension's chain equals the modules' bit for bit, and `expand` makes the token the
    spine node's rank-0 child, the row's top k - 1 after it."""
    from entmtp.spec.drafting import Chain

    heads = random_heads(model, kind, **kw)
    vocab = torch.arange(3, 47, 2)  # odd ids 3..45: every even id lies outside
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
    heads.set_draft_vocab(vocab)
    packed = copy.deepcopy(heads).bind(model).pack((torch.randn(60, model.config.hidden_size), ids))
    assert packed._chain is not None

    def force(path, head_p, row):  # outside first at odd depths (the token 2 * depth + 10), one index after it
        depth = len(path) - 1
        if depth % 2:
            return [-1 - (2 * depth + 10), 4], 0.25
        return [7], -1.0

    tree = compile_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [1, 0], [0, 0, 0, 0]], "t")
    with torch.inference_mode():
        for root, feature in features(model, packed, 4):
            fast = packed.top1_on_blocks(feature, torch.tensor([[root]]), 4, force)
            chain_ext, packed._chain = packed._chain, None
            try:
                slow = _top1(packed, feature, torch.tensor([[root]]), 4, force)
            finally:
                packed._chain = chain_ext
            assert fast[1] == slow[1].tolist() and all(torch.equal(a, b) for a, b in zip(fast[0], slow[0]))
            assert fast[2] == slow[2].tolist()
            assert fast[2][1] == 12 and fast[2][3] == 16  # the path went on through the outside tokens
            assert fast[1][1] == 0.25
            chain = top1_chain(packed, feature, root, 4, force=force)
            assert chain.tokens == fast[2] and packed.outside(chain.tokens) == [-1, 12, -1, 16]
            tokens = expand(tree, packed, feature, root, chain[0], packed.outside(chain.tokens)).tolist()
            plain = expand(tree, packed, feature, root, chain[0]).tolist()
            nodes = {tuple(p): i + 1 for i, p in enumerate(tree.paths)}
            # depth 1's spine node (0,) has the outside token 12 first, its row's first (index 4 -> id 11) second
            assert tokens[nodes[(0, 0)]] == 12 and tokens[nodes[(0, 1)]] == plain[nodes[(0, 0)]] == 11
            assert tokens[nodes[(0, 0, 0, 0)]] == 16  # depth 3's spine node: the outside token 16 first
            assert tokens[nodes[(1,)]] == plain[nodes[(1,)]] and tokens[nodes[(0,)]] == plain[nodes[(0,)]]
            assert isinstance(chain, Chain)


def q4_1_heads(model, packed: bool):
    """Random Hydra heads on Q4_1 blocks: as modules, or packed (the extension's `HeadChain`)."""
    heads = random_heads(model, "hydra")
    heads.blocks = "q4_1"
    if packed:
        ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
        heads = copy.deepcopy(heads).bind(model).pack((torch.randn(60, model.config.hidden_size), ids))
        assert heads._chain is not None
    return heads


@pytest.mark.parametrize("packed", [False, True])
def test_a_chain_that_settles_stops_where_reading_head_by_head_stops(model, packed):
    """`top1_chain(..., settle=(p0, t, strict))` runs the heads up to the first whose path value
    p0 * p_1 * ... * p_d is at most t (below t where strict), in one call, on Q4_1 blocks (the
    extension stops itself) and on the modules: the same chain as reading one head at a time and
    stopping there, as the engine's policy did."""
    from entmtp.spec.policy import path_value

    heads = q4_1_heads(model, packed)
    stops = []
    with torch.inference_mode():
        for root, feature in features(model, heads, 6):
            whole = top1_chain(heads, feature, root, 4)
            for p0 in (1.0, 0.6, 0.2):
                values = [path_value(p0, whole[1][:d]) for d in range(1, 5)]
                for t in (values[0], values[1], values[2], 0.0, 2.0):
                    for strict in (False, True):
                        want = next((d for d in range(1, 5) if (values[d - 1] < t if strict else values[d - 1] <= t)), 4)
                        got = top1_chain(heads, feature, root, 4, None, None, (p0, t, strict))
                        assert got[1] == whole[1][:want] and got.tokens == whole.tokens[:want]
                        assert all(torch.equal(a, b) for a, b in zip(got[0], whole[0][:want]))
                        # resumed from a one-head prefix, the value goes on from the prefix's
                        one = top1_chain(heads, feature, root, 1)
                        again = top1_chain(heads, feature, root, 4, one, None, (p0, t, strict))
                        assert again[1] == whole[1][:max(1, want)]
                        stops.append(want)
    assert {1, 2, 4} <= set(stops)  # the bounds stopped the chain at several depths


@pytest.mark.parametrize("packed", [False, True])
def test_a_read_chain_goes_on_to_the_depth_of_the_tree_its_value_picks(model, packed):
    """With `then` = (settled, unsettled), the chain that reads the value goes on in the same call:
    past the head that settles it to depth `settled`, past `depth` read unsettled to `unsettled`
    (-1: it stops as before). Each deeper head's logits, probability and token are the plain
    chain's: the tree's own chain, not run again."""
    from entmtp.spec.policy import path_value

    heads = q4_1_heads(model, packed)
    seen = set()
    with torch.inference_mode():
        for root, feature in features(model, heads, 5):
            whole = top1_chain(heads, feature, root, 4)
            for p0 in (1.0, 0.3):
                values = [path_value(p0, whole[1][:d]) for d in range(1, 5)]
                for t in (values[0], values[1], 0.0):
                    for depth in (1, 2, 3):
                        settles = next((d for d in range(1, depth + 1) if values[d - 1] <= t), None)
                        for then in ((-1, -1), (1, 3), (3, 1), (4, 4), (2, -1)):
                            want = max(settles, then[0]) if settles else max(depth, then[1])
                            got = top1_chain(heads, feature, root, depth, None, None, (p0, t, False), then)
                            assert got[1] == whole[1][:want] and got.tokens == whole.tokens[:want], (depth, then, t)
                            assert all(torch.equal(a, b) for a, b in zip(got[0], whole[0][:want]))
                            seen.add((settles is not None, want > depth))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


def test_every_policy_states_its_settle_bound_as_settled_decides():
    """`Chooser.settle_at()` is `settled` as a bound (value <= t, or < t where strict), in every
    state of every policy, so the chain that stops itself stops where the policy would have; and
    `outcomes()` names the tree a settled value picks and the one an unsettled value picks (where
    one tree does), so the chain that goes on to that tree's depth goes as deep as the step needs."""
    from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy

    values = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.9, 1.0]
    for policy in (StaticPolicy(0), LadderPolicy((0, 1, 2), (0.2, 0.5)), LadderPolicy((0,), ()),
                   TauPolicy(0, 1, tau_on=0.3, tau_off=0.1), TauPolicy(0, 1, tau_on=0.2, tau_off=0.2)):
        choose, history = policy.chooser(), []
        for drive in values + values[::-1]:  # walk τ through both of its states
            t, strict = choose.settle_at()
            for v in values:
                assert choose.settled(v) == (v < t if strict else v <= t), (policy, drive, v)
            settled_tree, unsettled_tree = choose.outcomes()
            for v in values:  # the tree each value picks from this state: on a copy of the chooser's history
                probe = policy.chooser()
                for earlier in history:
                    probe(earlier)
                picked = probe(v)
                assert picked == settled_tree if choose.settled(v) else unsettled_tree in (None, picked), (policy, history, v)
            choose(drive)
            history.append(drive)


def test_the_chain_keeps_token_parts_without_changing_a_bit(model):
    """Hydra heads on blocks read [h ; E(t_0) ; ...] in parts (`gguf.PartedLinear`): the chain keeps
    each token's part once computed. Chains drawing on kept parts, and the same chains after they are
    forgotten, give the same bits as the modules, which compute every part each call."""
    heads = random_heads(model, "hydra")
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(3))
    packed = copy.deepcopy(heads).bind(model).pack((torch.randn(60, model.config.hidden_size), ids))
    assert packed.numerics.endswith("-parted")
    assert all(isinstance(packed.head_blocks(i)[0].linear, gguf.PartedLinear) for i in range(packed.num_heads))
    chain = packed._chain
    chain.clear_kept()
    with torch.inference_mode():
        run = lambda: [packed.top1_on_blocks(feature, torch.tensor([[root]]), 4) for root, feature in features(model, packed, 6)]
        runs = [run()]
        entries, hits, misses = chain.kept()
        assert misses > 0 and entries == misses  # each part computed once, then kept
        runs.append(run())
        assert chain.kept()[1] > hits and chain.kept()[2] == misses  # the second run drew on kept parts alone
        chain.clear_kept()
        assert chain.kept() == (0, 0, 0)
        runs.append(run())
        packed._chain = None
        slow = [_top1(packed, feature, torch.tensor([[root]]), 4) for root, feature in features(model, packed, 6)]
        packed._chain = chain
    for run in runs:
        for fast, ref in zip(run, slow):
            assert fast[1] == ref[1].tolist() and all(torch.equal(a, b) for a, b in zip(fast[0], ref[0]))
            assert fast[2] == ref[2].tolist()


def test_a_q4_1_lm_head_refines_its_best_rows_to_the_q8_0_heads_bits(model):
    """A draft LM head served in Q4_1 (`lm_blocks`): each call's 16 best logits (an equal value
    after the earlier index) are the Q8_0 head's own bits on the same input, every other logit the
    Q4_1 head's; `gguf.q8_0_rows` gives back the Q8_0 blocks it packed."""
    from entmtp.spec.heads import LM_REFINE

    heads = random_heads(model, "hydra")
    heads.blocks, heads.lm_blocks = "q4_1", "q4_1"
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
    sample = (torch.randn(60, model.config.hidden_size, generator=torch.Generator().manual_seed(5)), ids)
    packed = copy.deepcopy(heads).bind(model).pack(sample)
    plain = copy.deepcopy(heads)
    plain.lm_blocks = "q8_0"
    plain = plain.bind(model).pack(sample)
    coarse = packed._lm_packed[packed._lm_key(0)]
    fine = plain._lm_packed[plain._lm_key(0)]
    assert coarse.kind == "q4_1" and fine.kind == "q8_0" and torch.equal(coarse.smooth, fine.smooth)
    q, d = gguf.q8_0_rows(fine)
    assert q.shape == (fine.out_features, fine.in_features) and d.shape == (fine.out_features, fine.in_features // 32)
    again = gguf.pack("q8_0", q, d, None)  # packed back: the very bytes and scales the layer holds
    assert torch.equal(again[0], fine.qs) and torch.equal(again[1], fine.d)
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    x[4] = x[3]
    with torch.inference_mode():
        got, four, eight = packed.lm_logits(0, x), coarse(x), fine(x)
    for r in range(len(x)):
        best = torch.sort(four[r], descending=True, stable=True).indices[:LM_REFINE]
        rest = torch.ones(four.shape[1], dtype=torch.bool)
        rest[best] = False
        assert torch.equal(got[r, best], eight[r, best]) and torch.equal(got[r, rest], four[r, rest])
    assert torch.equal(got[3], got[4])
