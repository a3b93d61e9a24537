"""The phrasebook: its tables against a plain count, its proposals, and what it is built from."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from entmtp.config import DEFAULT_MODEL, EVAL_SETS, TASKS, ModelConfig
from entmtp.data import everyday
from entmtp.data.answers import ANSWER_CAPS, AnswerStore, repo_store, training_answers
from entmtp.data.prompts import eval_set, prompts
from entmtp.runtime.runtime import load_runtime
from entmtp.runtime.weights import default_gguf
from entmtp.spec.phrasebook import N_FEATURES, Phrasebook, Reranker, _table, candidate_features, force_row, ngram_hash


def _sequences(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # a small vocabulary, so n-grams repeat with several followers
    return [[rng.randrange(6) for _ in range(rng.randrange(1, 60))] for _ in range(80)]


@pytest.mark.parametrize("base", [0, 2**55])  # 2**55: token ids too wide for the packed sort key (the lexsort path)
def test_tables_hold_the_most_frequent_follower_of_every_ngram(base):
    seqs = [[base + t for t in s] for s in _sequences()]
    book = Phrasebook(seqs, max_n=4)
    for n in range(1, 5):
        counts: dict[tuple, Counter] = defaultdict(Counter)
        for s in seqs:  # windows never cross from one sequence into the next
            for i in range(n, len(s)):
                counts[tuple(s[i - n : i])][s[i]] += 1
        assert len(book.tables[n].keys) == len(counts)
        for gram, c in counts.items():
            best = min(c, key=lambda t: (-c[t], t))  # the largest count, the smallest token on a tie
            assert book.tables[n].get(ngram_hash(gram)) == (best, c[best], sum(c.values()))
    assert book.tables[2].get(ngram_hash((7, 7))) is None


def test_the_packed_sort_and_the_lexsort_build_the_same_tables():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, rng.integers(1, 200)) for _ in range(300)]  # many ties among followers
    tokens = np.concatenate(seqs)
    offset = np.concatenate([np.arange(len(s)) for s in seqs])
    for n in range(1, 6):
        a, b = _table(tokens, offset, n), _table(tokens, offset, n, packed=False)
        for k in ("keys", "token", "count", "total"):
            assert np.array_equal(getattr(a, k), getattr(b, k)) and getattr(a, k).dtype == getattr(b, k).dtype
    empty = _table(np.arange(3), np.arange(3), 5)
    assert len(empty.keys) == len(empty.token) == len(empty.count) == len(empty.total) == 0


def test_a_proposal_takes_the_longest_suffix_the_text_first():
    book = Phrasebook([[1, 2, 3, 4], [9, 2, 3, 5], [9, 2, 3, 5]], max_n=3)
    ctx = book.context([8, 2, 3])
    p = ctx.propose()  # (2, 3) is in the book twice with 5 after it, once with 4
    assert (p.token, p.n, p.local, round(p.share, 3)) == (5, 2, False, 0.667)
    ctx = book.context([1, 2, 3])
    p = ctx.propose()  # (1, 2, 3) -> 4
    assert (p.token, p.n) == (4, 3)
    ctx.extend([7, 1, 2, 3])  # now the text itself holds (1, 2, 3) -> 7: it comes first
    p = ctx.propose()
    assert (p.token, p.n, p.local) == (7, 3, True)
    assert ctx.propose(extra=[6]) is None  # nothing ever followed 6
    assert ctx.propose(extra=[2, 3], min_n=3) is None  # (3, 2, 3) was never seen
    p = ctx.propose(extra=[2, 3])  # a drafted path after the text: (2, 3) -> 7 in the text itself
    assert (p.token, p.n, p.local) == (7, 2, True)


def test_the_reranker_scores_the_heads_and_the_books_candidates():
    book = Phrasebook([[1, 2, 3, 4], [9, 2, 3, 5], [9, 2, 3, 5]], max_n=3)
    ctx = book.context([8, 2, 3])
    m = ctx.matches()  # (2, 3) and (3,) in the book, 5 after them 2 times of 3; neither followed by anything in the text yet
    assert m == [(2, None, (5, 2, 3)), (1, None, (5, 2, 3))]
    cands, x = candidate_features(m, [4, 7], [-0.5, -1.5], 0)
    assert cands == [4, 7, 5] and x.shape == (3, N_FEATURES)
    assert x[0, 1] == 1 and x[0, 0] == -0.05 and x[2, 0] == -2.0  # the head's top-1; 5 is not among the head's top
    assert (x[2, 7], round(x[2, 8], 3), x[2, 10]) == (2 / 8, 0.667, 1.0) and x[0, 10] == 0  # 5 is what `propose` names
    assert list(x[:, 11]) == [2 / 8] * 3
    ctx.extend([6, 2, 3])  # now the text itself holds (2, 3) -> 6: a local candidate at n = 2
    cands, x = candidate_features(ctx.matches(), [4], [-0.1], 1)
    assert cands == [4, 6, 5] and (x[1, 3], x[1, 4], x[1, 6], x[1, 10]) == (2 / 8, 1.0, 1.0, 1.0) and x[2, 10] == 0
    w = np.zeros((N_FEATURES, 1))
    w[0, 0], w[10, 0] = 1.0, 3.0
    tokens, probs = Reranker(((w, np.zeros(1)),), first=2).rank(ctx.matches(), [4], [-0.1], 1)
    s = np.array([-0.1 / 10, -2.0 + 3.0, -2.0])  # the scores of 4, 6, 5: their softmax is the scorer's confidence
    assert tokens == [6, 4] and np.allclose(probs, (np.exp(s) / np.exp(s).sum())[[1, 0]])
    # the merged row: the named indices first, in order, then the head's own ranking
    row = force_row(torch.tensor([0.0, 3.0, 1.0, 2.0]), [2, 0])
    assert row.tolist() == [4.0, 3.0, 5.0, 2.0]


@pytest.mark.slow
def test_the_book_holds_answers_to_training_prompts_only(tiny_dir):
    """Every stored answer the phrasebook reads belongs to a training prompt of some source; none
    to a calibration or evaluation prompt (the banks are fitted, the heads and benches measured on those)."""
    gguf = default_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def encode(text: str) -> list[int]:  # Runtime.encode: the user message in the chat template
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok(chat, add_special_tokens=False)["input_ids"]

    book = training_answers(DEFAULT_MODEL, lambda texts: [encode(t) for t in texts])
    # the runtime's batched encoding (what the app's phrasebook reads with): the same ids, the same book
    rt = load_runtime(ModelConfig(model=str(tiny_dir)))
    texts = [p for t in TASKS for p in prompts(t, "calib")] + everyday.prompts("calib")
    assert rt.encode_all(texts) == [encode(t) for t in texts] and rt.encode(texts[0]) == encode(texts[0])
    assert training_answers(DEFAULT_MODEL, rt.encode_all) == book
    store = repo_store(DEFAULT_MODEL)
    keys = lambda texts: {AnswerStore(None, DEFAULT_MODEL + a).key(encode(t), cap)  # noqa: E731
                          for t in texts for a in ("", "+q8") for cap in ANSWER_CAPS}
    train = keys([p for t in TASKS for p in prompts(t, "train")] + everyday.prompts("train"))
    held = keys([p for t in TASKS for p in prompts(t, "calib")] + everyday.prompts("calib")
                + [it["prompt"] for name in EVAL_SETS for it in eval_set(name)])
    kept = [k for k, r in store.rows.items() if r["source"] != "greedy" and k not in held]
    assert len(book) == len(kept) > 9000
    assert all(k in train for k in kept)
    assert not any(k in held for k in kept)


@pytest.mark.parametrize("kind", ["share rule", "reranker", "reranker to depth 2"])
@pytest.mark.parametrize("vocab", ["whole", "draft"])
@pytest.mark.parametrize("seed", range(4))
def test_the_extension_forces_the_tokens_the_python_forcer_does(kind, vocab, seed):
    """csrc/phrasebook.cpp against `forcer` in Python, on texts that grow between calls: the same
    draft indices first, in the same order, and the same probability to 1e-12 (float64 sums in
    another order), under the share rule and a two-layer reranker, over the whole vocabulary and a
    draft vocabulary that leaves tokens out (the first of them named as -1 - token)."""
    from entmtp.config import PhrasebookRule
    from entmtp.model import ext
    from entmtp.spec.phrasebook import NativeForcer, forcer

    if ext.extension() is None:
        pytest.skip(f"the extension cannot serve here: {ext._state.get('error')}")
    rng, gen = random.Random(3 + seed), np.random.default_rng(3 + seed)
    V = 12
    book = Phrasebook(_sequences(4), max_n=4)
    draft_vocab = torch.tensor([0, 2, 3, 5, 7, 8, 11] if vocab == "draft" else [], dtype=torch.long)
    K = len(draft_vocab) or V
    rule = (PhrasebookRule(min_n=1, max_head_p=0.8, min_share=0.3) if kind == "share rule" else
            Reranker(((gen.normal(size=(N_FEATURES, 8)), gen.normal(size=8)), (gen.normal(size=(8, 1)), gen.normal(size=1))), first=2,
                     depths=2 if kind.endswith("depth 2") else 0))
    forced = outside = 0
    rows = torch.Generator().manual_seed(seed)
    for _ in range(6):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(0, 10))]
        a, b = book.context(prompt), book.context(prompt)
        native, python = forcer(a, rule, draft_vocab), forcer(b, rule, draft_vocab, native=False)
        assert isinstance(native, NativeForcer) and not isinstance(python, NativeForcer)
        for _ in range(30):
            path = [rng.randrange(V) for _ in range(rng.randrange(1, 5))]
            row, head_p = torch.randn(K, generator=rows) * 2, rng.random()
            (i1, p1), (i2, p2) = native(path, head_p, row), python(path, head_p, row)
            assert i1 == i2 and (p1 < 0) == (p2 < 0) and p1 == pytest.approx(p2, abs=1e-12)
            if getattr(rule, "depths", 0) and len(path) > rule.depths:  # past its depths: the head's own ranking and probability
                assert (i1, p1) == ([], -1.0)
            forced += bool(i1)
            outside += bool(i1) and i1[0] < 0
            assert all(i >= 0 for i in i1[1:])  # only the first may lie outside the vocabulary
            more = [rng.randrange(V) for _ in range(rng.randrange(0, 3))]
            a.extend(more), b.extend(more)
    assert forced > 30, "the book should put tokens first often on these texts"
    assert (outside > 0) == (vocab == "draft"), "a token outside the draft vocabulary should go first now and then"


def test_the_extensions_scorer_is_the_python_scorer_without_atens_tanh():
    """`PhraseForcer.scores` (its own tanh, `tanh_inplace`: IEEE operations four lanes at a time,
    the tail padded into the same lanes, so the same bits on every CPU) against
    `Reranker.scores` (numpy's tanh) to 1e-13, over pre-activations from 0 to saturation and both
    signs; tanh is odd, reaches +-1 exactly, and the tail gives the lanes' bits."""
    from entmtp.model import ext

    kernels = ext.extension()
    if kernels is None:
        pytest.skip(f"the extension cannot serve here: {ext._state.get('error')}")
    gen = np.random.default_rng(11)
    for scale in (1e-9, 0.1, 1.0, 4.0, 40.0):
        rule = Reranker(((gen.normal(size=(N_FEATURES, 32)) * scale, gen.normal(size=32) * scale),
                         (gen.normal(size=(32, 32)), gen.normal(size=32)), (gen.normal(size=(32, 1)), gen.normal(size=1))))
        layers = [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in rule.layers]
        force = kernels.PhraseForcer(Phrasebook(_sequences(1), max_n=4).native(kernels), torch.tensor([], dtype=torch.long), layers, 2, 0, 0.0, 0.0)
        x = gen.normal(size=(40, N_FEATURES))
        got = np.array(force.scores([list(map(float, r)) for r in x]))
        assert np.allclose(got, rule.scores(x), rtol=0, atol=1e-13), scale
    one = Reranker(((np.eye(N_FEATURES)[:, :1] * 1.0, np.zeros(1)), (np.ones((1, 1)), np.zeros(1))))
    force = kernels.PhraseForcer(Phrasebook(_sequences(1), max_n=4).native(kernels), torch.tensor([], dtype=torch.long),
                                 [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in one.layers], 2, 0, 0.0, 0.0)
    v = np.array([0.0, 1e-300, 1e-8, 0.3, 0.5493061443340549, 1.0, 2.0, 9.0, 19.0, 25.0, 400.0, 1e300])
    tail = [0.3, -19.0, 2.0]  # past the last four lanes: padded, it must give the full lanes' bits
    x = np.zeros((2 * len(v) + len(tail), N_FEATURES))
    x[:, 0] = np.concatenate([v, -v, tail])
    got = np.array(force.scores([list(map(float, r)) for r in x]))
    assert np.allclose(got, np.tanh(x[:, 0]), rtol=0, atol=4e-16)
    lanes, rest = got[: 2 * len(v)], got[2 * len(v):]
    assert list(lanes[: len(v)]) == [-g for g in lanes[len(v):]] and lanes[-1] == -1.0 and lanes[len(v) - 1] == 1.0
    assert list(rest) == [lanes[3], lanes[len(v) + 8], lanes[6]]


def test_the_extension_ranks_a_node_with_many_candidates_as_python_does():
    """A text in which one token was followed by 150 others: past 64 candidates the extension's
    forcer finds them through a map instead of a scan, and still ranks and scores them as the
    Python forcer does."""
    from entmtp.model import ext
    from entmtp.spec.phrasebook import forcer

    if ext.extension() is None:
        pytest.skip(f"the extension cannot serve here: {ext._state.get('error')}")
    gen = np.random.default_rng(5)
    V = 400
    text = [t for follower in range(1, 151) for t in (0, follower)] + [0, 3, 0]
    book = Phrasebook([[0, 7, 0, 9, 0, 7]] + _sequences(1), max_n=4)
    rule = Reranker(((gen.normal(size=(N_FEATURES, 8)), gen.normal(size=8)), (gen.normal(size=(8, 1)), gen.normal(size=1))), first=3)
    empty = torch.tensor([], dtype=torch.long)
    native, python = forcer(book.context(text), rule, empty), forcer(book.context(text), rule, empty, native=False)
    rows = torch.Generator().manual_seed(5)
    for path in ([0], [5, 0], [3, 0, 3], [0, 0]):
        row = torch.randn(V, generator=rows) * 2
        (i1, p1), (i2, p2) = native(path, 0.5, row), python(path, 0.5, row)
        assert i1 == i2 and p1 == pytest.approx(p2, abs=1e-12)


@pytest.mark.parametrize("kind", ["share rule", "reranker", "reranker to depth 1"])
@pytest.mark.parametrize("native", [True, False], ids=["native forcer", "python forcer"])
@pytest.mark.parametrize("vocab", ["whole", "draft"])
def test_drafting_with_the_book_is_lossless_and_its_traces_exact(kind, native, vocab, monkeypatch):
    """With the book first on the spine (under the share rule, or a reranker putting two
    candidates first) the engine still decodes `generate`'s tokens, and a bank's traces recorded
    with it predict every tree's steps exactly (the served Q8 arithmetic, where a head's row
    computes alike alone and batched). With a draft vocabulary that leaves out a third of the
    tokens, the book's first may lie outside it and still goes first on the spine."""
    from entmtp.bank import record as rec
    from entmtp.bank import traces as tr
    from entmtp.config import GenerationConfig, PhrasebookRule
    from entmtp.spec.engine import Engine, Strategy, collect
    from entmtp.spec.policy import StaticPolicy
    from entmtp.spec.topology import chain_paths, compile_tree
    from conftest import random_heads, reference
    from test_fused import blocked_llama

    model = blocked_llama(3, q8=True)
    engine, heads = Engine(model, []), random_heads(model)
    rng = random.Random(1)
    prompt = [rng.randrange(1, 96) for _ in range(12)]
    ref = reference(model, prompt, 40)
    if vocab == "draft":
        heads.set_draft_vocab(torch.tensor([t for t in range(model.config.vocab_size) if t % 3 != 2]))  # 14, the reference's most frequent, out
    noisy = [t if rng.random() < 0.7 else rng.randrange(96) for t in ref]  # right guesses and wrong ones
    book = Phrasebook([prompt + ref[:15], noisy, noisy[5:] + noisy[:5]] + _sequences(2))
    rule = PhrasebookRule(min_n=2, max_head_p=1.01, min_share=0.0)  # random heads: let the book go first at any probability
    if kind.startswith("reranker"):  # one linear layer: the head's log-probability, and much more for the token `propose` names
        w = np.zeros((N_FEATURES, 1))
        w[0, 0], w[10, 0] = 1.0, 3.0
        # "to depth 1": the first head's node only, deeper ones keep the head's ranking
        rule = Reranker(((w, np.zeros(1)),), first=2, depths=1 if kind.endswith("depth 1") else 0)
    trees = [compile_tree([[0]], "n2"), compile_tree(chain_paths(3), "chain3"), compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], "t6")]
    from entmtp.model import ext
    from entmtp.spec.phrasebook import NativeForcer, forcer

    if not native:  # the Python forcer, called back at each node (where the extension is not loaded)
        monkeypatch.setattr(ext, "loaded", lambda: None)
    assert isinstance(forcer(book.context(prompt), rule, heads.draft_vocab), NativeForcer) == native
    plain = rec.record(engine, heads, prompt, ref, 3)
    trace = rec.record(engine, heads, prompt, ref, 3, book=book, rule=rule)
    assert trace.ranks != plain.ranks  # the book moved ranks
    if kind == "share rule":  # the first head's top-1 probability stays the head's; deeper heads read the book's path
        assert [c[0] for c in trace.chain] == [c[0] for c in plain.chain] and trace.chain != plain.chain
    else:  # the chain's probabilities are the reranker's
        assert [c[0] for c in trace.chain] != [c[0] for c in plain.chain]
    gained = 0
    for tree in trees:
        real = collect(engine.generate(prompt, Strategy(tree.name, (tree,), StaticPolicy(0), heads, book, rule),
                                       GenerationConfig(max_new_tokens=40)))
        assert real.token_ids == ref, tree.name
        assert tr.decode_with(tree, trace) == (real.new_tokens, len(real.steps)), tree.name
        gained += len(real.steps) < tr.decode_with(tree, plain)[1]
    assert gained, "the book should save steps on these prompts"
    if vocab == "draft":  # right first guesses from outside the vocabulary, which the heads alone never rank
        outside = [i for i, r in enumerate(trace.ranks) if r[0] == 0 and i + 1 < len(ref) and ref[i + 1] % 3 == 2]
        assert outside and all(plain.ranks[i][0] == -1 for i in outside)


