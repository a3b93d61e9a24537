"""Draft heads: Hydra (sequentially dependent) and Medusa, bound to a base model (files: `headfiles`).

Module names mirror the official checkpoints so that their state dicts load with a strict key
check: Hydra `hydra_mlp.{i}.{j}.*` / `hydra_lm_head.{i}.*` (+ `prefix_embeding_layer.*` for
Hydra++), Medusa `{i}.{j}.linear.*` / `{i}.{L}.weight` (no `{i}.{L}.weight` in Medusa's version 2
files, which use the base LM head). Official files also hold what their authors' modules saved
besides the heads: Hydra's `input_embed_fn.weight` (the base embedding) and Hydra++'s
`*.rotary_emb.inv_freq` buffers; both are checked against the base model and dropped.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from entmtp.model import gguf, kernels
from entmtp.model import kv

# A draft LM head served in Q4_1 ranks its rows; its best this many of each call are computed again
# from the Q8_0 rows (`DraftHeads.lm_logits`): the head's top tokens and their logits as Q8_0 gives
# them, for the bytes of Q4_1 (docs/kernels.md, *Sixth part*)
LM_REFINE = 16


class HeadsError(ValueError):
    """Heads that cannot be loaded, or that do not fit the base model."""


class HeadsWarning(UserWarning):
    """Heads that load, but whose files disagree with their config or with the base model."""


def note_provenance(heads: DraftHeads, message: str) -> None:
    """Record what does not stop loading but should be known: in the provenance, and as a warning."""
    heads.provenance.setdefault("notes", []).append(message)
    warnings.warn(message, HeadsWarning, stacklevel=2)



class ResBlock(nn.Module):
    """`y = R(x) + SiLU(W x + b)`; R is the identity, or a linear map when the input is widened."""

    def __init__(self, hidden: int, num_condition: int = 0):
        super().__init__()
        width = hidden * (num_condition + 1)
        self.linear = nn.Linear(width, hidden)
        self.res_connection = nn.Linear(width, hidden) if num_condition > 0 else nn.Identity()
        nn.init.zeros_(self.linear.weight)  # starts as (a projection of) the identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        native = self.__dict__.get("_native")  # set by DraftHeads.pack on blocks: the extension's SiLU, the chain's
        if native is not None and y.dtype == torch.float32 and y.device.type == "cpu" and not torch.is_grad_enabled():
            return self.res_connection(x) + native.silu(y)
        return self.res_connection(x) + F.silu(y)


class DraftHeads(nn.Module):
    """Common interface used by drafting: `head_logits(i, feature, path_tokens)`.

    Base-model pieces (input embedding, shared LM head) are attached by `bind` as plain
    attributes, so they are neither trained nor saved with the heads.
    """

    kind = "base"
    path_dependent = False  # True when head i reads the tokens of the path it extends

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, shared_lm_head: bool):
        super().__init__()
        self.hidden_size, self.vocab_size = hidden, vocab
        self.num_heads, self.num_layers = num_heads, num_layers
        self.shared_lm_head = shared_lm_head
        self.register_buffer("draft_vocab", torch.empty(0, dtype=torch.long), persistent=False)
        self.provenance: dict[str, Any] = {}
        self._base: dict[str, Any] = {}
        self._lm_cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._lm_packed: dict[int, nn.Module] | None = None  # set by pack()
        self._chain = None  # set by pack() on GGUF blocks: the extension's top-1 chain (`top1_on_blocks`)
        self.compute_dtype: torch.dtype | None = None  # set by pack(): the heads' activations
        self.numerics = "float32"  # set by pack(): how the heads compute (q4_1-blocks, int8-rows, packed-bfloat16, ...)
        self.blocks = "q8_0"  # the GGUF block kind pack() serves the linears in where the extension does (heads.json "blocks")
        # the LM head's block kind on GGUF blocks (heads.json "lm_blocks"): Q8_0, or Q4_1 with its best
        # LM_REFINE rows of each call computed again in Q8_0 (`lm_logits`)
        self.lm_blocks = "q8_0"
        self._lm_fine: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # set by pack(): those rows
        self.parted = True  # pack() serves a widened ResBlock's linears in parts (`gguf.PartedLinear`); False: whole (probes)
        self._embed_probe: tuple[Path, torch.Tensor, torch.Tensor] | None = None  # set by load_heads (Hydra)

    # -- binding to a base model -------------------------------------------------------------
    def bind(self, model: nn.Module) -> "DraftHeads":
        """Attach to `model`: dtype, device (that of the LM head), embedding and shared LM head."""
        lm_head = model.get_output_embeddings()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if cfg.hidden_size != self.hidden_size:
            raise HeadsError(f"heads have hidden size {self.hidden_size}, the model has {cfg.hidden_size}")
        if cfg.vocab_size != self.vocab_size:
            raise HeadsError(f"heads have vocabulary {self.vocab_size}, the model has {cfg.vocab_size}")
        if self._embed_probe is not None:
            self._check_embedding(model.get_input_embeddings().weight)
        w = lm_head.weight
        self.to(device=w.device, dtype=w.dtype)
        self.draft_vocab = self.draft_vocab.to(w.device)
        self._base = {"embed": model.get_input_embeddings(), "lm_head": lm_head}
        self._lm_cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._lm_packed, self._chain = None, None
        return self

    def _check_embedding(self, weight: torch.Tensor) -> None:
        """Compare the base embedding rows an official Hydra file saved with the model's own."""
        source, rows, saved = self._embed_probe
        if weight.shape[0] <= int(rows.max()) or weight.shape[1] != saved.shape[1]:
            same = False
        else:
            # the file holds the base embedding in its training dtype: compare at that precision
            mine = weight.detach()[rows.to(weight.device)].to("cpu", saved.dtype).float()
            same = torch.allclose(mine, saved.float(), rtol=1e-2, atol=1e-3)
        if not same:
            note_provenance(
                self,
                f"{source}: input_embed_fn.weight (the base embedding saved with the heads) differs from "
                "the base model's: the heads were trained on another base model (drafts stay proposals, "
                "output stays exact, acceptance may drop)",
            )

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Restrict drafting to `token_ids` (drafts are proposals: verification keeps output exact)."""
        ids = torch.empty(0, dtype=torch.long) if token_ids is None else token_ids.to(torch.long).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise HeadsError(f"draft vocabulary holds ids outside [0, {self.vocab_size})")
        self.draft_vocab = ids.to(self.draft_vocab.device)
        self._lm_cache, self._lm_packed, self._chain = {}, None, None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._base["embed"](ids)

    def own_lm_head(self, i: int) -> nn.Linear:
        raise NotImplementedError

    def _lm_key(self, i: int) -> int:
        return -1 if self.shared_lm_head else i

    def _lm_weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K, H) weight and (K,) bias of head i's LM head, restricted to the draft vocabulary."""
        key = self._lm_key(i)
        if key not in self._lm_cache:
            lin = self._base["lm_head"] if self.shared_lm_head else self.own_lm_head(i)
            w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            if self.draft_vocab.numel():
                w = w.index_select(0, self.draft_vocab).contiguous()
                b = None if b is None else b.index_select(0, self.draft_vocab)
            self._lm_cache[key] = (w, b)
        return self._lm_cache[key]

    def lm_logits(self, i: int, x: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
        """(B, H) head hidden -> (B, K) logits over the draft vocabulary (or the full one)."""
        if full_vocab:
            lin = self._base["lm_head"] if self.shared_lm_head else self.own_lm_head(i)
            return lin(x)
        if self._lm_packed is not None:
            lin = self._lm_packed[self._lm_key(i)]
            z = lin(x)
            fine = self._lm_fine.get(self._lm_key(i))
            if fine is not None:  # its best rows again in Q8_0, on the input the Q4_1 product read
                xs = x.float() if lin.smooth is None else x.float() * lin.smooth
                z = z.contiguous()
                bias = torch.empty(0) if lin.bias is None else lin.bias
                gguf.extension().lm_refine(xs.reshape(-1, xs.shape[-1]).contiguous(), z.view(-1, z.shape[-1]), *fine, bias, LM_REFINE)
            return z
        return F.linear(x, *self._lm_weights(i))

    def pack(self, sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DraftHeads":
        """Inference on a CPU: every head linear in GGUF blocks (`gguf.BlockLinear`, Q8 inputs;
        the ResBlocks' weights of kind `self.blocks`, Q4_1 or Q8_0, the LM head's Q8_0, or Q4_1
        with its best rows refined in Q8_0 where `self.lm_blocks` says so) where the
        extension serves, else in row-wise int8 (`kernels.Int8RowLinear`). Once per bound heads:
        packing replaces their float linears.

        Drafts are proposals that verification checks against the float32 base model, so their
        precision never reaches the output. Int8 streams a quarter of float32's bytes (the 4-head
        chain with its 8,192-row LM head measured ~14 -> ~4 ms a step on the 2-core AMD EPYC
        without AVX-512), and a row's drafts do not depend on the batch it is computed in, so the
        engine drafts exactly what a bank's traces recorded. `sample` = (features (N, H), token
        ids (N + num_heads,)) of some text: each linear's inputs on it set the per-channel
        smoothing that keeps the base state's outlier channels from swamping int8 (without it,
        head 1's top-1 agreed with float32 on two thirds of positions). Where the quantized engine
        is missing, the linears are prepacked for oneDNN instead (bfloat16 where the CPU has it).
        """
        w = self._base["lm_head"].weight
        if not kernels.available(w.device, torch.float32):
            return self
        blocks = w.device.type == "cpu" and gguf.extension() is not None and self._whole_blocks()
        int8 = blocks or kernels.int8_available(w.device)
        dtype = torch.float32 if int8 or not kernels.available(w.device, torch.bfloat16) else torch.bfloat16
        seen: dict[Any, torch.Tensor] = {}
        if int8 and sample is not None:
            seen = self._input_absmax(*sample)

        # A widened ResBlock's two linears read the same input: on blocks they share one smoothing,
        # set from both weights, so that both quantise the input alike and the heads' chain runs
        # them as one product (`HeadChain`: one call, each output computed alone, the same bits)
        pairs: dict[nn.Module, torch.Tensor] = {}
        if blocks:
            for i in range(self.num_heads):
                for b in self.head_blocks(i):
                    if isinstance(b.res_connection, nn.Linear):
                        both = torch.cat([b.linear.weight, b.res_connection.weight])
                        pairs[b.linear] = pairs[b.res_connection] = both
                        if b.linear in seen and b.res_connection in seen:
                            seen[b.linear] = seen[b.res_connection] = torch.maximum(seen[b.linear], seen[b.res_connection])

        def quantized(weight, bias, absmax, kind=self.blocks, smooth_from=None):
            if blocks:
                smooth = None if absmax is None else kernels.smooth_factors(weight if smooth_from is None else smooth_from, absmax)
                if self.parted and smooth_from is not None and self.path_dependent and weight.shape[1] > self.hidden_size:
                    # a widened ResBlock's linear reads [h ; E(t_0) ; ...]: a part a slice, so that the
                    # chain keeps each token's part (`gguf.PartedLinear`) instead of reading its weights
                    return gguf.PartedLinear(weight, bias, smooth, self.hidden_size, kind=kind)
                return gguf.BlockLinear(weight, bias, smooth, kind=kind)
            return kernels.Int8RowLinear(weight, bias, absmax)

        # the LM heads' float rows first: a head's own LM head is among the children replaced below
        lm_rows = {self._lm_key(i): self._lm_weights(i) for i in range(self.num_heads)}
        for name, child in self.named_children():
            if name == "prefix_embeding_layer":  # Hydra++'s prefix layer reads float32 base states
                kernels.pack_linears(child)
            elif int8:
                kernels.replace_linears(child, lambda lin: quantized(lin.weight, lin.bias, seen.get(lin), smooth_from=pairs.get(lin)))
            else:
                child.to(dtype)
                kernels.pack_linears(child)
        self.compute_dtype = dtype
        if blocks:
            parted = any(isinstance(m, gguf.PartedLinear) for m in self.modules())
            self.numerics = ("q8" if self.blocks == "q8_0" else self.blocks) + "-blocks" + ("-smoothed" if seen else "") + ("-parted" if parted else "")
            if self.lm_blocks == "q4_1":
                self.numerics += f"-lm-q4_1-top{LM_REFINE}-q8"
        else:
            self.numerics = ("int8-rows" + ("-smoothed" if seen else "")) if int8 else f"packed-{str(dtype).removeprefix('torch.')}"
        self._lm_packed, self._lm_fine = {}, {}
        for i in range(self.num_heads):
            if self._lm_key(i) not in self._lm_packed:
                weight, bias = lm_rows[self._lm_key(i)]
                if int8:  # the LM head in Q8_0 whatever `blocks`: the base model's tied head is Q8_0 (its rows
                    # exact there), and in Q4_1 alone the drafts lost 1-2% of their acceptance (docs/kernels.md);
                    # `lm_blocks` = Q4_1 ranks in Q4_1 and takes each call's best rows from the Q8_0 head
                    absmax = seen.get(("lm", self._lm_key(i)))
                    self._lm_packed[self._lm_key(i)] = quantized(weight, bias, absmax, "q8_0")
                    if blocks and self.lm_blocks == "q4_1":  # the Q4_1 head ranks, its best rows come from the Q8_0 one
                        self._lm_fine[self._lm_key(i)] = gguf.q8_0_rows(self._lm_packed[self._lm_key(i)])
                        self._lm_packed[self._lm_key(i)] = quantized(weight, bias, absmax, "q4_1")
                else:
                    bias = None if bias is None else bias.to(dtype)
                    self._lm_packed[self._lm_key(i)] = kernels.PackedLinear(weight.to(dtype), bias)
        self._lm_cache = {}  # the packed copies replace the float32 slices
        # on blocks, SiLU and the top-1 probability are the extension's (`ResBlock.forward`, `top1`),
        # in the modules as in the chain: one order of operations on every CPU, where ATen's
        # follows its vector width (a bank's traces then hold the same bits wherever they are recorded)
        self.__dict__["_native"] = gguf.extension() if blocks else None
        for m in self.modules():
            if isinstance(m, ResBlock):
                m.__dict__["_native"] = self.__dict__["_native"]
        self._chain = self._chain_on_blocks() if blocks else None
        return self

    def _chain_on_blocks(self):
        """The extension's `HeadChain` over these heads' blocks (the same operations as the
        modules, without the Python between them), or None where some head is not made of
        block-linear ResBlocks or the embedding is not float32."""
        embed = self._base["embed"].weight.detach() if self.path_dependent else torch.empty(0)
        if embed.dtype != torch.float32 or not embed.is_contiguous():
            return None
        empty = torch.empty(0)

        def parts(lin) -> list[torch.Tensor]:
            if isinstance(lin, nn.Identity):
                return [empty] * 5
            if not isinstance(lin, gguf.BlockLinear):
                raise TypeError
            present = lambda t: empty if t is None else t
            return [lin.qs, lin.d, present(lin.m), present(lin.smooth), present(lin.bias)]

        def block(b) -> list[torch.Tensor]:  # a ResBlock's linear and residual; a parted pair part by part, the bias with the first
            if not isinstance(b.linear, gguf.PartedLinear):
                return parts(b.linear) + parts(b.res_connection)
            lin, res = b.linear, b.res_connection
            if not isinstance(res, gguf.PartedLinear) or len(res.parts) != len(lin.parts):
                raise TypeError
            with_bias = lambda m, j: parts(m.parts[j])[:4] + [m.bias if j == 0 and m.bias is not None else empty]
            return [t for j in range(len(lin.parts)) for t in with_bias(lin, j) + with_bias(res, j)]

        try:
            heads = [[block(b) for b in self.head_blocks(i)] for i in range(self.num_heads)]
            lm = [parts(self._lm_packed[self._lm_key(i)]) for i in range(self.num_heads)]
        except TypeError:
            return None
        lm_rows = self._lm_packed[self._lm_key(0)].out_features
        isa = gguf.ISA_CODES[self._lm_packed[self._lm_key(0)].isa]
        chain = gguf.extension().HeadChain(heads, lm, embed, self.draft_vocab, self.hidden_size, lm_rows, isa)
        if self._lm_fine:
            chain.set_refine([self._lm_fine[self._lm_key(i)] for i in range(self.num_heads)], LM_REFINE)
        return chain

    def head_blocks(self, i: int) -> list[ResBlock]:
        """Head i's ResBlocks, in order."""
        raise NotImplementedError

    def top1_on_blocks(self, feature: torch.Tensor, path: torch.Tensor, depth: int, force=None,
                       settle: tuple[float, float, bool] | None = None,
                       then: tuple[int, int] = (-1, -1)) -> tuple[list[torch.Tensor], list[float], list[int]] | None:
        """`drafting.top1_logits` in one extension call where the heads are on GGUF blocks (the same
        bits): from `path` (1, d+1), or that path as a list of ids, on to `depth`, the logits (K,)
        of heads d..depth-1, their top-1 probabilities (float32 values) and the tokens the path went
        on through, as lists; None elsewhere. `force`:
        `drafting.top1_logits`'s; `settle`, `then`: `drafting._top1`'s (the chain stops or goes on itself)."""
        if self._chain is None or feature.device.type != "cpu":
            return None
        stop = {} if settle is None else {"p0": settle[0], "settle": settle[1], "strict": settle[2],
                                          "settled_depth": then[0], "unsettled_depth": then[1]}
        ids = path if isinstance(path, list) else path[0].tolist()
        if feature.dtype != torch.float32:
            feature = feature.float()
        native = getattr(force, "sync", None)  # a `phrasebook.NativeForcer`: called at each node without leaving C++
        # lists from the extension, so that no ATen call follows the chain (`HeadChain::chain`)
        if native is not None:
            return self._chain.chain_native(feature, ids, depth, native(), **stop)
        return self._chain.chain(feature, ids, depth, force, **stop)

    def _whole_blocks(self) -> bool:
        """Whether every head linear's inputs come in whole blocks of 32 (the Q8 block kernels')."""
        return self.hidden_size % 32 == 0 and all(m.in_features % 32 == 0 for m in self.modules() if isinstance(m, nn.Linear))

    @torch.inference_mode()
    def _input_absmax(self, features: torch.Tensor, ids: torch.Tensor) -> dict[Any, torch.Tensor]:
        """Per-channel max |input| of every head linear (and, under ("lm", key), of the LM head)
        with the heads run on `features` along the true paths in `ids`: in float64, rounded to
        float32 at the end, so that the smoothing (and so the served heads' bits, and a bank's
        traces) does not follow the thread count or the instruction set of a float32 product's
        sums (in float32, 1 and 2 threads gave 59-214 of a head's 576 factors apart)."""
        n = min(len(features), len(ids) - self.num_heads)
        features = features[:n].double()
        dtype = next(self.parameters()).dtype
        self.double()  # exact both ways from float32
        try:
            with kernels.input_absmax(self) as seen:
                for i in range(self.num_heads):
                    paths = torch.stack([ids[j : j + n] for j in range(i + 1)], dim=1).to(features.device)
                    h = self.head_hidden(i, features, paths).abs().amax(0).float()
                    key = ("lm", self._lm_key(i))
                    seen[key] = h if key not in seen else torch.maximum(seen[key], h)
        finally:
            self.to(dtype)
        return dict(seen)

    def top1(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(z).max(-1) of logits (..., K): (top-1 probability float32, its index). On blocks,
        the extension's (`top1_rows`: the first maximal logit, 1 / sum exp(z - max) in one order on
        every CPU), which the chain computes too; elsewhere ATen's."""
        native = self.__dict__.get("_native")
        if native is not None and z.device.type == "cpu":
            return native.top1_rows(z.float())
        return torch.softmax(z.float(), -1).max(-1)

    def to_token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices back to token ids."""
        return self.draft_vocab[idx] if self.draft_vocab.numel() else idx

    def outside(self, tokens: list[int]) -> list[int]:
        """Per token, itself where it lies outside the draft vocabulary (a phrasebook's spine may
        carry one: `phrasebook.spine_first`), else -1."""
        if not self.draft_vocab.numel():
            return [-1] * len(tokens)
        ids = getattr(self, "_draft_ids", None)
        if ids is None or ids[0] is not self.draft_vocab:
            ids = self._draft_ids = (self.draft_vocab, frozenset(self.draft_vocab.tolist()))
        return [t if t not in ids[1] else -1 for t in tokens]

    # -- per-generation context --------------------------------------------------------------
    def new_context(self) -> "HeadContext":
        return HeadContext()

    def head_hidden(self, i: int, feature: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head_logits(self, i: int, feature: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        """Head i's draft logits. feature (B, H); path_tokens (B, i+1) = root..node. -> (B, K)."""
        if self.compute_dtype is not None:
            feature = feature.to(self.compute_dtype)
        return self.lm_logits(i, self.head_hidden(i, feature, path_tokens))

    def config_dict(self) -> dict[str, Any]:
        raise NotImplementedError


class HeadContext:
    """Turns the base hidden states of newly accepted tokens into the heads' input feature."""

    def observe(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (L, H) of the accepted tokens, in order -> feature (H,) at the last one."""
        return hidden[-1]


class PrefixContext(HeadContext):
    """Hydra++: a one-layer decoder with its own KV cache runs over the base hidden states."""

    def __init__(self, layer: nn.Module):
        from transformers import DynamicCache

        self.layer, self.cache, self.pos = layer, DynamicCache(), 0

    def observe(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        pos = torch.arange(self.pos, self.pos + n, device=hidden.device)[None]
        out = self.layer(inputs_embeds=hidden[None], position_ids=pos, use_cache=True, **kv.cache_arg(self.layer, self.cache))
        self.pos += n
        return out[0][0, -1]


def state_layer(base_config: Any) -> nn.Module:
    """One decoder layer of the base model's shape (a one-layer model of its config) that reads
    hidden states (`inputs_embeds`), never token ids: Hydra++'s prefix layer. Its own embedding
    table (vocab x hidden, larger than the heads) is neither kept nor saved."""
    from transformers import AutoModel

    cfg = copy.deepcopy(base_config)
    cfg.num_hidden_layers = 1
    if hasattr(cfg, "layer_types") and cfg.layer_types:
        cfg.layer_types = cfg.layer_types[:1]
    layer = AutoModel.from_config(cfg)
    layer.embed_tokens = None
    return layer


class HydraHeads(DraftHeads):
    """Hydra heads. Head i reads [h ; E(x_{t+1}) ; ... ; E(x_{t+1+i})] and predicts x_{t+2+i}."""

    kind = "hydra"

    def __init__(
        self,
        hidden: int,
        vocab: int,
        num_heads: int = 4,
        num_layers: int = 1,
        arch: str = "mlp",
        grounded: bool = True,
        shared_lm_head: bool = True,
        base_config: Any = None,
    ):
        super().__init__(hidden, vocab, num_heads, num_layers, shared_lm_head)
        if arch not in ("mlp", "prefix-mlp"):
            raise HeadsError(f"unknown Hydra head arch {arch!r} (expected 'mlp' or 'prefix-mlp')")
        if num_heads < 1 or num_layers < 1:
            raise HeadsError(f"Hydra needs at least one head and one layer, got {num_heads} and {num_layers}")
        self.arch, self.grounded = arch, grounded
        self.path_dependent = grounded
        prefix = arch == "prefix-mlp"

        def block(i: int) -> nn.Sequential:
            first = ResBlock(hidden, i + 1 if grounded else 0)
            rest = [ResBlock(hidden) for _ in range(num_layers - 1)]
            if prefix:  # upstream puts a Dropout before every block: keys move to odd indices
                mods = [nn.Dropout(0.0), first]
                for r in rest:
                    mods += [nn.Dropout(0.0), r]
                return nn.Sequential(*mods)
            return nn.Sequential(first, *rest)

        self.hydra_mlp = nn.ModuleList(block(i) for i in range(num_heads))
        if not shared_lm_head:
            heads = [nn.Linear(hidden, vocab) for _ in range(num_heads)]
            self.hydra_lm_head = nn.ModuleList(nn.Sequential(nn.Dropout(0.0), h) if prefix else h for h in heads)
        if prefix:
            if base_config is None:
                raise HeadsError("prefix-mlp heads need the base model's config")
            self.prefix_embeding_layer = state_layer(base_config)

    def own_lm_head(self, i: int) -> nn.Linear:
        head = self.hydra_lm_head[i]
        return head[1] if isinstance(head, nn.Sequential) else head

    def new_context(self) -> HeadContext:
        return PrefixContext(self.prefix_embeding_layer) if self.arch == "prefix-mlp" else HeadContext()

    def head_blocks(self, i: int) -> list[ResBlock]:
        return [m for m in self.hydra_mlp[i] if isinstance(m, ResBlock)]  # Hydra++'s Dropout(0.0)s are identities

    def head_hidden(self, i: int, feature: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        if self.grounded:
            emb = self.embed(path_tokens[:, : i + 1]).to(feature.dtype)  # (B, i+1, H)
            x = torch.cat([feature, emb.flatten(1)], dim=-1)  # (B, (i+2)H)
        else:
            x = feature
        return self.hydra_mlp[i](x)

    def config_dict(self) -> dict[str, Any]:
        return {
            "kind": "hydra",
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "arch": self.arch,
            "grounded": self.grounded,
            "shared_lm_head": self.shared_lm_head,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "blocks": self.blocks,
            **({"lm_blocks": self.lm_blocks} if self.lm_blocks != "q8_0" else {}),
        }


class MedusaHeads(DraftHeads):
    """Medusa heads: head i reads h_t only, `ResBlock(h) x L` then an LM head, predicts x_{t+2+i}."""

    kind = "medusa"

    def __init__(self, hidden: int, vocab: int, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = True):
        super().__init__(hidden, vocab, num_heads, num_layers, shared_lm_head)
        if num_heads < 1 or num_layers < 1:
            raise HeadsError(f"Medusa needs at least one head and one layer, got {num_heads} and {num_layers}")

        def head() -> nn.Sequential:
            mods: list[nn.Module] = [ResBlock(hidden) for _ in range(num_layers)]
            if not shared_lm_head:
                mods.append(nn.Linear(hidden, vocab, bias=False))
            return nn.Sequential(*mods)

        self.heads = nn.ModuleList(head() for _ in range(num_heads))

    def own_lm_head(self, i: int) -> nn.Linear:
        return self.heads[i][self.num_layers]

    def head_blocks(self, i: int) -> list[ResBlock]:
        return list(self.heads[i][: self.num_layers])

    def head_hidden(self, i: int, feature: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        return self.heads[i][: self.num_layers](feature)

    def config_dict(self) -> dict[str, Any]:
        return {
            "kind": "medusa",
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "shared_lm_head": self.shared_lm_head,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "blocks": self.blocks,
            **({"lm_blocks": self.lm_blocks} if self.lm_blocks != "q8_0" else {}),
        }


def head_features(heads: DraftHeads, hidden: torch.Tensor) -> torch.Tensor:
    """(L, H) base hidden states of a whole sequence -> the heads' input feature at every position.

    Equal to what the engine's per-step `HeadContext.observe` gives position by position: the
    hidden state itself, or for Hydra++ the prefix layer run over the sequence.
    """
    ctx = heads.new_context()
    layer = getattr(ctx, "layer", None)
    if layer is None:
        return hidden
    pos = torch.arange(hidden.shape[0], device=hidden.device)[None]
    return layer(inputs_embeds=hidden[None], position_ids=pos, use_cache=True, **kv.cache_arg(layer, ctx.cache))[0][0]
