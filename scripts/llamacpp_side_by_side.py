"""llama.cpp on the default model's GGUF and the bench's evaluation prompts, for a side-by-side
with `python -m entmtp bench` on the same machine. Optional: nothing in entmtp needs llama.cpp.

Two steps, because llama-cpp-python builds llama.cpp from source and is best kept in its own
virtual environment:

    python scripts/llamacpp_side_by_side.py --write-prompts prompts.jsonl   # in entmtp's environment
    python -m venv /tmp/lcpp && /tmp/lcpp/bin/pip install llama-cpp-python  # builds llama.cpp (~10 min on 2 cores)
    /tmp/lcpp/bin/python scripts/llamacpp_side_by_side.py --prompts prompts.jsonl --gguf PATH

The first writes the evaluation prompts `bench` uses (4 per task by default) and prints the GGUF's
path; the second decodes each prompt greedily through the model's chat template (up to 128 new
tokens, 2 threads), prints tokens/s per prompt and per task (wall time, prompt processing
included, as `bench` counts it), then one JSON line. llama.cpp multiplies 8-bit quantised
activations with the 4-bit weights, so its tokens are its own model's, not ours token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def write_prompts(path: str, per_task: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from entmtp.data import prompts as data
    from entmtp.config import TASKS
    from entmtp.runtime.weights import default_gguf

    with open(path, "w") as f:
        for task in TASKS:
            for prompt in data.prompts(task, "eval", per_task):
                f.write(json.dumps({"prompt": prompt, "task": task}) + "\n")
    print(f"{path}: {per_task} evaluation prompts per task; GGUF: {default_gguf()}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(prompts: str, gguf: str, threads: int, max_new: int) -> None:
    from llama_cpp import Llama, __version__

    items = [json.loads(line) for line in open(prompts) if line.strip()]
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False, seed=0)
    llm.create_chat_completion([{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0.0, top_k=1)  # warm-up
    per_task: dict[str, list[tuple[int, float]]] = {}
    for it in items:
        t0 = time.perf_counter()
        out = llm.create_chat_completion([{"role": "user", "content": it["prompt"]}], max_tokens=max_new, temperature=0.0, top_k=1)
        dt = time.perf_counter() - t0
        n = out["usage"]["completion_tokens"]
        per_task.setdefault(it["task"], []).append((n, dt))
        print(f"{it['task']:5} {n:4d} tokens {dt:6.2f} s {n / dt:6.1f} tok/s", flush=True)
    tasks = {t: round(sum(n for n, _ in r) / sum(d for _, d in r), 2) for t, r in per_task.items()}
    hardware = f"cpu {cpu_name()}, {os.cpu_count()} cores, {threads} threads"
    print(f"llama.cpp (llama-cpp-python {__version__}) on {hardware}: " + ", ".join(f"{t} {v} tok/s" for t, v in tasks.items()))
    print(json.dumps({"engine": f"llama-cpp-python {__version__}", "hardware": hardware, "gguf": gguf, "max_new_tokens": max_new,
                      "prompts": len(items), "tokens_per_s": tasks}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-prompts", metavar="FILE", help="write the evaluation prompts (run in entmtp's environment)")
    p.add_argument("--per-task", type=int, default=4)
    p.add_argument("--prompts", metavar="FILE", help="JSONL written by --write-prompts")
    p.add_argument("--gguf", help="the GGUF file (printed by --write-prompts)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args()
    if a.write_prompts:
        write_prompts(a.write_prompts, a.per_task)
    elif a.prompts and a.gguf:
        run(a.prompts, a.gguf, a.threads, a.max_new_tokens)
    else:
        p.error("give --write-prompts FILE, or --prompts FILE and --gguf PATH")


if __name__ == "__main__":
    main()
