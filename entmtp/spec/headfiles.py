"""Draft heads on disk: our format (`heads.json` + `heads.safetensors`), the official Hydra and
Medusa layouts (loaded with a strict key check, see `heads`), and a hub repo named by the user."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from entmtp.model import gguf
from entmtp.spec.heads import DraftHeads, HeadsError, HydraHeads, MedusaHeads, note_provenance

FORMAT = "entmtp-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"


def build_heads(cfg: dict[str, Any], base_config: Any = None) -> DraftHeads:
    """Heads from a config dict as written by `config_dict()` (our format). `blocks` (optional,
    default Q8_0) is the GGUF block kind their linears are served in on a CPU (`DraftHeads.pack`);
    `lm_blocks` (optional, default Q8_0) their LM head's (Q4_1: its best rows refined in Q8_0)."""
    kinds = {}
    for key in ("blocks", "lm_blocks"):
        kinds[key] = cfg.get(key, "q8_0")
        if kinds[key] not in gguf.HEAD_BLOCKS:
            raise HeadsError(f"heads config: unknown {key} {kinds[key]!r} (expected one of {', '.join(gguf.HEAD_BLOCKS)})")
    heads = _build(cfg, base_config)
    heads.blocks, heads.lm_blocks = kinds["blocks"], kinds["lm_blocks"]
    return heads


def _build(cfg: dict[str, Any], base_config: Any) -> DraftHeads:
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
                note_provenance(heads, f"{weights}: {k} differs from the RoPE frequencies of the base config, which the prefix layer uses")
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
        note_provenance(heads, f"{config_file}: version {cfg.get('version')!r} but {weights.name} is laid out for {lm}; {lm} are used")
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
        note_provenance(heads, f"{config_file}: {name} is {said} but {weights.name} holds {found}; using {found}")


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
