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
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

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


def pack_linears(module: nn.Module) -> int:
    """Replace every CPU `nn.Linear` of a packable dtype under `module` by a `PackedLinear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and available(child.weight.device, child.weight.dtype):
            setattr(module, name, PackedLinear.of(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


def is_packed(module: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in module.modules())
