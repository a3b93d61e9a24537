import random

import pytest
import torch

from entmtp.config import TREES_FILE
from entmtp.spec.topology import TopologyError, chain_paths, compile_tree, load_named_trees
from conftest import random_tree


@pytest.mark.parametrize(
    "paths, msg",
    [
        ([[0, 0]], "prefix-closed"),
        ([[1]], "rank gap"),
        ([[0], [0, 1]], "rank gap"),
        ([[0], [0]], "duplicate"),
        ([[]], "empty"),
        ([[0], [-1]], "non-negative"),
        ([[0], "ab"], "list of ranks"),
    ],
)
def test_invalid_trees_are_refused(paths, msg):
    with pytest.raises(TopologyError, match=msg):
        compile_tree(paths)


def test_public_trees_compile():
    trees = load_named_trees(TREES_FILE)
    assert set(trees) >= {"mc_sim_7b_63", "vicuna_7b_stage2", "eagle1_default_25"}
    mc = trees["mc_sim_7b_63"]
    assert mc.n_nodes == 64 and mc.max_depth == 4
    assert [sum(1 for d in mc.depth if d == k) for k in range(1, 5)] == [10, 28, 23, 2]


def test_compile_buffers_match_the_paths():
    rng = random.Random(0)
    for _ in range(30):
        paths = random_tree(rng)
        t = compile_tree(paths)
        assert t.n_nodes == len(paths) + 1
        for i, p in enumerate(t.paths, start=1):
            assert t.node_of(p) == i
            assert t.depth[i] == len(p)
            assert t.parent[i] == t.node_of(p[:-1])
            # ancestors (self and root included) are exactly the prefixes of the path
            anc = {t.node_of(p[:k]) for k in range(len(p) + 1)}
            assert set(torch.nonzero(t.ancestor_mask[i]).flatten().tolist()) == anc
        # every leaf path ends in a leaf and starts at the root
        for lp in t.leaf_paths:
            assert lp[0] == 0 and not t.children[lp[-1]]
        # the per-depth plans cover every non-root node exactly once
        covered = sorted(c for plan in t.plans for c in plan.children.tolist())
        assert covered == list(range(1, t.n_nodes))


def test_mask_block_is_additive_and_cached():
    t = compile_tree(chain_paths(3))
    m = t.mask_block(torch.float32, torch.device("cpu"))
    assert m.shape == (4, 4)
    assert torch.equal(m == 0, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert t.mask_block(torch.float32, torch.device("cpu")) is m


def test_empty_tree_is_plain_decoding():
    t = compile_tree([])
    assert t.n_nodes == 1 and t.max_depth == 0 and t.plans == ()
