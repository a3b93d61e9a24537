"""Prefill and the one decode loop. Every engine method is a `Strategy` of this loop.

Per step (one base forward): schedule (feature s, policy) -> draft (expand the tree with the
heads) -> verify (tree forward) -> accept (greedy or lossless sampling) -> commit KV.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from entmtp.config import GenerationConfig, PhrasebookRule
from entmtp.model import forward, graphs, kernels, kv
from entmtp.model.gguf import q8_inputs
from entmtp.spec import drafting, verify
from entmtp.spec.heads import DraftHeads
from entmtp.spec.phrasebook import Phrasebook, Rule, forcer
from entmtp.spec.policy import Policy, confidence, feature_value, path_value
from entmtp.spec.topology import Tree, chain_paths, compile_tree

PHASES = ("schedule", "draft", "verify", "accept", "kv")


class GenerationError(ValueError):
    """A request the engine refuses: empty or over-long prompt, bad budget or temperature."""


@dataclass(frozen=True)
class Strategy:
    """A configuration of the decode loop: which trees, which policy picks one (by index into
    `trees`), which heads. A bank's trees are `bank.trees`; any sequence of trees is taken."""

    name: str
    trees: tuple[Tree, ...]
    policy: Policy
    heads: DraftHeads | None = None
    book: Phrasebook | None = None  # a phrasebook's guesses go first on the drafted spine where `rule` says
    rule: Rule = PhrasebookRule()
    # `bank.refit.Session`: asked each step whether a refit at the live costs changed the policy
    # (`look`) and whether to time another tree this step (`probe`); None: the policy as given
    serving: Any = None

    def __post_init__(self):
        object.__setattr__(self, "trees", tuple(self.trees))
        if not self.trees:
            raise ValueError(f"{self.name}: no tree to decode with")
        depth = self.max_depth
        if depth and self.heads is None:
            raise ValueError(f"{self.name}: trees of depth {depth} need draft heads")
        if self.heads is not None and depth > self.heads.num_heads:
            raise ValueError(f"{self.name}: a tree of depth {depth} needs {depth} heads, the heads have {self.heads.num_heads}")

    @property
    def max_depth(self) -> int:
        return max(t.max_depth for t in self.trees)


@dataclass
class StepRecord:
    """What one decode step did; the CLI, benchmark and app all format these."""

    step: int
    tokens: list[int]  # emitted this step (accepted path, root first), truncated at EOS/budget
    tree: str
    tree_index: int
    tree_nodes: int
    s: float
    entropy: float
    path_value: float  # value of the heads' top-1 path through the chosen tree's depth (g_D)
    feature: float  # the value the policy read (p0; g_d through the heads it ran, up to its depth, stopping at the first that settles the choice; exp(-entropy))
    accepted: int  # tokens emitted this step
    accepted_nodes: list[int]  # node ids of the accepted path in the tree
    draft_tokens: list[int]  # candidate token per tree node, root first
    ms: dict[str, float]  # wall time of each phase
    step_ms: float
    elapsed_s: float  # own clock since the request started, prefill included
    prefill_ms: float
    finished: bool = False
    stop_reason: str = ""
    heads_read: int = 0  # heads behind `feature` where it is the path value (fewer than the policy's depth where they settled the choice)
    tree_depth: int = 0  # the tree's depth: heads read beyond it for the feature cost the step more (`bank.live`)
    probe: bool = False  # the tree was timed for the live costs, not picked by the policy (`bank.refit`)
    refit: dict[str, Any] | None = None  # a refit at the live costs before this step (when, why, old and new policy)

    def trace(self) -> dict[str, Any]:
        """The per-step entry of the CLI's `--json` trace (features are null for `hf` methods)."""
        return {
            "s": None if math.isnan(self.s) else round(self.s, 5),
            "entropy": None if math.isnan(self.entropy) else round(self.entropy, 4),
            "tree": self.tree,
            "tree_nodes": self.tree_nodes,
            "accepted": self.accepted,
            "ms": round(self.step_ms, 3),
            "phase_ms": {k: round(v, 3) for k, v in self.ms.items()},
            **({"probe": True} if self.probe else {}),
            **({"refit": self.refit} if self.refit else {}),
        }


