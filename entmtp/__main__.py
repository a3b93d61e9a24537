"""Command line: `python -m entmtp {generate,bench,report,calibrate,build-bank,train-heads,eval-heads,kernels,prepare}`.

Argument parsing and dispatch only: each command's work lives in its module (engine, bench,
report, calibrate, train, evalheads, kernels). A bad argument or file prints one
`entmtp: error: ...` line and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from entmtp.config import (DEFAULT_MODEL, EVAL_HEADS_PROMPTS, EVAL_SETS, CUDA_GRAPHS, KERNELS, METHODS, TASKS, BankBuildConfig, BenchConfig, CalibrateConfig, GenerationConfig, GrowAnswersConfig,
                     KernelBenchConfig, ModelConfig, TrainConfig)

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage too)
        print(f"entmtp: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class UsageError(ValueError):
    """A bad argument value found after parsing."""


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be {'positive' if least == 1 else f'>= {least}'}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    v = non_negative_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def source_counts(text: str) -> dict:
    """`chat/turns=5000,math/self` -> {"chat/turns": 5000, "math/self": None} over grow-answers' sources."""
    from entmtp.tools.answers import SOURCES

    out: dict = {}
    for part in text.split(","):
        name, eq, n = part.partition("=")
        if name.strip() not in SOURCES:
            raise argparse.ArgumentTypeError(f"unknown source {name.strip()!r} in {text!r} (expected {', '.join(SOURCES)})")
        out[name.strip()] = positive_int(n.strip()) if eq else None
    return out


def add_model_args(p: argparse.ArgumentParser, fit: bool = True) -> None:
    d = ModelConfig()
    if fit:
        p.add_argument("--no-calibrate", action="store_true",
                       help="use the fit shipped in the bank file instead of this machine's (no timing run)")
        p.add_argument("--no-refit", action="store_true",
                       help="serve EntMTP's policies as fitted: no refit at the live step costs, no probe steps")
    p.add_argument("--model", default=d.model, help="default alias, hub id or local path (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--kernels", default=d.kernels, choices=list(KERNELS),
                   help="CPU linears. q8: the GGUF's Q4_1/Q8_0 blocks for the default model with the inputs quantised "
                        "to Q8 blocks (llama.cpp's arithmetic), else oneDNN prepacked float32; packed: the same blocks in "
                        "float32 arithmetic; onednn: prepacked float32 only; stock: plain PyTorch (default: %(default)s)")
    p.add_argument("--cuda-graphs", default=d.cuda_graphs, choices=list(CUDA_GRAPHS),
                   help="tree verification on a GPU. on: one CUDA graph per tree size; compiled: their layers through "
                        "torch.compile too (compiles at warm-up); off: eager (default: %(default)s)")
    p.add_argument("--heads", default=None, help="Hydra heads: folder (ours or official layout) or hub repo")
    p.add_argument("--medusa-heads", default=None, help="Medusa heads: folder or hub repo")
    p.add_argument("--banks-dir", default=None, help="folder holding <model>/<task>.json banks (default: banks/)")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(model=args.model, dtype=args.dtype, device=args.device, kernels=args.kernels, cuda_graphs=args.cuda_graphs)


