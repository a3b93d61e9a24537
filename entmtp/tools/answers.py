"""`grow-answers`: the served model's greedy answers to training prompts not answered yet, batched
on the served kernels (`model.batch.BatchDecoder`), appended to the answer corpus as they finish.

The corpus is a second answer store beside the repository's (`data/answers/<model>-corpus.jsonl.gz`,
the same format and keys, under the served arithmetic): the draft heads train on it; the phrasebook
and the banks' traces read the first store only, so growing the corpus changes no draft until the
banks are retraced on heads trained on it.

Sources, training splits only (each checked against every evaluation set by
`tests/test_everyday.py`):
- `chat/turns`: ShareGPT's later human turns, each in its conversation's context
  (`data.prompts.chat_turns`); a conversation's turns run in one slot, each continuing the cache
  of the turn before.
- `chat/self`: ShareGPT's first human turns; `math/self`: GSM8K's training questions;
  `code/sharegpt`: chat prompts naming Python; `chat/everyday`: the composed everyday requests.

Resumable: a prompt whose answer either store holds is skipped, answers are appended in small
batches (an interruption loses at most the answers in flight), and `--minutes` stops cleanly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from entmtp.config import GrowAnswersConfig
from entmtp.data import everyday
from entmtp.data import prompts as data
from entmtp.data.answers import AnswerStore, repo_store

SOURCES = ("chat/turns", "chat/self", "math/self", "code/sharegpt", "chat/everyday")


class AnswersError(ValueError):
    """A bad source or store."""


def source_prompts(source: str, split: str = "train") -> tuple[list, list[int | None]]:
    """The prompts of one source (a user message, or a conversation for `chat/turns`) and each
    one's parent: the prompt before it that it extends (a conversation's previous turn), or None."""
    if split == "eval":
        raise AnswersError("answers are grown for training and calibration prompts only")
    if source == "chat/turns":
        turns = data.chat_turns(split)
        parents: list[int | None] = [None]
        for k in range(1, len(turns)):
            prev = turns[k - 1]
            parents.append(k - 1 if turns[k][: len(prev)] == prev else None)
        return list(turns), parents[: len(turns)]
    if source in ("chat/self", "math/self", "code/self"):
        texts = data.prompts(source.split("/")[0], split)
    elif source == "code/sharegpt":
        texts = [p for p, _ in data.sharegpt_code_pairs(split)]
    elif source == "chat/everyday":
        texts = everyday.prompts(split)
    else:
        raise AnswersError(f"unknown source {source!r} (expected one of {', '.join(SOURCES)})")
    return texts, [None] * len(texts)


@dataclass
class Plan:
    """What one run answers: token ids, each one's parent among them, source and limit."""

    ids: list[list[int]] = field(default_factory=list)
    parents: list[int | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)


def plan(sources: dict[str, int | None], model: str, encode_all, stores: list[AnswerStore], answer_tokens: int,
         max_prompt_tokens: int, split: str = "train", arithmetics: tuple[str, ...] = ("", "+q8")) -> Plan:
    """Of each source's first `limit` prompts that fit `max_prompt_tokens` (all where None), those no
    store answers yet at `answer_tokens` in either arithmetic of `model` (float32 or Q8 inputs: the
    same prompt's answers part only after a few dozen tokens), in source order: a rerun plans only
    what is missing. A parent is kept where its child's tokens extend its own (the conversation's
    turns may tokenise apart at their seam: the child then prefills whole)."""
    from entmtp.model.batch import extends

    out = Plan()
    keys = [AnswerStore(None, model + a) for a in arithmetics]
    for source, limit in sources.items():
        texts, parents = source_prompts(source, split)
        kept: dict[int, int] = {}  # index in the source -> index in the plan
        long = stored = fitting = 0
        for k, (p, up) in enumerate(zip(_encoded(texts, encode_all), parents)):
            if len(p) > max_prompt_tokens:
                long += 1
                continue
            fitting += 1
            if limit is not None and fitting > limit:
                break
            if any(key.key(p, answer_tokens) in s.rows for s in stores for key in keys):
                stored += 1
                continue
            kept[k] = len(out.ids)
            out.ids.append(p)
            parent = kept.get(up) if up is not None else None
            out.parents.append(parent if parent is not None and extends(p, out.ids[parent]) else None)
            out.sources.append(source)
        out.skipped[source] = {"too_long": long, "stored": stored}
    return out


