"""Step cost of Hydra++ heads (`prefix-mlp`: a decoder layer over the base hidden states before
the MLP heads) against the shipped `mlp` heads, on the same trees, prompts and machine.

The cost of a step does not depend on the heads' weights, so the Hydra++ heads here are fresh
(seeded) ones with the shipped heads' draft vocabulary; their drafts are not accepted, so every
step verifies the whole tree. Prints per tree and head kind the median step and phase times (ms)
over 3 calibration prompts, 48 new tokens each, after an untimed round.

    PYTHONPATH=. python scripts/hydra_prefix_cost.py
"""

import json
import statistics
import tempfile

import torch

from entmtp.data import prompts as data
from entmtp.config import DEFAULT_MODEL, TREES_FILE, GenerationConfig, ModelConfig, TrainConfig
from entmtp.spec.engine import Strategy
from entmtp.spec.headfiles import load_heads, save_heads
from entmtp.runtime.runtime import default_heads_dir, load_runtime, resolve_heads
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import load_named_trees
from entmtp.tools.train import new_heads


def main() -> None:
    rt = load_runtime(ModelConfig(kernels="packed"))
    shipped = load_heads(default_heads_dir(DEFAULT_MODEL, "hydra"), rt.model.config)
    torch.manual_seed(0)
    fresh = new_heads("hydra", TrainConfig(arch="prefix-mlp", num_layers=shipped.num_layers), rt.model)
    fresh.draft_vocab = shipped.draft_vocab.clone()
    folder = tempfile.mkdtemp()
    save_heads(fresh, folder, {"note": "fresh prefix-mlp heads, for timing only"})
    heads = {"mlp": rt.heads("hydra"), "prefix-mlp": resolve_heads(rt.model, DEFAULT_MODEL, "hydra", folder)}
    bank = {t.name: t for t in rt.bank("chat").trees}
    trees = [bank[n] for n in ("n2-d1", "n5-d3") if n in bank] + [load_named_trees(TREES_FILE)["mc_sim_7b_63"]]
    prompts = [rt.encode(p) for p in data.prompts("chat", "calib")[:3]]
    gen = GenerationConfig(max_new_tokens=48)
    times: dict[str, list[float]] = {}
    for timed in (False, True):
        for tree in trees:
            for label, h in heads.items():
                strategy = Strategy(label, (tree,), StaticPolicy(0), h)
                for ids in prompts:
                    records = list(rt.engine.generate(ids, strategy, gen))[2:]
                    if timed:
                        times.setdefault(f"{tree.name}|{label}", []).extend(r.step_ms for r in records)
                        for r in records:
                            for phase, ms in r.ms.items():
                                times.setdefault(f"{tree.name}|{label}|{phase}", []).append(ms)
    print(json.dumps({k: round(statistics.median(v), 2) for k, v in times.items()}))


if __name__ == "__main__":
    main()
