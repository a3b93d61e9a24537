"""Linear layers computed straight from a GGUF file's Q4_1 and Q8_0 blocks, on CPUs with AVX2.

The default model comes as a Q4_1 GGUF (its embedding and tied LM head in Q8_0) and runs as the
float32 model those blocks dequantise to. A decode step on a CPU is bound by reading the weights:
float32 is 540 MB a step, the blocks are 96 MB. `GGUFLinear` keeps the blocks and computes with
a small C++ kernel (`csrc/gguf_linear.cpp`, built once per machine with the system's C++ compiler
through `torch.utils.cpp_extension`): each weight row is dequantised into a float32 buffer,
exactly the values of the float32 model (`attach` checks every matrix against the model's own
weights, bit for bit), and dotted with each input row in float32.

Every output element is summed in one fixed order, however many rows share the call and whichever
thread computes it, so a row's result never depends on its batch: a tree verification of N tokens
computes exactly what N single-token steps compute, and `generate` on the same module is the
oracle the engine matches. Against stock `F.linear` on the same weights the results differ by
float32 rounding (~1e-5 on SmolLM2's layers), as oneDNN's do.

By default (`--kernels q8`, `GGUFLinear.q8`) the layers compute as llama.cpp does instead: each
input row quantised per block of 32 to int8 with a scale, and the products with the weights'
4-bit (Q4_1) or 8-bit (Q8_0, the LM head) values summed exactly in integers. The weights are
repacked once at load (`pack`: 16 output columns side by side, so one vector instruction adds
4 products for each of 16 outputs), the integer block sums come from AVX-512 VNNI's vpdpbusd or
AVX2's maddubs/madd, whichever the CPU runs (`ext.isa()`), and every output is finished from them
in one fixed floating-point order, the same in every path and in the scalar reference: a row's
result is the same bits whatever the rows in its call and whichever instructions ran. The served
model is then that arithmetic (~0.5% from the float32 product per layer on random inputs).
docs/kernels.md has the measurements.

`ENTMTP_GGUF_KERNELS=0` (`ext.GGUF_ENV`) turns it off (oneDNN's packed float32 then serves, as on CPUs without
AVX2 or where the build fails: the loader says why on stderr).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from entmtp.model import kernels
from entmtp.model.ext import ISA_CODES, extension, extension_error
from entmtp.model.ext import isa as isa_name

_BLOCK = 32
MAX_IN = 2048  # the float32 path's per-thread buffer holds 4 weight rows of at most this many inputs (kMaxIn)

GROUP = 16  # output columns a packed group (csrc/gguf_linear.cpp)
# the kernels' arithmetic of a call (`q8` argument): float32 inputs; Q8 inputs for calls of up to 64
# rows, float32 beyond (how the base model was served before 2026-12-02: `kernels` times it); Q8
# inputs whatever the rows (the base model with `--kernels q8`, and the draft heads)
F32, Q8_SMALL, Q8_ALWAYS = 0, 1, 2


def pack(kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A matrix's blocks in the GGUF's own layout (`_split_blocks`: values [out, bytes], fp16
    scales and minimums [out, blocks]) -> the kernels' packed layout: per group of 16 outputs and
    block of 32 inputs, 64-byte chunks holding 4 consecutive inputs of each of the 16 (Q4_1: as the
    file's nibbles, Q8_0: as w + 128), then the 16 scales (and minimums) as fp16. A permutation of
    the file's bytes (Q8_0's flipped in their top bit): nothing is rounded. Outputs past the last
    (a partial group) are zero weights with zero scales."""
    n, blocks = d.shape
    groups = -(-n // GROUP)
    pad = groups * GROUP - n

    def padded(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)]) if pad else t

    if kind == "q4_1":
        q = padded(qs.view(n, blocks, 4, 4), 0)  # [out, block, chunk j, i]: nibbles of inputs 4j + i and 16 + 4j + i
    else:
        q = padded(qs.view(torch.uint8).view(n, blocks, 8, 4) ^ 0x80, 0x80)  # [out, block, chunk j, i]: input 4j + i, + 128
    q = q.view(groups, GROUP, blocks, -1, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, -1, 64).contiguous()
    scales = lambda s: padded(s.to(torch.float16), 0).view(groups, GROUP, blocks).permute(0, 2, 1).contiguous()
    return q, scales(d), None if m is None else scales(m)


