"""Self-distillation of draft heads on CPU; the base model stays frozen.

Corpus. For a prompt (in the chat template) and an answer, keep only the base model's final
normed hidden states and the answer's tokens: `hidden[j]` (H,) is the state that predicts
`tokens[j]`, so `hidden[0]` sits on the prompt's last token. An answer is either the base model's
own greedy continuation ("self": batched, left-padded; it is what the heads see at inference;
"sharegpt": the same for Python questions from chat's training split, more code for the code
heads; "everyday": the same for composed everyday requests, `entmtp.data.everyday`) or a
reference answer read teacher-forced ("ref": cheaper per token, off-distribution paths).

Targets. The base model's distribution for `tokens[j]` is `softmax(lm_head(hidden[j]))`, so no
logits are stored. At an anchor t, head i reads `hidden[t]` (Hydra also E(tokens[t..t+i])) and
learns `softmax(lm_head(hidden[t+1+i]))` (soft cross-entropy, as Hydra++), or its argmax. Student
and teacher logits are both restricted to a draft vocabulary (the K most frequent answer tokens),
which is saved with the heads: the engine drafts only from it.

Everything checkpoints under a work folder: one corpus shard per generation batch, and the
trainer's state every `checkpoint_every` steps; a rerun resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm

from entmtp.data import everyday, prompts as data
from entmtp.model import kv
from entmtp.data.answers import AnswerStore
from entmtp.config import TrainConfig
from entmtp.spec.heads import DraftHeads, HydraHeads, MedusaHeads, ResBlock
from entmtp.spec.headfiles import save_heads

Encode = Callable[[str], list[int]]


class TrainError(ValueError):
    """A training request that cannot run (bad config, corpus or checkpoint); the message names it."""


# --- corpus --------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """Answers with the base model's hidden states: `hidden[j]` predicts `tokens[j]`."""

    hidden: list[torch.Tensor] = field(default_factory=list)  # (n, H) float32 each
    tokens: list[torch.Tensor] = field(default_factory=list)  # (n,) long each
    prompts: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    # Hydra++ only: base hidden states of each prompt but its last token ((P-1, H)), which the
    # prefix layer reads before hidden[0]; empty when no prefix heads are trained
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)

    def extend(self, other: "Corpus") -> None:
        for name in ("hidden", "tokens", "prompts", "tasks", "sources", "prompt_hidden"):
            getattr(self, name).extend(getattr(other, name))

    def __len__(self) -> int:
        return len(self.tokens)

    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def describe(self) -> dict[str, dict[str, int]]:
        """{"<task>/<source>": {"answers": n, "tokens": n}} for the provenance."""
        out: dict[str, dict[str, int]] = {}
        for task, src, tok in zip(self.tasks, self.sources, self.tokens):
            row = out.setdefault(f"{task}/{src}", {"answers": 0, "tokens": 0})
            row["answers"] += 1
            row["tokens"] += len(tok)
        return dict(sorted(out.items()))


def _base(model):
    return model.base_model


def _lm_head(model):
    return model.get_output_embeddings()


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy answers for a batch of prompts. -> per prompt (hidden (n,H), tokens (n,)).

    On the engine's fused stack (the default model), `model.batch.BatchDecoder`: each prompt
    decoded as the engine decodes it alone, bit for bit, a finished answer's slot taken by the next
    prompt (its throughput against the padded batch, and the machine it was measured on:
    docs/heads.md, *Answers in batches*); elsewhere transformers' forward over the left-padded batch."""
    from entmtp.model import batch

    if batch.available(model) and 0 < len(prompts) <= batch.MAX_BATCH:
        answers = {a.index: a for a in batch.BatchDecoder(model, eos, batch=len(prompts), keep_hidden=True).run(prompts, max_new_tokens)}
        return [(answers[i].hidden.float().cpu().contiguous(), torch.tensor(answers[i].tokens)) for i in range(len(prompts))]
    return padded_batch(model, prompts, max_new_tokens, eos, pad)