def _runtime(args: argparse.Namespace):
    """The runtime of a command that decodes: banks under this machine's fit (calibrated once if
    none is cached) unless --no-calibrate asks for the fit shipped in the bank file."""
    from entmtp.runtime.runtime import load_runtime

    rt = load_runtime(model_config(args), args.heads, args.medusa_heads, args.banks_dir,
                      fit_mode="shipped" if args.no_calibrate else "auto", progress=_progress)
    rt.follow_live = not getattr(args, "no_refit", False)  # refits at the live costs while serving (`bank.refit`)
    return rt


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
    gen.add_argument("--batch", type=positive_int, default=None, metavar="N",
                     help="with --method ar: decode N prompts at once on the served kernels, a finished one replaced by the "
                          "next (each answer token-identical to decoding it alone; answers printed in prompt order)")
    b = BankBuildConfig()
    gen.add_argument("--build-prompts", type=positive_int, default=b.calib_prompts,
                     help="where the model has no bank for the task and one is built here first: its calibration prompts "
                          "(default: %(default)s, as build-bank)")
    gen.add_argument("--build-tokens", type=positive_int, default=b.calib_new_tokens,
                     help="and the greedy tokens traced a prompt (default: %(default)s)")
    add_model_args(gen)

    t = TrainConfig()
    tr = sub.add_parser("train-heads", help="self-distil Hydra and/or Medusa heads for a model (resumable)")
    tr.add_argument("--kind", choices=["hydra", "medusa", "both"], default="both")
    tr.add_argument("--out", default=None, help="folder receiving <kind>/ (default: assets/heads/<model>/)")
    tr.add_argument("--work", default=None, help="corpus shards and checkpoints (default: checkpoints/heads/<model>)")
    resume = tr.add_mutually_exclusive_group()
    resume.add_argument("--resume", dest="resume", action="store_true", default=True, help="continue from the work folder (default)")
    resume.add_argument("--fresh", dest="resume", action="store_false", help="restart training (corpus shards are kept)")
    tr.add_argument("--steps", type=positive_int, default=t.steps)
    tr.add_argument("--batch-tokens", type=positive_int, default=t.batch_tokens, help="anchors per step")
    tr.add_argument("--lr", type=non_negative_float, default=t.lr)
    tr.add_argument("--num-layers", type=positive_int, default=t.num_layers)
    tr.add_argument("--arch", choices=["mlp", "prefix-mlp"], default=t.arch,
                    help="Hydra heads: mlp, or prefix-mlp (Hydra++: a decoder layer over the base hidden states first)")
    tr.add_argument("--draft-vocab", type=positive_int, default=t.draft_vocab, help="K most frequent answer tokens")
    tr.add_argument("--hard-targets", action="store_true", help="train on the teacher's argmax, not its distribution")
    tr.add_argument("--feature-dropout", type=float, default=t.feature_dropout,
                    help="while training, zero each element of the base hidden state the heads read with this probability")
    tr.add_argument("--self-prompts", type=task_counts, default=t.self_prompts, metavar="TASK=N,...",
                    help="prompts per task answered by the base model (default: %(default)s)")
    tr.add_argument("--ref-prompts", type=task_counts, default=t.ref_prompts, metavar="TASK=N,...",
                    help="prompts per task whose reference answer is read teacher-forced (default: %(default)s)")
    tr.add_argument("--sharegpt-code", type=non_negative_int, default=t.sharegpt_code_prompts, metavar="N",
                    help="Python questions from chat's training split answered by the base model, as code (default: %(default)s)")
    tr.add_argument("--everyday", type=non_negative_int, default=t.everyday_prompts, metavar="N",
                    help="composed everyday requests (advice, how-to, messages, ...) answered by the base model, as chat "
                         "(default: %(default)s)")
    tr.add_argument("--turns", type=non_negative_int, default=t.turn_prompts, metavar="N",
                    help="ShareGPT's later human turns, each in its conversation's context, answered by the base model, as chat "
                         "(grow-answers' chat/turns; default: %(default)s)")
    tr.add_argument("--max-prompt-tokens", type=positive_int, default=t.max_prompt_tokens,
                    help="longer prompts are left out of the corpus (default: %(default)s; grow-answers answers "
                         f"contexts up to {GrowAnswersConfig().max_prompt_tokens})")
    tr.add_argument("--init", default="", metavar="DIR",
                    help="train further the heads in DIR/<kind>/ (our format; their draft vocabulary is kept unless "
                         "--new-vocab; Hydra mlp heads may grow deeper with --num-layers: new blocks start as the identity)")
    tr.add_argument("--new-vocab", action="store_true",
                    help="with --init: choose the --draft-vocab most frequent answer tokens of this corpus afresh")
    tr.add_argument("--teacher", choices=["packed", "q8"], default=t.teacher,
                    help="arithmetic of the states the heads learn from: packed (float32) or q8 (the served model's, "
                         "~3x faster to read back; answers it lacks are generated on the served kernels; default: %(default)s)")
    tr.add_argument("--corpus-only", action="store_true", help="build the corpus (and store new answers), train nothing")
    tr.add_argument("--answers", default=None, metavar="FILE",
                    help="stored greedy answers, read and extended (default: data/answers/<model>.jsonl.gz for the "
                         "default model, <work>/answers.jsonl.gz otherwise)")
    tr.add_argument("--gen-batch", type=positive_int, default=t.gen_batch, help="prompts answered together (default: %(default)s)")
    tr.add_argument("--seed", type=int, default=t.seed)
    tr.add_argument("--model", default=ModelConfig().model, help="default alias, hub id or local path")
    tr.add_argument("--device", default=ModelConfig().device)

    ga = sub.add_parser("grow-answers", help="the served model's greedy answers to training prompts not answered yet, batched "
                                             "(the heads' corpus; resumable)")
    ga.add_argument("--sources", type=source_counts, default=None, metavar="SOURCE[=N],...",
                    help="where prompts come from, each with an optional limit (default: every source, no limit: "
                         "chat/turns, chat/self, math/self, code/sharegpt, chat/everyday)")
    gc = GrowAnswersConfig()
    ga.add_argument("--batch", type=positive_int, default=gc.batch, metavar="N", help="sequences decoded together (default: %(default)s)")
    ga.add_argument("--answer-tokens", type=positive_int, default=gc.answer_tokens,
                    help="answer cap (default: %(default)s, train-heads' training answers)")
    ga.add_argument("--max-prompt-tokens", type=positive_int, default=gc.max_prompt_tokens,
                    help="longer prompts are skipped (default: %(default)s)")
    ga.add_argument("--minutes", type=positive_float, default=None, help="stop after this long (the answers so far are kept)")
    ga.add_argument("--store", default=None, metavar="FILE",
                    help="the corpus store, read and extended (default: data/answers/<model>-corpus.jsonl.gz for the default model)")
    add_model_args(ga, fit=False)

    ev = sub.add_parser("eval-heads", help="held-out head accuracy and mean accepted length per task")
    ev.add_argument("--kind", choices=["hydra", "medusa", "both"], default="hydra")
    ev.add_argument("--prompts", type=set_counts, default=EVAL_HEADS_PROMPTS, metavar="SET=N,...",
                    help="prompts per evaluation set (default: %(default)s; everyday: chat's everyday requests)")
    ev.add_argument("--prompts-per-task", type=positive_int, default=None, help="the same number for every set instead")
    ev.add_argument("--max-new-tokens", type=positive_int, default=g.max_new_tokens)
    ev.add_argument("--tasks", default=",".join(EVAL_SETS), help="comma-separated evaluation sets (default: %(default)s)")
    ev.add_argument("--work", default=None, help="where the held-out corpus is cached (default: as train-heads)")
    ev.add_argument("--phrasebook", action="store_true",
                    help="also score Hydra heads drafting with the model's phrasebook first on the spine (as the shipped banks do)")
    ev.add_argument("--record", action="store_true",
                    help="write the accepted lengths into each evaluated heads folder's heads.json (docs/heads.md shows them)")
    add_model_args(ev)

    b = BankBuildConfig()
    bb = sub.add_parser("build-bank", help="record a task's acceptance traces and candidate trees, fit them here (resumable)")
    bb.add_argument("--task", choices=TASKS, required=True)
    bb.add_argument("--prompts", default=None, help="calibration prompts (JSONL); default: the task's calib split")
    bb.add_argument("--calib-prompts", type=positive_int, default=b.calib_prompts, help="prompts traced")
    bb.add_argument("--calib-new-tokens", type=positive_int, default=b.calib_new_tokens, help="greedy tokens traced per prompt")
    bb.add_argument("--max-candidates", type=positive_int, default=b.max_candidates)
    bb.add_argument("--out", default=None, help="bank file (default: banks/<model>/<task>.json)")
    bb.add_argument("--work", default=None, help="stage checkpoints (default: checkpoints/bank/<model>/<task>)")
    bb.add_argument("--fresh", action="store_true", help="discard the stage checkpoints and start over")
    bb.add_argument("--no-phrasebook", action="store_true",
                    help="draft the traces with the heads alone (default: with the model's phrasebook where it ships stored answers)")
    add_model_args(bb, fit=False)

    c = CalibrateConfig()
    ca = sub.add_parser("calibrate", help="time each bank tree on this machine and fit front and policies (cached)")
    ca.add_argument("--task", type=task_list, action="extend", default=None, help="task(s), repeatable or comma-separated (default: all)")
    ca.add_argument("--context", type=positive_int, default=c.context, help="tokens of context a step is timed at")
    ca.add_argument("--rounds", type=positive_int, default=c.rounds, help="timed rounds per tree")
    ca.add_argument("--steps", type=positive_int, default=c.steps, help="decode steps timed per round")
    ca.add_argument("--ship", action="store_true",
                    help="also save the fit into the bank files as the fit they ship with (for maintainers)")
    add_model_args(ca, fit=False)

    bc = BenchConfig()
    be = sub.add_parser("bench", help="every method side by side on this machine: a table, then one JSON line")
    be.add_argument("--prompts", default=None, help="JSONL prompt file (default: the eval split of each task)")
    be.add_argument("--methods", type=method_list, default=list(METHODS), help="comma-separated (default: all)")
    be.add_argument("--tasks", type=task_list, default=list(TASKS), help="tasks for the default prompts (default: all)")
    be.add_argument("--prompts-per-task", type=positive_int, default=bc.prompts_per_task)
    be.add_argument("--max-new-tokens", type=positive_int, default=bc.max_new_tokens)
    be.add_argument("--out", default=None, help="folder for results.json (per prompt) and the figure")
    be.add_argument("--repeats", type=positive_int, default=bc.repeats,
                    help="rounds of every method per prompt, each in a new rotation; the median run counts (default: %(default)s)")
    be.add_argument("--note", default=None, help="a remark stored with the results and shown by `report`")
    add_model_args(be)

    rp = sub.add_parser("report", help="regenerate BENCHMARKS.md, benchmarks/HISTORY.md and the generated blocks of "
                                       "README.md and docs/ from the committed results")
    rp.add_argument("files", nargs="*", help="bench results.json files: render only the benchmarks page of these "
                                             "(default: every committed result, every generated page)")
    rp.add_argument("--out", default=None, help="write only the benchmarks page, to this file (default: BENCHMARKS.md "
                                                "at the repository root, with the other pages)")

    k = KernelBenchConfig()
    pr = sub.add_parser("prepare", help="make this machine's served weights and CPU kernels ready (what `make setup` runs, "
                                        "so that the app's first start does not pay for them)")
    pr.add_argument("--model", default=ModelConfig().model, help="default alias, hub id or local path (default: %(default)s)")
    pr.add_argument("--watchdog", type=positive_int, default=900,
                    help="seconds after which a prepare that has not finished prints every thread's stack and exits "
                         "with 1 (it took ~40 s on the 2-core AMD EPYC Zen 4; `make setup` then tries once more) (default: %(default)s)")

    kn = sub.add_parser("kernels", help="packed against stock CPU kernels: a tree verification and the LM head, per tree size")
    kn.add_argument("--model", default=ModelConfig().model, help="default alias, hub id or local path (default: %(default)s)")
    kn.add_argument("--kernels", default=ModelConfig().kernels, choices=["q8", "packed"],
                    help="the served kernels timed against stock: see --kernels of generate (default: %(default)s)")
    kn.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own)")
    kn.add_argument("--reps", type=positive_int, default=k.reps, help="timed rounds, medians reported (default: %(default)s)")
    kn.add_argument("--context", type=positive_int, default=k.context, help="cached tokens a tree attends to (default: %(default)s)")
    kn.add_argument("--chain-only", action="store_true",
                    help="time only the Hydra heads' top-1 chain per depth (cold after a base step, and warm; bytes and bandwidth)")
    return parser


