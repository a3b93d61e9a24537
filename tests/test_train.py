"""Draft-head self-distillation (entmtp.tools.train) on the tiny random Llama."""

from __future__ import annotations

import gzip
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from entmtp.data import everyday, prompts as data
from entmtp.data.answers import AnswerStore
from entmtp.config import EVAL_SETS, TREES_FILE, BASELINE_TREE, GenerationConfig, TrainConfig
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.headfiles import load_heads
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import compile_tree, load_named_trees
from entmtp.tools.train import (
    Corpus,
    Flat,
    TrainError,
    _select,
    build_corpus,
    corpus_plan,
    draft_vocab,
    generate_batch,
    head_losses,
    new_heads,
    prefix_features,
    train_and_save,
    train_heads,
)

from conftest import VOCAB, tiny_llama

CFG = TrainConfig(steps=40, batch_tokens=64, lr=3e-3, warmup=5, draft_vocab=32, teacher_topk=8, checkpoint_every=10)


def fake_encode(text: str) -> list[int]:
    """Text -> tiny-vocabulary ids (bytes folded), short enough for the tiny model."""
    return [1 + b % (VOCAB - 1) for b in text.encode()[:12]] or [1]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=5)


@pytest.fixture(scope="module")
def flat(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 5, 9, 4, 6)]
    pairs = generate_batch(tiny, prompts, 40, set(), 0)
    corpus = Corpus([h for h, _ in pairs], [t for _, t in pairs], ["p"] * 6, ["chat"] * 6, ["self"] * 6)
    vocab = draft_vocab(corpus, CFG.draft_vocab, VOCAB)
    f = Flat.of(corpus)
    f.add_teacher(tiny.get_output_embeddings().weight[vocab], CFG.teacher_topk)
    return f, vocab


def _bound(tiny, kind, vocab, seed=0):
    torch.manual_seed(seed)
    heads = new_heads(kind, CFG, tiny).bind(tiny)
    heads.set_draft_vocab(vocab)
    return heads


def test_generate_batch_matches_greedy_decoding(tiny):
    """Left-padded batched generation gives each prompt's own greedy answer and hidden states."""
    prompts = [[3, 9, 4], [5, 6, 7, 8, 2, 11, 12]]
    pairs = generate_batch(tiny, prompts, 10, set(), 0)
    for p, (h, toks) in zip(prompts, pairs):
        ref = tiny.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):]
        assert toks.tolist() == ref.tolist()
        with torch.no_grad():
            assert torch.equal(tiny.get_output_embeddings()(h).argmax(-1), toks)


@pytest.mark.parametrize("kind, factor", [("hydra", 0.8), ("medusa", 0.98)])  # Medusa sees h_t only
def test_training_reduces_loss(tiny, flat, kind, factor, tmp_path):
    f, vocab = flat
    heads = _bound(tiny, kind, vocab)
    t = f.anchors[:256]
    before = float(head_losses(heads, f, t, True)[0].detach())
    train_heads(heads, f, CFG, tmp_path / "ckpt.pt", progress=False)
    after = float(head_losses(heads, f, t, True)[0].detach())
    assert after < factor * before


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, feature_dropout=0.3)], ids=["plain", "feature-dropout"])
def test_resume_continues_identically(tiny, flat, tmp_path, cfg):
    """A resumed run equals a straight one (with feature dropout too: its mask comes from the step's
    own generator), and training leaves the heads in eval mode."""
    f, vocab = flat
    straight = _bound(tiny, "hydra", vocab)
    train_heads(straight, f, cfg, tmp_path / "a.pt", progress=False)
    interrupted = _bound(tiny, "hydra", vocab)
    train_heads(interrupted, f, cfg, tmp_path / "b.pt", progress=False, until=20)
    resumed = _bound(tiny, "hydra", vocab, seed=123)  # fresh weights: everything comes from the checkpoint
    train_heads(resumed, f, cfg, tmp_path / "b.pt", progress=False)
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    assert not straight.training
    with pytest.raises(TrainError, match="another training config"):
        train_heads(_bound(tiny, "hydra", vocab), f, replace(cfg, lr=1e-4), tmp_path / "b.pt", progress=False)


