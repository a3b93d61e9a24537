"""Heads and banks for a loaded model, and `Runtime`: the facade that runs any method (the
engine's decode loop or transformers `generate`) on one loaded model, with its fits."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from entmtp.model import forward, kernels, kv, serve
from entmtp.bank.bank import BankError, TopologyBank, load_bank
from entmtp.config import (
    BANKS_DIR,
    BASELINE_TREE,
    ENGINE_METHODS,
    HEADS_DIR,
    METHODS,
    TASKS,
    TREES_FILE,
    BankBuildConfig,
    CalibrateConfig,
    GenerationConfig,
    ModelConfig,
    PhrasebookRule,
    PromptLookupConfig,
)
from entmtp.data.answers import training_answers
from entmtp.runtime.baselines import hf_generate
from entmtp.runtime.weights import LoadError, cache_root, eos_ids, load_model, model_slug, resolve_weights
from entmtp.machine import fingerprint
from entmtp.bank.calibrate import known_fit, resolve_fits
from entmtp.bank.live import LiveCosts
from entmtp.bank.refit import LiveFit
from entmtp.spec.engine import Engine, StepRecord, Strategy
from entmtp.spec.heads import DraftHeads, HeadsError, head_features
from entmtp.spec.phrasebook import Phrasebook, Reranker, Rule
from entmtp.spec.headfiles import load_heads
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import compile_tree, load_named_trees


def default_heads_dir(model_name: str, kind: str) -> Path:
    return HEADS_DIR / model_slug(model_name) / kind


def heads_dir(model_name: str, kind: str, heads: str | None = None) -> Path:
    """The folder of a model's heads: a local folder, a hub repo's files (fetched, only if named),
    or the shipped default. LoadError where there is none."""
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
        from entmtp.spec.headfiles import fetch_hub_heads

        path = fetch_hub_heads(heads)
    else:
        raise LoadError(f"heads not found: {heads!r} is neither a folder nor a hub repo id")
    return path


def resolve_heads(model, model_name: str, kind: str, heads: str | None = None) -> DraftHeads:
    """Heads from a local folder, a hub repo (only if named), or the shipped default."""
    path = heads_dir(model_name, kind, heads)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        loaded = load_heads(path, cfg)
        if loaded.kind != kind:
            raise LoadError(f"{path} holds {loaded.kind} heads, {kind} heads are needed")
        return served_heads(model, loaded.bind(model))
    except HeadsError as e:
        raise LoadError(f"heads {path}: {e}") from None


def served_heads(model, heads: DraftHeads) -> DraftHeads:
    """Bound heads as `model` serves them: packed where the model is (GGUF blocks, their smoothing
    set from `_heads_sample`), else as they are. Again after `set_draft_vocab`."""
    if not serve.is_packed(model):
        return heads
    device = model.get_output_embeddings().weight.device
    return heads.pack(_heads_sample(model, heads) if kernels.int8_available(device) else None)


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
        raise LoadError(f"no {task} bank for {model_name} at {path}; build it with `python -m entmtp build-bank --task {task}` "
                        "(generate builds one here for an EntMTP method)")
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
    # () -> the fingerprint to key fits by, or None to take this process's own: a process that cannot
    # see the device (ZeroGPU's page process) names the one its GPU worker measured
    fingerprint_from: Any = None
    _heads: dict[str, DraftHeads] = field(default_factory=dict)
    _trees: dict = field(default_factory=dict)
    _banks: dict[str, TopologyBank] = field(default_factory=dict)
    _book: Phrasebook | bool | None = None  # False: the model ships no stored answers
    _book_lock: threading.Lock = field(default_factory=threading.Lock)
    _timing: threading.Lock = field(default_factory=threading.Lock)  # one calibration at a time
    # the step costs of now on this machine, which the app's races feed and price their predictions by
    live: LiveCosts = field(default_factory=LiveCosts)
    # whether EntMTP's policies follow the live costs while serving (refits and probes, `bank.refit`)
    follow_live: bool = True
    # the budget of a bank built here, where the model has none (`bank.ondemand`)
    build_config: BankBuildConfig = field(default_factory=BankBuildConfig)
    _served: dict[str, LiveFit] = field(default_factory=dict)
    _digests: dict[str, str] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return model_slug(self.name)

    def heads(self, kind: str) -> DraftHeads:
        if kind not in self._heads:
            self._heads[kind] = resolve_heads(self.model, self.name, kind, self.heads_paths.get(kind))
        return self._heads[kind]

    def bank(self, task: str) -> TopologyBank:
        return self.banks([task])[task]

    def phrasebook(self) -> Phrasebook | None:
        """The model's phrasebook over its stored answers to training prompts, built on first use
        (~3 s on the 2-core AMD EPYC Zen 3); None for a model that ships no stored answers."""
        with self._book_lock:
            if self._book is None:
                answers = training_answers(self.name, self.encode_all)
                self._book = Phrasebook(answers) if answers else False
        return self._book or None

    def phrasebook_rule(self) -> Rule:
        """How a new bank drafts with the phrasebook: the reranker fitted for these Hydra heads
        (`reranker.json` beside them, scripts/fit_reranker.py) where there is one and it names these
        heads' weights, else the share rule (`config.PhrasebookRule`)."""
        given = self.heads_paths.get("hydra")
        path = (Path(given) if given else default_heads_dir(self.name, "hydra")) / "reranker.json"
        if path.is_file():
            rr = Reranker.load(path)
            if rr.heads_sha256 == self.heads("hydra").provenance.get("sha256"):
                return rr
        return PhrasebookRule()

    def book_for(self, bank: TopologyBank) -> tuple[Phrasebook | None, Rule]:
        """The phrasebook and rule a bank's traces were drafted with; (None, the default rule) for a
        bank drafted by the heads alone, or a model without stored answers (its drafts then differ
        from the traces', so the fit's predictions do; the output never does)."""
        rule = bank.phrasebook_rule
        book = self.phrasebook() if rule is not None else None
        return (None, PhrasebookRule()) if book is None else (book, rule)

    @property
    def fingerprint(self) -> dict[str, Any]:
        named = self.fingerprint_from() if self.fingerprint_from is not None else None
        if named is not None:
            return named
        graphs = self.engine.graphs
        label = serve.label(self.model) + ("" if graphs is None else "+cuda-graphs" + ("-compiled" if graphs.compile else ""))
        return fingerprint(self.model, label)

    @property
    def fits_root(self) -> Path:
        """Where this machine's fits are cached."""
        return self.cache_root or cache_root(ModelConfig())

    def banks(self, tasks: list[str], progress: Any = None, mode: str | None = None, turn: Any = None) -> dict[str, TopologyBank]:
        """The tasks' banks under the fit `mode` (default: `fit_mode`) asks for; tasks that need
        calibrating are timed together (each block of timing inside `turn()`, see
        `calibrate.measure_costs`). mode "refit" measures again and replaces the loaded fits;
        mode "shipped" where `fit_mode` is not gives the bank files' fits without keeping them."""
        mode = mode or self.fit_mode
        keep = mode != "shipped" or self.fit_mode == "shipped"
        wanted = [t for t in dict.fromkeys(tasks) if t not in self._banks or mode == "refit" or not keep]
        if not wanted:
            return {t: self._banks[t] for t in tasks}
        if not self._trees:
            self._trees = load_named_trees(TREES_FILE)
        root, fp = self.fits_root, self.fingerprint
        need = {t: self.bank_from_file(t) for t in wanted}
        timing = mode == "refit" or any(known_fit(b, fp, root, mode) is None for b in need.values())
        with self._timing if timing else contextlib.nullcontext():  # a second caller finds the first one's fit
            if timing and mode != "refit":
                need = {t: b for t, b in need.items() if t not in self._banks}
            book = self.phrasebook() if timing and any(b.phrasebook_rule for b in need.values()) else None
            try:
                got = resolve_fits(self.engine, self.heads("hydra"), need, fp, root, mode, self.calibrate_config,
                                   self._trees[BASELINE_TREE], progress or self.progress, turn or contextlib.nullcontext, book)
            except BankError as e:
                raise LoadError(str(e)) from None
            if not keep:
                return {t: got.get(t) or self._banks[t] for t in tasks}
            self._banks.update(got)
        return {t: self._banks[t] for t in tasks}

    def needs_calibration(self, task: str) -> bool:
        """True when the task's bank has no fit for this machine yet (using it will time its trees first)."""
        if task in self._banks or self.bank_file(task) is None:  # no bank: nothing to time (races use a fallback)
            return False
        bank = self.bank_from_file(task)
        return known_fit(bank, self.fingerprint, self.fits_root, self.fit_mode) is None

    def fitted_here(self, task: str) -> bool:
        """Whether the task's bank has a fit measured on this machine (never times anything)."""
        fp = self.fingerprint
        fit = self._banks[task].fit if task in self._banks else known_fit(self.bank_from_file(task), fp, self.fits_root, self.fit_mode)
        return fit is not None and fit.get("fingerprint") == fp

    def adopt_fits(self, fits: dict[str, dict[str, Any]]) -> None:
        """Use fits measured elsewhere for this model's banks (by task): a GPU worker's, on ZeroGPU."""
        for task, fit in fits.items():
            self._banks[task] = self.bank_from_file(task).with_fit(fit)

    # -- where a bank comes from: shipped in banks/, else built here (`bank.ondemand`) -------------

    def bank_file(self, task: str) -> Path | None:
        """The task's bank file: the one shipped in the banks folder, else one built here for this
        model and these heads (cached under ENTMTP_CACHE), else None."""
        shipped = bank_path(self.name, task, self.banks_dir)
        if shipped.exists():
            return shipped
        built = self.built_file(task)
        return built if built is not None and built.exists() else None

    def heads_digest(self, kind: str = "hydra") -> str:
        """A hash of the heads' files (names and contents), without loading them (a ZeroGPU page
        process must not run them): what a bank built here is keyed by. Once per runtime."""
        if kind not in self._digests:
            from entmtp.spec.headfiles import file_sha256

            d = heads_dir(self.name, kind, self.heads_paths.get(kind))
            files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != "reranker.json")
            self._digests[kind] = hashlib.sha256(json.dumps([(str(p.relative_to(d)), file_sha256(p)) for p in files]).encode()).hexdigest()[:16]
        return self._digests[kind]

    def built_file(self, task: str) -> Path | None:
        """Where a bank built here for this model and its Hydra heads is cached (None: no Hydra heads)."""
        from entmtp.bank.ondemand import built_path

        try:
            return built_path(self, task)
        except LoadError:
            return None

    def built_here(self, task: str) -> bool:
        """Whether the task's bank is one built here (not shipped)."""
        got = self.bank_file(task)
        return got is not None and got == self.built_file(task)

    def bank_from_file(self, task: str) -> TopologyBank:
        """The task's bank as its file has it (`bank_file`); LoadError where there is none."""
        path = self.bank_file(task)
        if path is None:
            return resolve_bank(self.name, task, self.banks_dir)  # its error names the file and the way to build one
        try:
            return load_bank(path)
        except BankError as e:
            raise LoadError(str(e)) from None

    def ensure_bank(self, task: str, progress: Any = None) -> TopologyBank:
        """The task's bank, built here first where the model has none (`bank.ondemand.BankBuild`:
        build-bank's stages, resumable, cached under ENTMTP_CACHE)."""
        if self.bank_file(task) is None:
            from entmtp.bank.ondemand import BankBuild

            BankBuild(self, task).advance(progress=progress)
        return self.bank(task)

    def built_bank(self, task: str) -> TopologyBank:
        """The task's bank once built here (its fit measured here), as `bank` serves it."""
        self._banks.pop(task, None)
        return self.bank(task)

    def served(self, task: str) -> LiveFit:
        """The task's bank as served now: its fit, or the last refit of it at the live costs."""
        bank = self.bank(task)
        got = self._served.get(task)
        if got is None or got.bank is not bank:  # a new fit (calibrated, adopted) starts it over
            got = self._served[task] = LiveFit(bank, self.live, self._trees.get(BASELINE_TREE) or load_named_trees(TREES_FILE)[BASELINE_TREE])
        return got

    def live_fit(self, task: str) -> LiveFit | None:
        """The task's bank as served now, where a decode has served it (never loads or times anything)."""
        return self._served.get(task)

    def serves(self, task: str, bank: TopologyBank) -> bool:
        """Whether `bank` is the task's own bank as loaded here (not a fallback, nor a what-if's)."""
        return self._banks.get(task) is bank and bool(bank.traces)

    def reset_live(self) -> None:
        """Forget the steps timed so far and every refit: the banks' fits stand again."""
        self.live.clear()
        self._served.clear()

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
        book, rule = self.book_for(bank)
        try:
            if not self.follow_live:
                return Strategy(method, bank, bank.policy(method.split("-", 1)[1]), self.heads("hydra"), book, rule)
            served = self.served(task)
            return Strategy(method, bank, served.policy(method.split("-", 1)[1]), self.heads("hydra"), book, rule, served.session(method))
        except (BankError, ValueError) as e:
            raise LoadError(f"{method}: {e}") from None

    def run(self, method: str, task: str, prompt_ids: list[int], gen: GenerationConfig = GenerationConfig()) -> Iterator[StepRecord]:
        """One per-step generator for every method: the engine's loop or transformers `generate`
        (`hf`, `hf-lookup`: with stock kernels; `oracle`: on the model as served, untimed use only)."""
        if method == "oracle":
            self.engine.validate_request(prompt_ids, gen)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.engine_eos()
            return hf_generate(self.model, prompt_ids, gen, None, pad, stock=False)
        if method in ("hf", "hf-lookup"):
            if gen.typical:
                raise LoadError(f"{method} has no typical acceptance")
            self.engine.validate_request(prompt_ids, gen)
            lookup = PromptLookupConfig() if method == "hf-lookup" else None
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.engine_eos()
            return hf_generate(self.model, prompt_ids, gen, lookup, pad)
        # every engine step is timed into the live costs, which predictions and refits read
        return self.live.observe_run(self.engine.generate(prompt_ids, self.strategy(method, task), gen), len(prompt_ids))

    def served_differs(self) -> bool:
        """Whether the served arithmetic is not float32's (Q8 inputs, `--kernels q8`), so that stock
        transformers (`hf`) may decode other tokens than the model as served."""
        return self.engine.q8

    @property
    def arithmetic(self) -> str:
        """What keys stored greedy continuations apart by the served arithmetic: "+q8" (Q8 inputs in
        every call, the LM head's included, `gguf.q8_inputs`) or "" (float32). Earlier served models':
        "+q8h/64" (Q8 inputs for calls of up to 64 rows, a longer prompt in float32), "+q8/64" (the
        projections alone on Q8 inputs)."""
        return "+q8" if self.engine.q8 else ""

    def engine_eos(self) -> int | None:
        return min(self.engine.eos) if self.engine.eos else None

    def encode(self, prompt: str) -> list[int]:
        """The user message in the model's chat template, as token ids."""
        return chat_ids(self.tokenizer, [prompt], self.name)[0]

    def encode_all(self, prompts: list[str]) -> list[list[int]]:
        """`encode` of each prompt, in one call of the tokenizer (each prompt's ids as alone)."""
        return chat_ids(self.tokenizer, prompts, self.name)

    @property
    def prompt_format(self) -> str:
        """How a user message becomes the model's prompt (`chat_ids`), in words."""
        return prompt_format(self.tokenizer, self.name)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


