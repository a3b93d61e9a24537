"""Traces on the real default model: a simulated decode equals a real rollout, tree by tree.

With float32 heads (`--kernels stock`) the simulation must be exact, and so must it with the packed
kernels, whose draft heads compute each row on its own in int8 (`kernels.Int8RowLinear`): a head
called on one row in the engine and on hundreds of positions in the traces gives the same numbers.
Where int8 is missing and the heads run in bfloat16 instead, a batched row rounds differently; there
the residual is bounded (see DESIGN.md, *Where the bank is fitted*).
"""

from __future__ import annotations

import pytest
import torch

from conftest import SERVE_THREADS
from entmtp.model import gguf, kernels
from entmtp.bank import record as rec
from entmtp.bank import traces as tr
from entmtp.bank.bank import TopologyBank
from entmtp.bank.fit import _quantiles
from entmtp.config import TREES_FILE, GenerationConfig, ModelConfig, PhrasebookRule
from entmtp.data.prompts import prompts
from entmtp.spec.engine import Strategy, collect
from entmtp.spec.phrasebook import Reranker
from entmtp.runtime.runtime import load_runtime
from entmtp.spec.policy import StaticPolicy, TauPolicy
from entmtp.spec.topology import compile_tree, load_named_trees

pytestmark = pytest.mark.slow
N_NEW = 48
TREES = [[], [[0]], [[0], [1], [0, 0]], [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]]


def rollout_vs_simulation(kernels: str, task: str, n_prompts: int, phrasebook: bool = False):
    torch.set_num_threads(SERVE_THREADS)
    try:
        rt = load_runtime(ModelConfig(kernels=kernels))
        heads = rt.heads("hydra")
        book, rule = (rt.phrasebook(), rt.phrasebook_rule()) if phrasebook else (None, PhrasebookRule())
        assert not phrasebook or isinstance(rule, Reranker), "the shipped reranker should be found beside the Hydra heads"
        ids = [rt.encode(p) for p in prompts(task, "calib", n_prompts)]
        traces = rec.record_all(rt.engine, heads, ids, N_NEW, 4, book=book, rule=rule)
        trees = [compile_tree(p, f"t{i}") for i, p in enumerate(TREES)] + [load_named_trees(TREES_FILE)["mc_sim_7b_63"]]
        rows = []
        for tree in trees:
            st = Strategy(tree.name, (tree,), StaticPolicy(0), heads if tree.max_depth else None, book if tree.max_depth else None, rule)
            real = [collect(rt.engine.generate(p, st, GenerationConfig(max_new_tokens=N_NEW))) for p in ids]
            sim = tr.simulate(tr.Tables([tree], traces), StaticPolicy(0).chooser, [t.p0 for t in traces], [1.0])
            rows.append((tree.name, sum(len(r.steps) for r in real), sim.steps, sum(r.new_tokens for r in real), sim.tokens))
        # a switching policy on the heads' path value: the engine's picks equal the simulation's
        bank = TopologyBank(trees[1:4], [{}] * 3, {})
        # thresholds at the thirds, halfway between two recorded values as `calibrate` places them: the
        # traces keep 6-7 significant digits, so a threshold on a recorded value could split a tie either way
        low, high = _quantiles([v for t in traces for v in t.feature("path_value", bank.max_depth)], 3)
        tau = TauPolicy(0, 2, high, low, "path_value")
        real = [collect(rt.engine.generate(p, Strategy("tau", bank, tau, heads, book, rule), GenerationConfig(max_new_tokens=N_NEW)))
                for p in ids]
        sim = tr.simulate(tr.Tables(bank.trees, traces), tau.chooser, [t.feature("path_value", bank.max_depth) for t in traces], [1.0] * 3)
        picks = ([r.tree_index for res in real for r in res.steps], sim.picks)
        return rows, picks
    finally:
        torch.set_num_threads(1)


def test_float32_heads_simulate_exactly():
    rows, (real_picks, sim_picks) = rollout_vs_simulation("stock", "code", 2)
    for name, real_steps, sim_steps, real_tokens, sim_tokens in rows:
        assert (real_steps, real_tokens) == (sim_steps, sim_tokens), name
    # the path value is the heads' own top-1 chain, run on one row by the engine and over all
    # positions at once in the traces: a value next to a threshold can fall on the other side
    assert len(set(real_picks)) > 1, "the τ policy should switch on these thresholds"
    agree = sum(a == b for a, b in zip(real_picks, sim_picks)) / max(len(real_picks), len(sim_picks))
    assert agree >= 0.9 and abs(len(real_picks) - len(sim_picks)) <= 2, (agree, len(real_picks), len(sim_picks))


