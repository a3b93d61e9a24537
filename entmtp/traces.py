"""Acceptance traces: the machine-independent half of a bank, and exact decode simulation on them.

At temperature 0 the output does not depend on the tree, and a Hydra/Medusa head's draft at a
position depends only on the base model's state there and the tokens along the path. So for a
greedy continuation c[0..N-1] of a prompt, step position i (c[:i] committed, root c[i], feature h
at the last committed token) is described by

    ranks[i][d]  rank of the true token c[i+d+1] under head d, given h and the true path c[i..i+d]
                 (-1: not among the first `width`, outside the draft vocabulary, or past the end)
    p0[i]        the base model's top-1 probability at i (its argmax is c[i])
    entropy[i]   the entropy of that distribution
    chain[i][d]  top-1 probability of head d along the heads' own top-1 path (g_D = p0 * prod)

A tree accepts at i the root plus the longest prefix of ranks[i] that is one of its rank paths,
so a whole decode under any tree or policy follows exactly: i -> i + accepted(i). Only the cost
of a step with each tree depends on the machine (entmtp.calibrate measures it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import kv, verify
from .config import Progress
from .heads import DraftHeads
from .policy import FEATURES, path_value
from .topology import Tree

WIDTH = 16  # ranks kept per head; no tree of ours has a node of rank >= 16


@dataclass
class Trace:
    """One calibration prompt's continuation, position by position (see the module docstring)."""

    prompt_tokens: int
    ranks: list[list[int]]  # (N, D)
    p0: list[float]  # (N,)
    entropy: list[float]  # (N,)
    chain: list[list[float]]  # (N, D)

    def __len__(self) -> int:
        return len(self.p0)

    def feature(self, name: str, depth: int) -> list[float]:
        """The policy's input at every position; each lies in [0, 1], larger = more confident."""
        if name == "p0":
            return list(self.p0)
        if name == "neg_entropy":
            return [math.exp(-h) for h in self.entropy]
        if name == "path_value":
            return [path_value(p, c[:depth]) for p, c in zip(self.p0, self.chain)]  # the engine's arithmetic, factor by factor
        raise ValueError(f"unknown feature {name!r} (expected one of {', '.join(FEATURES)})")

    def rank_path(self, i: int) -> tuple[int, ...]:
        out = []
        for r in self.ranks[i]:
            if r < 0:
                break
            out.append(r)
        return tuple(out)

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "ranks": self.ranks,
            "p0": [round(x, 7) for x in self.p0],
            "entropy": [round(x, 6) for x in self.entropy],
            "chain": [[round(x, 6) for x in row] for row in self.chain],
        }

    @classmethod
    def from_json(cls, raw: dict) -> "Trace":
        return cls(int(raw["prompt_tokens"]), [list(map(int, r)) for r in raw["ranks"]], list(map(float, raw["p0"])),
                   list(map(float, raw["entropy"])), [list(map(float, r)) for r in raw["chain"]])


# -- recording -------------------------------------------------------------------------------------


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


