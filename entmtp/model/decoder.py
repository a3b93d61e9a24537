"""The engine's forward for Llama-architecture models on a CPU: transformers' operations, in
transformers' order, without the per-call machinery around them.

A decode step of SmolLM2-135M runs 30 layers of small tensors; with the linears computed from the
GGUF blocks (`gguf.py`, ~16 ms a step on the 2-core AMD EPYC) most of the rest of the step was
transformers' Python around the arithmetic: module calls, keyword plumbing, mask preparation,
cache dispatch. `forward` runs the same arithmetic directly: the embedding, RMSNorm as
`LlamaRMSNorm` computes it, rotary embeddings from the model's own `rotary_emb`, the attention
function the model is registered with (`kernels.tree_sdpa`), the MLP, the final norm. Where the
linears are `GGUFLinear`s, q/k/v and gate/up are each one call on the concatenated blocks: the
kernel sums every output element in the same order whatever rows share a call, so this changes
no bit. The hidden states equal transformers' forward bit for bit (`tests/test_decoder.py`), so
`generate` on the same module stays the oracle.

It applies to plain Llama layers (`LlamaForCausalLM`, default RoPE, no biases, SiLU) with the
engine's buffered cache, and to the masks the engine uses: none for one new token or a prompt
on an empty cache (causal), or a tree's 4-D block mask. Anything else, and anything under
`kernels.stock_kernels()`, goes through transformers. `ENTMTP_LEAN=0` turns it off.

A model served from GGUF blocks goes further (`fuse`, applied at load): the rest of each layer
runs in the same C++ extension (`csrc/layers.cpp`: RMSNorm, SiLU times up, rotary embedding,
attention over the visible keys, each row alone), transformers' own forward is rerouted through
those operations (the model's RMSNorm and MLP modules swapped, its attention handed over by
`kernels.tree_sdpa`), and `forward` runs all layers in one extension call (`Stack.forward`,
~2 ms a step besides the linears on the 2-core AMD EPYC). Both paths compute the same bits, so
`generate` on the served module is the oracle (`tests/test_fused.py`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from entmtp.model import kernels
from entmtp.model import kv
from entmtp.model.ext import ISA_CODES
from entmtp.model.gguf import GGUFLinear

LEAN_ENV = "ENTMTP_LEAN"


class _Fused(nn.Module):
    """Several `GGUFLinear`s of one kind over the same input, as one kernel call (`GGUFLinear.concat`)."""

    def __init__(self, layers: list[GGUFLinear]):
        super().__init__()
        self.sizes = [layer.out_features for layer in layers]
        self.layer = GGUFLinear.concat(layers)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.layer(x).split(self.sizes, dim=-1))


class FusedRMSNorm(nn.Module):
    """A model's RMSNorm computed by the GGUF extension's `rms_norm` (one row at a time, a fixed
    order); under `kernels.stock_kernels()`, with gradients, or off float32, the original's own
    arithmetic. It shares the original's weight."""

    def __init__(self, norm: nn.Module, ext):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.__dict__["_stock"], self.__dict__["_ext"] = norm, ext  # not submodules: no second copy in state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.stock() or x.dtype != torch.float32 or torch.is_grad_enabled():
            return self._stock(x)
        return self._ext.rms_norm(x, self.weight, self.variance_epsilon)


class FusedMLP(nn.Module):
    """LlamaMLP with gate and up as one GGUF kernel call and the extension's `silu_mul`; the
    original (kept for `kernels.stock_kernels()` and gradients) shares its projections."""

    def __init__(self, mlp: nn.Module, ext):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.gate_up = _Fused([mlp.gate_proj, mlp.up_proj])
        self.__dict__["_stock"], self.__dict__["_ext"] = mlp, ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.stock() or x.dtype != torch.float32 or torch.is_grad_enabled():
            return self._stock(x)
        g, u = self.gate_up(x)
        return self.down_proj(self._ext.silu_mul(g, u))


