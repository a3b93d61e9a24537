"""The lean Llama forward (entmtp/model/decoder.py) equals transformers' forward bit for bit."""

import pytest
import torch

from entmtp.model import decoder
from entmtp.model import kernels
from entmtp.model import kv
from entmtp.config import ModelConfig
from entmtp.runtime.weights import load_model
from entmtp.spec.topology import compile_tree
from conftest import SERVE_THREADS, tiny_llama


def transformers_forward(model, cache, ids, pos, mask):
    base = model.base_model
    out = base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kv.cache_arg(base, cache))
    hidden = out.last_hidden_state[0]
    return hidden, model.get_output_embeddings()(hidden)


def check_steps(model, prompt_len: int, vocab: int):
    """Prefill, single-token steps and tree blocks: the lean path and transformers, each on its
    own cache, give identical hidden states and logits."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, prompt_len), generator=g)
    caches = kv.new_cache(model.config), kv.new_cache(model.config)
    tree = compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [2]], "t7")
    with torch.inference_mode():
        outs = [decoder.lean_forward(model, caches[0], ids, torch.arange(prompt_len)[None], None),
                transformers_forward(model, caches[1], ids, torch.arange(prompt_len)[None], None)]
        assert outs[0] is not None
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        past = prompt_len
        for step in range(4):
            one = torch.randint(3, vocab, (1, 1), generator=g)
            pos = torch.tensor([[past]])
            a, b = decoder.lean_forward(model, caches[0], one, pos, None), transformers_forward(model, caches[1], one, pos, None)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
            past += 1
            toks = torch.randint(3, vocab, (tree.n_nodes,), generator=g)
            dtype = model.get_output_embeddings().weight.dtype
            mask = torch.cat([torch.zeros(tree.n_nodes, past, dtype=dtype), tree.mask_block(dtype, torch.device("cpu"))], 1)[None, None]
            pos = (tree.depth_tensor + past)[None]
            a, b = decoder.lean_forward(model, caches[0], toks[None], pos, mask), transformers_forward(model, caches[1], toks[None], pos, mask)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
            for c in caches:
                kv.commit(c, past, [0, 1, 3], tree.n_nodes)
            past += 3


def test_tiny_llama_bit_for_bit():
    model = tiny_llama()
    kernels.pack_linears(model)
    assert kernels.use_tree_attention(model)
    check_steps(model, 11, 48)


def test_unsupported_cases_fall_back():
    model = tiny_llama()  # stock attention implementation: transformers' own path
    cache = kv.new_cache(model.config)
    with torch.inference_mode():
        assert decoder.lean_forward(model, cache, torch.tensor([[1, 2]]), torch.arange(2)[None], None) is None
    kernels.use_tree_attention(model)
    model.__dict__.pop("_entmtp_plan", None)
    with torch.inference_mode(), kernels.stock_kernels():  # the hf baselines measure transformers as it is
        assert decoder.lean_forward(model, cache, torch.tensor([[1, 2]]), torch.arange(2)[None], None) is None


@pytest.mark.slow
def test_default_model_bit_for_bit():
    torch.set_num_threads(SERVE_THREADS)
    try:
        model, _ = load_model(ModelConfig())
        check_steps(model, 40, 49152)
    finally:
        torch.set_num_threads(1)
