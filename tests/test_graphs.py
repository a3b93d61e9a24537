"""The CUDA-graph path's forward (`graphs.Slot`), run eagerly on a CPU: static KV buffers, the
masked attention over the whole buffer, in-place commit and slot reuse must decode exactly what
`generate` does. The capture itself needs a GPU (`scripts/gpu_check.py` runs it there)."""

import pytest
import torch

from entmtp.model import forward
from entmtp.model import graphs
from entmtp.spec import drafting
from entmtp.spec import verify
from entmtp.config import TREES_FILE, GenerationConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy
from entmtp.spec.topology import chain_paths, compile_tree, load_named_trees
from conftest import random_heads, reference, tiny_llama

NAMED = load_named_trees(TREES_FILE)
TREES = [compile_tree([], "ar"), compile_tree(chain_paths(3), "chain3"), NAMED["mc_sim_7b_63"],
         compile_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0]], "small")]


def static_engine(model, monkeypatch=None) -> Engine:
    """An engine whose decodes take `graphs.Slot`s, run eagerly (no capture on a CPU)."""
    engine = Engine(model)
    assert engine.graphs is None  # graphs are for CUDA only
    engine.graphs = graphs.Graphs(model, capture=False)
    engine.drafts = drafting.DraftGraphs(capture=False)
    return engine


@pytest.mark.parametrize("seed,vocab", [(0, 48), (5, 12)])
def test_static_slots_decode_as_generate(seed, vocab, monkeypatch):
    monkeypatch.setattr(graphs, "MIN_CAPACITY", 16)  # a request grows the buffer (and keeps what it holds)
    monkeypatch.setattr(graphs, "MIN_SPAN", 8)  # and attention's span doubles as the context grows
    model = tiny_llama(seed=seed, vocab=vocab)
    heads = random_heads(model)
    engine = static_engine(model)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in (3, 17)]
    for prompt in prompts:
        ref = reference(model, prompt, 40)
        for i, tree in enumerate(TREES):
            s = Strategy(tree.name, TREES, StaticPolicy(i), heads)
            out = collect(engine.generate(prompt, s, GenerationConfig(max_new_tokens=40)))
            assert out.token_ids == ref, (tree.name, prompt)
        tau = Strategy("tau", (TREES[1], TREES[2]), TauPolicy(0, 1, 0.3, 0.3), heads)
        assert collect(engine.generate(prompt, tau, GenerationConfig(max_new_tokens=40))).token_ids == ref
    assert len(engine.graphs.slots) == 1 and engine.graphs.slots[0].capacity >= 17 + 40 + 64


def test_side_by_side_decodes_take_their_own_slots():
    model = tiny_llama(seed=2)
    heads = random_heads(model)
    engine = static_engine(model)
    prompt = [5, 9, 2, 7]
    ref = reference(model, prompt, 30)
    a = engine.generate(prompt, Strategy("a", (NAMED["mc_sim_7b_63"],), StaticPolicy(0), heads), GenerationConfig(max_new_tokens=30))
    b = engine.generate(prompt, Strategy("b", (TREES[0],), StaticPolicy(0)), GenerationConfig(max_new_tokens=30))
    out = {"a": [], "b": []}
    for ra, rb in zip(a, b):  # interleaved, as the app races two methods
        out["a"] += ra.tokens
        out["b"] += rb.tokens
    out["a"] += [t for r in a for t in r.tokens]
    out["b"] += [t for r in b for t in r.tokens]
    assert out["a"] == ref and out["b"] == ref
    assert len(engine.graphs.slots) == 2
    del a, b
    assert not any(s.busy for s in engine.graphs.slots)  # a finished request gives its slot back


def test_slot_forward_matches_transformers_logits():
    """One tree block through a slot against transformers' forward with the same 4-D mask."""
    model = tiny_llama(seed=1)
    from entmtp.model import kv

    tree = compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], "t6")
    prompt = torch.tensor([[3, 8, 1, 4, 4, 9, 2]])
    tokens = torch.tensor([6, 7, 11, 5, 2, 30])
    with torch.inference_mode():
        cache = kv.new_cache(model.config)
        forward.forward(model, cache, prompt, torch.arange(7)[None], None)
        h_ref, z_ref = verify.tree_forward(model, cache, tree, tokens, 7)
        slot = graphs.Graphs(model, capture=False).cache(32)
        forward.forward(model, slot, prompt, torch.arange(7)[None], None)
        h, z = verify.tree_forward(model, slot, tree, tokens, 7)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(z, z_ref, rtol=0, atol=1e-5)
    assert slot.get_seq_length() == 13


