"""eval-heads: accepted length from exact traces, with a bootstrap interval, on the tiny model."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from entmtp.config import BASELINE_TREE, GenerationConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.tools.evalheads import SMALL_TREES, accepted_on, bootstrap_ci, continuations, eval_trees
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import compile_tree
from entmtp.data.answers import AnswerStore
from conftest import random_heads, tiny_llama


def test_bootstrap_interval_holds_the_estimate_and_is_reproducible():
    assert bootstrap_ci([10] * 5, [4] * 5) == (2.5, 2.5)  # identical prompts: no spread
    tokens, steps = [10, 20, 30, 12, 40], [10, 8, 6, 5, 30]
    lo, hi = bootstrap_ci(tokens, steps)
    assert lo < sum(tokens) / sum(steps) < hi
    assert min(t / s for t, s in zip(tokens, steps)) <= lo and hi <= max(t / s for t, s in zip(tokens, steps))
    assert bootstrap_ci(tokens, steps) == (lo, hi)


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_trace_acceptance_equals_a_real_decode_with_the_default_tree(tmp_path, kind):
    """Per prompt, the tokens and steps eval-heads reports are those of the engine's own decode with
    Hydra's default tree, and the greedy continuations are stored, then read back."""
    model = tiny_llama(seed=5, vocab=12)  # a small vocabulary: random heads get drafts accepted
    heads = random_heads(model, kind)
    rt = SimpleNamespace(engine=Engine(model), heads=lambda k: heads)
    rng = random.Random(0)
    prompts = [[rng.randrange(12) for _ in range(rng.randint(3, 9))] for _ in range(5)]
    store = AnswerStore(tmp_path / "eval.jsonl.gz", "tiny")
    conts = continuations(rt, heads, prompts, 40, store)
    assert AnswerStore(tmp_path / "eval.jsonl.gz", "tiny").answers == store.answers and len(store.answers) == 5
    per_tree = accepted_on(rt, kind, prompts, conts)
    trees = eval_trees()
    assert list(per_tree) == [BASELINE_TREE, *SMALL_TREES] and trees[BASELINE_TREE].n_nodes == 64
    assert [trees[name].n_nodes for name in SMALL_TREES] == [2, 4]
    gen = GenerationConfig(max_new_tokens=40)
    for name, (tokens, steps) in per_tree.items():
        accepted = []
        for p, c, t, s in zip(prompts, conts, tokens, steps):
            ar = collect(rt.engine.generate(p, Strategy("ar", (compile_tree([], "ar"),), StaticPolicy(0)), gen))
            real = collect(rt.engine.generate(p, Strategy(kind, (trees[name],), StaticPolicy(0), heads), gen))
            assert list(ar.token_ids) == c == list(real.token_ids)
            assert (t, s) == (real.new_tokens, len(real.steps)), name
            accepted.append(t / s)
        # drafts were accepted: the comparison covers more than the root
        assert max(accepted) > (1.2 if name == BASELINE_TREE else 1.0), (name, accepted)


def test_bank_traces_reuse_stored_continuations(tmp_path, monkeypatch):
    """build-bank's traces read the greedy continuations from the answer store once they are there."""
    from entmtp.bank import record as rec


    model = tiny_llama(seed=5, vocab=12)
    heads = random_heads(model, "hydra")
    engine = Engine(model)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    store = AnswerStore(tmp_path / "a.jsonl.gz", "tiny")
    first = rec.record_all(engine, heads, prompts, 30, 4, answers=store)
    monkeypatch.setattr(rec, "greedy_continuation", lambda *a: pytest.fail("decoded although the continuation was stored"))
    again = rec.record_all(engine, heads, prompts, 30, 4, answers=AnswerStore(tmp_path / "a.jsonl.gz", "tiny"))
    assert [t.to_json() for t in again] == [t.to_json() for t in first]


def test_record_writes_the_figures_into_heads_json_and_docs_show_them(tmp_path):
    """`eval-heads --record`: the accepted lengths land in heads.json (weights untouched) and
    docs/heads.md's block renders them per evaluation set and tree."""
    import json

    from entmtp.spec.headfiles import save_heads
    from entmtp.tools.evalheads import record_in
    from entmtp.tools.report import heads_block

    model = tiny_llama(seed=5, vocab=12)
    folder = save_heads(random_heads(model, "hydra"), tmp_path / "hydra", {
        "command": "train", "date": "today", "heldout": {"split": "calib", "per_head": [{"top1": 0.5, "top5": 0.8, "n": 9}]}})
    weights = (folder / "heads.safetensors").read_bytes()
    row = lambda m: {"prompts": 3, "tokens": 30, "steps": 12, "mean_accepted": m, "ci95": [m - 0.1, m + 0.1]}  # noqa: E731
    report = {"method": "exact trace simulation at temperature 0", "max_new_tokens": 40, "tree": BASELINE_TREE,
              "trees": SMALL_TREES, "accepted": {"hydra": {"chat": row(2.5), "everyday": row(2.75)}},
              "small_trees": {"hydra": {"2-node": {"chat": row(1.5), "everyday": row(1.6)},
                                        "4-node": {"chat": row(2.0), "everyday": row(2.1)}}},
              "heldout": {"hydra": []}}
    record_in(folder, "hydra", report, "+q8")
    assert (folder / "heads.safetensors").read_bytes() == weights
    ev = json.loads((folder / "heads.json").read_text())["provenance"]["evaluation"]
    assert ev["accepted"]["everyday"]["mean_accepted"] == 2.75 and ev["served"] == "+q8"
    block = heads_block([folder / "heads.json"], tmp_path)
    assert "| everyday | 3 | 2.75 [2.65, 2.85] | 1.60 [1.50, 1.70] | 2.10 [2.00, 2.20] |" in block
    assert "| chat | 3 | 2.50 [2.40, 2.60] | 1.50 [1.40, 1.60] | 2.00 [1.90, 2.10] |" in block
    with pytest.raises(ValueError, match="not medusa"):
        record_in(folder, "medusa", report, "")