class Engine:
    """A base causal LM plus the decode loop. Sees token ids and tensors only."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int] | tuple[int, ...] = (), cuda_graphs: bool = True,
                 compiled: bool = False):
        self.model = model.eval()
        self.eos = set(int(t) for t in eos_token_ids)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.device = model.get_output_embeddings().weight.device
        self._warm: set[int] = set()
        self.warmup_ms: dict[int, float] = {}  # tree size -> ms its first forward shapes took (`warmup`)
        self.q8 = q8_inputs(model)  # the served arithmetic: Q8 inputs (every call) or float32
        # CUDA graphs for tree verification (compiled: their layers through torch.compile), or None (eager)
        self.graphs = graphs.Graphs.of(model, cuda_graphs, compiled)
        # with them, the heads' chain and expansion replay as one graph per tree too
        self.drafts = drafting.DraftGraphs(self.graphs.capture) if self.graphs is not None else None

    def new_cache(self):
        return kv.new_cache(self.model.config)

    def _request_cache(self, need: int):
        """A decode's cache: a CUDA-graph slot with room for `need` entries where graphs apply
        (and one is free), else the buffered dynamic cache."""
        cache = self.graphs.cache(min(need, self.max_positions)) if self.graphs is not None else None
        return cache if cache is not None else self.new_cache()

    @torch.inference_mode()
    def warmup(self, sizes: list[int], context: int = 64) -> None:
        """Run each forward shape once (bf16 kernels are built on first use; with CUDA graphs each
        size's graph is captured), outside any clock; the time each size took is kept in `warmup_ms`."""
        for n in sorted(set(sizes) - self._warm):
            t0 = time.perf_counter()
            lanes = 2 if self.graphs is not None else 1  # the app races two decodes: two graph slots
            caches = [self._request_cache(context + n) for _ in range(lanes)]
            for cache in caches:
                ids = torch.zeros(1, context, dtype=torch.long, device=self.device)
                forward.forward(self.model, cache, ids, torch.arange(context, device=self.device)[None], None)
                tokens = torch.zeros(n, dtype=torch.long, device=self.device)
                verify.tree_forward(self.model, cache, _chain_tree(n), tokens, context)
                forward.prepare(cache, n)  # every span up to the capacity, so that no request captures
            del caches
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.warmup_ms[n] = round((time.perf_counter() - t0) * 1e3, 1)
            self._warm.add(n)

    @torch.inference_mode()
    def warmup_drafts(self, heads: DraftHeads | None, trees) -> None:
        """Capture the heads' draft graphs for `trees` and their chains to every depth (CUDA graphs
        only), outside any clock; the time each took is in `drafts.capture_ms`."""
        if self.drafts is None or heads is None:
            return
        dtype = self.model.get_output_embeddings().weight.dtype
        feature = torch.zeros(heads.hidden_size, dtype=dtype, device=self.device)
        for tree in trees:
            if tree.n_nodes > 1 and tree.max_depth <= heads.num_heads:
                self.drafts.draft(heads, tree, feature, 0)
        for d in range(1, max((t.max_depth for t in trees), default=0) + 1):
            self.drafts.top1_chain(heads, feature, 0, d)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, prompt_ids: list[int], strategy: Strategy, gen: GenerationConfig = GenerationConfig()) -> Iterator[StepRecord]:
        """Decode from `prompt_ids`: one record per step until EOS or the budget. Checks eagerly."""
        self.validate_request(prompt_ids, gen)
        return self._decode(list(prompt_ids), strategy, gen)

    def validate_request(self, prompt_ids: list[int], gen: GenerationConfig) -> None:
        """Refuse a request up front, with a message naming the bad value."""
        if not prompt_ids:
            raise GenerationError("the prompt is empty")
        if gen.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be positive, got {gen.max_new_tokens}")
        if gen.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {gen.temperature}")
        if len(prompt_ids) >= self.max_positions:
            raise GenerationError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_positions}")

    @torch.inference_mode()
    def _decode(self, prompt_ids: list[int], strategy: Strategy, gen: GenerationConfig) -> Iterator[StepRecord]:
        model, device, trees, heads = self.model, self.device, strategy.trees, strategy.heads
        sampling = gen.temperature > 0
        rng = torch.Generator().manual_seed(gen.seed)
        serving = strategy.serving
        choose, settled, settle_at, outcomes, feature_name, feature_depth = _bind(strategy.policy, strategy.max_depth)
        ctx = heads.new_context() if heads is not None else None
        text = strategy.book.context(prompt_ids) if strategy.book is not None and heads is not None else None
        force = forcer(text, strategy.rule, heads.draft_vocab) if text is not None else None
        cache = self._request_cache(len(prompt_ids) + gen.max_new_tokens + max(t.n_nodes for t in trees) + 1)

        clock = _clock(device)  # on CUDA each reading waits for the queued kernels
        t_start = clock()
        ids = torch.tensor([prompt_ids], device=device)
        hidden, logits = forward.forward(model, cache, ids, torch.arange(len(prompt_ids), device=device)[None], None, last_only=True)
        z = logits[-1]  # (V,) base logits at the last accepted position
        feature = ctx.observe(hidden) if ctx is not None else None
        root = verify.sample(torch.softmax(z.float() / gen.temperature, -1).cpu(), rng) if sampling else int(kernels.argmax_rows(z[None])[0])
        past = len(prompt_ids)
        prefill_ms = (clock() - t_start) * 1e3
        produced, step = 0, 0

        # on CUDA with graphs the heads' chain and expansion replay as one graph per tree
        drafts = self.drafts if heads is not None and force is None else None  # a phrasebook's spine is decided on the host
        smallest = min(range(len(trees)), key=lambda i: trees[i].n_nodes)
        while True:
            t0 = clock()
            refit = None
            if serving is not None:  # the live costs departed from the fit: a refit may change the policy from here on
                policy, refit = serving.look(step + 1)
                if policy is not None:
                    choose, settled, settle_at, outcomes, feature_name, feature_depth = _bind(policy, strategy.max_depth)
            # now and then a tree not run lately is timed instead of the policy's pick, as `calibrate`
            # times a tree: no feature read, the heads to its own depth (the policy's state stays)
            probe = serving.probe(step + 1) if serving is not None else None
            # schedule: the policy's feature (p0, the heads' path value g_d through the policy's
            # depth, or exp(-entropy)), its tree, and the heads' top-1 path to the depth the tree needs
            s, entropy = confidence(z)
            chain, chain_probs = [], []
            chained = None  # the chain read so far (`drafting.Chain`), which a deeper read resumes
            if feature_name == "path_value" and heads is not None and probe is None:
                if drafts is not None:  # one graph runs every head; the policy reads them as the eager loop does
                    chain, chain_probs = chained = drafts.top1_chain(heads, feature, root, feature_depth)
                else:  # in one call, up to the first head whose value settles the choice (each deeper g is at most it),
                    # then on to the depth of the tree that value picks
                    settle = (s, *settle_at()) if settle_at is not None else None
                    then = tuple(-1 if i is None else trees[i].max_depth for i in outcomes()) if outcomes is not None else (-1, -1)
                    chain, chain_probs = chained = drafting.top1_chain(heads, feature, root, feature_depth, None, force, settle, then)
            heads_read = min(len(chain_probs), feature_depth)
            if settled is not None:
                heads_read = next((d for d in range(1, heads_read + 1) if settled(path_value(s, chain_probs[:d]))), heads_read)
            feat = feature_value(feature_name, s, entropy, path_value(s, chain_probs[:heads_read]))
            idx = choose(feat) if probe is None else probe
            if past + trees[idx].n_nodes > self.max_positions:
                idx = smallest  # near the context end fall back to the smallest tree
            tree = trees[idx]
            depth = tree.max_depth if heads is not None else 0
            captured = drafts is not None and tree.n_nodes > 1
            if not captured:
                if len(chain) < depth:
                    chain, chain_probs = chained = drafting.top1_chain(heads, feature, root, depth, chained, force)
                chain, chain_probs = chain[:depth], chain_probs[:depth]
            t1 = clock()
            # draft
            if captured:  # the chain through the tree's depth and its expansion, on the device
                tokens, probs = drafts.draft(heads, tree, feature, root)
            else:
                spine = getattr(chained, "tokens", None)  # its tokens from outside the draft vocabulary go first
                outside = heads.outside(spine[:depth]) if spine and heads is not None else None
                tokens = drafting.expand(tree, heads, feature, root, chain, outside, spine) if tree.n_nodes > 1 else torch.tensor([root], device=device)
            t2 = clock()
            # verify
            hidden, logits = verify.tree_forward(model, cache, tree, tokens, past)
            t3 = clock()
            # accept
            if not sampling:  # drafts and the base argmax in one read from the device
                tok_list, target = torch.stack([tokens, kernels.argmax_rows(logits)]).tolist()
                path, next_root = verify.accept_greedy(tree, tok_list, target)
            elif gen.typical:
                tok_list = tokens.tolist()
                path, next_root = verify.accept_typical(
                    tree, tok_list, logits, gen.temperature, rng, gen.typical_epsilon, gen.typical_alpha
                )
            else:
                tok_list = tokens.tolist()
                path, next_root = verify.accept_sample(tree, tok_list, logits, gen.temperature, rng)
            value = path_value(s, probs.tolist() if captured else chain_probs)
            t4 = clock()
            # commit KV of the accepted path; the next step reads h and z at its last node
            forward.commit(cache, past, path, tree.n_nodes)
            past += len(path)
            z = logits[path[-1]]
            if ctx is not None:
                feature = ctx.observe(hidden[path])
            if text is not None:
                text.extend(tok_list[i] for i in path)
            t5 = clock()

            emitted = [tok_list[i] for i in path]
            reason = ""
            for j, t in enumerate(emitted):
                if t in self.eos:
                    emitted, reason = emitted[: j + 1], "eos"
                    break
            if produced + len(emitted) >= gen.max_new_tokens:
                emitted, reason = emitted[: gen.max_new_tokens - produced], reason or "length"
            if not reason and past + 1 >= self.max_positions:
                reason = "context"
            produced += len(emitted)
            step += 1
            ms = dict(zip(PHASES, ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3, (t5 - t4) * 1e3)))
            yield StepRecord(
                step=step,
                tokens=emitted,
                tree=tree.name,
                tree_index=idx,
                tree_nodes=tree.n_nodes,
                s=s,
                entropy=entropy,
                path_value=value,
                feature=feat,
                accepted=len(emitted),
                accepted_nodes=path[: len(emitted)],
                draft_tokens=tok_list,
                ms=ms,
                step_ms=(t5 - t0) * 1e3,
                elapsed_s=clock() - t_start,
                prefill_ms=prefill_ms,
                finished=bool(reason),
                stop_reason=reason,
                heads_read=heads_read,
                tree_depth=tree.max_depth,
                probe=probe is not None,
                refit=refit,
            )
            if reason:
                return
            root = next_root


