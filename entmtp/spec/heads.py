"""Draft heads: Hydra (sequentially dependent) and Medusa; our file format and the official layouts.

Module names mirror the official checkpoints so that their state dicts load with a strict key
check: Hydra `hydra_mlp.{i}.{j}.*` / `hydra_lm_head.{i}.*` (+ `prefix_embeding_layer.*` for
Hydra++), Medusa `{i}.{j}.linear.*` / `{i}.{L}.weight` (no `{i}.{L}.weight` in Medusa's version 2
files, which use the base LM head). Official files also hold what their authors' modules saved
besides the heads: Hydra's `input_embed_fn.weight` (the base embedding) and Hydra++'s
`*.rotary_emb.inv_freq` buffers; both are checked against the base model and dropped.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from entmtp.model import kernels
from entmtp.model import kv

FORMAT = "entmtp-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"


class HeadsError(ValueError):
    """Heads that cannot be loaded, or that do not fit the base model."""


class HeadsWarning(UserWarning):
    """Heads that load, but whose files disagree with their config or with the base model."""


class ResBlock(nn.Module):
    """`y = R(x) + SiLU(W x + b)`; R is the identity, or a linear map when the input is widened."""

    def __init__(self, hidden: int, num_condition: int = 0):
        super().__init__()
        width = hidden * (num_condition + 1)
        self.linear = nn.Linear(width, hidden)
        self.res_connection = nn.Linear(width, hidden) if num_condition > 0 else nn.Identity()
        nn.init.zeros_(self.linear.weight)  # starts as (a projection of) the identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_connection(x) + F.silu(self.linear(x))


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
        self.compute_dtype: torch.dtype | None = None  # set by pack(): the heads' activations
        self.numerics = "float32"  # set by pack(): how the heads compute (int8-rows, packed-bfloat16, ...)
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
        self._lm_packed = None
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
            note(
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
        self._lm_cache, self._lm_packed = {}, None

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
            return self._lm_packed[self._lm_key(i)](x)
        return F.linear(x, *self._lm_weights(i))

    def pack(self, sample: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DraftHeads":
        """Inference on a CPU: every head linear in row-wise int8 (`kernels.Int8RowLinear`).

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
        int8 = kernels.int8_available(w.device)
        dtype = torch.float32 if int8 or not kernels.available(w.device, torch.bfloat16) else torch.bfloat16
        seen: dict[Any, torch.Tensor] = {}
        if int8 and sample is not None:
            seen = self._input_absmax(*sample)
        for name, child in self.named_children():
            if name == "prefix_embeding_layer":  # Hydra++'s prefix layer reads float32 base states
                kernels.pack_linears(child)
            elif int8:
                kernels.int8_linears(child, seen)
            else:
                child.to(dtype)
                kernels.pack_linears(child)
        self.compute_dtype = dtype
        self.numerics = ("int8-rows" + ("-smoothed" if seen else "")) if int8 else f"packed-{str(dtype).removeprefix('torch.')}"
        self._lm_packed = {}
        for i in range(self.num_heads):
            if self._lm_key(i) not in self._lm_packed:
                weight, bias = self._lm_weights(i)
                if int8:
                    self._lm_packed[self._lm_key(i)] = kernels.Int8RowLinear(weight, bias, seen.get(("lm", self._lm_key(i))))
                else:
                    bias = None if bias is None else bias.to(dtype)
                    self._lm_packed[self._lm_key(i)] = kernels.PackedLinear(weight.to(dtype), bias)
        self._lm_cache = {}  # the packed copies replace the float32 slices
        return self

    @torch.inference_mode()
    def _input_absmax(self, features: torch.Tensor, ids: torch.Tensor) -> dict[Any, torch.Tensor]:
        """Per-channel max |input| of every head linear (and, under ("lm", key), of the LM head)
        with the heads run in float32 on `features` along the true paths in `ids`."""
        n = min(len(features), len(ids) - self.num_heads)
        features = features[:n].float()
        with kernels.input_absmax(self) as seen:
            for i in range(self.num_heads):
                paths = torch.stack([ids[j : j + n] for j in range(i + 1)], dim=1).to(features.device)
                h = self.head_hidden(i, features, paths).float().abs().amax(0)
                key = ("lm", self._lm_key(i))
                seen[key] = h if key not in seen else torch.maximum(seen[key], h)
        return dict(seen)

    def to_token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices back to token ids."""
        return self.draft_vocab[idx] if self.draft_vocab.numel() else idx

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
            from transformers import AutoModel

            cfg = copy.deepcopy(base_config)
            cfg.num_hidden_layers = 1
            if hasattr(cfg, "layer_types") and cfg.layer_types:
                cfg.layer_types = cfg.layer_types[:1]
            self.prefix_embeding_layer = AutoModel.from_config(cfg)
            # it reads the base hidden states (inputs_embeds), never token ids: its own embedding
            # table (vocab x hidden, larger than the heads) is neither kept nor saved
            self.prefix_embeding_layer.embed_tokens = None

    def own_lm_head(self, i: int) -> nn.Linear:
        head = self.hydra_lm_head[i]
        return head[1] if isinstance(head, nn.Sequential) else head

    def new_context(self) -> HeadContext:
        return PrefixContext(self.prefix_embeding_layer) if self.arch == "prefix-mlp" else HeadContext()

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
        }


# -- construction, saving and loading -----------------------------------------------------------


def build_heads(cfg: dict[str, Any], base_config: Any = None) -> DraftHeads:
    """Heads from a config dict as written by `config_dict()` (our format)."""
    kind = cfg.get("kind")
    try:
        if kind == "hydra":
            return HydraHeads(
                cfg["hidden_size"],
                cfg["vocab_size"],
                cfg["num_heads"],
                cfg["num_layers"],
                cfg.get("arch", "mlp"),
                cfg.get("grounded", True),
                cfg.get("shared_lm_head", True),
                base_config,
            )
        if kind == "medusa":
            return MedusaHeads(
                cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_layers"], cfg.get("shared_lm_head", True)
            )
    except KeyError as e:
        raise HeadsError(f"heads config lacks field {e.args[0]!r}") from None
    raise HeadsError(f"unknown heads kind {kind!r} (expected 'hydra' or 'medusa')")


def save_heads(heads: DraftHeads, directory: str | Path, provenance: dict[str, Any] | None = None) -> Path:
    """Write our format: heads.json (config + provenance) and heads.safetensors."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    if heads.draft_vocab.numel():
        state["draft_vocab"] = heads.draft_vocab.to("cpu")
    save_file(state, str(d / WEIGHTS_FILE))
    meta = {"format": FORMAT, "version": FORMAT_VERSION, **heads.config_dict()}
    meta["provenance"] = provenance or heads.provenance
    (d / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return d


def _strict_load(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """load_state_dict with a readable error naming missing, unexpected or misshapen keys."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s), e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s), e.g. {unexpected[:3]}")
        raise HeadsError(f"{where}: key mismatch: " + "; ".join(parts))
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise HeadsError(f"{where}: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=True)


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a corrupt pickle; name the file
        raise HeadsError(f"cannot read {path}: {e}") from None
    if not isinstance(state, dict):
        raise HeadsError(f"{path} does not hold a state dict")
    return state


OFFICIAL_CONFIG = "config.json"
HYDRA_FILE = "hydra_lm_head.pt"
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # read in this order
HEAD_FILES = (CONFIG_FILE, WEIGHTS_FILE, OFFICIAL_CONFIG, HYDRA_FILE, *MEDUSA_FILES)
# a whole model's weights: model.safetensors, model-00001-of-00003.safetensors, pytorch_model.bin, index
_MODEL_WEIGHTS = re.compile(r"(?:model|pytorch_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin)(?:\.index\.json)?")


def note(heads: DraftHeads, message: str) -> None:
    """Record what does not stop loading but should be known: in the provenance, and as a warning."""
    heads.provenance.setdefault("notes", []).append(message)
    warnings.warn(message, HeadsWarning, stacklevel=2)


def load_heads(directory: str | Path, base_config: Any) -> DraftHeads:
    """Load heads from a directory in our format or an official Hydra / Medusa layout.

    Official files load as their authors saved them: the head and layer counts come from the
    weights' keys (a config.json that says otherwise gets a note, see `note`), Hydra's saved base
    embedding and Hydra++'s RoPE buffers are checked and dropped. Any other layout, Medusa-2's
    whole fine-tuned models included, is refused with the file and the reason.
    """
    d = Path(directory)
    if not d.is_dir():
        raise HeadsError(f"heads directory not found: {d}")
    cfg_text = d / CONFIG_FILE
    if cfg_text.exists():
        meta = _read_json(cfg_text)
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise HeadsError(f"{cfg_text}: not {FORMAT} version {FORMAT_VERSION}")
        heads = build_heads(meta, base_config)
        state = _safetensors_load(d / WEIGHTS_FILE)
        draft_vocab = state.pop("draft_vocab", None)
        _strict_load(heads, state, str(d / WEIGHTS_FILE))
        heads.set_draft_vocab(draft_vocab)
        heads.provenance = meta.get("provenance", {})
        heads.provenance["sha256"] = file_sha256(d / WEIGHTS_FILE)
        return heads
    config_file = d / OFFICIAL_CONFIG
    if not config_file.exists():
        raise HeadsError(f"{d}: no {CONFIG_FILE} (ours) and no {OFFICIAL_CONFIG} (Hydra/Medusa layout)")
    cfg = _read_json(config_file)
    if "hydra_num_heads" in cfg:
        return _load_hydra(d, cfg, base_config)
    if "medusa_num_heads" in cfg:
        return _load_medusa(d, cfg, base_config)
    whole = _model_weight_files(d)
    if whole:
        raise HeadsError(
            f"{config_file}: a whole model ({whole[0]}), not draft heads: neither hydra_num_heads nor medusa_num_heads is set"
        )
    raise HeadsError(f"{config_file}: neither hydra_num_heads nor medusa_num_heads is set")


def _load_hydra(d: Path, cfg: dict[str, Any], base_config: Any) -> HydraHeads:
    """zankner/Hydra: `hydra_head.state_dict()` of HydraMLP (`mlp`) or HydraPrefixMLP (`prefix-mlp`)."""
    config_file, weights = d / OFFICIAL_CONFIG, d / HYDRA_FILE
    arch = cfg.get("hydra_head_arch", "mlp")
    if arch not in ("mlp", "prefix-mlp"):
        raise HeadsError(f"{config_file}: hydra_head_arch {arch!r} is not supported (only 'mlp' and 'prefix-mlp')")
    if cfg.get("hidden_state_offset", 0) not in (0, None):
        raise HeadsError(f"{config_file}: hidden_state_offset={cfg['hidden_state_offset']} is not supported (only 0)")
    if not weights.exists():
        raise HeadsError(f"{d}: Hydra layout without {HYDRA_FILE}")
    state = _torch_load(weights)
    prefix = arch == "prefix-mlp"
    embed = state.pop("input_embed_fn.weight", None)  # the base embedding is a submodule of Hydra's heads
    # Hydra++'s Llama code registered RoPE frequencies as a saved buffer; ours recomputes them
    rope_keys = [k for k in state if k.startswith("prefix_embeding_layer.") and k.endswith(".rotary_emb.inv_freq")]
    rope = {k: state.pop(k) for k in rope_keys}
    state.pop("prefix_embeding_layer.embed_tokens.weight", None)  # unused: the layer reads hidden states
    if prefix != any(k.startswith("prefix_embeding_layer.") for k in state):
        raise HeadsError(
            f"{weights}: config.json says hydra_head_arch {arch!r} but the file "
            f"{'has no' if prefix else 'has a'} prefix layer (prefix_embeding_layer.*)"
        )
    num_heads, num_layers, grounded = _hydra_counts(state, prefix, weights)
    said = bool(cfg.get("grounded_heads", False))  # False when absent, as in Hydra's HydraConfig
    if said != grounded:
        raise HeadsError(
            f"{config_file}: grounded_heads is {said}{' (absent)' if 'grounded_heads' not in cfg else ''} "
            f"but {weights.name} holds {'grounded' if grounded else 'ungrounded'} heads"
        )
    heads = HydraHeads(
        base_config.hidden_size,
        base_config.vocab_size,
        num_heads,
        num_layers,
        arch,
        grounded,
        shared_lm_head=False,
        base_config=base_config,
    )
    _strict_load(heads, state, str(weights))
    heads.provenance = {"source": str(d), "layout": f"hydra {arch}", "sha256": file_sha256(weights)}
    _note_count(heads, config_file, "hydra_num_heads", cfg.get("hydra_num_heads"), weights, num_heads)
    _note_count(heads, config_file, "hydra_num_layers", cfg.get("hydra_num_layers", 1), weights, num_layers)
    if rope:
        ours = heads.prefix_embeding_layer.rotary_emb.inv_freq
        for k, saved in rope.items():
            if saved.shape != ours.shape or not torch.allclose(ours.to(saved.dtype).float(), saved.float(), rtol=1e-3):
                note(heads, f"{weights}: {k} differs from the RoPE frequencies of the base config, which the prefix layer uses")
    if embed is not None:
        rows = torch.linspace(0, embed.shape[0] - 1, 16).long().unique()  # a few rows tell two models apart
        heads._embed_probe = (weights, rows, embed[rows].clone())
    return heads


def _hydra_counts(state: dict[str, torch.Tensor], prefix: bool, weights: Path) -> tuple[int, int, bool]:
    """(heads, ResBlocks per head, grounded) read from the keys `hydra_mlp.{i}.{j}.linear.weight`."""
    blocks: dict[int, set[int]] = {}
    for k in state:
        m = re.fullmatch(r"hydra_mlp\.(\d+)\.(\d+)\.linear\.weight", k)
        if m:
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
    if not blocks:
        raise HeadsError(f"{weights}: no hydra_mlp.<head>.<block>.linear.weight keys, so no Hydra heads")
    if sorted(blocks) != list(range(len(blocks))):
        raise HeadsError(f"{weights}: Hydra heads numbered {sorted(blocks)}, expected 0..{len(blocks) - 1}")
    num_layers = len(blocks[0])
    expected = {2 * j + 1 if prefix else j for j in range(num_layers)}  # prefix-mlp: Dropout before each block
    for i, got in blocks.items():
        if got != expected:
            raise HeadsError(f"{weights}: head {i} has blocks {sorted(got)}, expected {sorted(expected)} as head 0")
    grounded = f"hydra_mlp.0.{1 if prefix else 0}.res_connection.weight" in state  # widened first block
    return len(blocks), num_layers, grounded


def _load_medusa(d: Path, cfg: dict[str, Any], base_config: Any) -> MedusaHeads:
    """FasterDecoding/Medusa: `medusa_head.state_dict()`, with per-head LM heads or (version 2) without."""
    config_file = d / OFFICIAL_CONFIG
    weights = next((d / f for f in MEDUSA_FILES if (d / f).exists()), None)
    if weights is None:
        whole = _model_weight_files(d)
        if whole:
            raise HeadsError(
                f"{config_file}: a Medusa-2 model ({whole[0]} holds base weights fine-tuned together with the "
                "heads), not heads for an unchanged base model"
            )
        raise HeadsError(f"{d}: Medusa layout without {' or '.join(MEDUSA_FILES)}")
    state = _safetensors_load(weights) if weights.suffix == ".safetensors" else _torch_load(weights)
    num_heads, num_layers, own_lm_head = _medusa_counts(state, weights)
    heads = MedusaHeads(base_config.hidden_size, base_config.vocab_size, num_heads, num_layers, shared_lm_head=not own_lm_head)
    _strict_load(heads.heads, state, str(weights))
    lm = "per-head LM heads" if own_lm_head else "the base LM head"
    heads.provenance = {"source": str(d), "layout": f"medusa with {lm}", "sha256": file_sha256(weights)}
    _note_count(heads, config_file, "medusa_num_heads", cfg.get("medusa_num_heads"), weights, num_heads)
    _note_count(heads, config_file, "medusa_num_layers", cfg.get("medusa_num_layers", 1), weights, num_layers)
    version = str(cfg.get("version", "1"))  # Medusa's version "2" configs drop the per-head LM heads
    if (version == "2") == own_lm_head:
        note(heads, f"{config_file}: version {cfg.get('version')!r} but {weights.name} is laid out for {lm}; {lm} are used")
    return heads


def _medusa_counts(state: dict[str, torch.Tensor], weights: Path) -> tuple[int, int, bool]:
    """(heads, ResBlocks per head, own LM heads) read from the keys `{i}.{j}.linear.weight`, `{i}.{L}.weight`."""
    blocks: dict[int, set[int]] = {}
    for k in state:
        m = re.fullmatch(r"(\d+)\.(\d+)\.linear\.weight", k)
        if m:
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
    if not blocks:
        what = "heads without ResBlocks (medusa_num_layers 0) are not supported" if "0.0.weight" in state else "no Medusa heads"
        raise HeadsError(f"{weights}: no <head>.<block>.linear.weight keys: {what} (keys start {sorted(state)[:3]})")
    if sorted(blocks) != list(range(len(blocks))):
        raise HeadsError(f"{weights}: Medusa heads numbered {sorted(blocks)}, expected 0..{len(blocks) - 1}")
    num_layers = len(blocks[0])
    for i, got in blocks.items():
        if got != set(range(num_layers)):
            raise HeadsError(f"{weights}: head {i} has blocks {sorted(got)}, expected 0..{num_layers - 1} as head 0")
    with_lm = [f"{i}.{num_layers}.weight" in state for i in blocks]
    if any(with_lm) and not all(with_lm):
        raise HeadsError(f"{weights}: only some heads have an LM head ({num_layers}th block)")
    return len(blocks), num_layers, all(with_lm)


def _note_count(heads: DraftHeads, config_file: Path, name: str, said: Any, weights: Path, found: int) -> None:
    """The weights' keys decide a count; a config that says otherwise gets a note."""
    if said is not None and int(said) != found:
        note(heads, f"{config_file}: {name} is {said} but {weights.name} holds {found}; using {found}")


def _model_weight_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if _MODEL_WEIGHTS.fullmatch(p.name))


def fetch_hub_heads(repo_id: str, revision: str | None = None) -> Path:
    """Download only the config and head files of a hub repo; refuse anything else before downloading it.

    -> the local snapshot folder, for `load_heads`. Offline, the cached snapshot is used as it is.
    """
    from huggingface_hub import constants, hf_hub_download, list_repo_files, snapshot_download

    if constants.HF_HUB_OFFLINE:  # no listing offline; the patterns still keep any model weights out
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HEAD_FILES)))
    try:
        files = set(list_repo_files(repo_id, revision=revision))
    except Exception as e:  # the hub raises HTTP, network and validation errors alike; name the repo
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HeadsError(f"hub repo {repo_id}: cannot list its files: {reason}") from None
    official = next((f for f in (HYDRA_FILE, *MEDUSA_FILES) if f in files), None)
    if {CONFIG_FILE, WEIGHTS_FILE} <= files:
        wanted = [CONFIG_FILE, WEIGHTS_FILE]
    elif OFFICIAL_CONFIG in files and official:
        wanted = [OFFICIAL_CONFIG, official]
    else:
        whole = sorted(f for f in files if _MODEL_WEIGHTS.fullmatch(f))
        if whole and OFFICIAL_CONFIG in files:
            cfg = _read_json(Path(hf_hub_download(repo_id, OFFICIAL_CONFIG, revision=revision)))
            medusa2 = "medusa_num_heads" in cfg
            what = "a Medusa-2 model (base weights fine-tuned together with the heads)" if medusa2 else "a whole model"
            raise HeadsError(f"hub repo {repo_id}: {what} in {whole[0]}, not draft heads; only its config.json was downloaded")
        raise HeadsError(
            f"hub repo {repo_id}: no draft-head files (expected {CONFIG_FILE} + {WEIGHTS_FILE}, or {OFFICIAL_CONFIG} + "
            f"{HYDRA_FILE}, {MEDUSA_FILES[0]} or {MEDUSA_FILES[1]})"
        )
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=wanted))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HeadsError(f"cannot read {path}: {e}") from None
    if not isinstance(out, dict):
        raise HeadsError(f"{path} does not hold a JSON object")
    return out


def _safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for a bad header; name the file
        raise HeadsError(f"cannot read {path}: {e}") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


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
