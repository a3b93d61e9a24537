"""GPU check: the engine stays lossless on the device, and what a decode step costs per tree.

Built for a GPU machine without network or the default weights (they do not travel): step costs
do not depend on weight values, so the default architecture (scripts/default_model_config.json)
is built with random weights. Needs only torch, transformers and safetensors (no gradio, gguf).

1. Lossless: every engine method equals transformers `generate` (greedy) token for token, on
   two tiny random Llamas with random heads (every bank tree, mc_sim_7b_63, AR, each bank's
   policies) and on the random-weight default architecture with the shipped heads (the CLI's
   methods for every task, and every bank tree). References come from stock transformers; the
   engine then runs with the kernels `load_model` installs. A differing token whose reference
   logit gap is within float noise is reported as a tie, not a failure.
2. Costs: the median wall time of one decode step per tree (the banks' candidate trees,
   mc_sim_7b_63 and AR), warm, synchronised around each step, at ~300 tokens of context;
   prefill per token from the first step's extra time; host reads per step (`host_reads`) for a
   few tree sizes; kernels per step (torch.profiler) for AR and mc_sim_7b_63. With CUDA graphs three ways: as served
   (verification and the heads' drafts captured), with the drafts eager, and all eager.
3. Prediction: with those costs, the fit `calibrate` would make here (`bank.fit.fit_task`: front,
   static / ladder / τ policies, and tokens/s of ar, hydra and each EntMTP policy by exact
   simulation of the banks' per-position acceptance traces).

Progress goes to stderr; stdout gets ONE JSON line. Exit code 1 when an output differed.
`--device cpu --quick` runs small sizes (1 layer) in seconds, for testing without a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from entmtp.model import forward
from entmtp.model import kernels, serve
from entmtp.model import kv
from entmtp.bank.bank import TopologyBank  # noqa: E402
from entmtp.bank.fit import fit_task  # noqa: E402
from entmtp.config import BASELINE_TREE, DEFAULT_MODEL, TASKS, TREES_FILE, GenerationConfig  # noqa: E402
from entmtp.spec.engine import Engine, Strategy, collect  # noqa: E402
from entmtp.spec.heads import HydraHeads, MedusaHeads  # noqa: E402
from entmtp.runtime.runtime import Runtime, resolve_bank  # noqa: E402
from entmtp.spec.policy import StaticPolicy  # noqa: E402
from entmtp.spec.topology import Tree, compile_tree, load_named_trees  # noqa: E402

CONFIG_FILE = Path(__file__).with_name("default_model_config.json")
TIE = 1e-3  # a reference logit gap below TIE * max(1, |logit|) is float noise between kernels


@dataclass(frozen=True)
class Sizes:
    prompts: int = 3  # per model
    new_tokens: int = 32
    context: int = 300  # prompt length for the step timings
    warm_steps: int = 3
    timed_steps: int = 30
    layers: int | None = None  # None: the default model's own


FULL = Sizes()
QUICK = Sizes(prompts=1, new_tokens=10, context=48, warm_steps=1, timed_steps=2, layers=1)


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- models ---------------------------------------------------------------------------------------


def tiny_llama(seed: int, vocab: int, device: torch.device) -> LlamaForCausalLM:
    """tests/conftest.py's tiny model: 2 layers, hidden 32, 4 heads over 2 KV heads, peaked logits."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )
    return _ready(LlamaForCausalLM(cfg), device)


def default_arch(device: torch.device, layers: int | None) -> LlamaForCausalLM:
    """The default model's architecture with random weights (float32, as the engine runs it)."""
    raw = {k: v for k, v in json.loads(CONFIG_FILE.read_text()).items() if not k.startswith("_")}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    if layers is not None:
        raw["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device(device):  # initialise in place: 135M parameters
        model = LlamaForCausalLM(LlamaConfig(**raw))
    return _ready(model, device)


def _ready(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None  # full-length outputs: random models emit EOS ids too
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=torch.float32).eval()


def engine_kernels(model) -> None:
    """What `weights.load_model` installs (packed linears on CPU, grouped tree attention)."""
    kernels.pack_linears(model)
    kernels.use_tree_attention(model)


def random_heads(model, kind: str, seed: int = 1):
    torch.manual_seed(seed)
    cfg = model.config
    heads = HydraHeads(cfg.hidden_size, cfg.vocab_size, 4, base_config=cfg) if kind == "hydra" else MedusaHeads(
        cfg.hidden_size, cfg.vocab_size, 4)
    with torch.no_grad():  # zero-init W leaves heads too dull: every weight random
        for p in heads.parameters():
            p.normal_(0, 0.3)
    heads.bind(model)
    return heads.pack() if serve.is_packed(model) else heads


# -- lossless -------------------------------------------------------------------------------------


def reference(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def divergence(model, prompt: list[int], got: list[int], ref: list[int]) -> dict | None:
    """None when equal; else where the output first differs and whether it is a float tie."""
    if got == ref:
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    out = {"at": k, "want": ref[k] if k < len(ref) else None, "got": got[k] if k < len(got) else None, "tie": False}
    if out["want"] is not None and out["got"] is not None:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ref[:k]], device=model.device)).logits[0, -1].float()
        gap = float(logits[ref[k]] - logits[got[k]])
        out.update(gap=round(gap, 7), tie=abs(gap) <= TIE * max(1.0, abs(float(logits[ref[k]]))))
    return out