@torch.inference_mode()
def padded_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy answers for a batch of prompts, left-padded through transformers' forward."""
    from transformers import DynamicCache

    device = _lm_head(model).weight.device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = _base(model)(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kv.cache_arg(_base(model), cache))
    h = out.last_hidden_state[:, -1]  # (B, H)
    hs, toks = [], []
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long)
    nxt_pos = pos[:, -1:] + 1
    for step in range(max_new_tokens):
        nxt = _lm_head(model)(h).argmax(-1)  # (B,)
        hs.append(h.float().cpu())
        toks.append(nxt.cpu())
        hit = torch.zeros_like(done)
        for e in eos:
            hit |= nxt == e
        for b in (hit & ~done).nonzero().flatten().tolist():
            lengths[b] = step + 1  # the EOS is kept: the heads learn to draft it
        done |= hit
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
        out = _base(model)(
            input_ids=nxt[:, None], attention_mask=mask, position_ids=nxt_pos, use_cache=True, **kv.cache_arg(_base(model), cache)
        )
        nxt_pos = nxt_pos + 1
        h = out.last_hidden_state[:, -1]
    H, T = torch.stack(hs, 1), torch.stack(toks, 1)  # (B, n, H), (B, n)
    return [(H[b, : lengths[b]].contiguous(), T[b, : lengths[b]].contiguous()) for b in range(B)]


