"""Recording acceptance traces through the engine: the base model's greedy continuation of a
prompt (decoded, or read from the stored answers), then one teacher-forced pass that ranks every
head's true token at every position (`traces.Trace`)."""

from __future__ import annotations

from typing import Callable

import torch

from entmtp.config import GenerationConfig, PhrasebookRule, Progress
from entmtp.model import forward
from entmtp.spec.engine import Strategy, collect
from entmtp.spec.heads import DraftHeads, head_features
from entmtp.spec.phrasebook import Phrasebook, Rule, force_row, forcer, spine_first
from entmtp.spec.policy import StaticPolicy, confidence_rows
from entmtp.spec.topology import compile_tree
from entmtp.bank.traces import WIDTH, Trace


@torch.inference_mode()
def record(engine, heads: DraftHeads, prompt: list[int], continuation: list[int], depth: int, width: int = WIDTH,
           book: Phrasebook | None = None, rule: Rule = PhrasebookRule()) -> Trace:
    """The trace of `continuation` (the greedy output for `prompt`), for heads 0..depth-1.

    One teacher-forced forward gives the base states at every position; each head then runs once,
    batched over the positions. With a phrasebook, ranks and the chain are those the engine drafts
    with it: at a node of the rank-0 spine its guess may go first (`drafting.top1_chain`), so the
    true path's rank at depth d is the merged one while the path is still on the spine (every
    earlier rank 0), and the chain follows the merged spine, with the probabilities a reranker
    gives its tokens (under the share rule, the head's own).
    """
    model, device = engine.model, engine.device
    n = len(continuation)
    seq = torch.tensor([prompt + continuation[:-1]], device=device)  # the last token is never a feature
    # the prompt in one forward, as the engine reads it, then the continuation in one more: each row
    # computes alone whatever the block (`gguf.q8_inputs`), so each token gets the bits it gets when decoded
    L, cache = len(prompt), engine.new_cache()
    outs = [forward.forward(model, cache, seq[:, a:b], torch.arange(a, b, device=device)[None], None)
            for a, b in ((0, L), (L, seq.shape[1])) if b > a]
    hidden, logits = torch.cat([h for h, _ in outs]), torch.cat([z for _, z in outs])
    feats = head_features(heads, hidden)[L - 1 :]  # (N, H): feature at the last committed token of each step
    p0, entropy = confidence_rows(logits[L - 1 :])  # what the engine reads at each step, the same bits

    cont = torch.tensor(continuation, device=device)
    inverse = draft_index(heads, model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size)
    ranks = torch.full((n, depth), -1, dtype=torch.long)
    chain = torch.zeros((n, depth))
    top_path = cont[:, None]  # (N, 1): roots; the heads' own top-1 chain grows from here
    for d in range(depth):
        rows = torch.arange(max(0, n - d - 1), device=device)  # positions whose target c[i+d+1] exists
        if len(rows):
            paths = torch.stack([cont[rows + j] for j in range(d + 1)], dim=1)  # (R, d+1) true path
            z = heads.head_logits(d, feats[rows], paths).float()  # (R, K)
            outside = torch.full((len(rows),), -1, dtype=torch.long, device=device)
            if book is not None:
                spine = (ranks[: len(rows), :d] == 0).all(1).tolist()  # every earlier rank 0: still on the spine
                z, _, first = _forced(book, rule, heads, prompt, continuation, z, paths.tolist(), spine)
                outside = torch.tensor(first, dtype=torch.long, device=device)
            true = cont[rows + d + 1]
            target = inverse[true]  # (R,) index in the draft vocabulary, -1 if absent
            tz = z.gather(1, target.clamp(min=0)[:, None])
            # a token from outside the vocabulary put first on the spine ranks 0, the row's own after it
            r = (z > tz).sum(-1) + (outside >= 0).long()
            r = torch.where(target >= 0, r, torch.full_like(r, width))
            r = torch.where((outside >= 0) & (true == outside), torch.zeros_like(r), r)
            ranks[: len(rows), d] = torch.where(r < width, r, torch.full_like(r, -1)).cpu()
        z = heads.head_logits(d, feats, top_path).float()  # (N, K) along the heads' own chain
        p, idx = heads.top1(z)
        token = heads.to_token_ids(idx)
        if book is not None:  # the chain goes on through the phrasebook's first; p is the drafter's where it gives one
            forced, q, first = _forced(book, rule, heads, prompt, continuation, z, top_path.tolist(), [True] * n)
            idx = heads.top1(forced)[1]
            first = torch.tensor(first, dtype=torch.long, device=device)
            token = torch.where(first >= 0, first, heads.to_token_ids(idx))
            q = torch.tensor(q, dtype=p.dtype, device=p.device)
            p = torch.where(q >= 0, q, p)
        chain[:, d] = p.cpu()
        top_path = torch.cat([top_path, token[:, None]], dim=1)
    return Trace(L, ranks.tolist(), p0, entropy, chain.tolist())