def q8_0_rows(lin: "BlockLinear") -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 `BlockLinear`'s blocks back in rows, as `pack` took them: values int8 [out, in] and
    scales float16 [out, in / 32] (what `lm_refine` reads a few rows of)."""
    if lin.kind != "q8_0":
        raise ValueError(f"q8_0_rows: a {lin.kind} layer")
    groups, blocks = lin.qs.shape[:2]
    q = lin.qs.view(groups, blocks, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(groups * GROUP, blocks * _BLOCK)
    q = (q[: lin.out_features] ^ 0x80).view(torch.int8).contiguous()
    d = lin.d.permute(0, 2, 1).reshape(groups * GROUP, blocks)[: lin.out_features].contiguous()
    return q, d


class GGUFLinear(nn.Module):
    """A bias-free linear layer whose weight is kept as GGUF blocks (Q4_1 or Q8_0), repacked for
    the CPU kernels (`pack`); it shares the float32 Parameter it replaces, which
    `kernels.stock_kernels()` (the `hf` baselines) and training use. `q8`: inputs quantised to Q8
    blocks (llama.cpp's arithmetic) in every call, each row alone, their products summed by
    instruction-set path `isa` (`ext.isa()`: bit for bit the same in every path)."""

    def __init__(self, weight: nn.Parameter | None, kind: str, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
                 out_features: int, q8: bool = False, isa: str | None = None):
        super().__init__()
        q, d, m = packed
        self.out_features, self.in_features = out_features, q.shape[1] * _BLOCK
        self.weight = weight  # None for `concat`: only the engine's own forward calls those
        self.bias = None
        self.kind = kind
        self.q8 = q8
        self.register_buffer("qs", q, persistent=False)
        self.register_buffer("d", d, persistent=False)
        self.register_buffer("m", m, persistent=False)
        self._ext = extension()
        self.isa = isa or isa_name()

    @classmethod
    def from_blocks(cls, weight: nn.Parameter | None, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                    q8: bool = False, isa: str | None = None) -> "GGUFLinear":
        """A layer from blocks in the GGUF's own layout (`_split_blocks`)."""
        return cls(weight, kind, pack(kind, qs, d, m), d.shape[0], q8, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.stock() or x.dtype != torch.float32 or torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight)
        code, arithmetic = ISA_CODES[self.isa], Q8_ALWAYS if self.q8 else F32
        if self.kind == "q4_1":
            return self._ext.q4_1_linear(x, self.qs, self.d, self.m, self.out_features, arithmetic, code)
        return self._ext.q8_0_linear(x, self.qs, self.d, self.out_features, arithmetic, code)

    @classmethod
    def concat(cls, layers: list["GGUFLinear"]) -> "GGUFLinear":
        """One layer for several of one kind over the same input, their outputs side by side. The
        kernels compute each output alone, so its outputs are the parts' outputs bit for bit."""
        assert len({(layer.q8, layer.isa) for layer in layers}) == 1, "concat: the layers must share one arithmetic"
        assert all(layer.out_features % GROUP == 0 for layer in layers[:-1]), "concat: whole groups of 16 outputs"
        cat = lambda name: torch.cat([getattr(layer, name) for layer in layers]).contiguous()
        packed = (cat("qs"), cat("d"), None if layers[0].m is None else cat("m"))
        return cls(None, layers[0].kind, packed, sum(layer.out_features for layer in layers), layers[0].q8, layers[0].isa)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias=False, {self.kind} blocks"
                f"{f', q8 inputs ({self.isa})' if self.q8 else ''}")


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [out, in] (in a multiple of 32) -> Q8_0 blocks in the GGUF's layout (values
    int8 [out, in], fp16 scales [out, blocks]), as ggml's reference quantiser makes them: per block
    of 32, d = max|w| / 127, q = w / d rounded to the nearest."""
    w = weight.detach().float().reshape(weight.shape[0], -1, _BLOCK)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float().clamp_min(1e-30), torch.zeros((), dtype=torch.float32))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape[0], -1), d


HEAD_BLOCKS = ("q4_1", "q8_0")  # the block kinds draft heads may be served in (`BlockLinear`)


def _block_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension (32) by halves, elementwise adds only: the same bits on every
    instruction set (a reduction's order may follow the vector width), so a span's choice is too."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def quantize_q4_1(weight: torch.Tensor, grid: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [out, in] (in a multiple of 32) -> Q4_1 blocks in the GGUF's layout (nibbles
    uint8 [out, in / 2]: element j the low nibble of byte j, j + 16 the high one; fp16 scales d
    and minimums m [out, blocks]), each element dequantising to d * q + m.

    ggml's reference quantiser spans each block from its minimum to its maximum. Here each block
    tries `grid` spans, the range shrunk at its ends by up to a quarter step-wise, and keeps the one
    whose dequantised values (with d and m rounded to fp16, as stored) are nearest in squared error:
    a block's outliers then cost less than stretching the step for all 32 values (on the default
    model's Hydra heads, their weights as trained, 15% less squared error than min-max; with
    `grid=5`, 6% less). Every step is elementwise or an exact minimum, maximum or sum of halves
    (`_block_sum`, in float64): the same blocks on every machine."""
    w = weight.detach().float().reshape(weight.shape[0], -1, _BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    best_err = best_q = best_d = best_m = None
    for k in range(grid):
        s = 0.25 * k / max(1, grid - 1)
        for a, b in ((s, 0.0), (0.0, s), (s / 2, s / 2)) if k else ((0.0, 0.0),):
            mn, mx = lo + a * (hi - lo), hi - b * (hi - lo)
            d = ((mx - mn) / 15).to(torch.float16)
            m = mn.to(torch.float16)
            df, mf = d.float(), m.float()
            inv = torch.where(df > 0, 1 / df.clamp_min(1e-30), torch.zeros((), dtype=torch.float32))
            q = torch.round((w - mf[..., None]) * inv[..., None]).clamp(0, 15)
            err = _block_sum(((df[..., None] * q + mf[..., None]) - w).double().square())
            if best_err is None:
                best_err, best_q, best_d, best_m = err, q, d, m
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_q = torch.where(better[..., None], q, best_q)
                best_d, best_m = torch.where(better, d, best_d), torch.where(better, m, best_m)
    q = best_q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return nibbles.reshape(weight.shape[0], -1).contiguous(), best_d, best_m


class BlockLinear(nn.Module):
    """A linear layer (with its bias) for draft heads on a CPU: its float weights quantised to GGUF
    blocks (`kind`: Q4_1, a scale and a minimum per 32 inputs of each output, or Q8_0, a scale per
    32) and its inputs to Q8 blocks, multiplied by the base model's GGUF kernels whatever the number
    of rows (`Q8_ALWAYS`). Each output is computed alone in one fixed order, so a row's result never
    depends on the batch it is in: the heads draft the same tokens in the engine (a few rows a
    depth) as in a bank's traces (hundreds of positions in one call). `smooth` (optional, [in]):
    inputs are divided by it and the weights' columns multiplied by it before quantising
    (SmoothQuant), so outlier channels do not swamp their block."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, smooth: torch.Tensor | None = None,
                 isa: str | None = None, kind: str = "q8_0"):
        super().__init__()
        if kind not in HEAD_BLOCKS:
            raise ValueError(f"BlockLinear: unknown block kind {kind!r} (expected one of {', '.join(HEAD_BLOCKS)})")
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        if self.in_features % _BLOCK:
            raise ValueError(f"BlockLinear: {self.in_features} inputs are not whole blocks of {_BLOCK}")
        self.kind = kind
        self.register_buffer("smooth", None if smooth is None else (1 / smooth.float()).contiguous(), persistent=False)
        if smooth is not None:
            w = w * smooth.float()
        q, d, m = pack(kind, *(quantize_q4_1(w) if kind == "q4_1" else (*quantize_q8_0(w), None)))
        self.register_buffer("qs", q, persistent=False)
        self.register_buffer("d", d, persistent=False)
        self.register_buffer("m", m, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self._ext = extension()
        self.isa = isa or isa_name()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.smooth is not None:
            x = x * self.smooth
        code = ISA_CODES[self.isa]
        if self.kind == "q4_1":
            y = self._ext.q4_1_linear(x, self.qs, self.d, self.m, self.out_features, Q8_ALWAYS, code)
        else:
            y = self._ext.q8_0_linear(x, self.qs, self.d, self.out_features, Q8_ALWAYS, code)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        """Bytes one call streams of this layer's weights (values, scales, minimums, bias)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m, self.bias) if t is not None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.kind} blocks ({self.isa})")


class PartedLinear(nn.Module):
    """A Hydra head's widened linear, whose input is [h ; E(t_0) ; ... ; E(t_i)]: one `BlockLinear`
    a part of `width` inputs (no bias), their outputs summed part by part in order (float32), then
    the bias. The same weights, blocks and smoothing as one `BlockLinear` over the whole input; only
    the sum's order differs (each part summed from zero). So a token's part is a function of the
    token alone, and the heads' chain (`HeadChain`) keeps each one it has computed instead of
    reading that part's weights again: what it computes is still, bit for bit, what these modules
    compute over any batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor | None, width: int,
                 isa: str | None = None, kind: str = "q8_0"):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        if width % _BLOCK or self.in_features % width:
            raise ValueError(f"PartedLinear: {self.in_features} inputs are not whole parts of {width} (whole blocks of {_BLOCK})")
        self.width = width
        cut = lambda t, j: None if t is None else t[..., j * width : (j + 1) * width]
        self.parts = nn.ModuleList(BlockLinear(cut(w, j), None, cut(smooth, j), isa, kind) for j in range(self.in_features // width))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self.kind, self.isa = kind, self.parts[0].isa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        y = self.parts[0](x[..., : self.width].contiguous())
        for j in range(1, len(self.parts)):
            y = y + self.parts[j](x[..., j * self.width : (j + 1) * self.width].contiguous())
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        """Bytes one call through the modules streams (every part, the bias)."""
        return sum(p.nbytes() for p in self.parts) + self._bias_bytes()

    def chain_nbytes(self) -> int:
        """Bytes the heads' chain streams a call: the first part's weights, the bias, and each
        token part's kept outputs (`out_features` float32 each) instead of its weights."""
        kept = (len(self.parts) - 1) * self.out_features * 4
        return self.parts[0].nbytes() + kept + self._bias_bytes()

    def _bias_bytes(self) -> int:
        return 0 if self.bias is None else self.bias.numel() * self.bias.element_size()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, parts of {self.width}, "
                f"bias={self.bias is not None}, {self.kind} blocks ({self.isa})")