def check(model, engine: Engine, strategies: list[Strategy], prompts: list[list[int]], refs: list[list[int]],
          n: int, label: str) -> tuple[int, list[dict], list[dict]]:
    """(cases run, failures, ties) of every strategy on every prompt against the references."""
    failures, ties = [], []
    for s in strategies:
        for prompt, ref in zip(prompts, refs):
            got = collect(engine.generate(prompt, s, GenerationConfig(max_new_tokens=n))).token_ids
            d = divergence(model, prompt, got, ref)
            if d is not None:
                (ties if d["tie"] else failures).append({"model": label, "strategy": s.name, **d})
    return len(strategies) * len(prompts), failures, ties


def random_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 11, 23, 40)[:count]]


def tree_strategies(trees: list[Tree], heads, kind: str) -> list[Strategy]:
    return [Strategy(f"{kind}/{t.name}", (t,), StaticPolicy(0), heads if t.max_depth else None) for t in trees]


def check_tiny(device, trees: list[Tree], baseline: Tree, banks, sizes: Sizes, cuda_graphs: bool) -> tuple[int, list, list]:
    cases, failures, ties = 0, [], []
    for seed, vocab in ((0, 48), (5, 16)):  # vocab 16: random heads guess right often (long accepted paths); no bank node ranks past 15
        label = f"tiny-v{vocab}"
        model = tiny_llama(seed, vocab, device)
        prompts = random_prompts(vocab, sizes.prompts, seed + 3)
        refs = [reference(model, p, sizes.new_tokens) for p in prompts]
        engine_kernels(model)
        heads = {k: random_heads(model, k) for k in ("hydra", "medusa")}
        strategies = tree_strategies(trees, heads["hydra"], "hydra") + tree_strategies([baseline], heads["medusa"], "medusa")
        for task, bank in banks.items():
            strategies += [Strategy(f"entmtp-{p}/{task}", bank, bank.policy(p), heads["hydra"]) for p in ("static", "ladder", "tau")]
        c, f, t = check(model, Engine(model, cuda_graphs=cuda_graphs), strategies, prompts, refs, sizes.new_tokens, label)
        cases, failures, ties = cases + c, failures + f, ties + t
        log(f"  {label}: {c} cases, {len(f)} failures, {len(t)} ties")
    return cases, failures, ties


# -- step costs -----------------------------------------------------------------------------------


def step_ms(engine: Engine, strategy: Strategy, prompt: list[int], sizes: Sizes) -> tuple[float, float, dict]:
    """(median ms of one decode step, ms of prefill + the first step, median ms per phase): each
    `next` of the engine's generator is one step, timed with the device synchronised on both sides."""
    device = engine.device
    gen = GenerationConfig(max_new_tokens=6 * (sizes.warm_steps + sizes.timed_steps + 2))
    steps = engine.generate(prompt, strategy, gen)
    sync(device)
    t0 = time.perf_counter()
    next(steps)  # prefill and the first step
    sync(device)
    first = time.perf_counter() - t0
    times, phases = [], []
    for i in range(sizes.warm_steps + sizes.timed_steps):
        sync(device)
        t0 = time.perf_counter()
        record = next(steps, None)
        if record is None:
            break
        sync(device)
        if i >= sizes.warm_steps:
            times.append(time.perf_counter() - t0)
            phases.append(record.ms)
    per_phase = {k: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]}
    return statistics.median(times) * 1e3, first * 1e3, per_phase


