"""The extension's layer operations (entmtp/model/csrc/layers.cpp, decoder.fuse): close to transformers'
arithmetic, independent of the batch a row is in, and a fused model's engine equal to `generate`
on that same model, bit for bit: a tiny Llama whose every projection is random GGUF blocks."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from entmtp.model import decoder, forward, kv
from entmtp.model import kernels, serve
from entmtp.model import ext
from entmtp.model import gguf as quant
from entmtp.config import GenerationConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import chain_paths, compile_tree
from conftest import random_heads, reference, tiny_config
from test_decoder import check_steps
from test_quant import random_blocks

pytestmark = pytest.mark.skipif(ext.unavailable_reason() is not None, reason=f"GGUF kernels: {ext.unavailable_reason()}")


def extension():
    e = ext.extension()
    assert e is not None, ext.extension_error()
    return e


def test_norm_and_activation_match_transformers():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 576, generator=g) * 3, torch.randn(576, generator=g)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(extension().rms_norm(x, w, 1e-5), w * h, rtol=2e-6, atol=1e-6)
    gate, up = torch.randn(3, 1536, generator=g) * 6, torch.randn(3, 1536, generator=g)
    torch.testing.assert_close(extension().silu_mul(gate, up), F.silu(gate) * up, rtol=2e-6, atol=1e-7)


def test_argmax_rows_is_torchs_argmax():
    """The decode loop's argmax (`kernels.argmax_rows`): torch.argmax's indices, the first maximal
    element, on random logits of any width, ties, infinities and NaN (torch's maximum)."""
    g = torch.Generator().manual_seed(0)
    for rows, n in [(1, 49152), (5, 49152), (9, 1000), (3, 7), (64, 37)]:
        x = torch.randn(rows, n, generator=g)
        assert torch.equal(extension().argmax_rows(x), x.argmax(-1))
        assert torch.equal(extension().argmax_rows(x.round()), x.round().argmax(-1))  # many ties
    x = torch.zeros(5, 37)
    x[0, [5, 30]] = 1.0  # a tie: the first
    x[1, 36] = 2.0  # the tail after the last 8 lanes
    x[2, [3, 20]] = float("nan")
    x[2, 9] = 5.0
    x[3] = -float("inf")
    x[4, 17] = float("inf")
    assert torch.equal(extension().argmax_rows(x), x.argmax(-1))
    assert extension().argmax_rows(x).tolist()[:2] == [5, 36]
    assert kernels.argmax_rows(x[1:2]).tolist() == [36]  # the engine's helper, the extension loaded


def test_native_confidence_is_the_softmax_maximum_and_entropy():
    """`policy.confidence` on the extension: p0 and the entropy of softmax(z) within 1e-6 of a
    float64 reference (closer than ATen's float32 reduction), at widths around its 8-lane vectors
    and 64-input runs; -inf adds nothing, a NaN or +inf gives NaN as ATen's softmax does, and the
    engine's helper takes this path for float32 CPU logits."""
    from entmtp.spec.policy import confidence

    def reference(z):
        logp = torch.log_softmax(z.double(), -1)
        p = logp.exp()
        return p.max().item(), (-(p * logp).sum()).item()

    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 63, 64, 65, 100, 4097, 49152):
        for scale in (0.1, 1.0, 5.0, 30.0):
            z = torch.randn(n, generator=g) * scale
            p0, h = extension().confidence(z)
            want = reference(z)
            assert p0 == pytest.approx(want[0], rel=1e-6) and h == pytest.approx(want[1], rel=1e-6, abs=1e-7), (n, scale)
            assert confidence(z) == (p0, h)  # the engine's helper: the same call
    z = torch.randn(49152, generator=g)
    z[[5, 77]] = -float("inf")
    assert extension().confidence(z) == pytest.approx(reference(z[z > -float("inf")]), rel=1e-6)
    assert extension().confidence(torch.tensor([3.0])) == (1.0, 0.0)
    peaked = torch.zeros(49152)
    peaked[0] = 100.0
    assert extension().confidence(peaked) == (1.0, 0.0)
    for bad in (float("nan"), float("inf")):
        z = torch.zeros(37)
        z[30] = bad
        assert all(math.isnan(v) for v in extension().confidence(z))
    assert all(math.isnan(v) for v in extension().confidence(torch.full((9,), -float("inf"))))