CHAT_TEMPLATE = "the model's own chat template"
# FastChat's `vicuna_v1.1` conversation (Vicuna v1.1 to v1.5, which ship no chat template): the system
# message, then " USER: <message> ASSISTANT:" (its ADD_COLON_TWO style, separators " " and "</s>")
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
VICUNA = "FastChat's Vicuna v1.1 conversation format (the model has no chat template)"
PLAIN = "the message as it is, a plain prompt (the model has no chat template)"


def prompt_format(tok, model_name: str = "") -> str:
    """Which format `chat_ids` puts a user message in for this tokenizer and model."""
    if getattr(tok, "chat_template", None):
        return CHAT_TEMPLATE
    return VICUNA if "vicuna" in model_name.lower() else PLAIN


def chat_ids(tok, prompts: list, model_name: str = "") -> list[list[int]]:
    """Each user message in the tokenizer's chat template where it has one, else FastChat's Vicuna
    format for a Vicuna model, else as it is; as token ids, in one call of the tokenizer: each
    prompt's ids as it alone would get them. A prompt may also be a conversation (a sequence of
    `{"role", "content"}` ending with the user's turn), in a chat template only."""
    if not prompts:
        return []
    fmt = prompt_format(tok, model_name)
    if fmt == CHAT_TEMPLATE:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else list(p),
                                         add_generation_prompt=True, tokenize=False) for p in prompts]
        return tok(texts, add_special_tokens=False)["input_ids"]
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"a conversation needs the model's chat template; this model's prompts are {fmt}")
    if fmt == VICUNA:
        return tok([f"{VICUNA_SYSTEM} USER: {p} ASSISTANT:" for p in prompts])["input_ids"]
    return tok(list(prompts))["input_ids"]


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
