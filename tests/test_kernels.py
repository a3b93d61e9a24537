"""Prepacked float32 linears (entmtp.model.kernels): same numbers as F.linear, same tokens as generate."""

import copy
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from entmtp.model import gguf, kernels, serve
from entmtp.config import TREES_FILE, GenerationConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.policy import StaticPolicy, TauPolicy
from entmtp.spec.topology import chain_paths, compile_tree, load_named_trees
from conftest import random_heads, reference, tiny_llama

pytestmark = pytest.mark.skipif(not kernels.available("cpu", torch.float32), reason="PyTorch without oneDNN")


def packed_copy(model):
    m = copy.deepcopy(model)
    n = kernels.pack_linears(m)
    assert n == sum(isinstance(x, torch.nn.Linear) for x in model.modules()) and serve.is_packed(m)
    assert kernels.use_tree_attention(m) and m.config._attn_implementation == kernels.ATTENTION
    assert model.config._attn_implementation == "sdpa"  # the untouched copy keeps stock attention
    return m


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_packed_linear_matches_f_linear(bias, rows):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(96, 200, bias=bias)
    packed = kernels.PackedLinear.of(lin)
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        ref = F.linear(x, lin.weight, lin.bias)
        got = packed(x)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        with kernels.stock_kernels():  # the switch gives stock F.linear bit for bit
            assert torch.equal(packed(x), ref)
        assert not kernels.stock()


def test_stock_switch_is_per_thread():
    seen = {}

    def other():
        seen["other"] = kernels.stock()

    with kernels.stock_kernels():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen["here"] = kernels.stock()
    assert seen == {"other": False, "here": True}


def test_gradients_fall_back_to_stock():
    lin = torch.nn.Linear(8, 4)
    packed = kernels.PackedLinear.of(lin)
    x = torch.randn(3, 8, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("seed, vocab", [(0, 48), (5, 12)])
def test_packed_engine_equals_stock_generate(prompts, seed, vocab):
    """Engine on a packed copy (base and heads) vs `generate` on the untouched model."""
    stock_model = tiny_llama(seed=seed, vocab=vocab)
    model = packed_copy(stock_model)
    trees = [compile_tree([], "ar"), compile_tree(chain_paths(3), "c3"), load_named_trees(TREES_FILE)["mc_sim_7b_63"]]
    for kind in ("hydra", "medusa"):
        heads = random_heads(model, kind).pack()
        assert serve.is_packed(heads)
        for prompt in prompts:
            prompt = [t % vocab for t in prompt]
            ref = reference(stock_model, prompt, 30)
            for tree in trees:
                strategy = Strategy("t", (tree,), StaticPolicy(0), heads if tree.n_nodes > 1 else None)
                assert collect(Engine(model, ()).generate(prompt, strategy, GenerationConfig(max_new_tokens=30))).token_ids == ref
            bank = (trees[1], trees[2])
            strategy = Strategy("tau", bank, TauPolicy(0, 1, 0.5, 0.3), heads)
            assert collect(Engine(model, ()).generate(prompt, strategy, GenerationConfig(max_new_tokens=30))).token_ids == ref


def test_packed_heads_draft_like_stock_heads():
    model = tiny_llama()
    heads = random_heads(model, "hydra")
    ids = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    sample = (torch.randn(60, model.config.hidden_size), ids)
    packed = copy.deepcopy(heads).bind(model).pack(sample)
    blocks = gguf.extension() is not None
    int8 = blocks or kernels.int8_available("cpu")
    bf16 = not int8 and kernels.available("cpu", torch.bfloat16)
    want = "q8-blocks-smoothed-parted" if blocks else "int8-rows-smoothed" if int8 else "packed-bfloat16" if bf16 else "packed-float32"
    assert packed.numerics == want
    feature = torch.randn(3, model.config.hidden_size)
    path = torch.randint(0, model.config.vocab_size, (3, 2))
    with torch.inference_mode():
        got, want = packed.head_logits(1, feature, path), heads.head_logits(1, feature, path)
        tol = 0.05 if int8 or bf16 else 1e-5  # int8 and bf16 keep about 8 bits
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))


