"""Tree verification as CUDA graphs: one captured forward per block size over static KV buffers.

On a GPU a decode step of a small model is launch-bound: transformers' eager forward of
SmolLM2-135M issues hundreds of kernels and their Python for microseconds of arithmetic each (on
an NVIDIA H200, ~17 ms a step whatever the tree). A CUDA graph replays a recorded forward as one
launch. Graphs need fixed shapes and fixed addresses, so:

- `Slot` holds the keys and values of every layer in one preallocated buffer
  [layers, kv_heads, capacity, head_dim] and the committed length; a new request takes a free
  slot (two requests decoding side by side, as the app races them, take two).
- `Slot.run` is the forward of a block of n new tokens at fixed shapes: embedding, per layer its
  RMSNorm and projections (`layer_math`: transformers' arithmetic on the layer's weights), rotary embedding at positions past + depth, the block's
  keys and values written in place at past .. past + n - 1, attention of the block over the
  buffer's first `span` entries under a mask (committed positions visible, the tree's block mask
  over the new ones, nothing beyond; span is a power of two, at least 256, so a step reads at most
  twice its context), the model's MLP; final norm and LM head. `past`, the tokens, the depths and
  the block mask are device tensors the graph reads, so one graph per (block size, span) serves
  every tree of that size at every context length in the span.
- The prompt runs the same function eagerly (its length varies); a tree block replays its graph,
  captured on first use (`Engine.warmup` captures the bank's sizes at every span ahead, outside
  any clock, and reports the time each took). A request that outgrows the capacity gets a larger
  buffer and fresh graphs.
- `compiled=True` (opt-in) runs the layers through `torch.compile` inside the graphs: fewer,
  fused kernels; one compilation per block size at warm-up.

The arithmetic is transformers' on the model's weights, but a tree block's attention reads a longer masked
row than transformers' (which stops at past + n) and computes it as three products (`attend`);
compiled layers also fuse and reorder. So results can differ from `generate` in the last bits:
greedy tokens can differ only where two logits tie within float noise (`scripts/gpu_check.py`
reports such ties apart from failures). `ENTMTP_CUDA_GRAPHS=0`, `ModelConfig.cuda_graphs=False`
or the CLI's `--no-cuda-graphs` keep the eager path. Supported: Llama-architecture models
(`LlamaForCausalLM`) on CUDA; anything else decodes eagerly. On a CPU the same `Slot` runs
eagerly (`capture=False`) so that tests can check its arithmetic without a GPU.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from entmtp.model.decoder import rms, rotate_half

CUDA_GRAPHS_ENV = "ENTMTP_CUDA_GRAPHS"
MIN_SPAN = 256  # attention reads the first `span` buffer entries: a power of two >= the entries in use
MIN_CAPACITY = 2048  # entries; a request that needs more doubles it (and recaptures)
MAX_SLOTS = 4  # requests decoding at once with graphs; more decode eagerly


def enabled() -> bool:
    return os.environ.get(CUDA_GRAPHS_ENV, "").strip().lower() not in ("0", "false", "off", "no")


def supported(model: nn.Module) -> bool:
    """A Llama-architecture model whose layers `Slot.run` computes as transformers does."""
    cfg = model.config
    if type(model).__name__ != "LlamaForCausalLM" or not hasattr(model, "model"):
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "llama3", "linear"):
        return False
    return getattr(cfg, "hidden_act", "") == "silu"


def attend(q, keys, values, mask, scaling: float, explicit: bool):
    """Attention of stacked-group queries q [1, kv_heads, groups * n, dim] over keys/values
    [kv_heads, span, dim] under an additive mask [1, 1, groups * n, span]. explicit: as three
    products (scores, softmax in float32, values): for a tree block's few rows this beats the
    fused kernel, which walks the span in one thread block per head (on an H200 it took half of
    a captured one-token step)."""
    if not explicit:
        return F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask, scale=scaling)
    scores = torch.matmul(q, keys.transpose(-1, -2)[None]) * scaling + mask
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), values[None])


def layer_math(x, cos, sin, mask, where, keys, values, w_in, wq, bq, wk, bk, wv, bv, wo, bo, w_post, wg, bg, wu, bu, wd, bd,
               eps: float, heads: int, kv_heads: int, dim: int, scaling: float, explicit: bool):
    """One Llama layer over n new tokens, as plain tensor operations on its weights (biases may be
    None): the arithmetic of transformers' modules (`decoder.rms` is `LlamaRMSNorm`, `F.linear` is
    `nn.Linear`), and what `torch.compile` fuses (`compiled`). Writes the block's keys and values
    into `keys`/`values` [kv_heads, span, dim] at `where`; `mask` is the stacked-group mask
    [1, 1, groups * n, span]; `explicit` picks `attend`'s three products over the fused kernel."""
    n = x.shape[1]
    h = rms(x, w_in, eps)
    q = F.linear(h, wq, bq).view(1, n, heads, dim).transpose(1, 2)
    k = F.linear(h, wk, bk).view(1, n, kv_heads, dim).transpose(1, 2)
    v = F.linear(h, wv, bv).view(1, n, kv_heads, dim).transpose(1, 2)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    keys.index_copy_(1, where, k[0])
    values.index_copy_(1, where, v[0])
    q = q.reshape(1, kv_heads, (heads // kv_heads) * n, dim)
    out = attend(q, keys, values, mask, scaling, explicit)
    x = x + F.linear(out.reshape(1, heads, n, dim).transpose(1, 2).reshape(1, n, -1), wo, bo)
    h = rms(x, w_post, eps)
    return x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)


_COMPILED = None


def compiled_layer():
    """`layer_math` under `torch.compile` (static shapes: one compilation per block size, shared by
    every layer and slot); made on first use."""
    global _COMPILED
    if _COMPILED is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED = torch.compile(layer_math, dynamic=False, fullgraph=True)
    return _COMPILED


def causal_block(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(n, n) additive mask of a plain sequence: 0 on and below the diagonal, the minimum above."""
    return torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)


class Slot:
    """Static KV buffers for one request at a time, and the graphs captured over them."""

    def __init__(self, model: nn.Module, capacity: int, capture: bool, compile: bool = False):
        cfg = model.config
        base = model.model
        attn = base.layers[0].self_attn
        self.model, self.base, self.head = model, base, model.get_output_embeddings()
        self.dtype, self.device = self.head.weight.dtype, self.head.weight.device
        self.heads, self.kv_heads, self.dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        self.capture = capture
        self.compile = compile  # tree blocks through `compiled_layer`
        self.eps = float(base.layers[0].input_layernorm.variance_epsilon)
        self.scaling = float(attn.scaling)

        def params(*linears):
            return [t for m in linears for t in (m.weight, m.bias)]

        self.weights = [(layer.input_layernorm.weight, *params(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                                               layer.self_attn.o_proj),
                         layer.post_attention_layernorm.weight, *params(layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
                        for layer in base.layers]
        self.capacity = 0
        self.length = 0  # committed entries
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}  # (n, span) ->
        self.capture_ms: dict[tuple[int, int], float] = {}
        self.busy = False
        self._grow(capacity)

    # -- buffers -------------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        n_layers = len(self.base.layers)
        shape = (n_layers, self.kv_heads, capacity, self.dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v, self.capacity = k, v, capacity
        self.cols = torch.arange(capacity, device=self.device)
        self.past = torch.zeros((), dtype=torch.long, device=self.device)
        self.graphs.clear()  # they read the old buffers
        self.pool = None  # the graphs' memory pool, made at the first capture

    def reserve(self, need: int) -> None:
        """Room for `need` entries (the request's prompt, budget and largest tree)."""
        if need > self.capacity:
            cap = max(MIN_CAPACITY, self.capacity)
            while cap < need:
                cap *= 2
            self._grow(cap)

    def get_seq_length(self) -> int:
        return self.length

    def span(self, need: int) -> int:
        """The buffer entries attention reads when `need` are in use: a power of two (at least
        MIN_SPAN), so a step attends over at most twice the context and a graph serves a range."""
        span = MIN_SPAN
        while span < need:
            span *= 2
        return min(span, self.capacity)

    def spans(self) -> list[int]:
        out, span = [], MIN_SPAN
        while span < self.capacity:
            out.append(span)
            span *= 2
        return out + [self.capacity]

    # -- the forward -----------------------------------------------------------------------------

    def run(self, ids: torch.Tensor, depth: torch.Tensor, block: torch.Tensor, past: torch.Tensor, span: int,
            tree: bool = False):
        """n new tokens at positions past + depth, seeing the committed entries and the block mask
        among themselves -> final normed hidden (n, H), logits (n, V). Writes their keys and values
        at past .. past + n - 1 < span. Every shape is fixed by n and the span. `tree`: a tree block
        (what the graphs capture): explicit attention, and the layers through `compiled_layer` if the
        slot compiles; else (a prompt) the fused attention kernel."""
        n = ids.shape[0]
        base = self.base
        x = base.embed_tokens(ids)[None]  # (1, n, H)
        pos = (past + depth)[None]
        cos, sin = base.rotary_emb(x, position_ids=pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rel = self.cols[:span] - past  # (span,) column offsets from the block's first position
        blocked = torch.finfo(self.dtype).min
        visible = block.index_select(1, rel.clamp(0, n - 1))  # (n, span)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        mask = torch.where(rel < 0, zero, torch.where(rel < n, visible, torch.full_like(zero, blocked)))
        groups = self.heads // self.kv_heads
        mask = mask.repeat(groups, 1)[None, None]  # queries of a group stacked over their key/value head
        where = past + torch.arange(n, device=self.device)
        fn = compiled_layer() if tree and self.compile else layer_math
        for i, w in enumerate(self.weights):
            x = fn(x, cos, sin, mask, where, self.k[i, :, :span], self.v[i, :, :span], *w, self.eps, self.heads, self.kv_heads,
                   self.dim, self.scaling, tree)
        hidden = base.norm(x)[0]
        return hidden, self.head(hidden)

    def verify(self, ids: torch.Tensor, depth: torch.Tensor, block: torch.Tensor, graph: bool):
        """Verify n new tokens after the committed entries (graph: replay the size's graph,
        capturing it first if needed); the cache then holds length + n entries."""
        n = ids.shape[0]
        if self.length + n > self.capacity:
            self.reserve(self.length + n)
        span = self.span(self.length + n)
        if not (graph and self.capture):
            self.past.fill_(self.length)
            out = self.run(ids, depth.to(self.device), block, self.past, span, graph)
        else:
            if (n, span) not in self.graphs:
                try:
                    self._capture(n, span)
                except Exception as e:  # e.g. a runtime that forbids capture: decode on, eagerly
                    warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); this slot verifies eagerly")
                    self.capture = False
                    return self.verify(ids, depth, block, graph)
            g, static, outs = self.graphs[(n, span)]
            static["ids"].copy_(ids)
            static["depth"].copy_(depth, non_blocking=True)
            static["block"].copy_(block)
            self.past.fill_(self.length)
            g.replay()
            out = (outs[0].clone(), outs[1].clone())  # the next replay overwrites the graph's outputs
        self.length += n
        return out

    def prepare(self, n: int) -> None:
        """Capture block size n at every span up to the capacity (warm-up: none is captured mid-request
        then). Only on a slot whose entries are expendable: a capture's first run writes n entries."""
        if not self.capture:
            return
        for span in self.spans():
            if (n, span) not in self.graphs and span >= n:
                self.length = min(self.length, span - n)
                self._capture(n, span)

    def _capture(self, n: int, span: int) -> None:
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static = {
            "ids": torch.zeros(n, dtype=torch.long, device=self.device),
            "depth": torch.arange(n, device=self.device),
            "block": causal_block(n, self.dtype, self.device),
        }
        self.past.fill_(self.length)  # the first run writes entries length .. length + n - 1, not yet committed
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compilation and lazy set-up (cuBLAS handles, workspaces) outside the capture
            for _ in range(2 if self.compile else 1):
                self.run(static["ids"], static["depth"], static["block"], self.past, span, True)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            outs = self.run(static["ids"], static["depth"], static["block"], self.past, span, True)
        torch.cuda.synchronize(self.device)
        self.graphs[(n, span)] = (g, static, outs)
        self.capture_ms[(n, span)] = round((time.perf_counter() - t0) * 1e3, 1)

    def commit(self, past: int, accepted: list[int], n_tree: int) -> None:
        """Keep the accepted nodes' entries at past .. past + len - 1 (all layers in one copy)."""
        keep = len(accepted)
        if accepted != list(range(keep)):
            src = torch.tensor(accepted, device=self.device) + past
            self.k[:, :, past : past + keep] = self.k.index_select(2, src)
            self.v[:, :, past : past + keep] = self.v.index_select(2, src)
        self.length = past + keep


class SlotCache:
    """A request's view of a slot: what the engine's decode loop passes around as its KV cache.
    The slot goes back to the pool when the request's cache is dropped."""

    def __init__(self, pool: "Graphs", slot: Slot):
        self.slot = slot
        slot.length = 0
        weakref.finalize(self, pool.release, slot)

    def get_seq_length(self) -> int:
        return self.slot.length


class Graphs:
    """An engine's slots, made on demand up to MAX_SLOTS."""

    def __init__(self, model: nn.Module, capture: bool | None = None, compile: bool = False):
        self.model, self.compile = model, compile
        device = model.get_output_embeddings().weight.device
        self.capture = device.type == "cuda" if capture is None else capture
        self.slots: list[Slot] = []
        self.lock = threading.Lock()

    @classmethod
    def of(cls, model: nn.Module, wanted: bool = True, compile: bool = False) -> "Graphs | None":
        """The graphs for `model` if they apply (CUDA, a supported architecture, not turned off);
        `compile`: their layers through `torch.compile` too."""
        device = model.get_output_embeddings().weight.device
        if not wanted or not enabled() or device.type != "cuda" or not supported(model):
            return None
        return cls(model, compile=compile)

    def cache(self, need: int) -> SlotCache | None:
        """A free slot with room for `need` entries, or None when MAX_SLOTS are in use."""
        with self.lock:
            slot = next((s for s in self.slots if not s.busy), None)
            if slot is None:
                if len(self.slots) >= MAX_SLOTS:
                    return None
                slot = Slot(self.model, need, self.capture, self.compile)
                self.slots.append(slot)
            slot.busy = True
        slot.reserve(need)
        return SlotCache(self, slot)

    def release(self, slot: Slot) -> None:
        with self.lock:
            slot.busy = False

    def capture_ms(self) -> dict[str, float]:
        """"size@span" -> ms its capture took (the first slot's; warm-up captures every slot alike)."""
        return {f"{n}@{span}": ms for (n, span), ms in sorted(self.slots[0].capture_ms.items())} if self.slots else {}