def method_list(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown method {bad[0] if bad else text!r} (choose from {', '.join(METHODS)})")
    return list(dict.fromkeys(out))


def task_list(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in TASKS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown task {bad[0] if bad else text!r} (choose from {', '.join(TASKS)})")
    return out


def task_counts(text: str, names: tuple[str, ...] = TASKS, what: str = "task") -> tuple:
    """`code=75,math=240` -> (("code", 75), ("math", 240)); `none` -> ()."""
    if text.strip().lower() == "none":
        return ()
    out = []
    for part in text.split(","):
        task, _, n = part.partition("=")
        if task.strip() not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {task.strip()!r} in {text!r} (expected {', '.join(names)})")
        out.append((task.strip(), positive_int(n.strip())))
    return tuple(out)


def set_counts(text: str) -> tuple:
    """`chat=48,everyday=72` -> (("chat", 48), ("everyday", 72)), over the evaluation sets."""
    return task_counts(text, EVAL_SETS, "evaluation set")


def _bank_here(rt, task: str) -> None:
    """Build the task's bank here where the model has none (`bank.ondemand`), with a progress bar;
    a build cut short resumes from its last prompt the next time."""
    if rt.bank_file(task) is not None:
        return
    from entmtp.runtime.weights import LoadError

    try:
        rt.heads("hydra")
    except LoadError as e:
        raise UsageError(f"no {task} bank for {rt.name}, and none can be built here: {e}") from None
    cfg, where = rt.build_config, rt.built_file(task)
    print(f"entmtp: no {task} bank for {rt.name}: building one here ({cfg.calib_prompts} calibration prompts, "
          f"{cfg.calib_new_tokens} greedy tokens each, then every candidate tree timed), cached in {where}", file=sys.stderr)
    t0 = time.perf_counter()
    rt.ensure_bank(task, _progress)
    print(f"entmtp: {task} bank built in {time.perf_counter() - t0:.0f} s: {where}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    from entmtp.bank.refit import policy_text
    from entmtp.data.prompts import read_prompt_file
    from entmtp.spec.engine import collect

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
    if args.batch is not None:
        if args.method != "ar" or args.temperature != 0:
            raise UsageError("--batch decodes greedily without heads: it takes --method ar at temperature 0")
        from entmtp.model.batch import MAX_BATCH

        if args.batch > MAX_BATCH:
            raise UsageError(f"--batch takes at most {MAX_BATCH} prompts at once, got {args.batch}")
    rt = _runtime(args)
    if args.batch is not None:
        return _generate_batched(rt, items, args)
    rt.build_config = replace(rt.build_config, calib_prompts=args.build_prompts, calib_new_tokens=args.build_tokens)
    gen = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, typical=args.typical
    )
    if args.method.startswith("entmtp-"):
        for task in dict.fromkeys(it["task"] for it in items):
            _bank_here(rt, task)
    if args.method.startswith("entmtp-") and rt.follow_live:  # what refits simulate, before the first clock (`bank.refit`)
        for task in dict.fromkeys(it["task"] for it in items):
            rt.served(task).wait()
    for it in items:
        ids = rt.encode(it["prompt"])
        res = collect(rt.run(args.method, it["task"], ids, gen))
        text = rt.decode(res.token_ids)
        if args.json:
            out = res.json(it["prompt"], args.method, it["task"], text)
            served = rt.live_fit(it["task"]) if args.method.startswith("entmtp-") else None
            if served is not None:  # the policy served at the end, and the live costs it was last fitted against
                out["live"] = {"policy": policy_text(served.fit["policies"], args.method.split("-", 1)[1]),
                               "refitted": "refit" in served.fit, **rt.live.snapshot(served.fit)}
            print(json.dumps(out, ensure_ascii=False), flush=True)
        else:
            print(text, flush=True)
            print(
                f"[{args.method} | {it['task']}] {res.new_tokens} tokens in {len(res.steps)} steps, "
                f"{res.tokens_per_s:.1f} tok/s, {res.mean_accepted:.2f} tokens/step",
                file=sys.stderr,
            )


def _generate_batched(rt, items: list[dict], args: argparse.Namespace) -> None:
    """`generate --batch N`: the prompts' greedy answers, N at a time (`model.batch`), printed in
    prompt order as `generate` prints them; a progress bar on stderr counts tokens a second."""
    import time

    from tqdm import tqdm

    from entmtp.model import batch

    if not batch.available(rt.model):
        raise UsageError(f"--batch needs the fused layer stack, which {rt.name} does not run on here ({rt.arithmetic})")
    ids = [rt.encode(it["prompt"]) for it in items]
    for i, p in enumerate(ids):
        if not p:
            raise UsageError(f"prompt {i + 1} is empty")
        if len(p) >= rt.engine.max_positions:
            raise UsageError(f"prompt {i + 1} has {len(p)} tokens; the model's context is {rt.engine.max_positions}")
    dec = batch.BatchDecoder(rt.model, rt.engine.eos, batch=args.batch)
    bar = tqdm(total=len(ids) * args.max_new_tokens, desc=f"generate --batch {args.batch}", unit="tok", file=sys.stderr)
    started, done, printed = time.perf_counter(), {}, 0
    for ans in dec.run(ids, args.max_new_tokens, on_token=bar.update):
        bar.total -= args.max_new_tokens - len(ans.tokens)  # an early EOS: fewer tokens to come
        done[ans.index] = ans
        while printed in done:
            a, it = done.pop(printed), items[printed]
            elapsed = a.elapsed_s  # from its prefill to its last token, beside the others in the batch
            text = rt.decode(a.tokens)
            if args.json:
                print(json.dumps({"prompt": it["prompt"], "method": "ar", "task": it["task"], "text": text, "token_ids": a.tokens,
                                  "new_tokens": len(a.tokens), "steps": len(a.tokens), "mean_accepted": 1.0,
                                  "tokens_per_s": round(len(a.tokens) / elapsed, 3) if elapsed > 0 else 0.0,
                                  "elapsed_s": round(elapsed, 4), "phase_ms": {}, "stop_reason": a.stop_reason, "trace": [],
                                  "batch": args.batch}, ensure_ascii=False), flush=True)
            else:
                print(text, flush=True)
            printed += 1
    bar.close()
    total = time.perf_counter() - started
    print(f"[ar --batch {args.batch}] {len(ids)} prompts, {bar.n} tokens in {total:.1f} s, {bar.n / total:.1f} tok/s", file=sys.stderr)


def cmd_grow_answers(args: argparse.Namespace) -> None:
    from entmtp.config import DEFAULT_MODEL
    from entmtp.data.answers import AnswerStore, corpus_path, held_out_keys
    from entmtp.model import batch
    from entmtp.tools import answers

    if args.batch > batch.MAX_BATCH:
        raise UsageError(f"--batch is at most {batch.MAX_BATCH}, got {args.batch}")
    from entmtp.runtime.runtime import load_runtime

    rt = load_runtime(model_config(args), progress=_progress)
    if not batch.available(rt.model):
        raise UsageError(f"grow-answers needs the fused layer stack, which {rt.name} does not run on here ({rt.arithmetic})")
    if args.store is None and rt.name != DEFAULT_MODEL:
        raise UsageError(f"--store is needed for {rt.name} (the repository keeps the default model's answers only)")
    path = Path(args.store) if args.store else corpus_path(rt.name)
    store = AnswerStore(path, rt.name + rt.arithmetic)
    sources = args.sources or {s: None for s in answers.SOURCES}
    cfg = GrowAnswersConfig(batch=args.batch, answer_tokens=args.answer_tokens, max_prompt_tokens=args.max_prompt_tokens)
    summary = answers.grow(rt, sources, store, cfg, minutes=args.minutes)
    # never a calibration or evaluation prompt's answer (a split can move when a prompt source grows)
    summary["dropped_held_out"] = store.drop(held_out_keys(rt.name, rt.encode_all))
    store.compact()
    summary["store"] = answers.describe(store)
    print(f"[grow-answers] {summary['answers']} answers, {summary['tokens']} tokens in {summary['seconds']:.0f} s "
          f"({summary['tokens_per_s']:.0f} tok/s); the store holds {summary['store']['tokens']} tokens in "
          f"{summary['store']['bytes'] / 1e6:.1f} MB", file=sys.stderr)
    print(json.dumps(summary))


def _work_dir(args: argparse.Namespace) -> Path:
    from entmtp.config import ROOT
    from entmtp.runtime.weights import model_slug

    return Path(args.work) if args.work else ROOT / "checkpoints" / "heads" / model_slug(args.model)


def _kinds(kind: str) -> list[str]:
    return ["hydra", "medusa"] if kind == "both" else [kind]


def cmd_train_heads(args: argparse.Namespace) -> None:
    from entmtp.runtime.weights import eos_ids
    from entmtp.runtime.runtime import default_heads_dir, load_runtime
    from entmtp.data.answers import ANSWERS_DIR, AnswerStore
    from entmtp.tools.train import train_and_save

    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if not 0.0 <= args.feature_dropout < 1.0:
        raise UsageError(f"--feature-dropout must lie in [0, 1), got {args.feature_dropout}")
    if not args.self_prompts and not args.ref_prompts:
        raise UsageError("--self-prompts and --ref-prompts are both empty: no corpus")
    if args.new_vocab and not args.init:
        raise UsageError("--new-vocab re-chooses the vocabulary of --init heads: fresh heads always get a new one")
    cfg = TrainConfig(
        self_prompts=args.self_prompts, ref_prompts=args.ref_prompts, steps=args.steps, batch_tokens=args.batch_tokens,
        lr=args.lr, num_layers=args.num_layers, draft_vocab=args.draft_vocab, soft_targets=not args.hard_targets,
        seed=args.seed, sharegpt_code_prompts=args.sharegpt_code, everyday_prompts=args.everyday, turn_prompts=args.turns, max_prompt_tokens=args.max_prompt_tokens, gen_batch=args.gen_batch, init=args.init, arch=args.arch,
        new_vocab=args.new_vocab, feature_dropout=args.feature_dropout, teacher=args.teacher,
    )
    kinds = _kinds(args.kind)
    if args.arch != "mlp" and kinds != ["hydra"]:
        raise UsageError(f"--arch {args.arch} is a Hydra architecture: add --kind hydra")
    # Hydra++ heads go beside the mlp ones (hydra-prefix/), never over them
    sub = {k: "hydra-prefix" if args.arch == "prefix-mlp" else k for k in kinds}
    out = {k: Path(args.out) / sub[k] if args.out else default_heads_dir(args.model, sub[k]) for k in kinds}
    # the teacher's arithmetic: float32 (packed), as the first store's answers, or the served Q8 (grow-answers')
    rt = load_runtime(ModelConfig(model=args.model, device=args.device, kernels=args.teacher))
    tok = rt.tokenizer
    eos = set(eos_ids(rt.model, tok))
    if not eos:
        raise UsageError(f"{args.model} has no EOS token: cannot delimit answers")
    end = min(eos)
    command = "python -m entmtp " + " ".join(sys.argv[1:])
    work = _work_dir(args)
    if args.answers:
        answers_file = Path(args.answers)
    elif args.model == DEFAULT_MODEL:
        answers_file = ANSWERS_DIR / f"{DEFAULT_MODEL}.jsonl.gz"
    else:
        answers_file = work / "answers.jsonl.gz"
    # an answer is keyed by the arithmetic that gave it (`Runtime.arithmetic`); new ones go to the first store
    if args.model == DEFAULT_MODEL and not args.answers:  # the repo's float32 store and grow-answers' served one
        from entmtp.data.answers import corpus_path

        stores = [AnswerStore(answers_file, args.model), AnswerStore(corpus_path(args.model), args.model + "+q8")]
        stores.sort(key=lambda s: s.model != args.model + rt.arithmetic)  # the teacher's own arithmetic first
    else:
        stores = [AnswerStore(answers_file, args.model + rt.arithmetic)]
    results = train_and_save(
        rt.model, rt.encode, lambda a: tok(a, add_special_tokens=False)["input_ids"] + [end], eos,
        tok.pad_token_id if tok.pad_token_id is not None else end, cfg, kinds, out, work, args.resume,
        {"command": command, "model": args.model},
        log=lambda rec: print(json.dumps(rec), file=sys.stderr, flush=True),
        answers=stores, corpus_only=args.corpus_only,
    )
    if args.corpus_only:
        print(json.dumps({**results["corpus"], "answers": str(answers_file)}))
        return
    for kind, prov in results.items():
        print(f"{kind}: saved to {out[kind]}; held-out (calib) per head:")
        for i, (h, t) in enumerate(zip(prov["heldout"]["per_head"], prov["train_sample"]["per_head"])):
            print(f"  head {i}: top-1 {h['top1']:.3f}  top-5 {h['top5']:.3f}  (n={h['n']}); "
                  f"training answers: top-1 {t['top1']:.3f}  top-5 {t['top5']:.3f}")
    print(json.dumps({k: {"out": str(out[k]), "heldout": p["heldout"]["per_head"], "training": p["training"]}
                      for k, p in results.items()}))


def cmd_eval_heads(args: argparse.Namespace) -> None:
    from entmtp.tools.evalheads import beside_before, evaluate, record_in
    from entmtp.runtime.runtime import default_heads_dir
    from entmtp.runtime.weights import cache_root

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in EVAL_SETS]
    if bad or not tasks:
        raise UsageError(f"--tasks: unknown evaluation set(s) {bad or args.tasks!r} (expected {', '.join(EVAL_SETS)})")
    counts = dict(args.prompts)
    per_task = {t: args.prompts_per_task or counts[t] for t in tasks if args.prompts_per_task or t in counts}
    if not per_task:
        raise UsageError(f"--prompts names none of the tasks {', '.join(tasks)}")
    rt = _runtime(args)
    if args.phrasebook and rt.phrasebook() is None:
        raise UsageError(f"--phrasebook: {rt.name} ships no stored answers to build a phrasebook from (only the default model does)")
    kinds = _kinds(args.kind)
    folders = {"hydra": args.heads, "medusa": args.medusa_heads}
    folders = {k: Path(folders[k]) if folders[k] else default_heads_dir(args.model, k) for k in kinds}
    if args.record:
        missing = [str(f / "heads.json") for f in folders.values() if not (f / "heads.json").is_file()]
        if missing:
            raise UsageError(f"--record writes into heads in our format: {', '.join(missing)} not found")
    report = evaluate(rt, kinds, per_task, args.max_new_tokens, _work_dir(args), cache_root(model_config(args)),
                      progress=_progress, phrasebook=args.phrasebook)
    for kind, folder in folders.items():  # beside the figures the heads recorded for the form they were served in before
        before = json.loads((folder / "heads.json").read_text()).get("provenance", {}).get("served_before") \
            if (folder / "heads.json").is_file() else None
        if before:
            print(beside_before(report, kind, before), file=sys.stderr)
    if args.record:
        for kind, folder in folders.items():
            print(f"recorded in {record_in(folder, kind, report, rt.arithmetic or 'float32')}", file=sys.stderr)
    print(json.dumps(report))


def _progress(it, desc, total):
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, file=sys.stderr)


