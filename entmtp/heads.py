"""Draft heads: Hydra (sequentially dependent) and Medusa; our file format and the official layouts.

Module names mirror the official checkpoints so that their state dicts load with a strict key
check: Hydra `hydra_mlp.{i}.{j}.*` / `hydra_lm_head.{i}.*` (+ `prefix_embeding_layer.*` for
Hydra++), Medusa `{i}.{j}.linear.*` / `{i}.{L}.weight`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from . import kernels

FORMAT = "entmtp-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"


class HeadsError(ValueError):
    """Heads that cannot be loaded, or that do not fit the base model."""


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

    # -- binding to a base model -------------------------------------------------------------
    def bind(self, model: nn.Module) -> "DraftHeads":
        """Attach to `model`: dtype, device (that of the LM head), embedding and shared LM head."""
        lm_head = model.get_output_embeddings()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if cfg.hidden_size != self.hidden_size:
            raise HeadsError(f"heads have hidden size {self.hidden_size}, the model has {cfg.hidden_size}")
        if cfg.vocab_size != self.vocab_size:
            raise HeadsError(f"heads have vocabulary {self.vocab_size}, the model has {cfg.vocab_size}")
        w = lm_head.weight
        self.to(device=w.device, dtype=w.dtype)
        self.draft_vocab = self.draft_vocab.to(w.device)
        self._base = {"embed": model.get_input_embeddings(), "lm_head": lm_head}
        self._lm_cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._lm_packed = None
        return self

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

    def pack(self) -> "DraftHeads":
        """Inference on a CPU: every linear prepacked for oneDNN, in bfloat16 where the CPU has it.

        Drafts are proposals that verification checks against the float32 base model, so their
        precision never reaches the output; bf16 halves the bytes each head step streams (the
        4-head chain measured 7.9 -> 2.0 ms on one core here).
        """
        w = self._base["lm_head"].weight
        if not kernels.available(w.device, torch.float32):
            return self
        dtype = torch.bfloat16 if kernels.available(w.device, torch.bfloat16) else torch.float32
        for name, child in self.named_children():
            if name != "prefix_embeding_layer":  # Hydra++'s prefix layer reads float32 base states
                child.to(dtype)
            kernels.pack_linears(child)
        self.compute_dtype = dtype
        self._lm_packed = {}
        for i in range(self.num_heads):
            if self._lm_key(i) not in self._lm_packed:
                weight, bias = self._lm_weights(i)
                bias = None if bias is None else bias.to(dtype)
                self._lm_packed[self._lm_key(i)] = kernels.PackedLinear(weight.to(dtype), bias)
        self._lm_cache = {}  # the packed copies replace the float32 slices
        return self

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
        out = self.layer(inputs_embeds=hidden[None], cache=self.cache, position_ids=pos, use_cache=True)
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


def load_heads(directory: str | Path, base_config: Any) -> DraftHeads:
    """Load heads from a directory in our format or the official Hydra / Medusa layout."""
    d = Path(directory)
    if not d.is_dir():
        raise HeadsError(f"heads directory not found: {d}")
    cfg_text = d / CONFIG_FILE
    if cfg_text.exists():
        meta = json.loads(cfg_text.read_text())
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise HeadsError(f"{cfg_text}: not {FORMAT} version {FORMAT_VERSION}")
        heads = build_heads(meta, base_config)
        state = load_file(str(d / WEIGHTS_FILE))
        draft_vocab = state.pop("draft_vocab", None)
        _strict_load(heads, state, str(d / WEIGHTS_FILE))
        heads.set_draft_vocab(draft_vocab)
        heads.provenance = meta.get("provenance", {})
        heads.provenance["sha256"] = file_sha256(d / WEIGHTS_FILE)
        return heads
    config_file = d / "config.json"
    if not config_file.exists():
        raise HeadsError(f"{d}: no {CONFIG_FILE} (ours) and no config.json (Hydra/Medusa layout)")
    cfg = json.loads(config_file.read_text())
    hidden, vocab = base_config.hidden_size, base_config.vocab_size
    if "hydra_num_heads" in cfg:
        if cfg.get("hidden_state_offset", 0) not in (0, None):
            raise HeadsError(f"{config_file}: hidden_state_offset={cfg['hidden_state_offset']} is not supported (only 0)")
        arch = cfg.get("hydra_head_arch", "mlp")
        heads = HydraHeads(
            hidden,
            vocab,
            int(cfg["hydra_num_heads"]),
            int(cfg.get("hydra_num_layers", 1)),
            arch,
            bool(cfg.get("grounded_heads", True)),
            shared_lm_head=False,
            base_config=base_config,
        )
        weights = d / "hydra_lm_head.pt"
        if not weights.exists():
            raise HeadsError(f"{d}: Hydra layout without hydra_lm_head.pt")
        _strict_load(heads, _torch_load(weights), str(weights))
        heads.provenance = {"source": str(d), "layout": "hydra", "sha256": file_sha256(weights)}
        return heads
    if "medusa_num_heads" in cfg:
        heads = MedusaHeads(hidden, vocab, int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1)), False)
        pt, st = d / "medusa_lm_head.pt", d / "medusa_lm_head.safetensors"
        if st.exists():
            state, weights = load_file(str(st)), st
        elif pt.exists():
            state, weights = _torch_load(pt), pt
        else:
            raise HeadsError(f"{d}: Medusa layout without medusa_lm_head.pt or .safetensors")
        _strict_load(heads.heads, state, str(weights))
        heads.provenance = {"source": str(d), "layout": "medusa", "sha256": file_sha256(weights)}
        return heads
    raise HeadsError(f"{config_file}: neither hydra_num_heads nor medusa_num_heads is set")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]