def test_graphs_apply_only_on_cuda_and_can_be_turned_off(monkeypatch):
    model = tiny_llama()
    assert graphs.supported(model)
    assert graphs.Graphs.of(model) is None  # a CPU model decodes eagerly
    monkeypatch.setenv(graphs.CUDA_GRAPHS_ENV, "0")
    assert not graphs.enabled()


def test_a_failed_capture_leaves_the_slot_decoding_eagerly():
    """Where capture is refused (here: no CUDA at all) the slot warns once and verifies eagerly."""
    model = tiny_llama(seed=3)
    heads = random_heads(model)
    engine = Engine(model)
    engine.graphs = graphs.Graphs(model, capture=True)
    engine.drafts = drafting.DraftGraphs(capture=True)
    prompt = [4, 1, 7]
    s = Strategy("t", (NAMED["mc_sim_7b_63"],), StaticPolicy(0), heads)
    with pytest.warns(UserWarning) as seen:
        out = collect(engine.generate(prompt, s, GenerationConfig(max_new_tokens=20)))
    said = [str(w.message) for w in seen]
    assert any("CUDA graph capture failed" in m for m in said)  # the slot's
    assert any("capture of the draft failed" in m for m in said)  # the heads' drafts'
    assert out.token_ids == reference(model, prompt, 20)
    assert not engine.graphs.slots[0].capture
    assert not engine.drafts.capture  # the drafts' graphs fell back the same way


@pytest.mark.parametrize("kind, kw", [("hydra", {}), ("hydra", {"arch": "prefix-mlp"}), ("medusa", {})])
def test_drafts_on_the_device_draft_what_the_eager_engine_drafts(kind, kw):
    """`drafting.DraftGraphs` (the chain and the expansion as one function per tree, what a CUDA graph
    holds; run eagerly here) proposes the eager engine's tokens at every step, reads the same
    feature, and decodes exactly `generate`."""
    model = tiny_llama(seed=4, vocab=16)
    heads = random_heads(model, kind, **kw).requires_grad_(False)
    device_engine, plain = static_engine(model), Engine(model)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    ref = reference(model, prompt, 40)
    trees = [TREES[0], TREES[1], TREES[3], NAMED["mc_sim_7b_63"]]

    def seen(depth):  # the feature's values along a decode, for thresholds that make policies switch
        never = TauPolicy(0, 0, -1.0, -1.0, "path_value", depth)  # never settled: every head read
        out = collect(plain.generate(prompt, Strategy("t", trees, never, heads), GenerationConfig(max_new_tokens=40)))
        return sorted(r.feature for r in out.steps)

    def cut(values, q):  # halfway between two seen values: float noise cannot flip a decision
        i = int(len(values) * q)
        return (values[i] + values[i + 1]) / 2

    g1, g4 = seen(1), seen(0)
    policies = [StaticPolicy(i) for i in range(len(trees))] + [
        TauPolicy(1, 3, cut(g1, 0.5), cut(g1, 0.25), "path_value", 1),
        LadderPolicy((0, 2, 3), (cut(g4, 0.33), cut(g4, 0.66)), "path_value", 0)]
    for policy in policies:
        s = Strategy("t", trees, policy, heads)
        a = collect(device_engine.generate(prompt, s, GenerationConfig(max_new_tokens=40)))
        b = collect(plain.generate(prompt, s, GenerationConfig(max_new_tokens=40)))
        assert a.token_ids == b.token_ids == ref, policy
        assert [r.draft_tokens for r in a.steps] == [r.draft_tokens for r in b.steps], policy
        assert [r.tree for r in a.steps] == [r.tree for r in b.steps]
        # the slot's attention differs from transformers' in the last bits (see test above)
        assert [r.path_value for r in a.steps] == pytest.approx([r.path_value for r in b.steps], rel=1e-4, abs=1e-7)
        assert [r.feature for r in a.steps] == pytest.approx([r.feature for r in b.steps], rel=1e-4, abs=1e-7)
        if not isinstance(policy, StaticPolicy):
            assert len({r.tree for r in a.steps}) > 1, f"{policy.name} must switch trees"


def test_biased_projections_decode_as_generate():
    """Llama layers with attention and MLP biases (`layer_math` takes them as plain tensors)."""
    from transformers import LlamaForCausalLM

    from conftest import tiny_config

    torch.manual_seed(7)
    cfg = tiny_config(48, 256, initializer_range=0.2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)  # transformers initialises biases to zero
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    engine = static_engine(model)
    prompt = [3, 9, 27, 4, 11]
    s = Strategy("t", (TREES[3],), StaticPolicy(0), random_heads(model))
    assert collect(engine.generate(prompt, s, GenerationConfig(max_new_tokens=30))).token_ids == reference(model, prompt, 30)
