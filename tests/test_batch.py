"""Batched greedy decoding on the served kernels (`model/batch.py`): every answer token-identical
to the engine's `ar` decode of its prompt alone (which `test_real_model` holds equal to the served
model's `generate`), at batch sizes 1, 7 and 32, over prompts of mixed lengths, with sequences that
end early on EOS and are replaced mid-run."""

import pytest
import torch

from entmtp.config import GenerationConfig, ModelConfig
from entmtp.data import prompts as data
from entmtp.model import batch
from entmtp.runtime.runtime import load_runtime
from entmtp.spec.engine import Engine, Strategy, collect
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import compile_tree
from conftest import SERVE_THREADS

pytestmark = pytest.mark.slow
N_NEW = 24


@pytest.fixture(scope="module")
def rt():
    torch.set_num_threads(SERVE_THREADS)
    runtime = load_runtime(ModelConfig())
    if not batch.available(runtime.model):
        pytest.skip("the served model is not on the fused stack here (the extension did not build)")
    yield runtime
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def prompts(rt):
    """40 chat-formatted calibration prompts of every task: lengths from a few dozen tokens to hundreds."""
    texts = [p for task in ("code", "math", "chat") for p in data.prompts(task, "calib")[:14]][:40]
    return [rt.encode(t) for t in texts]


@pytest.fixture(scope="module")
def alone(rt, prompts):
    """Each prompt's greedy answer from the engine's `ar` decode, alone, no EOS: (tokens, hidden states)."""
    engine = Engine(rt.model, ())
    ar = Strategy("ar", (compile_tree([], "ar"),), StaticPolicy(0))
    return [collect(engine.generate(ids, ar, GenerationConfig(max_new_tokens=N_NEW))).token_ids for ids in prompts]


def truncated(tokens, eos):
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


@pytest.mark.parametrize("size", [1, 7, 32])
def test_batched_answers_are_the_answers_alone(rt, prompts, alone, size):
    # an EOS set that ends some answers early (a token that one answer makes at its 5th step and
    # others at various places), so that slots free up and later prompts join mid-run
    eos = {alone[0][4], alone[5][9]}
    assert batch.common_opening(prompts) >= batch.MIN_SHARED  # the chat template's opening: prefilled once, copied
    assert max(map(len, prompts)) + N_NEW > 256  # the pools grow mid-run
    want = [truncated(a, eos) for a in alone]
    assert any(len(w) < N_NEW for w in want) and any(len(w) == N_NEW for w in want)
    n = len(prompts) if size > 1 else 6
    got, decoded = {}, []
    dec = batch.BatchDecoder(rt.model, eos, batch=size, keep_hidden=True)
    for ans in dec.run(prompts[:n], N_NEW, on_token=decoded.append):
        assert ans.index not in got
        got[ans.index] = ans
        assert ans.hidden.shape == (len(ans.tokens), rt.model.config.hidden_size)
        assert ans.stop_reason == ("eos" if ans.tokens[-1] in eos else "length")
    assert sorted(got) == list(range(n))
    for i in range(n):
        assert got[i].tokens == want[i], f"prompt {i} (of {len(prompts[i])} tokens) at batch {size}"
    assert sum(decoded) == sum(len(got[i].tokens) for i in range(n))


def test_hidden_states_are_the_engine_s(rt, prompts):
    """The kept hidden state before each token is the engine's own (what the heads train on)."""
    from entmtp.model import forward

    ids = prompts[3]
    dec = batch.BatchDecoder(rt.model, (), batch=4, keep_hidden=True)
    ans = {a.index: a for a in dec.run(prompts[:4], 6)}[3]
    cache = rt.engine.new_cache()
    with torch.inference_mode():  # the prompt's, then one token at a time, as decoding makes them
        h, _ = forward.forward(rt.model, cache, torch.tensor([ids]), torch.arange(len(ids))[None], None)
        assert torch.equal(ans.hidden[0], h[-1])
        for j in range(5):
            hj, _ = forward.forward(rt.model, cache, torch.tensor([[ans.tokens[j]]]), torch.tensor([[len(ids) + j]]), None)
            assert torch.equal(ans.hidden[j + 1], hj[-1])