def _split_blocks(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF rows of blocks -> (values, scale d, minimum m) in the file's layout, the scales fp16 as
    stored. A Q4_1 block is fp16 d, fp16 m and 16 bytes of nibbles; a Q8_0 block is fp16 d and 32
    int8 values."""
    rows = raw.shape[0]
    size = 20 if kind == "q4_1" else 34
    b = np.ascontiguousarray(raw).reshape(rows, -1, size)
    half = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.float16)[..., 0].copy())
    if kind == "q4_1":
        return torch.from_numpy(b[:, :, 4:].reshape(rows, -1).copy()), half(b[:, :, 0:2]), half(b[:, :, 2:4])
    return torch.from_numpy(b[:, :, 2:].reshape(rows, -1).copy().view(np.int8)), half(b[:, :, 0:2]), None


def _dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float32 weights the blocks stand for, rounded as gguf-py computes them (d * q, then + m)."""
    d = d.float()  # fp16 -> float32 is exact
    if m is None:
        return (d[:, :, None] * qs.view(d.shape[0], d.shape[1], _BLOCK).float()).reshape(d.shape[0], -1)
    blocks = qs.view(d.shape[0], d.shape[1], 16)
    q = torch.cat([blocks & 0x0F, blocks >> 4], -1).float()  # element j: low nibble of byte j; j + 16: high
    return (d[:, :, None] * q + m.float()[:, :, None]).reshape(d.shape[0], -1)


def _row_orders(rows: int, config) -> list[torch.Tensor]:
    """Row orders to try when matching a GGUF matrix to the model's: as stored, and transformers'
    undoing of llama.cpp's rotary permutation of q and k (per attention head or per key/value head)."""
    orders = [torch.arange(rows)]
    for heads in {getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", 0)}:
        if heads and rows % (2 * heads) == 0:
            orders.append(torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows))
    return orders


_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_TYPES = {3: ("q4_1", 20), 8: ("q8_0", 34)}  # GGML tensor type -> (kind, bytes per block of 32)


def read_blocks(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """{tensor name: (kind, uint8 rows of blocks)} for the Q4_1 and Q8_0 tensors of a GGUF file,
    memory-mapped. Reads the header directly: gguf-py's reader also decodes every metadata string
    (the tokenizer's ~100k), which takes ~9 s on a 2-core machine."""
    import struct

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, raw, pos)
        pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(raw[pos - n:pos]).decode("utf-8", "replace")

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            n = take("Q")  # (not `pos += take(...)`: that would add to the position from before the read)
            pos += n
        elif vtype == 9:
            etype, count = take("I"), take("Q")
            if etype in _SCALAR:
                pos += _SCALAR[etype] * count
            else:
                for _ in range(count):
                    skip(etype)
        else:
            pos += _SCALAR[vtype]

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF v2+ file")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if key == "general.alignment" and vtype == 4:
            alignment = take("I")
        else:
            skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), take("I")
        shape = [take("Q") for _ in range(dims)]
        ttype, offset = take("I"), take("Q")
        infos.append((name, shape, ttype, offset))
    start = (pos + alignment - 1) // alignment * alignment
    out = {}
    for name, shape, ttype, offset in infos:
        if ttype in _TYPES and len(shape) == 2 and shape[0] % _BLOCK == 0:
            kind, size = _TYPES[ttype]
            cols, rows = shape  # GGML lists the innermost dimension first
            nbytes = rows * cols // _BLOCK * size
            out[name] = (kind, raw[start + offset:start + offset + nbytes].reshape(rows, -1))
    return out