def test_feature_dropout_is_drawn_from_the_generator_given(tiny, flat):
    """With dropout 0 the loss is the plain one; with it, the same generator gives the same loss."""
    f, vocab = flat
    heads, t = _bound(tiny, "hydra", vocab), f.anchors[:128]
    plain = float(head_losses(heads, f, t, True)[0].detach())
    assert float(head_losses(heads, f, t, True, None, 0.0, torch.Generator().manual_seed(1))[0].detach()) == plain
    dropped = [float(head_losses(heads, f, t, True, None, 0.5, torch.Generator().manual_seed(s))[0].detach()) for s in (1, 1, 2)]
    assert dropped[0] == dropped[1] != dropped[2] and dropped[0] != plain


@pytest.mark.parametrize("task", data.TASKS)
def test_default_corpus_never_reads_evaluation_prompts(task):
    """The default plan's prompts (train corpus and held-out) are disjoint from the eval split by text."""
    evaluation = {it["prompt"] for name in EVAL_SETS for it in data.eval_set(name)}  # no set's prompt, by text
    approx = lambda s: [1] * (len(s) // 4)  # a token count near the real tokenizer's, for the length cap
    cfg = replace(TrainConfig(), sharegpt_code_prompts=300, everyday_prompts=900)  # every source, the extra ones included
    sources = set()
    for split in ("train", "calib"):
        for t, source, n in corpus_plan(cfg, split):
            if t != task:
                continue
            sources.add(source)
            # ShareGPT's Python questions come from chat's split of the same name
            allowed = set(everyday.prompts(split) if source == "everyday"
                          else data.prompts("chat" if source == "sharegpt" else task, split))
            chosen = {p for p, _ in _select(t, split, source, n, approx, cfg.max_prompt_tokens)}
            assert chosen and chosen <= allowed and not chosen & evaluation, (split, source)
    assert sources == {"code": {"self", "ref", "sharegpt"}, "math": {"self", "ref"}, "chat": {"self", "ref", "everyday"}}[task]
    for source in sorted(sources):
        with pytest.raises(TrainError):
            _select(task, "eval", source, 1, approx, cfg.max_prompt_tokens)


def test_built_corpus_holds_training_prompts_only(tiny, tmp_path):
    cfg = replace(CFG, self_prompts=(("code", 2), ("math", 2), ("chat", 2)), ref_prompts=(("math", 2), ("chat", 2)),
                  heldout_prompts=1, answer_tokens=6, gen_batch=2)
    corpus = build_corpus(tiny, fake_encode, fake_encode, set(), 0, cfg, tmp_path, "train", progress=False)
    assert corpus.describe()["chat/ref"]["answers"] == 2 and len(corpus) == 10
    for task in data.TASKS:
        mine = {p for p, t in zip(corpus.prompts, corpus.tasks) if t == task}
        assert mine and mine <= set(data.prompts(task, "train")) and not mine & set(data.prompts(task, "eval"))
    again = build_corpus(tiny, fake_encode, fake_encode, set(), 0, cfg, tmp_path, "train", progress=False)  # from shards
    assert all(torch.equal(a, b) for a, b in zip(corpus.hidden, again.hidden))
    with pytest.raises(TrainError, match="answer_tokens"):
        build_corpus(tiny, fake_encode, fake_encode, set(), 0, replace(cfg, answer_tokens=7), tmp_path, "train", progress=False)


@pytest.mark.parametrize("kind, arch", [("hydra", "mlp"), ("medusa", "mlp"), ("hydra", "prefix-mlp")])
def test_saved_heads_reload_decode_like_ar_and_accept_what_they_learned(tiny, tmp_path, kind, arch):
    """Reloaded heads are lossless, and they carry their training: on the prompts whose greedy
    answers they were trained on, they accept clearly more tokens per step than the same heads
    before training and than random heads (which already accept some on the tiny model's
    repetitive output). Hydra++ (prefix-mlp) included: its prefix layer trains with the heads."""
    cfg = replace(CFG, self_prompts=(("chat", 4),), ref_prompts=(("code", 2),), heldout_prompts=1,
                  answer_tokens=16, gen_batch=4, arch=arch, prefix_answers=3)
    prov = train_and_save(tiny, fake_encode, fake_encode, set(), 0, cfg, [kind], {kind: tmp_path / kind}, tmp_path / "work",
                          provenance={"command": "test"}, progress=False)[kind]
    assert prov["command"] == "test" and prov["corpus"]["train"]["chat/self"]["answers"] == 4
    assert len(prov["heldout"]["per_head"]) == 4
    stored = load_file(str(tmp_path / kind / "heads.safetensors"))
    assert {v.dtype for k, v in stored.items() if k != "draft_vocab"} == {torch.bfloat16}
    prefix_keys = {k for k in stored if k.startswith("prefix_embeding_layer.")}
    assert bool(prefix_keys) == (arch == "prefix-mlp") and not any("embed_tokens" in k for k in prefix_keys)
    heads = load_heads(tmp_path / kind, tiny.config).bind(tiny)
    assert getattr(heads, "arch", "mlp") == arch
    assert heads.draft_vocab.numel() == cfg.draft_vocab
    engine = Engine(tiny)
    ar = Strategy("ar", (compile_tree([], "ar"),), StaticPolicy(0))
    bank = (load_named_trees(TREES_FILE)[BASELINE_TREE],)

    def accepted(h, prompts, gen):
        """Tokens per step over `prompts` (root included), each output checked against `ar`."""
        tokens = steps = 0
        for prompt in prompts:
            want = collect(engine.generate(prompt, ar, gen))
            got = collect(engine.generate(prompt, Strategy(kind, bank, StaticPolicy(0), h), gen))
            assert got.token_ids == want.token_ids
            tokens, steps = tokens + got.new_tokens, steps + len(got.steps)
        return tokens / steps

    accepted(heads, ([4, 8, 15, 16, 23], [42, 7, 7, 1, 30, 2, 9, 11]), GenerationConfig(max_new_tokens=40))
    torch.manual_seed(cfg.seed)  # as train_and_save seeds the heads it trains
    untrained = new_heads(kind, cfg, tiny)
    torch.manual_seed(1)
    rand = new_heads(kind, cfg, tiny)
    with torch.no_grad():
        for p in rand.parameters():
            p.normal_(0, 0.3)
    for h in (untrained, rand):
        h.bind(tiny).set_draft_vocab(heads.draft_vocab)
    learned = [fake_encode(p) for p, _ in _select("chat", "train", "self", 4, fake_encode, cfg.max_prompt_tokens)]
    gen = GenerationConfig(max_new_tokens=cfg.answer_tokens)
    trained = accepted(heads, learned, gen)
    for name, h in (("untrained", untrained), ("random", rand)):
        base = accepted(h, learned, gen)
        assert trained >= base + 0.4, f"{kind}: trained heads accept {trained:.2f} tokens/step, {name} {base:.2f}"


def test_growing_the_corpus_reuses_its_shards(tiny, tmp_path, monkeypatch):
    """Shards are named by their prompts; length-sorting within blocks keeps earlier batches whole."""
    from entmtp.tools import train

    calls = []
    real = train.generate_batch
    monkeypatch.setattr(train, "generate_batch", lambda m, p, *a: calls.append(len(p)) or real(m, p, *a))
    monkeypatch.setattr(train, "SORT_BLOCK", 2)
    cfg = replace(CFG, self_prompts=(("chat", 2),), ref_prompts=(), answer_tokens=6, gen_batch=2)
    small = build_corpus(tiny, fake_encode, fake_encode, set(), 0, cfg, tmp_path, "train", progress=False)
    assert calls == [2]
    grown = build_corpus(tiny, fake_encode, fake_encode, set(), 0, replace(cfg, self_prompts=(("chat", 5),)), tmp_path,
                         "train", progress=False)
    assert calls == [2, 2, 1]  # the first batch came from its shard
    assert grown.prompts[:2] == small.prompts and all(torch.equal(a, b) for a, b in zip(small.hidden, grown.hidden))


def test_stored_answers_rebuild_the_corpus_without_generating(tiny, tmp_path, monkeypatch):
    """A second machine (a new work folder) reads the stored answers back teacher-forced: same tokens,
    the same hidden states up to float rounding, and generate is never called."""
    from entmtp.tools import train

    cfg = replace(CFG, self_prompts=(("chat", 3),), ref_prompts=(), sharegpt_code_prompts=2, answer_tokens=6, gen_batch=2)
    store_file = tmp_path / "answers.jsonl.gz"
    first = build_corpus(tiny, fake_encode, fake_encode, set(), 0, cfg, tmp_path / "a", "train", progress=False,
                         answers=AnswerStore(store_file, "tiny"))
    assert first.describe() == {"chat/self": {"answers": 3, "tokens": 18}, "code/sharegpt": {"answers": 2, "tokens": 12}}
    store = AnswerStore(store_file, "tiny")
    assert len(store.answers) == len({tuple(fake_encode(p)) for p in first.prompts})
    monkeypatch.setattr(train, "generate_batch", lambda *a: pytest.fail("generated although every answer was stored"))
    second = build_corpus(tiny, fake_encode, fake_encode, set(), 0, cfg, tmp_path / "b", "train", progress=False, answers=store)
    assert second.prompts == first.prompts
    for a, b, ta, tb in zip(first.hidden, second.hidden, first.tokens, second.tokens):
        assert torch.equal(ta, tb)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert AnswerStore(store_file, "another model").get(fake_encode(first.prompts[0]), 6) is None  # keyed by model
    with gzip.open(store_file, "ab") as f:  # an interrupted append: a cut gzip member
        f.write(b"")
    with open(store_file, "ab") as f:
        f.write(gzip.compress(b'{"key": "x", "tokens": [1, 2')[:-8])
    healed = AnswerStore(store_file, "tiny")  # the answers before the cut stand, and the file is whole again
    assert healed.answers == store.answers
    healed.add("chat", "self", [[1, 2, 3]], [[4, 5]], 6)
    assert AnswerStore(store_file, "tiny").answers == {**store.answers, healed.key([1, 2, 3], 6): [4, 5]}


def test_training_further_starts_from_the_given_heads_and_keeps_their_vocabulary(tiny, tmp_path):
    """`init` loads our saved heads (weights and draft vocabulary); zero steps change nothing but the
    bfloat16 round trip, and a mismatched shape is refused in one line."""
    cfg = replace(CFG, self_prompts=(("chat", 3),), ref_prompts=(), heldout_prompts=1, answer_tokens=12, gen_batch=3)
    first = tmp_path / "first"
    prov = train_and_save(tiny, fake_encode, fake_encode, set(), 0, cfg, ["hydra"], {"hydra": first / "hydra"}, tmp_path / "w1",
                          progress=False)["hydra"]
    assert len(prov["train_sample"]["per_head"]) == 4 and prov["train_sample"]["answers"] == 3  # beside "heldout"
    again = replace(cfg, init=str(first), steps=1, lr=1e-12, draft_vocab=8)  # the vocabulary size asked is ignored
    prov2 = train_and_save(tiny, fake_encode, fake_encode, set(), 0, again, ["hydra"], {"hydra": tmp_path / "second" / "hydra"},
                           tmp_path / "w2", progress=False)["hydra"]
    assert prov2["init"]["from"] == str(first) and prov2["init"]["sha256"] == load_heads(first / "hydra", tiny.config).provenance["sha256"]
    a, b = load_file(str(first / "hydra" / "heads.safetensors")), load_file(str(tmp_path / "second" / "hydra" / "heads.safetensors"))
    assert torch.equal(a["draft_vocab"], b["draft_vocab"]) and a["draft_vocab"].numel() == cfg.draft_vocab
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-2, atol=1e-3)
    with pytest.raises(TrainError, match="--init: .* 2 layers"):
        train_and_save(tiny, fake_encode, fake_encode, set(), 0, replace(again, num_layers=1), ["hydra"],
                       {"hydra": tmp_path / "third" / "hydra"}, tmp_path / "w3", progress=False)