@pytest.mark.parametrize("base", ["packed", "q8"])
def test_packed_heads_simulate_exactly(base):
    rows, (real_picks, sim_picks) = rollout_vs_simulation(base, "chat", 2)
    exact = gguf.extension() is not None or kernels.int8_available("cpu")  # heads batch-invariant: Q8 blocks or int8 rows
    for name, real_steps, sim_steps, real_tokens, sim_tokens in rows:
        assert real_tokens == sim_tokens, name
        if exact:
            assert real_steps == sim_steps, (name, real_steps, sim_steps)
        else:
            assert abs(real_steps - sim_steps) <= max(2, 0.05 * real_steps), (name, real_steps, sim_steps)
    if exact:  # measured on the AMD EPYC: every pick of the switching τ equal, on chat and on code
        assert real_picks == sim_picks


def test_phrasebook_drafts_simulate_exactly():
    """The served model drafting with its phrasebook first on the spine (what the shipped banks
    record): every tree's steps and a τ's picks as the traces recorded with it predict."""
    rows, (real_picks, sim_picks) = rollout_vs_simulation("q8", "chat", 2, phrasebook=True)
    for name, real_steps, sim_steps, real_tokens, sim_tokens in rows:
        assert (real_steps, real_tokens) == (sim_steps, sim_tokens), name
    assert len(set(real_picks)) > 1, "the τ policy should switch on these thresholds"
    agree = sum(a == b for a, b in zip(real_picks, sim_picks)) / max(len(real_picks), len(sim_picks))
    assert agree >= 0.9 and abs(len(real_picks) - len(sim_picks)) <= 2, (agree, len(real_picks), len(sim_picks))


_TRACE_SCRIPT = """
import hashlib, json, torch
torch.set_num_threads(1)
from entmtp.bank import record as rec
from entmtp.config import ModelConfig
from entmtp.data.prompts import prompts
from entmtp.model import serve
from entmtp.runtime.runtime import load_runtime
rt = load_runtime(ModelConfig())
heads = rt.heads("hydra")
blocks = hashlib.sha256()
for module in heads.modules():
    for name in ("qs", "d", "m", "smooth", "bias"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            blocks.update(t.contiguous().numpy().tobytes())
ids = [rt.encode(p) for p in prompts("chat", "calib", 1)]
traces = rec.record_all(rt.engine, heads, ids, 40, 4, book=rt.phrasebook(), rule=rt.phrasebook_rule())
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "base": serve.label(rt.model), "heads": heads.numerics,
                  "blocks": blocks.hexdigest(), "traces": [t.to_json() for t in traces]}))
"""


def test_traces_do_not_follow_atens_vector_width():
    """A bank's traces (the base model's p0 and entropy, the heads' blocks, ranks and chain, with
    the phrasebook's reranker) are the same bits whatever vector width ATen dispatches to: ATen's
    softmax, log-softmax and SiLU sum in the order of their width (AVX-512 on a Xeon, AVX2 on an
    AMD EPYC Zen 3, scalar with ATEN_CPU_CAPABILITY=default), and the shipped traces recorded on one
    differed on the other, so the served path computes them in the extension instead. Here ATen
    runs at this CPU's width and at the scalar one; the extension's kernels are the same."""
    import json
    import os
    import subprocess
    import sys

    def start(capability: str | None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        return subprocess.Popen([sys.executable, "-c", _TRACE_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(proc: subprocess.Popen) -> dict:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    # the two at once, one thread each (the script sets it): the traces do not depend on the timing
    both = [start(None), start("default")]
    try:
        wide, scalar = map(result, both)
    finally:
        for proc in both:
            proc.kill()
    assert wide["aten"] in ("AVX2", "AVX512") and scalar["aten"] == "DEFAULT"
    assert wide["base"] == scalar["base"] and "blocks" in wide["heads"]  # the same kernels serve both
    assert wide["blocks"] == scalar["blocks"]
    assert wide["traces"] == scalar["traces"]
