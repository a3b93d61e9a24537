"""The GGUF block kernels (entmtp/model/gguf.py): exact weights, float32 products, batch invariance,
every instruction-set path equal to the scalar reference bit for bit, and the real default model
served from its Q4_1/Q8_0 blocks, token for token."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from entmtp.model import kernels, serve
from entmtp.model import ext
from entmtp.model import gguf as quant
from entmtp.config import GenerationConfig, ModelConfig
from entmtp.spec.engine import Strategy, collect
from entmtp.runtime.weights import default_gguf, load_model
from entmtp.runtime.runtime import load_runtime
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import compile_tree
from conftest import ALL_THREADS, SERVE_THREADS

needs_kernels = pytest.mark.skipif(ext.unavailable_reason() is not None, reason=f"GGUF kernels: {ext.unavailable_reason()}")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """GGUF rows of random blocks, as a file stores them (uint8 [rows, bytes])."""
    rng = np.random.default_rng(seed)
    blocks = cols // 32
    d = (rng.random((rows, blocks, 1)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8)
    if kind == "q4_1":
        m = (-rng.random((rows, blocks, 1)) * 0.1).astype(np.float16).view(np.uint8)
        q = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
        return np.concatenate([d, m, q], -1).reshape(rows, -1)
    q = rng.integers(-127, 128, (rows, blocks, 32)).astype(np.int8).view(np.uint8)
    return np.concatenate([d, q], -1).reshape(rows, -1)


def gguf_type(kind: str):
    return GGMLQuantizationType.Q4_1 if kind == "q4_1" else GGMLQuantizationType.Q8_0


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_blocks_dequantise_as_gguf_py_and_kernel_matches_float32(kind):
    raw = random_blocks(kind, 72, 576)
    ref = torch.from_numpy(dequantize(raw, gguf_type(kind)).astype(np.float32))
    qs, d, m = quant._split_blocks(raw, kind)
    assert torch.equal(quant._dequantize(qs, d, m), ref)  # the exactness check `attach` relies on
    layer = quant.GGUFLinear.from_blocks(torch.nn.Parameter(ref, requires_grad=False), kind, qs, d, m)
    # one-hot rows read the weights back: the kernel's float32 weights are gguf-py's, bit for bit
    assert torch.equal(layer(torch.eye(576)), ref.T)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, stock = layer(x), F.linear(x, ref)
        with kernels.stock_kernels():
            assert torch.equal(layer(x), stock)  # the `hf` baselines' path
    exact = (x.double() @ ref.double().T)
    assert (got.double() - exact).abs().max() <= 4 * (stock.double() - exact).abs().max() + 1e-6


@needs_kernels
@pytest.mark.threads
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_rows_result_never_depends_on_its_batch(kind):
    """What makes tree verification compute exactly what single-token steps compute."""
    raw = random_blocks(kind, 37, 1536, seed=2)  # an odd row count: the kernels' last panel is partial
    qs, d, m = quant._split_blocks(raw, kind)
    w = torch.nn.Parameter(quant._dequantize(qs, d, m), requires_grad=False)
    layer = quant.GGUFLinear.from_blocks(w, kind, qs, d, m)
    # 100 rows: a prompt's rows go in chunks (42 rows of 1,536 features), the last one partial
    x = torch.randn(100, 1536, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        for n in (1, 2, 3, 4, 5, 7, 9, 16, 17, 25, 42, 43, 85, 100):
            assert torch.equal(layer(x[:n]), alone[:n]), n
        torch.set_num_threads(ALL_THREADS)  # and whatever threads compute it
        try:
            assert torch.equal(layer(x), alone)
        finally:
            torch.set_num_threads(1)


# The default model's matrices (out, in): q/k/v fused, o, gate/up fused, down, the LM head; and two
# odd ones (a partial group of 16 outputs, a single block of inputs).
SHAPES = [("q4_1", 960, 576), ("q4_1", 576, 576), ("q4_1", 3072, 576), ("q4_1", 576, 1536), ("q8_0", 49152, 576),
          ("q4_1", 37, 96), ("q8_0", 40, 32)]


@needs_kernels
@pytest.mark.parametrize("kind, n, k", SHAPES)
def test_every_isa_path_equals_the_scalar_reference_bit_for_bit(kind, n, k):
    """Q8 products: the exact integer block sums and the one fixed finish give the same bits in the
    scalar reference (std::fma), AVX2 (forced here even where AVX-512 runs) and AVX-512 VNNI, for
    every call of 1 to 64 rows and one of 100 (a prompt's), each row as it computes alone."""
    e = ext.extension()
    paths = list(e.isas())
    assert {"scalar", "avx2"} <= set(paths)  # the extension needs AVX2, so both always run
    qs, d, m = quant._split_blocks(random_blocks(kind, n, k, seed=n + k), kind)
    q, pd, pm = quant.pack(kind, qs, d, m)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(100, k, generator=g) * torch.rand(1, k, generator=g) * 3
    x[5, :32] = 0  # an all-zero block: scale 0
    x[7, 3] = 1e4  # one large input: the rest of its block quantises to small integers

    def run(rows: torch.Tensor, isa: str) -> torch.Tensor:
        code = ext.ISA_CODES[isa]
        mode = quant.Q8_ALWAYS  # the served base model's arithmetic: Q8 inputs whatever the rows
        return e.q4_1_linear(rows, q, pd, pm, n, mode, code) if kind == "q4_1" else e.q8_0_linear(rows, q, pd, n, mode, code)

    with torch.inference_mode():
        oracle = run(x, "scalar")
        exact = x.double() @ quant._dequantize(qs, d, m).double().T  # within quantisation error of the float product
        assert ((oracle.double() - exact).norm() / exact.norm()) < 0.02
        for isa in paths:
            for rows in [*range(1, 65), 100]:
                assert torch.equal(run(x[:rows], isa), oracle[:rows]), (isa, rows)
            assert torch.equal(run(x[37:38], isa), oracle[37:38]), isa  # a row alone, from the middle


@needs_kernels
def test_the_isa_path_is_a_verified_one_or_the_forced_one(monkeypatch):
    runnable = list(ext.extension().isas())
    best = next(name for name in ext.VERIFIED_ISAS if name in runnable)
    monkeypatch.delenv(ext.ISA_ENV, raising=False)
    assert ext.isa() == best
    monkeypatch.setenv(ext.ISA_ENV, "avx2")
    assert ext.isa() == "avx2"
    monkeypatch.setenv(ext.ISA_ENV, "amx_int8")
    with pytest.raises(ext.IsaError, match="ENTMTP_ISA=amx_int8"):
        ext.isa()


def test_the_build_is_keyed_by_this_cpu():
    assert ext.NAME == f"entmtp_gguf_{ext.cpu_key()}" and len(ext.cpu_key()) == 12


def test_header_reader_agrees_with_gguf_py():
    path = default_gguf()
    ours = quant.read_blocks(path)
    theirs = {t.name: t for t in GGUFReader(str(path)).tensors if t.tensor_type.name in ("Q4_1", "Q8_0")}
    assert set(ours) == set(theirs) and len(ours) == 211
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        kind, blocks = ours[name]
        assert kind == theirs[name].tensor_type.name.lower()
        assert np.array_equal(blocks, np.asarray(theirs[name].data))


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(ext.GGUF_ENV, "0")
    assert ext.unavailable_reason() == f"{ext.GGUF_ENV}=0"


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(SERVE_THREADS)
    rt = load_runtime(ModelConfig())
    yield rt
    torch.set_num_threads(1)


@needs_kernels
@pytest.mark.slow
def test_default_model_is_served_from_its_blocks(served):
    layers = [m for m in served.model.modules() if isinstance(m, quant.GGUFLinear) and m.weight is not None]  # not the fused copies
    assert len(layers) == 211  # 210 Q4_1 projections and the tied Q8_0 LM head, all matched bit for bit
    assert served.model.get_output_embeddings() in layers
    assert serve.label(served.model) == f"gguf-q8-{ext.isa()}+fused" == served.fingerprint["kernels"]
    assert all(m.q8 and m.isa == ext.isa() for m in layers)  # Q8 inputs everywhere, LM head included, on this CPU's path
    assert served.served_differs()


@needs_kernels
@pytest.mark.slow
def test_float32_blocks_stay_selectable():
    model, _ = load_model(ModelConfig(kernels="packed"))
    assert serve.label(model) == "gguf-blocks+fused"
    assert not any(getattr(m, "q8", False) for m in model.modules())


@needs_kernels
@pytest.mark.slow
def test_served_model_equals_its_own_generate(served):
    """`generate` on the served module (GGUF kernels, not stock) is the oracle: plain decoding
    and a tree of 9 nodes give its tokens exactly."""
    gen = GenerationConfig(max_new_tokens=48)
    heads = served.heads("hydra")
    tree = compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1], [0, 0, 0, 0], [2]], "t9")
    strategy = Strategy("t9", (tree,), StaticPolicy(0), heads)
    for prompt in ("Write a Python function that reverses a linked list.", "What is 17 * 23? Think step by step."):
        ids = served.encode(prompt)
        t = torch.tensor([ids])
        with torch.inference_mode():
            ref = served.model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=48)[0, len(ids):].tolist()
        assert collect(served.run("ar", "chat", ids, gen)).token_ids == ref
        assert collect(served.engine.generate(ids, strategy, gen)).token_ids == ref


@pytest.mark.slow
def test_onednn_kernels_stay_selectable():
    model, _ = load_model(ModelConfig(kernels="onednn"))
    assert not quant.is_attached(model) and serve.label(model) == "packed+lean"