def test_the_heads_silu_and_top1_on_blocks():
    """The draft heads' SiLU and top-1 probability on blocks (`silu`, `top1_rows`): within float32
    rounding of ATen's and of a float64 softmax, the first maximal logit's index (ties included), an
    element's bits the same wherever it lies (the tail padded to a vector), each row alone; a NaN
    row gives ATen's NaN."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 576, 1153):
        x = torch.randn(3, n, generator=g) * 6
        y = extension().silu(x)
        torch.testing.assert_close(y, F.silu(x), rtol=2e-6, atol=1e-7)
        assert torch.equal(y[:, -1:], extension().silu(x[:, -1:].contiguous()))  # the tail alone: the same bits
    for n in (1, 7, 9, 65, 4096, 49152):
        for scale in (0.1, 3.0, 30.0):
            z = torch.randn(4, n, generator=g) * scale
            p, idx = extension().top1_rows(z)
            assert torch.equal(idx, z.argmax(-1))
            torch.testing.assert_close(p.double(), torch.softmax(z.double(), -1).max(-1).values, rtol=1e-6, atol=0)
            rows = [extension().top1_rows(row) for row in z]  # each row alone: the same bits
            assert torch.equal(p, torch.stack([r[0] for r in rows])) and idx.tolist() == [int(r[1]) for r in rows]
    z = torch.zeros(2, 37)
    z[0, [5, 30]] = 1.0  # a tie: the first
    z[1, 3] = float("nan")
    p, idx = extension().top1_rows(z)
    assert idx[0] == 5 and math.isnan(p[1])


def test_native_head_top_is_the_top_log_softmax_earlier_first_on_ties():
    """`phrasebook.head_top` on the extension: ATen's top-k indices (no ties) and log-softmax
    values within 1e-6 (relative) of a float64 reference, at widths around its 8-lane vectors and k above
    the width; an equal logit goes after the earlier ones; the reranker's helper takes this path
    for finite CPU rows, and ATen's (unchanged) where a row holds a NaN or an infinity."""
    from entmtp.spec.phrasebook import HEAD_CANDIDATES, head_top

    g = torch.Generator().manual_seed(2)
    for n in (1, 7, 8, 9, 16, 17, 63, 64, 65, 2048, 4096):
        for scale in (0.1, 1.0, 8.0):
            z = torch.randn(n, generator=g) * scale
            k = min(HEAD_CANDIDATES, n)
            lp, idx = extension().head_top(z, HEAD_CANDIDATES)
            ref = torch.log_softmax(z.double(), -1)
            assert idx.tolist() == z.topk(k).indices.tolist(), (n, scale)
            assert torch.allclose(lp.double(), ref[idx], rtol=1e-6, atol=1e-6), (n, scale)
            assert head_top(z) == (lp.tolist(), idx.tolist())
    z = torch.zeros(40)
    z[[3, 9, 30]] = 2.0
    z[[5, 31]] = 1.0
    lp, idx = extension().head_top(z, 6)
    assert idx.tolist() == [3, 9, 30, 5, 31, 0] and lp[0] == lp[2] and lp[3] == lp[4] and lp[5] < lp[4]
    z[7] = float("nan")
    with pytest.raises(RuntimeError, match="NaN or an infinity"):
        extension().head_top(z, 6)
    want = torch.log_softmax(z, -1).topk(HEAD_CANDIDATES)
    assert head_top(z)[1] == want.indices.tolist()


def test_keep_entries_moves_the_accepted_path_in_place():
    g = torch.Generator().manual_seed(1)
    bufs = [torch.randn(1, 3, 50, 8, generator=g) for _ in range(4)]
    want = [b.clone() for b in bufs]
    past, accepted = 20, [0, 2, 5, 6]
    for w in want:
        w[:, :, past : past + 4] = w[:, :, [past + a for a in accepted]].clone()
    extension().keep_entries(bufs, past, accepted)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)
    with pytest.raises(RuntimeError, match="must grow"):
        extension().keep_entries(bufs, past, [0, 3, 2])


@pytest.mark.parametrize("n,past,dim,per_head", [(6, 37, 64, False), (1, 70, 64, False), (17, 70, 64, True), (40, 5, 16, False),
                                                  (9, 64, 32, True)])