class _Attn(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("n", [2, 9])
def test_tree_attention_equals_stock_sdpa(n):
    """Grouped queries stacked over their key/value head == stock `repeat_kv` SDPA, on a tree mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(n)
    past, dim = 37, 16
    q = torch.randn(1, n, 6, dim).transpose(1, 2)  # as the model hands it over: (B, heads, Q, D), strided
    k, v = torch.randn(1, 2, past + n, dim), torch.randn(1, 2, past + n, dim)
    tree = torch.rand(n, n) < 0.5
    tree = torch.tril(tree) | torch.eye(n, dtype=torch.bool)
    mask = torch.zeros(n, past + n)
    mask[:, past:][~tree] = torch.finfo(torch.float32).min
    mask = mask[None, None]
    got, _ = kernels.tree_sdpa(_Attn(), q, k, v, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (1, n, 6, dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with kernels.stock_kernels():  # the switch restores transformers' own code path exactly
        assert torch.equal(kernels.tree_sdpa(_Attn(), q, k, v, mask, scaling=dim**-0.5)[0], want)


def test_buffered_cache_layer_matches_dynamic_layer():
    """Appends past the first capacity and crops agree with the stock layer (commits: test_engine)."""
    from transformers.cache_utils import DynamicLayer

    from entmtp.model.kv import BufferedLayer

    torch.manual_seed(0)
    ours, stock = BufferedLayer(), DynamicLayer()
    for n, drop in ((200, 0), (9, 7), (100, 0), (5, 3), (1, 0)):  # 200 + 9 + 100 > 256: grows once
        k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
        a, b = ours.update(k, v), stock.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        ours.crop(-drop)
        stock.crop(-drop)
        assert ours.get_seq_length() == stock.get_seq_length()
    assert ours._k.shape[-2] == 512
    torch.testing.assert_close(ours.keys, stock.keys, rtol=0, atol=0)
    torch.testing.assert_close(ours.values, stock.values, rtol=0, atol=0)


@pytest.mark.skipif(not kernels.int8_available("cpu"), reason="PyTorch without the fbgemm/x86 quantized engine")
def test_int8_rows_do_not_depend_on_the_batch():
    """A row's result is the same alone and among others (what lets traces predict the engine's
    drafts exactly), and close to float32 even with an outlier input channel once smoothed."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(7, 96, generator=g)
    x[:, 3] *= 40  # an outlier channel, as in a base model's hidden state
    plain = kernels.Int8RowLinear(lin.weight, lin.bias)
    smooth = kernels.Int8RowLinear(lin.weight, lin.bias, x.abs().amax(0))
    with torch.inference_mode():
        want = lin(x)
        for layer in (plain, smooth):
            batch = layer(x)
            assert all(torch.equal(layer(x[r : r + 1])[0], batch[r]) for r in range(len(x)))
            assert layer(x[None]).shape == (1, 7, 40)
        err = lambda y: float((y - want).abs().max() / want.abs().max())
        assert err(smooth(x)) < 0.03 and err(smooth(x)) < err(plain(x))


@pytest.mark.skipif(gguf.extension() is None, reason="the GGUF block kernels do not build here")
@pytest.mark.parametrize("kind, bound", [("q8_0", 0.02), ("q4_1", 0.1)])
def test_block_rows_do_not_depend_on_the_batch(kind, bound):
    """The draft heads' block linears (Q8_0 or Q4_1 weights, Q8 inputs): a row's result is the
    same bits alone, among a few and among hundreds (a bank's traces read every position in one
    call, past the base model's 64-row float32 switch), on every instruction-set path; close to
    float32 with an outlier channel once smoothed (Q8_0: closer than row-wise int8)."""
    from entmtp.model import ext

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(2880, 40)  # wider than the float32 path's 2048 inputs: the 4th Hydra head's first layer
    x = torch.randn(150, 2880, generator=g)
    x[:, 3] *= 40  # an outlier channel, as in a base model's hidden state
    smooth = kernels.smooth_factors(lin.weight, x.abs().amax(0))
    with torch.inference_mode():
        want = lin(x)
        ref = gguf.BlockLinear(lin.weight, lin.bias, smooth, isa="scalar", kind=kind)(x)
        for isa in ext.extension().isas():
            layer = gguf.BlockLinear(lin.weight, lin.bias, smooth, isa=isa, kind=kind)
            batch = layer(x)
            assert torch.equal(batch, ref), isa
            assert all(torch.equal(layer(x[r : r + 1])[0], batch[r]) for r in (0, 5, 149))
            assert torch.equal(layer(x[10:13]), batch[10:13])
        assert layer(x[None, :7]).shape == (1, 7, 40)
        err = lambda y: float((y - want).abs().max() / want.abs().max())
        plain = gguf.BlockLinear(lin.weight, lin.bias, kind=kind)(x)
        assert err(ref) < bound and err(ref) <= err(plain), (err(ref), err(plain))
        if kind == "q8_0":
            rows = kernels.Int8RowLinear(lin.weight, lin.bias, x.abs().amax(0))(x) if kernels.int8_available("cpu") else plain
            assert err(ref) <= err(rows), (err(ref), err(rows))


def test_q4_1_blocks_dequantise_as_gguf_and_beat_min_max():
    """`quantize_q4_1` writes the GGUF's Q4_1 layout (gguf-py dequantises it to d * q + m), and its
    searched span is nearer the weights in squared error than ggml's min-to-max span, block by block
    never farther."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g)
    w[:, 7] *= 12  # outliers in some blocks
    qs, d, m = gguf.quantize_q4_1(w)
    assert qs.dtype == torch.uint8 and qs.shape == (48, 128) and d.dtype == m.dtype == torch.float16 and d.shape == (48, 8)
    back = gguf._dequantize(qs, d, m)
    blocks = lambda t: t.reshape(48, 8, 32)
    err = (blocks(back) - blocks(w)).square().sum(-1)
    qs0, d0, m0 = gguf.quantize_q4_1(w, grid=1)  # the min-to-max span alone
    err0 = (blocks(gguf._dequantize(qs0, d0, m0)) - blocks(w)).square().sum(-1)
    assert bool((err <= err0).all()) and float(err.sum()) < 0.95 * float(err0.sum())
    raw = np.concatenate([d.numpy().view(np.uint8).reshape(48, 8, 2), m.numpy().view(np.uint8).reshape(48, 8, 2),
                          qs.numpy().reshape(48, 8, 16)], -1).reshape(48, -1)
    from gguf import GGMLQuantizationType, quants

    assert np.array_equal(quants.dequantize(raw, GGMLQuantizationType.Q4_1), back.numpy())