def _bind(policy: Policy, max_depth: int):
    """(chooser, settled, settle_at, outcomes, feature, depth) of a policy as the loop reads them: the
    chooser's own tests where it has them (`policy.Chooser`), and the heads a path-value feature reads
    (its own depth, 0: the deepest tree's)."""
    choose = policy.chooser()
    settled = getattr(choose, "settled", None)
    settle_at = getattr(choose, "settle_at", None)  # `settled` as a bound the heads' chain stops at itself
    outcomes = getattr(choose, "outcomes", None)  # the trees it then picks: their depths, which the chain goes on to
    return choose, settled, settle_at, outcomes, policy.feature, min(policy.depth or max_depth, max_depth)


def _chain_tree(n: int) -> Tree:
    """A chain of n nodes (the shape warm-up verifies at each size)."""
    return compile_tree(chain_paths(n - 1), f"chain{n}")


def _clock(device: torch.device):
    """time.perf_counter, synchronised with the device first on CUDA (kernels run asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


@dataclass
class Result:
    """A finished generation, summarised from its step records."""

    token_ids: list[int]
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def elapsed_s(self) -> float:
        return self.steps[-1].elapsed_s if self.steps else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / max(1, len(self.steps))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def phase_ms(self) -> dict[str, float]:
        """Total wall time per phase over the whole generation."""
        out: dict[str, float] = {}
        for r in self.steps:
            for k, v in r.ms.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def json(self, prompt: str, method: str, task: str, text: str) -> dict[str, Any]:
        """One `generate --json` record (DESIGN.md, *Command line*)."""
        return {
            "prompt": prompt,
            "method": method,
            "task": task,
            "text": text,
            "token_ids": self.token_ids,
            "new_tokens": self.new_tokens,
            "steps": len(self.steps),
            "mean_accepted": round(self.mean_accepted, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "elapsed_s": round(self.elapsed_s, 4),
            "phase_ms": {k: round(v, 2) for k, v in self.phase_ms().items()},
            "stop_reason": self.steps[-1].stop_reason if self.steps else "",
            "trace": [r.trace() for r in self.steps],
        }


def collect(records: Iterator[StepRecord]) -> Result:
    res = Result([])
    for r in records:
        res.token_ids.extend(r.tokens)
        res.steps.append(r)
    return res