def test_a_bank_names_its_reranker_and_refuses_a_changed_one(tmp_path):
    from entmtp.bank.bank import BankError, phrasebook_rule, rule_provenance
    from entmtp.config import PhrasebookRule

    w = np.zeros((N_FEATURES, 1))
    w[10, 0] = 1.0
    path = tmp_path / "reranker.json"
    Reranker(((w, np.zeros(1)),), first=2).save(path, {"heads_sha256": "abc"})
    rr = Reranker.load(path)
    assert (rr.first, rr.heads_sha256, len(rr.sha256), rr.depths) == (2, "abc", 16, 0)
    Reranker(((w, np.zeros(1)),), first=2, depths=3).save(tmp_path / "capped.json", {"heads_sha256": "abc"})
    capped = Reranker.load(tmp_path / "capped.json")
    assert capped.depths == 3 and capped.sha256 != rr.sha256  # a bank drafted with one is not drafted with the other
    prov = {"phrasebook": rule_provenance(rr)}
    again = phrasebook_rule(prov)
    assert isinstance(again, Reranker) and again.sha256 == rr.sha256 and np.array_equal(again.layers[0][0], w)
    share = PhrasebookRule(min_n=2, max_head_p=0.5, min_share=0.9)
    assert phrasebook_rule({"phrasebook": rule_provenance(share)}) == share
    assert phrasebook_rule({}) is None
    Reranker(((2 * w, np.zeros(1)),), first=2).save(path, {"heads_sha256": "abc"})  # refitted since the traces were drafted
    with pytest.raises(BankError, match="changed since the traces were drafted"):
        phrasebook_rule(prov)
    path.unlink()
    with pytest.raises(BankError, match="is missing"):
        phrasebook_rule(prov)