def attach(model: nn.Module, gguf_path: str | Path, q8: bool = False) -> dict[str, Any]:
    """Replace each linear layer of `model` whose float32 weight is exactly what a Q4_1 or Q8_0
    tensor of `gguf_path` dequantises to by a `GGUFLinear` on those blocks (`q8`: the layers, LM
    head included, compute with their inputs quantised to Q8 blocks, as llama.cpp does). Returns {"layers": how many, "skipped":
    [names], "error": why none, or None}."""
    ext = extension()
    if ext is None:
        return {"layers": 0, "skipped": [], "error": extension_error()}
    modules = dict(model.named_modules())
    tied = model.get_output_embeddings()
    count, skipped = 0, []
    for tname, (kind, blocks) in read_blocks(gguf_path).items():
        if tname == "token_embd.weight":
            name = next((n for n, mod in modules.items() if mod is tied), None)
        else:
            parts = tname.split(".")  # blk.<i>.<kind>.weight
            name = f"model.layers.{parts[1]}.{_NAMES[parts[2]]}" if len(parts) == 4 and parts[2] in _NAMES else None
        layer = modules.get(name) if name else None
        weight = getattr(layer, "weight", None)
        if (layer is None or getattr(layer, "bias", None) is not None or not isinstance(weight, torch.Tensor)
                or weight.dim() != 2 or weight.shape[1] > MAX_IN or weight.dtype != torch.float32 or weight.device.type != "cpu"):
            skipped.append(tname)
            continue
        qs, d, m = _split_blocks(blocks, kind)
        values, weight = _dequantize(qs, d, m), weight.detach()
        order = next((o for o in _row_orders(weight.shape[0], model.config)
                      if values.shape == weight.shape and torch.equal(values[o], weight)), None)
        if order is None:
            skipped.append(tname)
            continue
        new = GGUFLinear.from_blocks(layer.weight, kind, qs[order], d[order], None if m is None else m[order], q8)
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, new)
        count += 1
    return {"layers": count, "skipped": skipped, "error": None}


def q8_inputs(model: nn.Module) -> bool:
    """Whether the model's GGUF layers take Q8 inputs (`--kernels q8`). They do in every call, a
    prompt's as a step's, each row computed alone, so any block of tokens (a prompt, a tree of any
    size, a trace's hundreds of positions) gets the bits its tokens get one at a time."""
    return any(isinstance(m, GGUFLinear) and m.q8 for m in model.modules())


def is_attached(model: nn.Module) -> bool:
    return any(isinstance(m, GGUFLinear) for m in model.modules())