def _forced(book: Phrasebook, rule: Rule, heads: DraftHeads, prompt: list[int], continuation: list[int],
            z: torch.Tensor, paths: list[list[int]], active: list[bool]) -> tuple[torch.Tensor, list[float], list[int]]:
    """z (R, K), row i the head's logits at position i after `paths[i]` (the root c[i] and the
    path on), with the tokens the rule puts first made first where `active[i]`; per row the
    probability the rule gives the first (-1: none, the head's stands) and the token it puts first
    from outside the draft vocabulary (-1: none; `phrasebook.spine_first`): the text it reads is
    the prompt and c[:i], as the engine's is at that step."""
    text = book.context(prompt)
    force = forcer(text, rule, heads.draft_vocab)
    probs = heads.top1(z)[0].tolist()
    out, held, conf, first = z, 0, [-1.0] * len(active), [-1] * len(active)
    for i, on in enumerate(active):
        if not on:
            continue
        text.extend(continuation[held:i])
        held = i
        forced, conf[i] = force(paths[i], probs[i], z[i])
        if forced:
            out = out.clone() if out is z else out
            out[i] = force_row(z[i], forced)
            first[i] = spine_first(forced)
    return out, conf, first


def draft_index(heads: DraftHeads, vocab: int) -> torch.Tensor:
    """(V,) token id -> index in the heads' draft vocabulary, -1 where absent."""
    dv = heads.draft_vocab
    if not dv.numel():
        return torch.arange(vocab, device=dv.device)
    inv = torch.full((vocab,), -1, dtype=torch.long, device=dv.device)
    inv[dv] = torch.arange(len(dv), device=dv.device)
    return inv


def greedy_continuation(engine, heads: DraftHeads, prompt: list[int], new_tokens: int) -> list[int]:
    """The base model's greedy continuation, through the engine with a small tree (faster than `ar`)."""
    strategy = Strategy("rollout", (compile_tree([[0], [1], [0, 0], [0, 0, 0]], "rollout"),), StaticPolicy(0), heads)
    return list(collect(engine.generate(prompt, strategy, GenerationConfig(max_new_tokens=new_tokens))).token_ids)


def stored_greedy(engine, heads: DraftHeads, prompt: list[int], new_tokens: int, answers=None, task: str = "calib") -> list[int]:
    """`greedy_continuation`, read from `answers` (a `data.answers.AnswerStore`) when it holds the prompt, else
    decoded and added to it."""
    cont = answers.get(prompt, new_tokens) if answers is not None else None
    if cont is None:
        cont = greedy_continuation(engine, heads, prompt, new_tokens)
        if answers is not None:
            answers.add(task, "greedy", [prompt], [cont], new_tokens)
    return cont


def record_all(engine, heads: DraftHeads, prompts: list[list[int]], new_tokens: int, depth: int,
               done: list[dict] | None = None, save: Callable[[list[dict]], None] | None = None,
               progress: Progress | None = None, answers=None, book: Phrasebook | None = None,
               rule: Rule = PhrasebookRule()) -> list[Trace]:
    """Greedy continuations (from `answers`, a `data.answers.AnswerStore`, or through the engine
    with a small tree for speed, then stored) and their traces (drafted with `book` under `rule`
    where given); resumable."""
    out = list(done or [])
    it = range(len(prompts))
    for i in (progress(it, "traces", len(prompts)) if progress else it):
        if i < len(out):
            continue  # resumed
        cont = stored_greedy(engine, heads, prompts[i], new_tokens, answers)
        out.append(record(engine, heads, prompts[i], cont, depth, book=book, rule=rule).to_json())
        if save:
            save(out)
    return [Trace.from_json(t) for t in out]
