"""Prepacked float32 linear layers for CPU decoding (oneDNN), and a switch back to stock kernels.

A decode step multiplies a few token rows by every weight matrix of the model, so on a CPU it
is bound by streaming the weights. Stock `F.linear` re-lays the weights out on every call
for small row counts; oneDNN with weights packed once does not. Measured on this project's
2-core machine (SmolLM2-135M's 210 linear layers, float32, medians): 1 row 41-52 ms -> 27 ms,
5 rows 41-67 -> 21 ms, 16 rows 64 -> 32 ms; its 49,152-row LM head 12.2 -> 5.6 ms for 1 row.

The base model's arithmetic stays float32 (results agree with `F.linear` to ~1e-6), and the
engine's outputs are checked token for token against stock `generate`. Draft heads, whose
outputs are only proposals, are packed in bfloat16 where the CPU supports it (`DraftHeads.pack`).
The `hf` baselines run under `stock_kernels()`, so they measure transformers as a user gets it.

`tree_sdpa` is the attention counterpart: the tree verification's masked query block attends
grouped-query heads without materialising the repeated key/value heads.

`tools.kernelbench` times both against stock per tree size on a loaded model (`python -m entmtp kernels`).
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from entmtp.model import ext

_local = threading.local()


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Packing applies on a CPU whose PyTorch build has oneDNN: float32, or bfloat16 where the
    CPU has native bf16 support."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


@contextmanager
def stock_kernels() -> Iterator[None]:
    """Within this block, in this thread, packed layers compute with stock `F.linear`."""
    before = getattr(_local, "stock", False)
    _local.stock = True
    try:
        yield
    finally:
        _local.stock = before


def stock() -> bool:
    return getattr(_local, "stock", False)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight is also kept packed for oneDNN; shares the original Parameter."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, bias: nn.Parameter | torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self._bias = None if bias is None else bias.detach()

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if stock() or torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self._bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def int8_available(device: torch.device | str) -> bool:
    """Row-wise int8 linears (`Int8RowLinear`) need a CPU and PyTorch's fbgemm/x86 quantized engine."""
    engines = torch.backends.quantized.supported_engines
    ops = all(hasattr(torch.ops.quantized, op) for op in ("linear_prepack", "linear_dynamic"))
    return torch.device(device).type == "cpu" and ops and ("x86" in engines or "fbgemm" in engines)


SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength; 0.3-0.85 measured, 0.5 agreed best with float32


def smooth_factors(weight: torch.Tensor, act_absmax: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s: inputs x / s and weights W * s balance each
    channel's range between the two before both are quantised."""
    w = weight.detach().float()
    return (act_absmax.float().clamp_min(1e-5) ** SMOOTH_ALPHA / w.abs().amax(0).clamp_min(1e-5) ** (1 - SMOOTH_ALPHA)).clamp(1e-3, 1e3)


class Int8RowLinear(nn.Module):
    """A linear layer for draft heads on a CPU: int8 weights (one scale per output row) and int8
    activations quantised per input row, multiplied by fbgemm with exact int32 accumulation.

    Each row is computed on its own (one call per row; the weights stay in cache after the first),
    so a row's result never depends on which other rows share the batch: the heads draft the same
    tokens in the engine (a few rows per depth) as in the bank's traces (hundreds of positions at
    once), which is what lets a bank simulate any tree exactly. A draft head's output is only a
    proposal that verification checks against the base model, so this precision never reaches the
    output. It streams a quarter of float32's bytes: the 8,192-row draft LM head measured 1.0 ->
    0.27 ms for one row on the 2-core AMD EPYC without AVX-512.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_absmax: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.smooth = None
        if act_absmax is not None:  # SmoothQuant: x / s and W * s balance each input channel's range
            s = smooth_factors(w, act_absmax)
            w = w * s
            self.smooth = (1 / s).contiguous()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated after the pinned torch; int8_available checks
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale, torch.zeros(len(scale), dtype=torch.long), 0, torch.qint8)
        _quantized_engine()
        self._packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.smooth is not None:
            rows = rows * self.smooth
        out = torch.cat([torch.ops.quantized.linear_dynamic(r[None], self._packed, True) for r in rows.unbind(0)])
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


def _quantized_engine() -> None:
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"


@contextmanager
def input_absmax(module: nn.Module) -> Iterator[dict[nn.Module, torch.Tensor]]:
    """Within this block, record the largest |input| per channel of every `nn.Linear` under
    `module` (forward pre-hooks), keyed by the layer."""
    seen: dict[nn.Module, torch.Tensor] = {}

    def hook(layer, args):
        a = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
        seen[layer] = a if layer not in seen else torch.maximum(seen[layer], a)

    handles = [m.register_forward_pre_hook(hook) for m in module.modules() if isinstance(m, nn.Linear)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def replace_linears(module: nn.Module, make, when=lambda linear: True) -> int:
    """Replace every `nn.Linear` under `module` for which `when(linear)` holds by `make(linear)`;
    returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and when(child):
            setattr(module, name, make(child))
            count += 1
        else:
            count += replace_linears(child, make, when)
    return count


def pack_linears(module: nn.Module) -> int:
    """Replace every CPU `nn.Linear` of a packable dtype under `module` by a `PackedLinear`; returns how many."""
    return replace_linears(module, PackedLinear.of, lambda linear: available(linear.weight.device, linear.weight.dtype))


# --- attention over a tree block --------------------------------------------------------------

ATTENTION = "entmtp_sdpa"  # transformers' SDPA path, plus grouped-query packing for masked blocks


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for (N, V) logits, the same indices: through the extension's
    `argmax_rows` where it is loaded and the logits are float32 on a CPU (ATen's reduction took
    ~0.2 ms of a 5-node step on the 2-core AMD EPYC, this ~0.05), else ATen's."""
    built = ext.loaded()
    if built is not None and logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape[1]:
        return built.argmax_rows(logits)
    return logits.argmax(-1)


def tree_sdpa(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa_attention_forward`, except for a masked block of several queries on a
    grouped-query model (a tree verification): there stock code copies every key and value head
    `groups` times (`repeat_kv`, ~11 ms a step at 300 cached tokens on this CPU); here the queries
    of a group are stacked over their shared key/value head instead, and the mask is tiled to match.
    The products are the same; the kernel may block the longer query axis differently, so results
    agree with stock to ~1e-7 (measured here at 300 cached tokens: bit-identical for blocks of 5, 9
    and 30 queries, 2.7e-7 apart for 2)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fused = getattr(module, "_entmtp_attention", None)  # a model served by the GGUF extension (decoder.fuse)
    if (fused is not None and not stock() and not dropout and kwargs.get("position_bias") is None and query.dtype == torch.float32
            and not torch.is_grad_enabled() and (attention_mask is None or attention_mask.dim() == 4)):
        return fused(query, key, value, attention_mask, module.scaling if scaling is None else scaling), None

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    stock_path = (
        stock() or attention_mask is None or groups == 1 or q_len == 1 or dropout
        or kwargs.get("position_bias") is not None
        or attention_mask.dtype == torch.bool or attention_mask.shape[1] != 1  # only one additive mask for all heads
    )
    if stock_path:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    q = query.reshape(b, heads // groups, groups * q_len, dim)  # head h reads key/value head h // groups
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1, groups * q_len, -1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, q_len, dim).transpose(1, 2).contiguous(), None


def use_tree_attention(model: nn.Module) -> bool:
    """Route `model`'s SDPA attention through `tree_sdpa` (masks built as for SDPA). True if set."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(ATTENTION, tree_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return model.config._attn_implementation == ATTENTION


