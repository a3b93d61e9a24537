"""What the heads' top-1 chain in one extension call (`HeadChain`, heads on Q8 blocks) saves a
decode step, against the same heads run module by module from Python (the same bits: both draft
the same tokens, so both accept the same).

Per tree (plain decoding, the 2-, 3- and 4-node chains) and per way of running the heads, interleaved
prompt by prompt: the median step and phase times (ms) over 3 code and 3 chat calibration prompts,
64 new tokens each, after an untimed round; and EntMTP-tau over the shipped banks (tokens/s on the
same prompts). Writes the figures as JSON to the path given (default: stdout only).

    PYTHONPATH=. python scripts/head_chain_cost.py [out.json]
"""

import json
import statistics
import sys
import time

from entmtp.config import GenerationConfig, ModelConfig
from entmtp.data import prompts as data
from entmtp.machine import hardware
from entmtp.runtime.runtime import load_runtime
from entmtp.spec.engine import Strategy, collect
from entmtp.spec.policy import StaticPolicy
from entmtp.spec.topology import chain_paths, compile_tree


def main() -> None:
    rt = load_runtime(ModelConfig())
    heads = rt.heads("hydra")
    chain = heads._chain
    if chain is None:
        sys.exit("the heads are not on Q8 blocks here: nothing to compare")
    trees = [compile_tree(chain_paths(n - 1), f"chain{n}") for n in (1, 2, 3, 4)]
    prompts = [(t, rt.encode(p)) for t in ("code", "chat") for p in data.prompts(t, "calib")[:3]]
    gen = GenerationConfig(max_new_tokens=64)
    steps: dict[str, dict[str, list[float]]] = {}
    tau: dict[str, list[float]] = {}
    for timed in (False, True, True):
        for task, ids in prompts:
            for way in ("one call", "modules"):
                heads._chain = chain if way == "one call" else None
                for tree in trees:
                    if tree.n_nodes == 1 and way == "modules":
                        continue  # plain decoding runs no heads
                    strategy = Strategy(tree.name, (tree,), StaticPolicy(0), heads if tree.n_nodes > 1 else None)
                    records = list(rt.engine.generate(ids, strategy, gen))[2:]
                    if timed:
                        row = steps.setdefault(f"{tree.name} | {way}" if tree.n_nodes > 1 else tree.name, {})
                        for r in records:
                            row.setdefault("step", []).append(r.step_ms)
                            for phase, ms in r.ms.items():
                                row.setdefault(phase, []).append(ms)
                start = time.perf_counter()
                result = collect(rt.run("entmtp-tau", task, ids, gen))
                if timed:
                    tau.setdefault(way, []).append(result.new_tokens / (time.perf_counter() - start))
    heads._chain = chain
    out = {
        "hardware": hardware(),
        "kernels": rt.fingerprint["kernels"],
        "what": "median step and phase ms per tree; entmtp-tau tokens/s per prompt (shipped banks)",
        "steps": {k: {p: round(statistics.median(v), 3) for p, v in row.items()} for k, row in steps.items()},
        "entmtp_tau_tok_s": {way: round(statistics.median(v), 1) for way, v in tau.items()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
