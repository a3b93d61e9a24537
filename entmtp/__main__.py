"""Command line: `python -m entmtp {generate,bench,build-bank,train-heads}`.

Argument parsing lives here only. A bad argument or file prints one `entmtp: error: ...` line
and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from .config import METHODS, TASKS, GenerationConfig, ModelConfig

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage too)
        print(f"entmtp: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class UsageError(ValueError):
    """A bad argument value found after parsing."""


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    p.add_argument("--model", default=d.model, help="default alias, hub id or local path (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--heads", default=None, help="Hydra heads: folder (ours or official layout) or hub repo")
    p.add_argument("--medusa-heads", default=None, help="Medusa heads: folder or hub repo")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(model=args.model, dtype=args.dtype, device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m entmtp", description="EntMTP: entropy-guided multi-token prediction")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = GenerationConfig()

    gen = sub.add_parser("generate", help="generate text with one method")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts", help="JSONL file: {\"prompt\": str, \"task\": code|math|chat} per line")
    gen.add_argument("--task", choices=TASKS, default=None, help="selects the bank (default: the file's task, else chat)")
    gen.add_argument("--method", choices=METHODS, default="entmtp-tau")
    gen.add_argument("--max-new-tokens", type=positive_int, default=g.max_new_tokens)
    gen.add_argument("--temperature", type=non_negative_float, default=g.temperature)
    gen.add_argument("--seed", type=int, default=g.seed)
    gen.add_argument("--typical", action="store_true", help="Hydra/Medusa typical acceptance (LOSSY, temperature > 0 only)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_model_args(gen)
    return parser


def cmd_generate(args: argparse.Namespace) -> None:
    from .data import read_prompt_file
    from .engine import collect
    from .loading import load_runtime

    if args.typical and args.temperature == 0:
        raise UsageError("--typical needs --temperature > 0")
    if args.prompts:
        items = read_prompt_file(args.prompts, default_task=args.task)
        if args.task:
            items = [{**it, "task": args.task} for it in items]
    else:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty")
        items = [{"prompt": args.prompt, "task": args.task or "chat"}]
    rt = load_runtime(model_config(args), args.heads, args.medusa_heads)
    gen = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, typical=args.typical
    )
    for it in items:
        ids = rt.encode(it["prompt"])
        res = collect(rt.run(args.method, it["task"], ids, gen))
        text = rt.decode(res.token_ids)
        if args.json:
            print(json.dumps(generation_json(it, args.method, text, res), ensure_ascii=False), flush=True)
        else:
            print(text, flush=True)
            print(
                f"[{args.method} | {it['task']}] {res.new_tokens} tokens in {len(res.steps)} steps, "
                f"{res.tokens_per_s:.1f} tok/s, {res.mean_accepted:.2f} tokens/step",
                file=sys.stderr,
            )


def generation_json(item: dict, method: str, text: str, res) -> dict[str, Any]:
    return {
        "prompt": item["prompt"],
        "method": method,
        "task": item["task"],
        "text": text,
        "token_ids": res.token_ids,
        "new_tokens": res.new_tokens,
        "steps": len(res.steps),
        "mean_accepted": round(res.mean_accepted, 4),
        "tokens_per_s": round(res.tokens_per_s, 3),
        "elapsed_s": round(res.elapsed_s, 4),
        "phase_ms": {k: round(v, 2) for k, v in res.phase_ms().items()},
        "stop_reason": res.steps[-1].stop_reason if res.steps else "",
        "trace": [r.trace() for r in res.steps],
    }


COMMANDS = {"generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    from .bank import BankError
    from .data import DataError
    from .engine import GenerationError
    from .heads import HeadsError
    from .loading import LoadError
    from .topology import TopologyError

    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (UsageError, DataError, LoadError, GenerationError, HeadsError, BankError, TopologyError) as e:
        print(f"entmtp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("entmtp: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