@torch.inference_mode()
def record(engine, heads: DraftHeads, prompt: list[int], continuation: list[int], depth: int, width: int = WIDTH) -> Trace:
    """The trace of `continuation` (the greedy output for `prompt`), for heads 0..depth-1.

    One teacher-forced forward gives the base states at every position; each head then runs once,
    batched over the positions.
    """
    model, device = engine.model, engine.device
    n = len(continuation)
    seq = torch.tensor([prompt + continuation[:-1]], device=device)  # the last token is never a feature
    # the prompt in one forward, as the engine reads it; then the continuation in blocks no larger
    # than a step may verify, so each token gets the arithmetic it gets when decoded (quant.block_limit)
    L, cache, block = len(prompt), engine.new_cache(), engine.max_block or seq.shape[1]
    outs = [verify.forward(model, cache, seq[:, a:b], torch.arange(a, b, device=device)[None], None)
            for a, b in [(0, L)] + [(i, min(i + block, seq.shape[1])) for i in range(L, seq.shape[1], block)]]
    hidden, logits = torch.cat([h for h, _ in outs]), torch.cat([z for _, z in outs])
    feats = head_features(heads, hidden)[L - 1 :]  # (N, H): feature at the last committed token of each step
    logp = torch.log_softmax(logits[L - 1 :].float(), -1)  # (N, V)
    probs = logp.exp()
    p0 = probs.max(-1).values
    entropy = torch.nan_to_num(-(probs * logp).sum(-1))

    cont = torch.tensor(continuation, device=device)
    inverse = _draft_index(heads, model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size)
    ranks = torch.full((n, depth), -1, dtype=torch.long)
    chain = torch.zeros((n, depth))
    top_path = cont[:, None]  # (N, 1): roots; the heads' own top-1 chain grows from here
    for d in range(depth):
        rows = torch.arange(max(0, n - d - 1), device=device)  # positions whose target c[i+d+1] exists
        if len(rows):
            paths = torch.stack([cont[rows + j] for j in range(d + 1)], dim=1)  # (R, d+1) true path
            z = heads.head_logits(d, feats[rows], paths).float()  # (R, K)
            target = inverse[cont[rows + d + 1]]  # (R,) index in the draft vocabulary, -1 if absent
            tz = z.gather(1, target.clamp(min=0)[:, None])
            r = (z > tz).sum(-1)
            ranks[: len(rows), d] = torch.where((target >= 0) & (r < width), r, torch.full_like(r, -1)).cpu()
        z = heads.head_logits(d, feats, top_path).float()  # (N, K) along the heads' own chain
        p, idx = torch.softmax(z, -1).max(-1)
        chain[:, d] = p.cpu()
        top_path = torch.cat([top_path, heads.to_token_ids(idx)[:, None]], dim=1)
    return Trace(L, ranks.tolist(), p0.tolist(), entropy.tolist(), chain.tolist())


def _draft_index(heads: DraftHeads, vocab: int) -> torch.Tensor:
    """(V,) token id -> index in the heads' draft vocabulary, -1 where absent."""
    dv = heads.draft_vocab
    if not dv.numel():
        return torch.arange(vocab, device=dv.device)
    inv = torch.full((vocab,), -1, dtype=torch.long, device=dv.device)
    inv[dv] = torch.arange(len(dv), device=dv.device)
    return inv


def greedy(engine, heads: DraftHeads, prompt: list[int], new_tokens: int) -> list[int]:
    """The base model's greedy continuation, through the engine with a small tree (faster than `ar`)."""
    from .bank import TopologyBank
    from .config import GenerationConfig
    from .engine import Strategy, collect
    from .policy import StaticPolicy
    from .topology import compile_tree

    strategy = Strategy("rollout", TopologyBank.of(compile_tree([[0], [1], [0, 0], [0, 0, 0]], "rollout")),
                        StaticPolicy(0), heads)
    return list(collect(engine.generate(prompt, strategy, GenerationConfig(max_new_tokens=new_tokens))).token_ids)


def stored_greedy(engine, heads: DraftHeads, prompt: list[int], new_tokens: int, answers=None, task: str = "calib") -> list[int]:
    """`greedy`, read from `answers` (an entmtp.answers.AnswerStore) when it holds the prompt, else
    decoded and added to it."""
    cont = answers.get(prompt, new_tokens) if answers is not None else None
    if cont is None:
        cont = greedy(engine, heads, prompt, new_tokens)
        if answers is not None:
            answers.add(task, "greedy", [prompt], [cont], new_tokens)
    return cont


def decode_with(tree: Tree, trace: Trace) -> tuple[int, int]:
    """(tokens, steps) of a decode with one static tree along `trace`."""
    have = set(tree.paths)
    n, i, tokens, steps = len(trace), 0, 0, 0
    while i < n:
        a = min(accepted_in(have, trace.rank_path(i)), n - i)
        tokens, steps, i = tokens + a, steps + 1, i + a
    return tokens, steps