def test_training_further_may_choose_a_new_vocabulary_and_deepen_the_heads(tiny, tmp_path):
    """`new_vocab` re-chooses the draft vocabulary from the corpus (the shared LM head's rows carry
    no head weights), and more layers than the init heads have append blocks that start as the
    identity: before any real step the deeper heads score every token as the ones they grew from."""
    cfg = replace(CFG, self_prompts=(("chat", 3),), ref_prompts=(), heldout_prompts=1, answer_tokens=12, gen_batch=3,
                  draft_vocab=24)
    first = tmp_path / "first"
    train_and_save(tiny, fake_encode, fake_encode, set(), 0, cfg, ["hydra"], {"hydra": first / "hydra"}, tmp_path / "w1",
                   progress=False)
    again = replace(cfg, init=str(first), steps=1, lr=1e-12, draft_vocab=40, new_vocab=True, num_layers=3)
    prov = train_and_save(tiny, fake_encode, fake_encode, set(), 0, again, ["hydra"], {"hydra": tmp_path / "second" / "hydra"},
                          tmp_path / "w2", progress=False)["hydra"]
    old, new = load_heads(first / "hydra", tiny.config).bind(tiny), load_heads(tmp_path / "second" / "hydra", tiny.config).bind(tiny)
    assert prov["draft_vocab"]["size"] == 40 and new.draft_vocab.numel() == 40 and old.draft_vocab.numel() == 24
    assert prov["train_config"]["new_vocab"] and new.num_layers == 3 and old.num_layers == 2
    assert set(old.draft_vocab.tolist()) < set(new.draft_vocab.tolist())  # the 24 most frequent stay among the 40
    torch.manual_seed(0)
    feature, path = torch.randn(5, tiny.config.hidden_size), torch.randint(0, VOCAB, (5, 4))
    for i in range(old.num_heads):
        full_a = old.lm_logits(i, old.head_hidden(i, feature, path[:, : i + 1]), full_vocab=True)
        full_b = new.lm_logits(i, new.head_hidden(i, feature, path[:, : i + 1]), full_vocab=True)
        torch.testing.assert_close(full_a, full_b, rtol=2e-2, atol=2e-2)  # bfloat16 weights on both sides