def _command(args: argparse.Namespace) -> str:
    """The command line, as the provenance of what a command writes records it."""
    return "python -m entmtp " + " ".join(args.argv)


def cmd_build_bank(args: argparse.Namespace) -> None:
    from entmtp.figures.plots import bank_figure
    from entmtp.bank.build import build_task_bank, calibration_prompts
    from entmtp.bank.fit import fit_summary, fit_table
    from entmtp.data.answers import repo_store
    from entmtp.runtime.runtime import bank_path, load_runtime

    cfg = BankBuildConfig(calib_prompts=args.calib_prompts, calib_new_tokens=args.calib_new_tokens,
                          max_candidates=args.max_candidates)
    if cfg.max_candidates < 3:
        raise UsageError(f"--max-candidates must be at least 3 (the bank needs 3 trees), got {cfg.max_candidates}")
    texts, calibration = calibration_prompts(args.task, args.prompts, cfg.calib_prompts)
    rt = load_runtime(model_config(args), args.heads, args.medusa_heads, args.banks_dir)
    out = Path(args.out) if args.out else bank_path(rt.name, args.task)
    try:
        rule = None if args.no_phrasebook or repo_store(rt.name) is None else rt.phrasebook_rule()
        bank = build_task_bank(rt, args.task, texts, calibration, cfg, args.work, args.fresh, _command(args), _progress, rule)
    except ValueError as e:
        if type(e) is ValueError:  # a refused setting (the work folder's); subclasses name their own fault
            raise UsageError(str(e)) from None
        raise
    bank.save(out)
    figure = bank_figure(bank, rt.slug, args.task, out.resolve() == bank_path(rt.name, args.task).resolve(), out)
    print(fit_table(bank.fit))
    print(f"bank: {out}  figure: {figure}")
    print(json.dumps({"bank": str(out), "task": args.task, **fit_summary(bank.fit)}))