def record_all(engine, heads: DraftHeads, prompts: list[list[int]], new_tokens: int, depth: int,
               done: list[dict] | None = None, save: Callable[[list[dict]], None] | None = None,
               progress: Progress | None = None, answers=None) -> list[Trace]:
    """Greedy continuations (from `answers`, an entmtp.answers.AnswerStore, or through the engine
    with a small tree for speed, then stored) and their traces; resumable."""
    out = list(done or [])
    it = range(len(prompts))
    for i in (progress(it, "traces", len(prompts)) if progress else it):
        if i < len(out):
            continue  # resumed
        cont = stored_greedy(engine, heads, prompts[i], new_tokens, answers)
        out.append(record(engine, heads, prompts[i], cont, depth).to_json())
        if save:
            save(out)
    return [Trace.from_json(t) for t in out]


# -- simulation -------------------------------------------------------------------------------------


@dataclass
class Tables:
    """Per tree and trace: tokens accepted at every position; features per trace."""

    trees: list[Tree]
    traces: list[Trace]
    accepted: list[list[list[int]]] = field(default_factory=list)  # [tree][trace][i]

    def __post_init__(self):
        paths = [[t.rank_path(i) for i in range(len(t))] for t in self.traces]
        for tree in self.trees:
            have = set(tree.paths)
            self.accepted.append([[accepted_in(have, p) for p in tp] for tp in paths])


def accepted_in(tree_paths: set, path: tuple[int, ...]) -> int:
    """Tokens a tree accepts at a position whose true rank path is `path` (root included)."""
    k = 0
    while k < len(path) and path[: k + 1] in tree_paths:
        k += 1
    return k + 1


@dataclass
class Outcome:
    tokens: int
    steps: int
    ms: float  # steps' cost plus prefill
    picks: list[int]  # tree index of every step, all traces in order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, self.ms) * 1e3

    @property
    def mean_accepted(self) -> float:
        return self.tokens / max(1, self.steps)


def simulate(tables: Tables, choose_factory: Callable[[], Callable[[float], int]], features: list[list[float]],
             step_ms: Sequence[float], prefill_ms_per_token: float = 0.0) -> Outcome:
    """Decode every trace under a policy: at i pick a tree from features[trace][i], jump by its acceptance."""
    tokens = steps = 0
    ms = 0.0
    picks: list[int] = []
    for j, trace in enumerate(tables.traces):
        choose, n, i = choose_factory(), len(trace), 0
        ms += prefill_ms_per_token * trace.prompt_tokens
        while i < n:
            k = choose(features[j][i])
            a = min(tables.accepted[k][j][i], n - i)
            picks.append(k)
            tokens, steps, ms, i = tokens + a, steps + 1, ms + step_ms[k], i + a
    return Outcome(tokens, steps, ms, picks)


def foresight(tables: Tables, step_ms: Sequence[float], prefill_ms_per_token: float = 0.0,
              among: Sequence[int] | None = None) -> Outcome:
    """The fastest decode of every trace that any per-step choice among the tables' trees (or the
    trees `among`) allows: a policy that knew each step's accepted length before choosing.
    Backwards over positions, best[i] = min over trees k of step_ms[k] + best[i + accepted(k, i)];
    a ceiling on every policy over those trees, not a policy."""
    among = list(range(len(tables.trees))) if among is None else list(among)
    tokens, ms = 0, 0.0
    picks: list[int] = []
    for j, trace in enumerate(tables.traces):
        n = len(trace)
        after = lambda k, i: min(n, i + tables.accepted[k][j][i])  # noqa: E731  (position after tree k's step at i)
        best, choice = [0.0] * (n + 1), [0] * n
        for i in range(n - 1, -1, -1):  # the first of `among` on a tie
            best[i], choice[i] = min(((step_ms[k] + best[after(k, i)], k) for k in among), key=lambda c: c[0])
        ms += prefill_ms_per_token * trace.prompt_tokens + best[0]
        i = 0
        while i < n:
            picks.append(choice[i])
            i = after(choice[i], i)
        tokens += n
    return Outcome(tokens, len(picks), ms, picks)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Rank correlation (average ranks for ties)."""

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(x) < 2:
        return 0.0
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else 0.0