HOST_READS = ((torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"),
              (torch.Tensor, "__bool__"), (torch.Tensor, "__int__"), (torch.Tensor, "__float__"), (torch.cuda, "synchronize"))


def host_reads(engine: Engine, strategy: Strategy, prompt: list[int], steps: int = 3) -> float:
    """Calls per decode step that bring a device value to the host or wait for the device (`.item()`,
    `.tolist()`, `.cpu()`, a tensor's truth value or number, `torch.cuda.synchronize`): each stalls
    the host until the device has caught up. Counted over `steps` warm steps (not timed)."""
    gen = engine.generate(prompt, strategy, GenerationConfig(max_new_tokens=4 * (steps + 2)))
    next(gen)
    next(gen)
    count = [0]
    saved = [(owner, name, getattr(owner, name)) for owner, name in HOST_READS]

    def counting(fn):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        for owner, name, fn in saved:
            setattr(owner, name, counting(fn))
        done = sum(1 for _ in zip(range(steps), gen))
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        gen.close()
    return round(count[0] / max(1, done), 1)


def predict(bank: TopologyBank, step_costs: list[float], prefill_ms_per_token: float, baseline: tuple[Tree, float]) -> dict:
    """The fit `calibrate` would make on this machine at these step costs: front, policies and
    tokens/s of every method by exact simulation of the bank's acceptance traces."""
    fit = fit_task(bank.trees, bank.traces, step_costs, prefill_ms_per_token, baseline=baseline)
    return {"tokens_per_s": fit["predicted_tokens_per_s"], "policies": fit["policies"], "front": fit["front"],
            "degenerate": fit["degenerate"], "trees": {k: v["tokens_per_s"] for k, v in fit["trees"].items()}}


def distinct_trees(banks: dict[str, TopologyBank], baseline: Tree) -> tuple[list[Tree], dict[tuple[str, str], str]]:
    """Every tree shape once (AR, the banks' trees, the baseline), uniquely named, smallest first;
    and (task, tree id in that bank) -> that name (banks reuse ids like n17-d4 for other shapes)."""
    by_shape: dict[tuple, Tree] = {}
    alias: dict[tuple[str, str], str] = {}

    def add(tree: Tree, task: str = "") -> None:
        shape = tuple(map(tuple, tree.as_lists()))
        if shape not in by_shape:
            taken = {t.name for t in by_shape.values()}
            by_shape[shape] = compile_tree(tree.as_lists(), tree.name if tree.name not in taken else f"{tree.name}@{task}")
        alias[(task, tree.name)] = by_shape[shape].name

    add(compile_tree([], "ar"))
    for task, bank in banks.items():
        for t in bank.trees:
            add(t, task)
    add(baseline)
    return sorted(by_shape.values(), key=lambda t: (t.n_nodes, t.name)), alias


def kernel_profile(engine: Engine, strategy: Strategy, context: list[int], steps: int = 5, top: int = 10) -> dict:
    """Where `steps` one-token steps spend device time: the top kernels by total time (torch.profiler)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        gen = engine.generate(context, strategy, GenerationConfig(max_new_tokens=steps + 3))
        next(gen)
        next(gen)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                next(gen)
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
        rows.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in rows)
        return {"steps": steps, "device_us_per_step": round(total / steps, 1), "kernels_per_step": round(sum(e.count for e in rows) / steps, 1),
                "top": [{"name": e.key[:80], "calls_per_step": round(e.count / steps, 1), "us_per_step": round(e.device_time_total / steps, 1)}
                        for e in rows[:top]]}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


COMPILE_SIZES = (1, 5, 17, 64)  # block sizes timed with compiled layers (each compiles once)


def compiled_graphs(model, rt: Runtime, trees: list[Tree], prompts, refs, context: list[int], sizes: Sizes) -> dict:
    """CUDA graphs over `torch.compile`d layers (`Engine(compiled=True)`), for a few block sizes:
    compile + capture time, lossless cases, step cost. Any error is reported, not raised."""
    picks = list({t.n_nodes: t for t in reversed(trees) if t.n_nodes in COMPILE_SIZES}.values())[::-1]
    out: dict = {"sizes": [t.n_nodes for t in picks]}
    try:
        log(f"compiled layers: compiling and capturing {out['sizes']}")
        engine = Engine(model, cuda_graphs=True, compiled=True)
        engine.warmup([t.n_nodes for t in picks], context=len(context))
        out["warmup_ms"] = {str(k): v for k, v in sorted(engine.warmup_ms.items())}
        strategies = tree_strategies(picks, rt.heads("hydra"), "hydra")
        c, f, t = check(model, engine, strategies, prompts, refs, sizes.new_tokens, "default-arch compiled")
        log(f"  compiled: {c} cases, {len(f)} failures, {len(t)} ties")
        out["lossless"] = {"cases": c, "n_failures": len(f), "n_ties": len(t), "failure_list": f, "tie_list": t}
        out["step_ms"] = {}
        for s in strategies:
            out["step_ms"][s.trees[0].name], _, _ = step_ms(engine, s, context, sizes)
            log(f"  {s.trees[0].name:>14} {s.trees[0].n_nodes:3d} nodes {out['step_ms'][s.trees[0].name]:9.3f} ms (compiled)")
    except Exception as e:  # the rest of the check stands
        import traceback

        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def preflight(device: torch.device) -> None:
    """The engine must reach the KV cache through this transformers (its forward argument changed
    name across 5.x releases); otherwise every case would fail with a shape error."""
    import transformers

    model = tiny_llama(0, 48, device)
    cache = kv.new_cache(model.config)
    with torch.inference_mode():
        forward.forward(model, cache, torch.tensor([[1, 2, 3]], device=device), torch.arange(3, device=device)[None], None)
    if cache.get_seq_length() != 3:
        raise RuntimeError(
            f"transformers {transformers.__version__}: a forward through entmtp.verify.forward left the KV cache "
            f"empty (the cache argument is named differently in this version); the engine cannot run here"
        )


def run(device: torch.device, quick: bool, cuda_graphs: bool = True) -> dict:
    sizes = QUICK if quick else FULL
    baseline = load_named_trees(TREES_FILE)[BASELINE_TREE]
    banks = {task: resolve_bank(DEFAULT_MODEL, task) for task in TASKS}
    trees, alias = distinct_trees(banks, baseline)

    log(f"lossless on {device}: tiny models")
    preflight(device)
    cases, failures, ties = check_tiny(device, trees, baseline, banks, sizes, cuda_graphs)

    log("lossless: random-weight default architecture with the shipped heads")
    model = default_arch(device, sizes.layers)
    prompts = random_prompts(model.config.vocab_size, sizes.prompts, 7)
    refs = [reference(model, p, sizes.new_tokens) for p in prompts]
    engine_kernels(model)
    rt = Runtime(DEFAULT_MODEL, model, None, Engine(model, cuda_graphs=cuda_graphs))
    graphed = rt.engine.graphs is not None
    log(f"  CUDA graphs: {'on' if graphed else 'off'}")
    strategies = [rt.strategy(m) for m in ("ar", "hydra", "medusa")]
    for task in TASKS if not quick else TASKS[:1]:
        for p in ("static", "ladder", "tau"):
            bank = rt.bank(task)  # random weights, no tokenizer: the banks' trees and policies, the heads alone
            strategies.append(Strategy(f"entmtp-{p}/{task}", bank, bank.policy(p), rt.heads("hydra")))
    if not quick:
        strategies += tree_strategies(trees, rt.heads("hydra"), "hydra")
    c, f, t = check(model, rt.engine, strategies, prompts, refs, sizes.new_tokens, "default-arch")
    log(f"  default-arch: {c} cases, {len(f)} failures, {len(t)} ties")
    cases, failures, ties = cases + c, failures + f, ties + t

    log(f"step costs at {sizes.context} tokens of context" + (" (CUDA graphs, then eager)" if graphed else ""))
    node_sizes = sorted({t.n_nodes for t in trees})
    rt.engine.warmup(node_sizes, context=sizes.context)
    rt.engine.warmup_drafts(rt.heads("hydra"), trees)
    eager = Engine(model, cuda_graphs=False) if graphed else None
    if eager is not None:
        eager.warmup(node_sizes, context=sizes.context)
    # captured verification with the heads drafting eagerly: what capturing the drafts saves
    eager_drafts = Engine(model, cuda_graphs=True) if graphed else None
    if eager_drafts is not None:
        eager_drafts.drafts.capture = False
        eager_drafts.warmup(node_sizes, context=sizes.context)
    g = torch.Generator().manual_seed(11)
    context = torch.randint(1, model.config.vocab_size, (sizes.context,), generator=g).tolist()
    costs, costs_eager, costs_eager_drafts, phases, prefills = {}, {}, {}, {}, []
    for s in tree_strategies(trees, rt.heads("hydra"), "hydra"):
        name = s.trees[0].name
        step, first, phases[name] = step_ms(rt.engine, s, context, sizes)
        costs[name] = round(step, 3)
        prefills.append((first - step) / sizes.context)
        line = f"  {name:>14} {s.trees[0].n_nodes:3d} nodes {costs[name]:9.3f} ms"
        if eager_drafts is not None and s.trees[0].n_nodes > 1:
            costs_eager_drafts[name] = round(step_ms(eager_drafts, s, context, sizes)[0], 3)
            line += f"   eager drafts {costs_eager_drafts[name]:9.3f} ms"
        if eager is not None:
            costs_eager[name] = round(step_ms(eager, s, context, sizes)[0], 3)
            line += f"   eager {costs_eager[name]:9.3f} ms"
        log(line)
    prefill_ms_per_token = max(0.0, statistics.median(prefills))
    reads = {s.trees[0].name: host_reads(rt.engine, s, context) for s in tree_strategies(
        [t for t in trees if t.name in ("ar", BASELINE_TREE) or t.n_nodes in (2, 5, 9)], rt.heads("hydra"), "hydra")}
    log(f"host reads per step: {reads}")

    profile = {"graphs": kernel_profile(rt.engine, rt.strategy("ar"), context)} if graphed and not quick else {}
    if graphed and not quick:
        profile["graphs_baseline_tree"] = kernel_profile(rt.engine, tree_strategies([baseline], rt.heads("hydra"), "hydra")[0], context)
    if eager is not None and not quick:
        profile["eager"] = kernel_profile(eager, rt.strategy("ar"), context)
    compiled = compiled_graphs(model, rt, trees, prompts, refs, context, sizes) if graphed and not quick else {}
    if compiled.get("lossless"):
        cases += compiled["lossless"]["cases"]
        failures += compiled["lossless"].pop("failure_list")
        ties += compiled["lossless"].pop("tie_list")

    log("predicted throughput from the banks")
    predicted = {task: predict(bank, [costs[alias[(task, t.name)]] for t in bank.trees], prefill_ms_per_token,
                               (baseline, costs[BASELINE_TREE]))
                 for task, bank in banks.items()}

    return {
        "ok": not failures,
        "model": {"arch": f"{DEFAULT_MODEL} architecture, random weights", "layers": model.config.num_hidden_layers},
        "lossless": {"cases": cases, "failures": failures[:20], "n_failures": len(failures), "ties": ties[:20], "n_ties": len(ties)},
        "context_tokens": sizes.context,
        "cuda_graphs": graphed,
        "compiled": compiled,
        "profile_ar_steps": profile,
        "step_ms": costs,
        "host_reads_per_step": reads,
        "step_ms_eager": costs_eager,
        "step_ms_eager_drafts": costs_eager_drafts,
        "phase_ms": phases,
        "warmup_ms": {"served": {str(k): v for k, v in sorted(rt.engine.warmup_ms.items())},
                      "eager": {str(k): v for k, v in sorted(eager.warmup_ms.items())} if eager is not None else {},
                      "capture_per_slot": {str(k): v for k, v in sorted(rt.engine.graphs.capture_ms().items())} if graphed else {},
                      "draft_capture": dict(rt.engine.drafts.capture_ms) if graphed else {}},
        "prefill_ms_per_token": round(prefill_ms_per_token, 4),
        "nodes": {t.name: t.n_nodes for t in trees},
        "predicted": predicted,
    }


def main(argv: list[str] | None = None) -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (1 layer, few cases, short runs), for a CPU")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="verify eagerly (default: one CUDA graph per tree size)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available (use --device cpu)")
    if device.type == "cpu" and args.quick:
        torch.set_num_threads(1)  # small ops: thread hand-offs on a shared CPU would dominate
    torch.set_float32_matmul_precision("highest")  # no TF32: verification must match `generate`
    result = {
        "check": "entmtp-gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "float32",
        "quick": args.quick,
    }
    try:
        result.update(run(device, args.quick, not args.no_cuda_graphs))
        code = 0 if result["ok"] else 1
    except Exception as e:  # still one JSON line, naming the error; the traceback goes to stderr
        import traceback

        traceback.print_exc()
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
        code = 2
    result["seconds"] = round(time.perf_counter() - _T0, 1)
    print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