def cmd_calibrate(args: argparse.Namespace) -> None:
    from entmtp.figures.plots import bank_figure
    from entmtp.bank.fit import fit_summary, fit_table
    from entmtp.runtime.runtime import bank_path, load_runtime

    t0 = time.perf_counter()
    tasks = list(dict.fromkeys(args.task or TASKS))
    cfg = CalibrateConfig(context=args.context, rounds=args.rounds, steps=args.steps)
    rt = load_runtime(model_config(args), args.heads, args.medusa_heads, args.banks_dir, fit_mode="refit",
                      calibrate_config=cfg, progress=_progress)
    banks = rt.banks(tasks)
    for task, bank in banks.items():
        print(f"== {task}")
        print(fit_table(bank.fit))
        if args.ship:
            bank.shipped_fit = bank.fit
            out = bank.save(bank_path(rt.name, task, rt.banks_dir))
            figure = bank_figure(bank, rt.slug, task, out.resolve() == bank_path(rt.name, task).resolve(), out)
            print(f"shipped fit saved in {out}; figure {figure}")
    hardware = next(iter(banks.values())).fit["hardware"]
    print(json.dumps({"hardware": hardware, "seconds": round(time.perf_counter() - t0, 1),
                      "tasks": {t: fit_summary(b.fit) for t, b in banks.items()}}))