def _encoded(texts: list, encode_all, chunk: int = 256):
    """Each text's token ids, encoded a chunk at a time as they are read (a limit stops early)."""
    for i in range(0, len(texts), chunk):
        yield from encode_all(texts[i : i + chunk])


def grow(rt, sources: dict[str, int | None], store: AnswerStore, cfg: GrowAnswersConfig = GrowAnswersConfig(),
         minutes: float | None = None, progress: bool = True) -> dict:
    """Answer the planned prompts, appending to `store`; -> a summary (answers, tokens, seconds, per source)."""
    from tqdm import tqdm

    from entmtp.model.batch import BatchDecoder

    answer_tokens = cfg.answer_tokens
    known = [store] + [s for s in (repo_store(rt.name, rt.arithmetic),) if s is not None]
    todo = plan(sources, rt.name, rt.encode_all, known, answer_tokens, cfg.max_prompt_tokens)
    dec = BatchDecoder(rt.model, rt.engine.eos, batch=cfg.batch)
    bar = tqdm(total=len(todo.ids) * answer_tokens, desc=f"grow-answers --batch {cfg.batch}", unit="tok", disable=not progress,
               smoothing=0.05, mininterval=2.0)
    pending: dict[str, list[tuple[list[int], list[int]]]] = {}
    per_source = {s: {"answers": 0, "tokens": 0} for s in sources}

    def flush() -> None:
        for source, rows in pending.items():
            if rows:
                store.add(source.split("/")[0], source.split("/")[1], [p for p, _ in rows], [a for _, a in rows], answer_tokens)
        pending.clear()

    started = time.perf_counter()
    deadline = None if minutes is None else started + 60 * minutes
    n = 0
    stopped = "done"
    try:
        for ans in dec.run(todo.ids, answer_tokens, on_token=bar.update, parents=todo.parents):
            bar.total -= answer_tokens - len(ans.tokens)
            source = todo.sources[ans.index]
            pending.setdefault(source, []).append((todo.ids[ans.index], ans.tokens))
            per_source[source]["answers"] += 1
            per_source[source]["tokens"] += len(ans.tokens)
            n += 1
            if n % cfg.flush_every == 0:
                flush()
            if deadline is not None and time.perf_counter() > deadline:
                stopped = "minutes"
                break
    finally:
        flush()
        bar.close()
    seconds = time.perf_counter() - started
    tokens = sum(v["tokens"] for v in per_source.values())
    return {"answers": n, "tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
            "planned": len(todo.ids), "stopped": stopped, "by_source": per_source, "skipped": todo.skipped,
            "batch": cfg.batch, "answer_tokens": answer_tokens, "max_prompt_tokens": cfg.max_prompt_tokens, "served": rt.arithmetic}


def describe(store: AnswerStore) -> dict:
    """The store's answers and tokens by source, and its size on disk."""
    by: dict[str, dict[str, int]] = {}
    for row in store.rows.values():
        d = by.setdefault(f"{row['task']}/{row['source']}", {"answers": 0, "tokens": 0})
        d["answers"] += 1
        d["tokens"] += len(row["tokens"])
    size = store.path.stat().st_size if store.path is not None and store.path.exists() else 0
    return {"path": str(store.path), "answers": len(store.rows), "tokens": sum(d["tokens"] for d in by.values()), "bytes": size,
            "by_source": dict(sorted(by.items()))}