def _attention(ext):
    """The attention `kernels.tree_sdpa` hands a fused model's queries to: the extension's, which
    takes each query and head alone over the keys it may see (masks as bool, or none: causal)."""

    def attend(query, key, value, mask, scaling):
        return ext.attention(query, key, value, _seen(mask), float(scaling))

    return attend


def _seen(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask as bool, True where a query sees a key: an additive mask holds 0 there and the dtype's
    minimum elsewhere."""
    return mask if mask is None or mask.dtype == torch.bool else mask == 0


def _fusable(layers: list[nn.Module]) -> bool:
    return all(isinstance(layer, GGUFLinear) and layer.kind == layers[0].kind for layer in layers)


class Plan:
    """What `forward` needs of one model, prepared once: per layer its norms, projections (fused
    where the kernels allow) and attention settings."""

    def __init__(self, model: nn.Module):
        base = model.model
        self.base, self.head = base, model.get_output_embeddings()
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            gate_up = [mlp.gate_proj, mlp.up_proj]
            self.layers.append((
                layer, attn,
                _Fused(qkv) if _fusable(qkv) else None,
                _Fused(gate_up) if _fusable(gate_up) else None,
            ))


def fuse(model: nn.Module) -> bool:
    """For a Llama model served from GGUF blocks (every projection Q4_1, the LM head Q8_0): swap its
    RMSNorms and MLPs for the extension's and route its attention there, so that transformers'
    forward, which `generate` runs, computes what the engine's `Stack` computes, bit for bit; and
    prepare that `Stack`. True if done."""
    from entmtp.model.ext import extension

    ext = extension()
    if ext is None or not supported(model) or model.__dict__.get("_entmtp_stack") is not None:
        return False
    base = model.model
    linears = [getattr(layer.self_attn, n) for layer in base.layers for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(layer.mlp, n) for layer in base.layers for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, GGUFLinear) and m.kind == "q4_1" for m in linears):
        return False
    if not isinstance(model.get_output_embeddings(), GGUFLinear) or len({layer.self_attn.head_dim for layer in base.layers}) != 1:
        return False
    weights = []
    for layer in base.layers:
        layer.mlp = FusedMLP(layer.mlp, ext)
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = GGUFLinear.concat([attn.q_proj, attn.k_proj, attn.v_proj]), mlp.gate_up.layer
        weights += [layer.input_layernorm.weight.detach(), qkv.qs, qkv.d, qkv.m, attn.o_proj.qs, attn.o_proj.d, attn.o_proj.m,
                    layer.post_attention_layernorm.weight.detach(), gate_up.qs, gate_up.d, gate_up.m,
                    mlp.down_proj.qs, mlp.down_proj.d, mlp.down_proj.m]
    cfg, attn0 = model.config, base.layers[0].self_attn
    eps = base.layers[0].input_layernorm.variance_epsilon
    arithmetic = {(m.q8, m.isa) for m in linears}
    if len(arithmetic) != 1:
        return False
    q8, isa = arithmetic.pop()
    stack = ext.Stack(weights, cfg.num_attention_heads, cfg.num_key_value_heads, attn0.head_dim, float(eps), float(attn0.scaling),
                      q8, ISA_CODES[isa])
    attend = _attention(ext)
    for layer in base.layers:
        layer.input_layernorm = FusedRMSNorm(layer.input_layernorm, ext)
        layer.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm, ext)
        layer.self_attn.__dict__["_entmtp_attention"] = attend
    base.norm = FusedRMSNorm(base.norm, ext)
    model.__dict__["_entmtp_stack"] = stack
    model.__dict__.pop("_entmtp_plan", None)
    return True


def fused(model: nn.Module) -> bool:
    return model.__dict__.get("_entmtp_stack") is not None


def supported(model: nn.Module) -> bool:
    """Whether `forward` computes exactly what transformers' forward does for this model."""
    if os.environ.get(LEAN_ENV, "").strip() in ("0", "false", "off", "no"):
        return False
    cfg = model.config
    if type(model).__name__ != "LlamaForCausalLM" or not hasattr(model, "model"):
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return False
    if getattr(cfg, "hidden_act", "") != "silu" or getattr(cfg, "_attn_implementation", None) != kernels.ATTENTION:
        return False
    return model.get_output_embeddings().weight.device.type == "cpu"


def plan(model: nn.Module) -> Plan | None:
    """The model's prepared plan (made on first use, kept on the model), or None if unsupported."""
    cached = model.__dict__.get("_entmtp_plan")
    if cached is None:
        cached = Plan(model) if supported(model) else False
        model.__dict__["_entmtp_plan"] = cached
    return cached or None


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm.forward`, operation for operation (its weight and epsilon passed in)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms(x, norm.weight, norm.variance_epsilon)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_forward(model: nn.Module, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 last_only: bool = False):
    """One forward as `forward.forward` makes it: (1, Q) ids -> final normed hidden (Q, H), logits
    (Q, V), or (1, V) for the last position alone with `last_only`; or None when this path does
    not apply (the caller then runs transformers)."""
    p = plan(model)
    if p is None or kernels.stock() or torch.is_grad_enabled():
        return None
    layers = getattr(cache, "layers", None)
    if not layers or len(layers) != len(p.layers) or not all(type(c) is kv.BufferedLayer for c in layers):
        return None
    q_len = input_ids.shape[1]
    past = layers[0].get_seq_length()
    if mask is None and q_len > 1 and past > 0:  # transformers would build a mask here: leave it to them
        return None
    base = p.base
    x = base.embed_tokens(input_ids)
    cos, sin = base.rotary_emb(x, position_ids=position_ids)
    stack = model.__dict__.get("_entmtp_stack")
    if stack is not None:  # a fused model: the whole stack in one call, or transformers (whose modules are the same)
        mask = _seen(mask)
        if mask is not None and not bool(mask[0, 0, :, :past].all()):  # the stack lets every node see the cache
            return None
        return stack_forward(model, stack, layers, x[0], cos[0], sin[0], past, mask, last_only)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    shape = (1, q_len, -1, p.layers[0][1].head_dim)
    for (layer, attn, qkv, gate_up), c in zip(p.layers, layers):
        residual = x
        h = _rms(layer.input_layernorm, x)
        q, k, v = qkv(h) if qkv is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        k, v = c.update(k, v)
        out, _ = kernels.tree_sdpa(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        x = residual + attn.o_proj(out.reshape(1, q_len, -1).contiguous())
        residual = x
        h = _rms(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        g, u = gate_up(h) if gate_up is not None else (mlp.gate_proj(h), mlp.up_proj(h))
        x = residual + mlp.down_proj(F.silu(g) * u)
    hidden = _rms(base.norm, x)[0]
    return hidden, p.head(hidden[-1:] if last_only else hidden)


def stack_forward(model, stack, layers, x, cos, sin, past: int, mask, last_only: bool = False):
    """The fused model's layers in one extension call, writing the cache in place; `mask` is None
    (causal) or bool [1, 1, Q, past + Q] that shows every node the whole cache."""
    attn = model.model.layers[0].self_attn
    kv_heads, dim = model.config.num_key_value_heads, attn.head_dim
    q_len = x.shape[0]
    buffers = [c.make_room(q_len, kv_heads, dim, x.dtype, x.device) for c in layers]
    block = None if mask is None else mask[0, 0, :, past:]  # the tree block among the new tokens (bool)
    out = stack.forward(x.contiguous(), cos.contiguous(), sin.contiguous(), [b[0] for b in buffers], [b[1] for b in buffers], past, block)
    for c in layers:
        c.advance(q_len)
    hidden = model.model.norm(out)
    return hidden, model.get_output_embeddings()(hidden[-1:] if last_only else hidden)