def cmd_bench(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from entmtp.tools.bench import bench_items, check_methods, results_table, run_bench, save_results, summary_json, warmup_line

    cfg = BenchConfig(prompts_per_task=args.prompts_per_task, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    items = bench_items(args.prompts, args.tasks, cfg.prompts_per_task)
    rt = _runtime(args)
    check_methods(rt, items, args.methods)  # fail before measuring anything

    def progress(it, desc, total):
        return tqdm(it, desc=desc, total=total, file=sys.stderr, unit="prompt")

    t0 = time.perf_counter()
    out = run_bench(rt, items, args.methods, cfg, progress)
    print(results_table(out["results"]))
    result = summary_json(rt, out, items, cfg, time.perf_counter() - t0, _command(args), args.note)
    print(warmup_line(result["warmup"]))
    if args.out:
        save_results(args.out, result, out)
    print(json.dumps(result))


def cmd_report(args: argparse.Namespace) -> None:
    from entmtp.config import ROOT
    from entmtp.tools.report import ReportError, benchmarks_page, committed, pages, read_run, render

    try:
        if args.files:  # the page of these runs alone, as given
            written = {Path(args.out) if args.out else ROOT / "BENCHMARKS.md": render([read_run(Path(f)) for f in args.files])}
        elif args.out:  # the page of the committed results, elsewhere
            written = {Path(args.out): benchmarks_page(committed(ROOT))}
        else:
            written = pages(ROOT)
    except ReportError as e:
        raise UsageError(str(e)) from None
    for out, text in written.items():
        try:
            out.write_text(text)
        except OSError as e:
            raise UsageError(f"cannot write {out}: {e.strerror or e}") from None
        print(out)


def cmd_kernels(args: argparse.Namespace) -> None:
    import torch

    from entmtp.machine import hardware
    from entmtp.model.serve import is_packed
    from entmtp.tools.kernelbench import chain_costs, chain_table, compare, compare_table, isa_rows, isa_table
    from entmtp.runtime.runtime import load_runtime

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rt = load_runtime(ModelConfig(model=args.model, dtype="float32", device="cpu", kernels=args.kernels))
        if not is_packed(rt.model):
            raise UsageError("packed kernels need PyTorch with oneDNN on this CPU: there is nothing to compare here")
        cfg = KernelBenchConfig(reps=args.reps, context=args.context)
        from entmtp.model.serve import label

        result = {"hardware": hardware(), "model": rt.name, "weights": rt.weights, "dtype": "float32", "kernels": label(rt.model),
                  "torch": torch.__version__}
        if not args.chain_only:
            result.update(compare(rt.model, cfg.sizes, cfg.context, cfg.reps, cfg.warmup))
            result["isa"] = isa_rows(rt.model, cfg.rows, cfg.context, cfg.reps, cfg.warmup)
        from entmtp.runtime.weights import LoadError

        try:
            heads = rt.heads("hydra")
        except LoadError:
            heads = None  # a model without Hydra heads: no chain to time
        result["chain"] = None if heads is None else chain_costs(rt.engine, heads, reps=max(cfg.reps, 25), context=cfg.context,
                                                                 book=rt.phrasebook(), rule=rt.phrasebook_rule())
    finally:
        torch.set_num_threads(threads)
    if not args.chain_only:
        print(compare_table(result))
        if result["isa"]:
            print(isa_table(result["isa"]))
    if result["chain"]:
        print(chain_table(result["chain"]))
    print(json.dumps(result))


def cmd_prepare(args: argparse.Namespace) -> None:
    """Load the model as the app serves it: the dequantised weights and the extension are built
    into their caches where missing (ENTMTP_CACHE, TORCH_EXTENSIONS_DIR), the heads are checked."""
    import faulthandler

    from entmtp.model import ext
    from entmtp.runtime.runtime import load_runtime

    # A hang (a deadlock in a library's thread pool, a stalled disk) must say where it hangs and
    # end, not wait until the caller's own limit kills it without a word.
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    t0 = time.perf_counter()
    rt = load_runtime(ModelConfig(model=args.model))
    print(f"entmtp: weights {rt.weights} ({rt.load_s:.1f} s)", flush=True)
    built = ext.build_report()
    if built:
        print(f"entmtp: CPU kernels ready for this CPU ({built['seconds']:.1f} s)")
    elif ext.extension_error():
        print(f"entmtp: CPU kernels not used here: {ext.extension_error()}")
    for kind in ("hydra", "medusa"):
        rt.heads(kind)
    print(f"entmtp: ready in {time.perf_counter() - t0:.1f} s")
    faulthandler.cancel_dump_traceback_later()


COMMANDS = {"prepare": cmd_prepare, "bench": cmd_bench, "report": cmd_report, "calibrate": cmd_calibrate, "generate": cmd_generate, "train-heads": cmd_train_heads,
            "grow-answers": cmd_grow_answers,
            "eval-heads": cmd_eval_heads, "build-bank": cmd_build_bank, "kernels": cmd_kernels}


def main(argv: list[str] | None = None) -> int:
    from entmtp.bank.bank import BankError
    from entmtp.data.prompts import DataError
    from entmtp.spec.engine import GenerationError
    from entmtp.spec.heads import HeadsError
    from entmtp.runtime.weights import LoadError
    from entmtp.spec.topology import TopologyError
    from entmtp.tools.train import TrainError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in the provenance of what a command writes
    try:
        COMMANDS[args.command](args)
    except (UsageError, DataError, LoadError, GenerationError, HeadsError, BankError, TopologyError, TrainError) as e:
        print(f"entmtp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("entmtp: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
