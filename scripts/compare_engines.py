"""The engine of an earlier commit against this checkout's, interleaved on this machine: one JSON record.

    python scripts/compare_engines.py --old <rev> [--methods ar,entmtp-static,entmtp-tau] [--out FILE]

The old engine runs from a git worktree of `<rev>` with its own build of the C++ kernels (its own
TORCH_EXTENSIONS_DIR), in a process of its own; this checkout's runs in another. Both read this
checkout's banks (same trees, same policies, same fit), so what differs is the code alone; with
`--own-banks` each side reads its own commit's banks (and heads), each fitted on this machine. Per
prompt the two take turns, the side going first swapped every prompt, after an untimed warm-up
of each; a method's figure is its new tokens over its decode time (prefill excluded) per task.
Both sides' token ids must be equal (the same served arithmetic) and every method's equal to
`ar`'s (the greedy output), else it stops. Prompts: the tasks' calibration split (never the
evaluation prompts). Figures hold for this machine only: it is named, flags included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(repo: str, banks: str, max_new_tokens: int) -> None:
    """A side: read "method task index" lines, answer each with one JSON line."""
    sys.path.insert(0, repo)
    from entmtp.config import GenerationConfig
    from entmtp.data.prompts import prompts
    from entmtp.runtime.runtime import load_runtime
    from entmtp.spec.engine import collect

    rt = load_runtime(banks_dir=banks)
    gen, ids = GenerationConfig(max_new_tokens=max_new_tokens), {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        method, task, i = line.split()
        if (task, i) not in ids:
            ids[(task, i)] = rt.encode(prompts(task, "calib", int(i) + 1)[int(i)])
        res = collect(rt.run(method, task, ids[(task, i)], gen))
        decode_s = res.elapsed_s - res.steps[0].prefill_ms / 1e3
        print(json.dumps({"tokens": res.token_ids, "steps": len(res.steps), "decode_s": decode_s}), flush=True)


def _shown(path: str) -> str:
    """A path as a record names it: relative to the checkout where it lies inside."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def cpu_id() -> str:
    """The CPU's model name, family and model number as /proc/cpuinfo gives them ("" elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    first = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    return f"{first.get('model name', '?')}, family {first.get('cpu family', '?')} model {first.get('model', '?')}"


class Side:
    def __init__(self, repo: Path, ext_dir: str, banks: Path, max_new_tokens: int):
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext_dir, PYTHONPATH=str(repo))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(repo), "--banks", str(banks),
               "--max-new-tokens", str(max_new_tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
        self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise SystemExit(f"a side stopped (exit {self.proc.wait()})")

    def ask(self, method: str, task: str, i: int) -> dict:
        self.proc.stdin.write(f"{method} {task} {i}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="the earlier commit (any git revision)")
    ap.add_argument("--methods", default="ar,entmtp-static,entmtp-tau")
    ap.add_argument("--tasks", default="code,math,chat")
    ap.add_argument("--prompts-per-task", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--banks", default=str(ROOT / "banks"), help="the banks both sides read (default: this checkout's)")
    ap.add_argument("--own-banks", action="store_true",
                    help="each side reads its own commit's banks (and heads), each fitted here: the whole system against the whole system")
    ap.add_argument("--out", type=Path, help="also write the record here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.banks, args.max_new_tokens)
    if not args.old:
        ap.error("--old is required")
    from entmtp.machine import cpu_features, hardware

    methods, tasks = args.methods.split(","), args.tasks.split(",")
    rev = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode:
        ap.error(f"--old {args.old}: not a revision of this repository")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), rev.stdout.strip()], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            old_banks = tree / "banks" if args.own_banks else Path(args.banks)
            sides = {"old": Side(tree, str(Path(tmp) / "ext"), old_banks, args.max_new_tokens),
                     "new": Side(ROOT, os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions")),
                                 Path(args.banks), args.max_new_tokens)}
            for side in sides.values():  # untimed: kernels, caches, each tree size
                for t in tasks:
                    for m in methods:
                        side.ask(m, t, 0)
            acc: dict = {}
            for r in range(args.rounds):
                for t in tasks:
                    for i in range(args.prompts_per_task):
                        for m in methods:
                            for v in (("old", "new") if (r + i) % 2 else ("new", "old")):
                                out = sides[v].ask(m, t, i)
                                a = acc.setdefault((t, m, v), {"tokens": 0, "decode_s": 0.0, "steps": 0, "ids": []})
                                a["tokens"] += len(out["tokens"])
                                a["decode_s"] += out["decode_s"]
                                a["steps"] += out["steps"]
                                a["ids"].append(out["tokens"])
            for side in sides.values():
                side.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    rows = []
    for t in tasks:
        for m in methods:
            old, new = acc[(t, m, "old")], acc[(t, m, "new")]
            if old["ids"] != new["ids"]:
                raise SystemExit(f"{t} {m}: the two engines decoded different tokens")
            if "ar" in methods and new["ids"] != acc[(t, "ar", "new")]["ids"]:
                raise SystemExit(f"{t} {m}: not the greedy output")
            row = {"task": t, "method": m}
            for v, a in (("old", old), ("new", new)):
                row[f"{v}_tokens_per_s"] = round(a["tokens"] / a["decode_s"], 2)
                row[f"{v}_ms_per_step"] = round(a["decode_s"] * 1e3 / a["steps"], 3)
                if "ar" in methods:
                    base = acc[(t, "ar", v)]
                    row[f"{v}_over_ar"] = round(a["tokens"] / a["decode_s"] / (base["tokens"] / base["decode_s"]), 3)
            row["new_over_old"] = round(row["new_tokens_per_s"] / row["old_tokens_per_s"], 3)
            rows.append(row)
    record = {"hardware": hardware(), "cpu_flags": cpu_features(), "cpu": cpu_id(), "old": args.old, "old_commit": rev.stdout.strip(), "new_commit": head,
              "date": datetime.date.today().isoformat(), "banks": "each side its own commit's" if args.own_banks else _shown(args.banks),
              "prompts": f"calib split, {args.prompts_per_task} a task",
              "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "lossless": True, "same_tokens": True, "rows": rows,
              "command": "python scripts/compare_engines.py " + " ".join(sys.argv[1:])}
    for row in rows:
        print(f"{row['task']:5} {row['method']:14} old {row['old_tokens_per_s']:7.1f} tok/s"
              + (f" ({row['old_over_ar']:.2f}x ar)" if "old_over_ar" in row else "")
              + f"  new {row['new_tokens_per_s']:7.1f}" + (f" ({row['new_over_ar']:.2f}x ar)" if "new_over_ar" in row else "")
              + f"  new/old {row['new_over_old']:.3f}")
    print(json.dumps(record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