def test_common_opening():
    assert batch.common_opening([list(range(20)), list(range(12)) + [99]]) == 12
    assert batch.common_opening([list(range(20)), list(range(20))]) == 19  # each prompt keeps a token of its own
    assert batch.common_opening([list(range(20)), list(range(7)) + [99]]) == 0  # under MIN_SHARED
    assert batch.common_opening([list(range(20))]) == 0


def test_bad_requests_are_refused(rt):
    with pytest.raises(ValueError, match="batch must be"):
        batch.BatchDecoder(rt.model, (), batch=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        list(batch.BatchDecoder(rt.model, (), batch=2).run([[1, 2], []], 4))


def test_train_heads_answers_through_the_batched_decoder(rt, prompts, alone):
    """`train.generate_batch` on the fused model decodes through `BatchDecoder`: the answers decoding
    alone gives, and the hidden states transformers' padded batch computes (to float32 rounding)."""
    from entmtp.tools import train

    ids = prompts[:6]
    eos = {alone[0][4]}
    got = train.generate_batch(rt.model, ids, N_NEW, eos, 0)
    ref = train.padded_batch(rt.model, ids, N_NEW, eos, 0)
    for i, ((h, t), (rh, rt_)) in enumerate(zip(got, ref)):
        assert t.tolist() == truncated(alone[i], eos) == rt_.tolist()
        assert h.shape == rh.shape and torch.allclose(h, rh, atol=1e-3, rtol=1e-3)


def test_a_conversation_s_turns_continue_their_parent_s_cache(rt, alone, prompts):
    """Prompts given parents (a conversation's turns, each extending the one before) take their
    parent's slot and prefill only their own tokens, and answer exactly as alone."""
    from entmtp.runtime.runtime import chat_ids

    engine = Engine(rt.model, ())
    ar = Strategy("ar", (compile_tree([], "ar"),), StaticPolicy(0))
    turns = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
              {"role": "user", "content": "And a fruit?"}],
             [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
              {"role": "user", "content": "And a fruit?"}, {"role": "assistant", "content": "A pear."},
              {"role": "user", "content": "Why?"}]]
    convo = chat_ids(rt.tokenizer, turns, rt.name)
    ids = prompts[:5] + convo + prompts[5:9]
    parents = [None] * 5 + [None, 5, 6] + [None] * 4
    want = [collect(engine.generate(p, ar, GenerationConfig(max_new_tokens=N_NEW))).token_ids for p in convo]
    prefilled = []
    dec = batch.BatchDecoder(rt.model, (), batch=3, keep_hidden=True)
    real = dec._prefill
    dec._prefill = lambda s, tokens, past: prefilled.append((len(tokens), past)) or real(s, tokens, past)
    got = {a.index: a.tokens for a in dec.run(ids, N_NEW, parents=parents)}
    assert [got[5], got[6], got[7]] == want
    assert [got[i] for i in range(5)] == alone[:5] and [got[i] for i in range(8, 12)] == alone[5:9]
    # turns 2 and 3 prefilled from their parent's length, their own tokens only
    assert (len(convo[1]) - len(convo[0]), len(convo[0])) in prefilled
    assert (len(convo[2]) - len(convo[1]), len(convo[1])) in prefilled
    with pytest.raises(ValueError, match="does not extend its parent"):
        list(batch.BatchDecoder(rt.model, (), batch=2).run([convo[1], convo[0]], 4, parents=[None, 0]))


def test_answers_read_back_give_the_states_decoding_kept(rt, prompts):
    """`read_back` (the heads' corpus teacher-forced on the served stack): one block a sequence,
    the same hidden states as decoding kept, bit for bit, a conversation's turn continuing its
    parent's cache included."""
    from entmtp.runtime.runtime import chat_ids

    turns = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
              {"role": "user", "content": "And a fruit?"}]]
    ids = prompts[:3] + chat_ids(rt.tokenizer, turns, rt.name)
    parents = [None, None, None, None, 3]
    dec = batch.BatchDecoder(rt.model, (), batch=3, keep_hidden=True)
    decoded = {a.index: a for a in dec.run(ids, 12, parents=parents)}
    back = list(batch.BatchDecoder(rt.model, (), batch=1).read_back(ids, [decoded[i].tokens for i in range(len(ids))], parents))
    assert [i for i, _ in back] == list(range(len(ids)))
    for i, hidden in back:
        assert torch.equal(hidden, decoded[i].hidden), i