def test_attention_matches_sdpa_and_each_query_stands_alone(n, past, dim, per_head):
    """Whatever block of rows, chunk of keys or mask a query shares a call with, its result is
    that of the query alone over only the keys it sees, in cache order: the same bits."""
    g = torch.Generator().manual_seed(n + past)
    heads, kv_heads = 9, 3
    q = torch.randn(1, heads, n, dim, generator=g)
    k, v = torch.randn(1, kv_heads, past + n, dim, generator=g), torch.randn(1, kv_heads, past + n, dim, generator=g)
    # a random tree over the block (each node sees itself and some earlier nodes), per head if asked
    block = (torch.rand(heads if per_head else 1, n, n, generator=g) < 0.4).tril() | torch.eye(n, dtype=torch.bool)
    mask = torch.cat([torch.ones(block.shape[0], n, past, dtype=torch.bool), block], 2)[None]
    got = extension().attention(q, k, v, mask, dim ** -0.5)  # [1, n, heads, dim]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask)
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    for h in range(heads):
        for i in range(n):  # a node alone, over only the keys it sees, in cache order: the same bits
            seen = mask[0, h if per_head else 0, i].nonzero()[:, 0]
            kv = slice(h // 3, h // 3 + 1)
            alone = extension().attention(q[:, h : h + 1, i : i + 1], k[:, kv, seen], v[:, kv, seen], None, dim ** -0.5)
            assert torch.equal(alone[0, 0, 0], got[0, i, h]), (h, i)
    causal = extension().attention(q, k, v, None, dim ** -0.5)  # no mask: the last n keys causal
    full = torch.ones(n, past + n, dtype=torch.bool).tril(past)[None, None]  # a mask over every key: none shared
    assert torch.equal(causal, extension().attention(q, k, v, full, dim ** -0.5))
    assert torch.equal(causal, extension().attention(q, k, v, full[..., past:], dim ** -0.5))  # the cache before all visible


def blocked_llama(seed: int = 0, q8: bool = False) -> LlamaForCausalLM:
    """A tiny Llama (dimensions multiples of 32) whose projections are random Q4_1 blocks and whose
    LM head is Q8_0, each a `GGUFLinear` on the float32 weights its blocks dequantise to (`q8`: the
    layers take Q8 inputs, as `--kernels q8` serves)."""
    torch.manual_seed(seed)
    cfg = tiny_config(96, 256, tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 64, 128, 16
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    modules = dict(model.named_modules())
    for i, (name, layer) in enumerate([(n, m) for n, m in modules.items() if isinstance(m, torch.nn.Linear)]):
        kind = "q8_0" if name == "lm_head" else "q4_1"
        qs, d, m = quant._split_blocks(random_blocks(kind, layer.out_features, layer.in_features, seed=10 + i), kind)
        weight = torch.nn.Parameter(quant._dequantize(qs, d, m) * (4.0 if kind == "q8_0" else 1.0), requires_grad=False)
        if kind == "q8_0":
            d = d * 4.0  # peakier logits: exercises acceptance (exact: a power of two)
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, quant.GGUFLinear.from_blocks(weight, kind, qs, d, m, q8))
    kernels.use_tree_attention(model)
    assert decoder.fuse(model) and serve.label(model) == (f"gguf-q8-{ext.isa()}+fused" if q8 else "gguf-blocks+fused")
    return model


@pytest.mark.parametrize("q8", [False, True])
def test_fused_stack_equals_transformers_forward(q8):
    check_steps(blocked_llama(0, q8), 11, 96)


@pytest.mark.parametrize("q8", [False, True])
def test_fused_engine_equals_its_generate(monkeypatch, q8):
    calls = []
    stack_forward = decoder.stack_forward
    monkeypatch.setattr(decoder, "stack_forward", lambda *a: calls.append(1) or stack_forward(*a))
    model = blocked_llama(1, q8)
    heads = random_heads(model)
    engine = Engine(model, [])
    gen = GenerationConfig(max_new_tokens=40)
    trees = [compile_tree([], "ar"), compile_tree(chain_paths(3), "c3"), compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [2]], "t7")]
    for prompt in ([1, 5, 9, 13, 2], [7, 7, 3, 90, 41, 8, 8, 60]):
        ref = reference(model, prompt, 40)  # transformers' generate, through the fused modules
        for i, tree in enumerate(trees):
            strategy = Strategy(tree.name, trees, StaticPolicy(i), heads)
            assert collect(engine.generate(prompt, strategy, gen)).token_ids == ref, (tree.name, prompt)
    assert calls  # the engine ran the stack, not transformers


