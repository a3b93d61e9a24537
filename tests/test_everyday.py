"""Chat's second evaluation set (everyday requests) and the rule that no evaluation prompt is ever
trained or calibrated on, checked against every source: composed instructions, every task's
training and calibration splits, grow-answers' sources, and the repository's stored greedy answers."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from entmtp.config import DEFAULT_MODEL, EVAL_SETS, ROOT, TASKS, BankBuildConfig, TrainConfig
from entmtp.data import everyday
from entmtp.data import prompts as data
from entmtp.data.answers import ANSWERS_DIR, AnswerStore, corpus_path, held_out_keys
from entmtp.bank.build import calibration_prompts
from entmtp.tools import answers
from entmtp.tools.train import corpus_plan


UNSEEN = ROOT / "benchmarks" / "prompts" / "unseen-short.jsonl"  # bench's prompts for the predictions at hand


def _evaluation() -> set[str]:
    return {r["prompt"] for name in EVAL_SETS for r in data.eval_set(name)} | {r["prompt"] for r in data.read_prompt_file(UNSEEN)}


def test_everyday_set_spans_the_kinds_and_keeps_its_licence():
    rows = everyday.eval_rows()
    kinds = Counter(r["kind"] for r in rows)
    assert len(rows) >= 64 and set(kinds) == set(everyday.KINDS) and min(kinds.values()) >= 8
    assert len({r["prompt"] for r in rows}) == len(rows) and all(r["task"] == "chat" for r in rows)
    licence = (everyday.EVAL_FILE.parent / "README.md").read_text()
    assert "CC0" in licence and "never" in licence.lower()
    assert [it["prompt"] for it in data.eval_set("everyday", 5)] == [r["prompt"] for r in rows[:5]]
    with pytest.raises(data.DataError, match="unknown evaluation set"):
        data.eval_set("poems")


def test_composed_instructions_stay_clear_of_every_evaluation_set():
    train, calib = everyday.prompts("train"), everyday.prompts("calib")
    assert len(train) > 800 and len(calib) > 80 and not set(train) & set(calib)
    assert len(set(train)) == len(train)
    banned = everyday.eval_ngrams()
    assert not any(everyday.overlaps(p, banned) for p in train + calib)  # not even a shared 4-word run
    assert not (set(train) | set(calib)) & _evaluation()
    assert everyday.prompts("eval") == [r["prompt"] for r in everyday.eval_rows()]
    # the rule bites: an evaluation prompt reworded by one word still overlaps
    first = everyday.eval_rows()[0]["prompt"]
    assert everyday.overlaps(first.replace("three", "four"), banned)


@pytest.mark.parametrize("split", ["train", "calib"])
def test_no_training_or_calibration_source_holds_an_evaluation_prompt(split):
    """Every source the default plan (and the largest optional plan) reads, and the calibration
    prompts banks trace, by text, against every evaluation set."""
    evaluation = _evaluation()
    cfg = replace(TrainConfig(), sharegpt_code_prompts=10**6, everyday_prompts=10**6, turn_prompts=10**6)
    sources = {(t, s) for t, s, _ in corpus_plan(cfg, split)}
    assert ("chat", "everyday") in sources
    for task, source in sorted(sources):
        if source == "everyday":
            texts = everyday.prompts(split)
        elif source == "sharegpt":
            texts = [p for p, _ in data.sharegpt_code_pairs(split)]
        elif source == "turns":  # every turn of each context
            texts = [m["content"] for conv in data.chat_turns(split) for m in conv]
        else:
            texts = data.prompts(task, split) + [p for p, _ in data.pairs(task, split)]
        assert texts and not set(texts) & evaluation, (task, source)
    for source in answers.SOURCES:  # what grow-answers answers (the heads' corpus): every turn of a conversation
        texts = [m["content"] if isinstance(m, dict) else m for p in answers.source_prompts(source, split)[0]
                 for m in (p if isinstance(p, tuple) else (p,))]
        assert texts and not set(texts) & evaluation, source
    for task in TASKS:  # what build-bank traces (chat: ShareGPT's calib split and composed everyday requests)
        texts, _ = calibration_prompts(task, None, BankBuildConfig().calib_prompts)
        assert len(texts) == BankBuildConfig().calib_prompts and not set(texts) & evaluation
        if task == "chat":
            assert set(texts) & set(everyday.prompts("calib")) and set(texts) & set(data.prompts("chat", "calib"))


def test_stored_answers_hold_no_evaluation_prompt():
    """The repository's greedy answers (training corpora and bank traces read them) are keyed by
    the prompt's token ids: none is the answer to an evaluation prompt, at any stored length."""
    from transformers import AutoTokenizer

    from entmtp.runtime.runtime import Runtime
    from entmtp.runtime.weights import resolve_weights

    tok = AutoTokenizer.from_pretrained(resolve_weights().source)
    encode = lambda text: Runtime.encode(type("R", (), {"tokenizer": tok, "name": DEFAULT_MODEL})(), text)  # noqa: E731
    store = AnswerStore(ANSWERS_DIR / f"{DEFAULT_MODEL}.jsonl.gz", DEFAULT_MODEL)
    assert len(store.rows) > 1000
    corpus = AnswerStore(corpus_path(DEFAULT_MODEL), DEFAULT_MODEL)  # grow-answers' store
    assert len(corpus.rows) > 100
    # ... which holds no calibration prompt's answer either (the heads train on all of it)
    assert not set(corpus.rows) & held_out_keys(DEFAULT_MODEL, lambda texts: [encode(t) for t in texts])
    store.rows.update(corpus.rows)
    lengths = {TrainConfig().answer_tokens, BankBuildConfig().calib_new_tokens}
    keyed = [AnswerStore(None, DEFAULT_MODEL + a) for a in ("", "+q8", "+q8h/64", "+q8/64")]
    evaluation = sorted(_evaluation())
    ids = [encode(p) for p in evaluation]
    hits = [p for p, i in zip(evaluation, ids) for s in keyed for n in lengths if s.key(i, n) in store.rows]
    assert not hits
    # the check can fail: a stored training prompt is found the same way
    stored = everyday.prompts("train")[0]
    assert any(s.key(encode(stored), TrainConfig().answer_tokens) in store.rows for s in keyed)
