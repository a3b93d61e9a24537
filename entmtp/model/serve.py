"""Make a loaded Hugging Face model serve on this machine's kernels, and name how it serves.

`serve` is the kernel set-up the loader applies after `from_pretrained`: the GGUF's own blocks
where the extension builds (`gguf.attach`), oneDNN-packed float32 for the remaining linears, the
tree attention, and the fused layer stack. `label` is the word fits and benchmarks record.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from entmtp.model import decoder, gguf
from entmtp.model.ext import ISA_CODES
from entmtp.model.gguf import GGUFLinear, BlockLinear
from entmtp.model.kernels import Int8RowLinear, PackedLinear, pack_linears, use_tree_attention


def serve(model: nn.Module, kernels: str, gguf_path: str | Path | None) -> nn.Module:
    """Set `model` (loaded on its device and dtype) up to serve with `kernels` (config.KERNELS):
    q8/packed read the GGUF's blocks at `gguf_path` where the extension builds (a CPU float32
    model only; the reason goes to stderr where it cannot), and q8/packed/onednn pack the
    remaining float32 linears, route tree attention and fuse the layer stack."""
    device = model.get_output_embeddings().weight.device
    if kernels in ("q8", "packed") and gguf_path is not None and device.type == "cpu" and model.dtype == torch.float32:
        attached = gguf.attach(model, gguf_path, q8=kernels == "q8")  # read the GGUF's blocks directly where the kernels build
        if attached["error"]:
            print(f"entmtp: serving float32 with oneDNN: the GGUF block kernels are off here ({attached['error']})", file=sys.stderr)
    if kernels in ("q8", "packed", "onednn"):
        pack_linears(model)  # the remaining float32 linears; CPU only, a no-op on GPUs
        use_tree_attention(model)  # grouped-query tree blocks without copying key/value heads
        if gguf.is_attached(model):
            decoder.fuse(model)  # norms, MLP and attention from the extension too, in transformers' forward and the engine's
    return model


def is_packed(module: nn.Module) -> bool:
    """Whether any linear under `module` computes with this project's CPU kernels (oneDNN packed,
    int8 rows, GGUF blocks or Q8 blocks)."""
    return any(isinstance(m, (PackedLinear, Int8RowLinear, GGUFLinear, BlockLinear)) for m in module.modules())


def label(model: nn.Module) -> str:
    """The base model's CPU kernels in a word, as fits and benchmarks record them: "gguf-q8-<isa>"
    (`gguf.GGUFLinear` with Q8 inputs, their products on instruction-set path <isa>) or
    "gguf-blocks" (float32 inputs), "packed" (oneDNN float32) or "stock", plus "+fused" where the
    GGUF extension runs the whole layer (`decoder.fuse`), else "+lean" where the engine runs the
    model through `decoder.lean_forward`. Step costs differ by path, so fits are keyed by it."""
    mods = list(model.modules())
    gguf_layers = [m for m in mods if isinstance(m, GGUFLinear)]
    if gguf_layers:
        q8 = [m for m in gguf_layers if m.q8]
        name = f"gguf-q8-{q8[0].isa}" if q8 else "gguf-blocks"
    else:
        name = "packed" if any(isinstance(m, PackedLinear) for m in mods) else "stock"
    if decoder.fused(model):
        return name + "+fused"
    return name + ("+lean" if decoder.plan(model) is not None else "")


def set_isa(model: nn.Module, isa: str) -> None:
    """Compute `model`'s Q8 products on instruction-set path `isa` (one `ext.isas()` lists): every
    GGUF layer and the fused layer stack. The results are the same bits on every path."""
    for m in model.modules():
        if isinstance(m, (GGUFLinear, BlockLinear)):
            m.isa = isa
    stack = model.__dict__.get("_entmtp_stack")
    if stack is not None:
        stack.isa = ISA_CODES[isa]