def q8_reference(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 weights times Q8-quantised inputs, in float64: per block of 32, d_x = max|x| / 127,
    q_x = x / d_x rounded to even, d_w * d_x * sum(q_w * q_x) + m_w * d_x * sum(q_x)."""
    rows, k = x.shape
    xb = x.view(rows, k // 32, 32)
    amax = xb.abs().amax(-1)
    dx = (amax / 127).double()
    qx = torch.round(xb * torch.where(amax > 0, 127 / amax, 0.0)[..., None]).double()
    lo, hi = (qs & 0x0F).double(), (qs >> 4).double()
    qw = torch.cat([lo.view(-1, k // 32, 16), hi.view(-1, k // 32, 16)], -1)  # [n, blocks, 32]
    dots = torch.einsum("rbi,nbi->rnb", qx, qw)
    return (dots * d.double()[None] * dx[:, None] + m.double()[None] * (dx * qx.sum(-1))[:, None]).sum(-1)


def packed_linear(kind: str, x: torch.Tensor, qs, d, m, q8: bool, isa: str = "scalar") -> torch.Tensor:
    """The extension's linear on blocks in the GGUF's layout, packed as `GGUFLinear` packs them."""
    q, pd, pm = quant.pack(kind, qs, d, m)
    code = ext.ISA_CODES[isa]
    if kind == "q4_1":
        return extension().q4_1_linear(x, q, pd, pm, d.shape[0], q8, code)
    return extension().q8_0_linear(x, q, pd, d.shape[0], q8, code)


def test_q8_linear_is_llamacpp_arithmetic_and_batch_invariant():
    g = torch.Generator().manual_seed(3)
    for n, k in ((70, 96), (13, 576)):
        qs, d, m = quant._split_blocks(random_blocks("q4_1", n, k, seed=n), "q4_1")
        x = torch.randn(9, k, generator=g) * torch.rand(1, k, generator=g) * 4
        x[2, :32] = 0  # an all-zero block: scale 0
        got = packed_linear("q4_1", x, qs, d, m, True)
        ref = q8_reference(x, qs, d.float(), m.float())
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        for rows in (range(9), range(0, 9, 2), [4]):  # each row computes the same bits in any batch
            rows = list(rows)
            assert torch.equal(packed_linear("q4_1", x[rows], qs, d, m, True), got[rows])
        exact = x @ quant._dequantize(qs, d, m).T  # the float32 model's product, within quantisation error
        assert ((got - exact).norm() / exact.norm()) < 0.02


def test_q8_holds_for_a_prompt_and_a_tree_of_any_size():
    """The served model takes Q8 inputs in every call (`Q8_ALWAYS`), each row as alone: a prompt of
    more than 64 rows too (the earlier `Q8_SMALL` computes it in float32). A long prompt, decoding
    with trees small and over 64 nodes, and traces all agree with `generate`."""
    from entmtp.bank import record as rec
    from entmtp.bank import traces as tr

    g = torch.Generator().manual_seed(4)
    qs, d, m = quant._split_blocks(random_blocks("q4_1", 40, 96, seed=4), "q4_1")
    x = torch.randn(100, 96, generator=g)
    always, small = packed_linear("q4_1", x, qs, d, m, quant.Q8_ALWAYS), packed_linear("q4_1", x, qs, d, m, quant.Q8_SMALL)
    assert torch.equal(small, packed_linear("q4_1", x, qs, d, m, quant.F32))  # past 64 rows the earlier mode is float32
    assert not torch.equal(always, small)
    for r in (0, 63, 64, 99):
        assert torch.equal(always[r], packed_linear("q4_1", x[r : r + 1], qs, d, m, quant.Q8_ALWAYS)[0]), r
    model = blocked_llama(3, q8=True)
    engine, heads = Engine(model, []), random_heads(model)
    assert engine.q8
    big = compile_tree([[i] for i in range(66)] + [[0, 0], [0, 0, 0]], "n69")
    trees = [compile_tree([], "ar"), compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [2]], "t7"), big]
    assert big.n_nodes > 64
    prompt = [int(t) for t in torch.randint(1, 96, (70,), generator=g)]
    ref = reference(model, prompt, 30)
    trace = rec.record(engine, heads, prompt, ref, 3)
    for i, tree in enumerate(trees):
        real = collect(engine.generate(prompt, Strategy(tree.name, trees, StaticPolicy(i), heads),
                                       GenerationConfig(max_new_tokens=30)))
        assert real.token_ids == ref, tree.name
        if tree is not big:  # traces keep ranks within their width only
            assert tr.decode_with(tree, trace) == (real.new_tokens, len(real.steps)), tree.name


@pytest.mark.parametrize("q8", [False, True])
def test_a_prompts_last_logits_alone_are_the_full_forwards_last_row(q8):
    """The engine's prefill computes the LM head for the last position alone (`last_only`): the
    same hidden states and, bit for bit, the last row of the logits a full forward gives."""
    model = blocked_llama(2, q8)
    ids = torch.randint(1, 96, (1, 37), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(37)[None]
    with torch.inference_mode():
        hidden, logits = forward.forward(model, kv.new_cache(model.config), ids, pos, None)
        last_hidden, last = forward.forward(model, kv.new_cache(model.config), ids, pos, None, last_only=True)
    assert last.shape == (1, 96) and torch.equal(last_hidden, hidden) and torch.equal(last, logits[-1:])
