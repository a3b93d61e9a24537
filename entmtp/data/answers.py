"""Stored greedy answers of the base model, by prompt: what is dear to generate, kept to reuse.

Generating answers is the dearest part of a training corpus or a bank's traces (about 100 answer
tokens/s in batches on a 2-core CPU, ~12 tokens/s one prompt at a time); reading a stored answer
back teacher-forced costs one forward. The default model's answers to training and calibration
prompts are kept in the repository (`data/answers/<model>.jsonl.gz`); evaluation continuations
only in the user cache (entmtp.evalheads), so training can never meet them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Callable

from entmtp.config import DEFAULT_MODEL, ROOT

ANSWERS_DIR = ROOT / "data" / "answers"
ANSWER_CAPS = (128, 160)  # answer lengths the store keys: bank and eval continuations, training answers


def repo_store(model: str, arithmetic: str = "") -> "AnswerStore | None":
    """The repository's store for the default model; None for other models. `arithmetic` ("" for
    float32, "+q8" for Q8 inputs: `Runtime.arithmetic`) keys the answers apart, since greedy
    answers part between the two after a few dozen tokens."""
    return AnswerStore(ANSWERS_DIR / f"{DEFAULT_MODEL}.jsonl.gz", model + arithmetic) if model == DEFAULT_MODEL else None


class AnswerStore:
    """The base model's greedy answers as token ids, by prompt, in one gzip JSONL file.

    A line is `{"key", "task", "source", "tokens"}`;
    the key hashes the model's name, the prompt's token ids and the answer length cap. Each batch
    appends one gzip member, so an interrupted run loses at most the batch in flight.
    """

    def __init__(self, path: Path | None, model: str):
        self.path, self.model = path, model
        self.rows: dict[str, dict] = {}
        if path is not None and path.exists():
            try:
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    for line in f:
                        if line.strip():
                            row = json.loads(line)
                            self.rows[row["key"]] = row
            except (EOFError, OSError, json.JSONDecodeError):  # a member cut by an interruption
                self._rewrite()  # keep the answers before the cut, so later appends stay readable

    @property
    def answers(self) -> dict[str, list[int]]:
        return {k: r["tokens"] for k, r in self.rows.items()}

    def key(self, prompt: list[int], answer_tokens: int) -> str:
        text = f"{self.model}|{answer_tokens}|" + ",".join(map(str, prompt))
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def get(self, prompt: list[int], answer_tokens: int) -> list[int] | None:
        row = self.rows.get(self.key(prompt, answer_tokens))
        return None if row is None else list(row["tokens"])

    def add(self, task: str, source: str, prompts: list[list[int]], answers: list[list[int]], answer_tokens: int) -> None:
        new = []
        for p, a in zip(prompts, answers):
            k = self.key(p, answer_tokens)
            if k not in self.rows:
                self.rows[k] = {"key": k, "task": task, "source": source, "tokens": list(a)}
                new.append(self.rows[k])
        if new and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(self.path, "at", encoding="utf-8") as f:
                f.write(_lines(new))

    def drop(self, keys: set[str]) -> int:
        """Forget the answers under `keys` (the file rewritten); -> how many there were."""
        gone = [k for k in self.rows if k in keys]
        for k in gone:
            del self.rows[k]
        if gone and self.path is not None:
            self._rewrite()
        return len(gone)

    def compact(self) -> None:
        """Rewrite the file as one gzip member (appends add one each), the rows in the same order."""
        if self.path is not None and self.path.exists():
            self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            f.write(_lines(self.rows.values()))
        tmp.replace(self.path)


def _lines(rows) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


def corpus_path(model: str) -> Path:
    """`grow-answers`' store: the served model's answers to training prompts, batched (keys "+q8")."""
    return ANSWERS_DIR / f"{model}-corpus.jsonl.gz"


def training_answers(model: str, encode_all: Callable[[list[str]], list[list[int]]]) -> list[list[int]]:
    """The repository's stored answers of `model` to training prompts only ([] for other models).
    `encode_all`: prompts to their token ids (`Runtime.encode_all`). The first store only: adding
    `grow-answers`' corpus (twice the tokens) moved no evaluation set's acceptance by more than 0.6%
    (docs/heads.md, *The phrasebook*), for twice the memory and build time.

    Left out: the banks' calibration continuations (source "greedy") and every answer whose key is
    that of a calibration or evaluation prompt (any task, the everyday requests included), under
    either arithmetic and any answer cap the project uses. So a draft source built on them (the
    phrasebook) has never seen a prompt it is fitted or measured on."""
    store = repo_store(model)
    if store is None:
        return []
    held = held_out_keys(model, encode_all)
    return [r["tokens"] for k, r in store.rows.items() if r["source"] != "greedy" and k not in held]


def held_out_keys(model: str, encode_all: Callable[[list[str]], list[list[int]]]) -> set[str]:
    """The store keys of every calibration and evaluation prompt (any task, the everyday requests
    included), under either arithmetic and any answer cap the project uses."""
    from entmtp.config import EVAL_SETS, TASKS
    from entmtp.data import everyday
    from entmtp.data.prompts import eval_set, prompts

    texts = [p for t in TASKS for p in prompts(t, "calib")] + everyday.prompts("calib")
    texts += [it["prompt"] for name in EVAL_SETS for it in eval_set(name)]
    ids = encode_all(texts)
    return {AnswerStore(None, model + arithmetic).key(p, cap) for p in ids for arithmetic in ("", "+q8") for cap in ANSWER_CAPS}