def test_prefix_features_equal_the_engines_incremental_prefix_layer(tiny):
    """Training runs Hydra++'s prefix layer over a whole sequence at once; the engine feeds it the
    accepted tokens' states step by step with a cache. Both give the same features."""
    torch.manual_seed(3)
    heads = new_heads("hydra", replace(CFG, arch="prefix-mlp"), tiny).bind(tiny)
    seq = torch.randn(11, tiny.config.hidden_size)
    whole = prefix_features(heads.prefix_embeding_layer, seq)
    ctx = heads.new_context()
    steps = [ctx.observe(seq[a:b]) for a, b in ((0, 4), (4, 5), (5, 8), (8, 11))]
    for (a, b), f in zip(((0, 4), (4, 5), (5, 8), (8, 11)), steps):
        torch.testing.assert_close(f, whole[b - 1], rtol=1e-5, atol=1e-5)


def test_prefix_corpus_adds_the_prompts_states_to_existing_shards(tiny, tmp_path, monkeypatch):
    """Hydra++ needs the prompt's base states: a corpus built for mlp heads gains them in place
    (no answer generated again), and they are the states a forward over prompt + answer gives."""
    from entmtp.tools import train

    cfg = replace(CFG, self_prompts=(("chat", 2),), ref_prompts=(("math", 1),), answer_tokens=6, gen_batch=2)
    plain = build_corpus(tiny, fake_encode, fake_encode, set(), 0, cfg, tmp_path, "train", progress=False)
    assert plain.prompt_hidden == []
    monkeypatch.setattr(train, "generate_batch", lambda *a: pytest.fail("generated again"))
    monkeypatch.setattr(train, "teacher_forced", lambda *a: pytest.fail("read again"))
    rich = build_corpus(tiny, fake_encode, fake_encode, set(), 0, replace(cfg, arch="prefix-mlp"), tmp_path, "train",
                        progress=False)
    assert len(rich.prompt_hidden) == len(rich) == 3
    for p, ph, h, t in zip(rich.prompts, rich.prompt_hidden, rich.hidden, rich.tokens):
        ids = fake_encode(p)
        assert ph.shape == (len(ids) - 1, tiny.config.hidden_size)
        full = tiny.model(input_ids=torch.tensor([ids + t.tolist()])).last_hidden_state[0].detach()
        torch.testing.assert_close(ph, full[: len(ids) - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h, full[len(ids) - 1 : len(ids) - 1 + len(t)], rtol=1e-4, atol=1e-4)