@torch.inference_mode()
def teacher_forced(model, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states along a given answer. -> (hidden (n,H), tokens (n,)); hidden[0] is the prompt's last."""
    device = _lm_head(model).weight.device
    ids = torch.tensor([prompt + answer], device=device)
    h = _base(model)(input_ids=ids).last_hidden_state[0]  # (P+n, H)
    n = len(answer)
    return h[len(prompt) - 1 : len(prompt) - 1 + n].float().cpu().contiguous(), torch.tensor(answer)


def read_back(model, prompts: list[list[int]], answers: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`teacher_forced` for a batch of answers: on the engine's fused stack, one block a sequence
    through `model.batch.BatchDecoder.read_back` (the states decoding keeps, bit for bit; a turn
    right after the turn it extends continues its cache), else one transformers forward each."""
    from entmtp.model import batch

    if not batch.available(model):
        return [teacher_forced(model, p, a) for p, a in zip(prompts, answers)]
    parents = [None] + [k - 1 if batch.extends(p, prompts[k - 1]) else None for k, p in enumerate(prompts[1:], 1)]
    states = dict(batch.BatchDecoder(model, (), batch=1).read_back(prompts, answers, parents))
    return [(states[k].float().cpu().contiguous(), torch.tensor(a)) for k, a in enumerate(answers)]


def _stored(stores: list[AnswerStore], prompt: list[int], cap: int) -> list[int] | None:
    for store in stores:
        got = store.get(prompt, cap)
        if got is not None:
            return got
    return None


@torch.inference_mode()
def prompt_states(model, prompt: list[int]) -> torch.Tensor:
    """Base hidden states of a prompt's tokens but the last: (P-1, H) float32 (Hydra++'s prefix input)."""
    device = _lm_head(model).weight.device
    h = _base(model)(input_ids=torch.tensor([prompt], device=device)).last_hidden_state[0]
    return h[: len(prompt) - 1].float().cpu().contiguous()


def corpus_plan(cfg: TrainConfig, split: str) -> list[tuple[str, str, int]]:
    """(task, source, number of prompts) to build for `split` ("train", or "calib" held out)."""
    if split == "calib":
        extra = [("chat", "everyday", cfg.heldout_prompts)] if cfg.everyday_prompts else []
        return [(t, "self", cfg.heldout_prompts) for t in data.TASKS] + extra
    extra = [("code", "sharegpt", cfg.sharegpt_code_prompts)] if cfg.sharegpt_code_prompts else []
    extra += [("chat", "everyday", cfg.everyday_prompts)] if cfg.everyday_prompts else []
    extra += [("chat", "turns", cfg.turn_prompts)] if cfg.turn_prompts else []
    return [(t, "self", n) for t, n in cfg.self_prompts] + extra + [(t, "ref", n) for t, n in cfg.ref_prompts]


GENERATED = ("self", "sharegpt", "everyday", "turns")  # sources answered greedily by the base model; "ref" is read teacher-forced


SORT_BLOCK = 64  # prompts sorted by length together, so a larger --self-prompts count keeps earlier batches


def _length_sorted_blocks(rows: list[tuple[str, str]], encode: Encode) -> list[tuple[str, str]]:
    """Rows sorted by prompt length within consecutive blocks of SORT_BLOCK."""
    out = []
    for i in range(0, len(rows), SORT_BLOCK):
        out += sorted(rows[i : i + SORT_BLOCK], key=lambda r: len(encode(r[0])))
    return out


def prompt_text(prompt) -> str:
    """A corpus prompt as text: a user message as it is, a conversation (`chat/turns`) as its JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(list(prompt), ensure_ascii=False)


def prompt_of(text: str):
    """`prompt_text` undone: the conversation a JSON text holds, else the message itself."""
    if text.startswith('[{"role"'):
        try:
            return tuple(json.loads(text))
        except json.JSONDecodeError:
            pass
    return text


def _select(task: str, split: str, source: str, n: int, encode: Encode, max_prompt: int) -> list[tuple]:
    """The first `n` (prompt, reference) of a split whose prompt fits `max_prompt` tokens."""
    if split == "eval":
        raise TrainError("training and held-out corpora never read the eval split")
    if source == "turns":  # later turns in their conversation's context (grow-answers' chat/turns)
        rows = [(p, "") for p in data.chat_turns(split)]
    elif source == "sharegpt":  # Python questions from chat's split, answered by the base model
        rows = [(p, "") for p, _ in data.sharegpt_code_pairs(split)]
    elif source == "everyday":  # composed everyday requests, answered by the base model
        rows = [(p, "") for p in everyday.prompts(split)]
    elif source == "ref":
        rows = data.pairs(task, split)
    else:
        rows = [(p, "") for p in data.prompts(task, split)]
    out = []
    for p, r in rows:
        if len(out) >= n:
            break
        if len(encode(p)) <= max_prompt:
            out.append((p, r))
    return out


def build_corpus(
    model,
    encode: Encode,
    encode_answer: Encode,
    eos: set[int],
    pad: int,
    cfg: TrainConfig,
    work: Path,
    split: str = "train",
    progress: bool = True,
    answers: AnswerStore | list[AnswerStore] | None = None,
) -> Corpus:
    """Build (or resume) the corpus of `split` under `work/corpus/<split>/`, one shard per batch.

    Generated answers come from the `answers` stores (the first that holds a prompt's) when they
    hold every prompt of a batch, and new ones are added to the first store.
    """
    stores = [] if answers is None else list(answers) if isinstance(answers, (list, tuple)) else [answers]
    folder = work / "corpus" / split
    folder.mkdir(parents=True, exist_ok=True)
    shape = {"answer_tokens": cfg.answer_tokens, "max_prompt_tokens": cfg.max_prompt_tokens, "teacher": cfg.teacher}
    manifest = folder / "corpus.json"
    if manifest.exists() and {"teacher": "packed", **json.loads(manifest.read_text())} != shape:  # older: float32
        raise TrainError(f"{folder} was built with {manifest.read_text().strip()}, not {shape}; use another --work")
    manifest.write_text(json.dumps(shape) + "\n")
    corpus = Corpus()
    for task, source, n in corpus_plan(cfg, split):
        rows = _select(task, split, source, n, encode, cfg.max_prompt_tokens)
        generated = source in GENERATED
        if generated and source != "turns":  # similar lengths in a batch: less padding (turns keep their order)
            rows = _length_sorted_blocks(rows, encode)
        size = cfg.gen_batch if generated else cfg.ref_batch
        batches = [rows[i : i + size] for i in range(0, len(rows), size)]
        bar = tqdm(batches, desc=f"corpus {split} {task}/{source}", unit="batch", disable=not progress)
        for k, batch in enumerate(bar):
            texts = [prompt_text(p) for p, _ in batch]
            digest = hashlib.sha1("\0".join(texts).encode()).hexdigest()[:10]  # a shard is its prompts
            shard = folder / f"{task}-{source}-{k:04d}-{digest}.pt"
            if shard.exists():
                part = torch.load(shard, weights_only=True)
            else:
                if generated:
                    ids = [encode(p) for p, _ in batch]
                    known = [_stored(stores, i, cfg.answer_tokens) for i in ids]
                    if all(a is not None for a in known):  # stored answers: read back teacher-forced
                        pairs = read_back(model, ids, known)
                    else:
                        pairs = generate_batch(model, ids, cfg.answer_tokens, eos, pad)
                        if stores:
                            stores[0].add(task, source, ids, [t.tolist() for _, t in pairs], cfg.answer_tokens)
                else:
                    pairs = read_back(model, [encode(p) for p, _ in batch], [encode_answer(r)[: cfg.answer_tokens] for _, r in batch])
                part = {"prompts": texts, "hidden": [h for h, _ in pairs], "tokens": [t for _, t in pairs]}
                _atomic_save(part, shard)
            if cfg.arch == "prefix-mlp" and "prompt_hidden" not in part:  # added to older shards in place
                part["prompt_hidden"] = [prompt_states(model, encode(prompt_of(p))) for p in part["prompts"]]
                _atomic_save(part, shard)
            keep = [i for i, t in enumerate(part["tokens"]) if len(t) >= 2]
            corpus.extend(
                Corpus(
                    [part["hidden"][i] for i in keep],
                    [part["tokens"][i] for i in keep],
                    [part["prompts"][i] for i in keep],
                    [task] * len(keep),
                    [source] * len(keep),
                    [part["prompt_hidden"][i] for i in keep] if cfg.arch == "prefix-mlp" else [],
                )
            )
            bar.set_postfix(tokens=corpus.n_tokens())
    return corpus


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --- draft vocabulary ----------------------------------------------------------------------------


def draft_vocab(corpus: Corpus, k: int, vocab_size: int, prompt_tokens: list[list[int]] = ()) -> torch.Tensor:
    """The `k` most frequent answer tokens, sorted by id. -> (K,) long.

    Ties go to the smaller id. When the answers hold fewer than k distinct tokens, the rest is
    filled with the most frequent prompt tokens (answers copy names and numbers from prompts),
    then with the lowest unused ids.
    """
    answers, prompts = Counter(), Counter()
    for t in corpus.tokens:
        answers.update(t.tolist())
    for p in prompt_tokens:
        prompts.update(p)
    ids: list[int] = []
    for counts in (answers, prompts):
        seen = set(ids)
        ids += [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in seen][: k - len(ids)]
    if len(ids) < k:
        seen = set(ids)
        ids += [t for t in range(vocab_size) if t not in seen][: k - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.long)


# --- training ------------------------------------------------------------------------------------


@dataclass
class Flat:
    """The corpus as flat tensors, the anchors usable by head 0, and sparse teacher targets."""

    hidden: torch.Tensor  # (N, H)
    tokens: torch.Tensor  # (N,)
    remaining: torch.Tensor  # (N,) positions left in the same answer after this one
    anchors: torch.Tensor  # (A,) flat positions t with t+1 inside the same answer
    starts: torch.Tensor | None = None  # (n_answers + 1,) where each answer begins in the flat tensors
    teacher_idx: torch.Tensor | None = None  # (N, k) draft-vocab indices of the teacher's top-k
    teacher_p: torch.Tensor | None = None  # (N, k) their probabilities, renormalised

    @classmethod
    def of(cls, corpus: Corpus) -> "Flat":
        """The corpus flattened. Its answers' states become views of the flat tensor, so a corpus of
        millions of tokens is held once (3.2M tokens: 7.4 GB of float32 states), not twice."""
        if not len(corpus):
            raise TrainError("the corpus is empty")
        hidden = torch.empty(sum(len(h) for h in corpus.hidden), corpus.hidden[0].shape[-1])  # (N, H) float32
        at = 0
        for i, h in enumerate(corpus.hidden):
            hidden[at : at + len(h)] = h
            corpus.hidden[i] = hidden[at : at + len(h)]
            at += len(h)
        tokens = torch.cat(corpus.tokens).long()
        remaining = torch.cat([torch.arange(len(t) - 1, -1, -1) for t in corpus.tokens])
        starts = torch.tensor([0] + [len(t) for t in corpus.tokens]).cumsum(0)
        return cls(hidden, tokens, remaining, (remaining >= 1).nonzero().flatten(), starts)

    @torch.no_grad()
    def add_teacher(self, lm_rows: torch.Tensor, k: int, temperature: float = 1.0, chunk: int = 4096) -> None:
        """Teacher top-k over the draft vocabulary at every position, once (lm_rows: (K, H))."""
        idx, prob = [], []
        w = lm_rows.float()
        for s in range(0, len(self.hidden), chunk):
            z = self.hidden[s : s + chunk] @ w.T  # (c, K)
            v, i = torch.topk(z, min(k, w.shape[0]), dim=-1)
            idx.append(i.to(torch.int32))
            prob.append(torch.softmax(v / temperature, -1))  # renormalised over the top-k
        self.teacher_idx, self.teacher_p = torch.cat(idx), torch.cat(prob)


def new_heads(kind: str, cfg: TrainConfig, model) -> DraftHeads:
    """Fresh heads for `model` (seeded by the caller); Hydra++'s prefix layer is not trained here."""
    mcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if kind == "hydra":
        if cfg.arch not in ("mlp", "prefix-mlp"):
            raise TrainError(f"unknown Hydra arch {cfg.arch!r} (expected mlp or prefix-mlp)")
        return HydraHeads(mcfg.hidden_size, mcfg.vocab_size, cfg.num_heads, cfg.num_layers, cfg.arch, True, True, mcfg)
    if cfg.arch != "mlp":
        raise TrainError(f"{kind} heads have no arch {cfg.arch!r} (only Hydra has prefix-mlp)")
    if kind == "medusa":
        return MedusaHeads(mcfg.hidden_size, mcfg.vocab_size, cfg.num_heads, cfg.num_layers, True)
    raise TrainError(f"unknown heads kind {kind!r} (expected hydra or medusa)")


def initial_heads(kind: str, cfg: TrainConfig, model) -> DraftHeads:
    """The heads in `cfg.init/<kind>` (our format), bound to `model` in its dtype, to train further."""
    from entmtp.spec.heads import HeadsError
    from entmtp.spec.headfiles import load_heads

    folder = Path(cfg.init) / ("hydra-prefix" if cfg.arch == "prefix-mlp" else kind)
    try:
        heads = load_heads(folder, model.config)
    except HeadsError as e:
        raise TrainError(f"--init: {e}") from None
    if heads.kind != kind or getattr(heads, "arch", "mlp") != cfg.arch:
        raise TrainError(f"--init: {folder} holds {heads.kind} {getattr(heads, 'arch', 'mlp')} heads, not {kind} {cfg.arch}")
    if kind == "hydra" and cfg.arch == "mlp" and heads.num_heads == cfg.num_heads and heads.num_layers < cfg.num_layers:
        _deepen(heads, cfg.num_layers)
    if heads.num_heads != cfg.num_heads or heads.num_layers != cfg.num_layers:
        raise TrainError(f"--init: {folder} holds {heads.kind} heads with {heads.num_heads} heads of {heads.num_layers} "
                         f"layers; training asks for {cfg.num_heads} of {cfg.num_layers}")
    if not heads.draft_vocab.numel():
        raise TrainError(f"--init: {folder} has no draft vocabulary")
    return heads.bind(model)


def _deepen(heads: DraftHeads, num_layers: int) -> None:
    """Append ResBlocks to every Hydra mlp head, each the identity at first (zero weight and bias),
    so deeper heads start from the given heads' predictions."""
    for block in heads.hydra_mlp:
        like = block[0].linear.weight
        while len(block) < num_layers:
            new = ResBlock(heads.hidden_size)
            torch.nn.init.zeros_(new.linear.bias)
            block.append(new.to(device=like.device, dtype=like.dtype))
    heads.num_layers = num_layers


def head_losses(heads: DraftHeads, flat: Flat, t: torch.Tensor, soft: bool,
                feature: torch.Tensor | None = None, dropout: float = 0.0,
                g: torch.Generator | None = None) -> tuple[torch.Tensor, list[float], list[float]]:
    """Summed loss of all heads at anchors t (B,), and per head its loss and top-1 agreement.

    Head i at anchor t reads the feature there (hidden[t], or Hydra++'s prefix output given as
    `feature` (B, H)) and tokens[t..t+i]; its teacher is the base distribution at t+1+i (top-k
    over the draft vocabulary, soft) or that distribution's argmax (hard). `dropout`: each element
    of the feature is zeroed with that probability (the rest scaled by 1 / (1 - dropout)), the mask
    drawn from `g` so that a resumed run draws the same.
    """
    feature = flat.hidden[t] if feature is None else feature  # (B, H)
    if dropout > 0:
        keep = torch.rand(feature.shape, generator=g) >= dropout
        feature = feature * keep.to(feature.device, feature.dtype) / (1.0 - dropout)
    total, losses, accs = feature.new_zeros(()), [], []
    for i in range(heads.num_heads):
        ok = flat.remaining[t] >= i + 1  # the target position t+1+i lies inside the answer
        ti = t[ok]
        if not len(ti):
            losses.append(float("nan"))
            accs.append(float("nan"))
            continue
        path = flat.tokens[ti[:, None] + torch.arange(i + 1)]  # (b, i+1) = tokens[t..t+i]
        logp = torch.log_softmax(heads.lm_logits(i, heads.head_hidden(i, feature[ok], path)), -1)  # (b, K)
        idx, p = flat.teacher_idx[ti + 1 + i].long(), flat.teacher_p[ti + 1 + i]  # (b, k)
        loss = -(p * logp.gather(1, idx)).sum(-1).mean() if soft else -logp.gather(1, idx[:, :1]).mean()
        total = total + loss
        losses.append(float(loss.detach()))
        accs.append(float((logp.argmax(-1) == idx[:, 0]).float().mean()))
    return total, losses, accs


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_heads(
    heads: DraftHeads,
    flat: Flat,
    cfg: TrainConfig,
    ckpt: Path,
    resume: bool = True,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
    until: int | None = None,
    prompt_hidden: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Train bound `heads` (draft vocabulary set, `flat.add_teacher` done) for cfg.steps.

    Checkpoints to `ckpt` every cfg.checkpoint_every steps. The batch of step s depends only
    on (seed, s), so a resumed run continues exactly as an uninterrupted one. `until` stops
    after that step, as an interruption would (the run resumes from there). Hydra++ heads
    (`prefix-mlp`) also need the corpus' `prompt_hidden`: a step then runs the prefix layer over
    `cfg.prefix_answers` whole sequences and trains at anchors drawn from their answers.
    """
    if flat.teacher_idx is None:
        raise TrainError("call Flat.add_teacher before training")
    prefix = getattr(heads, "arch", "mlp") == "prefix-mlp"
    if prefix and (prompt_hidden is None or len(prompt_hidden) != len(flat.starts) - 1):
        raise TrainError("prefix-mlp heads need the prompts' hidden states of every answer (Corpus.prompt_hidden)")
    for base in heads._base.values():  # the base model stays frozen (and gets no gradients)
        base.requires_grad_(False)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    start, seconds = 0, 0.0
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["config"] != asdict(cfg) or state["kind"] != heads.kind:
            raise TrainError(f"{ckpt} was written by another training config; pass --fresh or another --work")
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        start, seconds = state["step"], state["seconds"]
    heads.train()
    last: dict[str, Any] = {}
    stop = cfg.steps if until is None else min(until, cfg.steps)
    bar = tqdm(range(start, stop), initial=start, total=cfg.steps, desc=f"train {heads.kind}", disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        if prefix:
            t, feature = _prefix_batch(heads, flat, prompt_hidden, cfg, g)
        else:
            t, feature = flat.anchors[torch.randint(len(flat.anchors), (cfg.batch_tokens,), generator=g)], None
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        loss, losses, accs = head_losses(heads, flat, t, cfg.soft_targets, feature, cfg.feature_dropout, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        seconds += time.perf_counter() - t0
        last = {"step": step + 1, "loss": [round(x, 4) for x in losses], "train_top1": [round(x, 4) for x in accs]}
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{accs[0]:.2f}", acc3=f"{accs[-1]:.2f}")
        if log is not None and (step + 1) % 25 == 0:
            log(last)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == stop:
            state = {"config": asdict(cfg), "kind": heads.kind, "heads": heads.state_dict(), "opt": opt.state_dict()}
            _atomic_save({**state, "step": step + 1, "seconds": seconds}, ckpt)
    heads.eval()
    return {"steps": stop, "seconds": round(seconds, 1), "last": last}


def prefix_features(layer: nn.Module, sequence: torch.Tensor) -> torch.Tensor:
    """Hydra++: its prefix layer (`heads.prefix_embeding_layer`, a `heads.state_layer`) over a whole
    sequence's base hidden states (L, H) -> (L, H), causally.

    Equal, position by position, to what the engine's `PrefixContext.observe` gives.
    """
    pos = torch.arange(sequence.shape[0], device=sequence.device)[None]
    return layer(inputs_embeds=sequence[None], position_ids=pos, use_cache=False).last_hidden_state[0]


def _answer_features(heads: DraftHeads, flat: Flat, prompt_hidden: list[torch.Tensor], a: int) -> torch.Tensor:
    """Features at answer `a`'s positions (n, H): the prefix layer run over prompt and answer."""
    s, e = int(flat.starts[a]), int(flat.starts[a + 1])
    x = torch.cat([prompt_hidden[a], flat.hidden[s:e]]).to(next(heads.parameters()).dtype)
    return prefix_features(heads.prefix_embeding_layer, x)[len(prompt_hidden[a]) :]


def _prefix_batch(heads: DraftHeads, flat: Flat, prompt_hidden: list[torch.Tensor], cfg: TrainConfig,
                  g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors (B,) and their features (B, H) from `cfg.prefix_answers` answers drawn with `g`."""
    ts, feats = [], []
    for a in torch.randint(len(flat.starts) - 1, (cfg.prefix_answers,), generator=g).tolist():
        s, e = int(flat.starts[a]), int(flat.starts[a + 1])
        ok = flat.remaining[s:e] >= 1
        ts.append(torch.arange(s, e)[ok])
        feats.append(_answer_features(heads, flat, prompt_hidden, a)[ok])
    t, feature = torch.cat(ts), torch.cat(feats)
    if len(t) > cfg.batch_tokens:
        keep = torch.randperm(len(t), generator=g)[: cfg.batch_tokens]
        t, feature = t[keep], feature[keep]
    return t, feature


# --- held-out accuracy ---------------------------------------------------------------------------


@torch.no_grad()
def head_accuracy(heads: DraftHeads, corpus: Corpus, topk: tuple[int, ...] = (1, 5), batch: int = 4096) -> list[dict[str, float]]:
    """Per head: how often the base model's greedy token at t+2+i is in the head's top-k.

    Head i reads the true path tokens[t..t+i] (the top-1 path of a tree when the earlier heads
    were right). The target is the argmax of the base model's full distribution, so a token
    outside the draft vocabulary counts as a miss.
    """
    flat = Flat.of(corpus)
    lm = _lm_head_of(heads)
    hits = [[0] * len(topk) for _ in range(heads.num_heads)]
    counts = [0] * heads.num_heads
    heads.eval()
    features = flat.hidden
    if getattr(heads, "arch", "mlp") == "prefix-mlp":
        if len(corpus.prompt_hidden) != len(corpus):
            raise TrainError("prefix-mlp heads need the held-out prompts' hidden states (build it with arch prefix-mlp)")
        features = torch.cat([_answer_features(heads, flat, corpus.prompt_hidden, a).float() for a in range(len(corpus))])
    for s in range(0, len(flat.anchors), batch):
        t = flat.anchors[s : s + batch]
        feature = features[t].to(lm.weight.dtype)
        for i in range(heads.num_heads):
            ok = flat.remaining[t] >= i + 1
            ti = t[ok]
            if not len(ti):
                continue
            target = lm(flat.hidden[ti + 1 + i].to(lm.weight.dtype)).argmax(-1)  # (b,) full-vocab greedy
            path = flat.tokens[ti[:, None] + torch.arange(i + 1)]
            logits = heads.head_logits(i, feature[ok], path)
            top = heads.to_token_ids(torch.topk(logits, max(topk), -1).indices)  # (b, k)
            for j, k in enumerate(topk):
                hits[i][j] += int((top[:, :k] == target[:, None]).any(-1).sum())
            counts[i] += len(ti)
    return [
        {**{f"top{k}": round(hits[i][j] / max(1, counts[i]), 4) for j, k in enumerate(topk)}, "n": counts[i]}
        for i in range(heads.num_heads)
    ]


def _lm_head_of(heads: DraftHeads):
    return heads._base["lm_head"]


def _sample(corpus: Corpus, n: int, seed: int) -> Corpus:
    """`n` answers of `corpus` drawn with `seed`, among its generated ones ("self") when it has any."""
    g = torch.Generator().manual_seed(seed)
    keep = [i for i, src in enumerate(corpus.sources) if src == "self"] or list(range(len(corpus)))
    chosen = sorted(keep[int(j)] for j in torch.randperm(len(keep), generator=g)[:n])
    out = Corpus()
    for i in chosen:
        out.extend(Corpus([corpus.hidden[i]], [corpus.tokens[i]], [corpus.prompts[i]], [corpus.tasks[i]], [corpus.sources[i]],
                          corpus.prompt_hidden[i : i + 1]))
    return out


def vocab_coverage(vocab: torch.Tensor, corpus: Corpus) -> float:
    """Share of the corpus' answer tokens inside the draft vocabulary."""
    return round(float(torch.isin(torch.cat(corpus.tokens), vocab).float().mean()), 4)


# --- the whole run -------------------------------------------------------------------------------


def train_and_save(
    model,
    encode: Encode,
    encode_answer: Encode,
    eos: set[int],
    pad: int,
    cfg: TrainConfig,
    kinds: list[str],
    out_dirs: dict[str, Path],
    work: Path,
    resume: bool = True,
    provenance: dict[str, Any] | None = None,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
    answers: AnswerStore | list[AnswerStore] | None = None,
    corpus_only: bool = False,
) -> dict[str, dict[str, Any]]:
    """Corpus -> draft vocabulary -> train each kind -> held-out accuracy -> save (bfloat16).

    Returns per kind the provenance written to its heads.json; with `corpus_only`, builds the
    corpora (and stores new answers) and returns {"corpus": their description}.
    """
    torch.manual_seed(cfg.seed)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    heldout = build_corpus(model, encode, encode_answer, eos, pad, cfg, work, "calib", progress, answers)
    corpus = build_corpus(model, encode, encode_answer, eos, pad, cfg, work, "train", progress, answers)
    corpus_s = time.perf_counter() - t0
    if corpus_only:
        return {"corpus": {"train": corpus.describe(), "heldout_calib": heldout.describe(), "seconds": round(corpus_s, 1)}}
    lm = _lm_head(model)
    flat = Flat.of(corpus)
    results = {}
    fresh_vocab = None  # chosen once from the corpus, for every kind that needs it
    for kind in kinds:
        torch.manual_seed(cfg.seed)
        # fine-tune shipped heads: their weights and (unless new_vocab) draft vocabulary
        heads = initial_heads(kind, cfg, model) if cfg.init else new_heads(kind, cfg, model).bind(model)
        if cfg.init and not cfg.new_vocab:
            vocab = heads.draft_vocab.cpu()
        else:
            if fresh_vocab is None:
                fresh_vocab = draft_vocab(corpus, cfg.draft_vocab, lm.weight.shape[0],
                                          [encode(prompt_of(p)) for p in dict.fromkeys(corpus.prompts)])
            vocab = fresh_vocab
            heads.set_draft_vocab(vocab)
        flat.add_teacher(lm.weight.detach().index_select(0, vocab.to(lm.weight.device)).cpu(), cfg.teacher_topk, cfg.temperature)
        stats = train_heads(heads, flat, cfg, work / f"{kind}.ckpt", resume, progress, log,
                            prompt_hidden=corpus.prompt_hidden if kind == "hydra" else None)
        heads.to(torch.bfloat16).bind(model)  # measure what ships: bf16 weights, cast back on bind()
        acc = head_accuracy(heads, heldout)
        seen = head_accuracy(heads, _sample(corpus, len(heldout), cfg.seed))  # the same measure on training answers
        prov = {
            **(provenance or {}),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "recipe": "self-distillation: heads learn the frozen base model's distribution "
            + ("(soft, teacher top-k)" if cfg.soft_targets else "(argmax)")
            + " over a draft vocabulary",
            "corpus": {"train": corpus.describe(), "heldout_calib": heldout.describe(), "seconds": round(corpus_s, 1)},
            "draft_vocab": {"size": int(vocab.numel()), "coverage_train": vocab_coverage(vocab, corpus),
                            "coverage_heldout": vocab_coverage(vocab, heldout)},
            "train_config": asdict(cfg),
            **({"init": {"from": str(cfg.init), "sha256": heads.provenance.get("sha256", "")}} if cfg.init else {}),
            "training": stats,
            "heldout": {"split": "calib (self-generated answers)", "per_head": acc},
            "train_sample": {"answers": len(heldout), "per_head": seen},  # beside heldout: the generalisation gap
            "weights_dtype": "bfloat16",
            "torch_threads": torch.get_num_threads(),
        }
        save_heads(heads.to(torch.bfloat16), out_dirs[kind], prov)
        results[kind] = prov
        if log is not None:
            log({"kind": kind, "heldout": acc, "seconds": stats["seconds"]})
    return results