def test_grow_answers_appends_what_no_store_holds_and_resumes(rt, tmp_path, capsys):
    """`grow-answers` on the served model: new answers land in the store given, as `generate --batch`
    gives them; a prompt either store answers (in either arithmetic) is skipped, so a rerun plans
    nothing."""
    import json

    from entmtp.__main__ import main
    from entmtp.data.answers import AnswerStore
    from entmtp.tools import answers

    store = tmp_path / "corpus.jsonl.gz"
    args = ["grow-answers", "--sources", "code/sharegpt=3,math/self=2", "--store", str(store), "--batch", "2"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the repository's store answers the first code/sharegpt and math/self training prompts already (float32
    # arithmetic, train-heads' 160-token cap), so nothing is planned: the skip crosses arithmetics
    assert first["planned"] == 0 and first["skipped"]["math/self"]["stored"] == 2
    turns = ["grow-answers", "--sources", "chat/turns=3", "--answer-tokens", "6", "--store", str(store), "--batch", "2"]
    assert main(turns) == 0
    grown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert grown["answers"] == grown["planned"] == 3 and grown["store"]["answers"] == 3
    texts, _ = answers.source_prompts("chat/turns")
    ids = [p for p in rt.encode_all(texts[:20]) if len(p) <= 1024][:3]
    got = AnswerStore(store, rt.name + rt.arithmetic)
    want = {a.index: a.tokens for a in batch.BatchDecoder(rt.model, rt.engine.eos, batch=1).run(ids, 6)}
    assert [got.get(p, 6) for p in ids] == [want[i] for i in range(3)]
    assert main(turns) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["planned"] == 0


def test_a_served_teacher_answers_on_the_served_kernels_and_reads_back_the_same_states(rt, tmp_path, monkeypatch):
    """`train-heads --teacher q8`: the heads' corpus from the served arithmetic. Missing answers are
    decoded in a batch on the served kernels (each the served model's answer alone) and stored; a new
    work folder reads them back teacher-forced with the same states, bit for bit; a work folder built
    with the other teacher is refused."""
    from dataclasses import replace

    from entmtp.config import TrainConfig
    from entmtp.data.answers import AnswerStore
    from entmtp.tools import train

    cfg = replace(TrainConfig(), self_prompts=(("chat", 3),), ref_prompts=(), answer_tokens=6, gen_batch=3, teacher="q8")
    store = AnswerStore(tmp_path / "served.jsonl.gz", rt.name + "+q8")
    eos = set(rt.engine.eos)
    first = train.build_corpus(rt.model, rt.encode, rt.encode, eos, 0, cfg, tmp_path / "a", "train", progress=False, answers=store)
    ids = [rt.encode(p) for p in first.prompts]
    alone = [next(batch.BatchDecoder(rt.model, eos, batch=1).run([p], 6)).tokens for p in ids]
    assert [t.tolist() for t in first.tokens] == alone == [store.get(p, 6) for p in ids]
    monkeypatch.setattr(train, "generate_batch", lambda *a: pytest.fail("generated although every answer was stored"))
    again = train.build_corpus(rt.model, rt.encode, rt.encode, eos, 0, cfg, tmp_path / "b", "train", progress=False,
                               answers=AnswerStore(store.path, store.model))
    assert all(torch.equal(a, b) for a, b in zip(first.hidden, again.hidden))
    with pytest.raises(train.TrainError, match="teacher"):
        train.build_corpus(rt.model, rt.encode, rt.encode, eos, 0, replace(cfg, teacher="packed"), tmp_path / "a", "train",
                           progress=False, answers=store)
