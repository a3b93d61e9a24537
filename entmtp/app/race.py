"""A race: EntMTP and a baseline decode the same prompt, one step each in turn, each on its own clock.

The app's logic without its widgets: which models may be loaded, input validation, the two
strategies (bank, fitted or custom policy, baseline), the sides' streamed text and stats, and
the badge that says what was checked. `app.py` only lays out the page and wires events to this.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from entmtp.app import gpu
from entmtp.figures import plots
from entmtp.bank.bank import TopologyBank
from entmtp.bank.fit import ceiling_text, through_heads
from entmtp.bank.live import LiveCosts
from entmtp.bank.refit import policy_text
from entmtp.bank.predict import predict
from entmtp.config import TASKS, BankBuildConfig, GenerationConfig, ModelConfig
from entmtp.spec.engine import StepRecord, Strategy
from entmtp.runtime.weights import LoadError
from entmtp.bank.ondemand import read_status, status_text
from entmtp.runtime.runtime import CHAT_TEMPLATE, Runtime, bank_path, load_runtime, resolve_bank
from entmtp.spec.policy import LadderPolicy, Policy, StaticPolicy, TauPolicy
from entmtp.spec.topology import chain_paths, compile_tree

POLICIES = {"tau": "EntMTPτ (two trees, hysteresis)", "ladder": "EntMTP-ladder (thresholds)", "static": "EntMTP* (one static tree)"}
BASELINES = {"hydra": "Hydra (63-node default tree)", "medusa": "Medusa (63-node default tree)", "ar": "Plain decoding (AR)"}
MAX_NEW_TOKENS = (1, 1024)
TEMPERATURE = (0.0, 2.0)
TAU_RANGE = (0.0, 1.0)  # every feature a policy reads lies in [0, 1]
MAX_PROMPT_TOKENS = 2048  # a CPU prefill of more takes tens of seconds; the model allows 8192
MAX_PROMPT_CHARS = 20_000  # refused before tokenising
SLOW_STEPS, SLOW_RATIO = 8, 1.5  # a side's steps this much slower than calibrated: the page says the machine was busy


class RaceError(ValueError):
    """A request the race refuses; `title` heads the message the page shows."""

    def __init__(self, message: str, title: str = "Cannot run this race"):
        super().__init__(message)
        self.title = title


@dataclass(frozen=True)
class Request:
    prompt: str
    task: str
    policy: str
    baseline: str
    max_new_tokens: int
    temperature: float
    seed: int = 0
    tau: tuple[float, float] | None = None  # (tau_on, tau_off) for the τ policy, None: the fitted ones


def validate(prompt, task, policy, baseline, max_new_tokens, temperature, seed=0,
             custom_tau=False, tau_on=None, tau_off=None) -> Request:
    """A clean request, or a RaceError naming the bad value (the API receives raw values too)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise RaceError("The prompt is empty: type a question or pick an example.", "Empty prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RaceError(f"The prompt has {len(prompt):,} characters; the demo accepts up to {MAX_PROMPT_CHARS:,}.", "Prompt too long")
    if task not in TASKS:
        raise RaceError(f"Unknown task {task!r}: choose one of {', '.join(TASKS)}.")
    if policy not in POLICIES:
        raise RaceError(f"Unknown policy {policy!r}: choose one of {', '.join(POLICIES)}.")
    if baseline not in BASELINES:
        raise RaceError(f"Unknown baseline {baseline!r}: choose one of {', '.join(BASELINES)}.")
    try:
        n, t, s = float(max_new_tokens), float(temperature), float(seed or 0)
    except (TypeError, ValueError):
        raise RaceError(f"max_new_tokens, temperature and seed must be numbers, got {max_new_tokens!r}, {temperature!r}, {seed!r}.") from None
    if not (MAX_NEW_TOKENS[0] <= n <= MAX_NEW_TOKENS[1]) or n != int(n):
        raise RaceError(f"max_new_tokens must be a whole number from {MAX_NEW_TOKENS[0]} to {MAX_NEW_TOKENS[1]}, got {max_new_tokens}.", "Out of range")
    if not (TEMPERATURE[0] <= t <= TEMPERATURE[1]):
        raise RaceError(f"temperature must be between {TEMPERATURE[0]} and {TEMPERATURE[1]}, got {temperature}.", "Out of range")
    tau = None
    if custom_tau:
        if policy != "tau":
            raise RaceError(f"Your τ thresholds apply to the EntMTPτ policy only; the {POLICIES[policy].split(' (')[0]} "
                            "policy has none. Pick EntMTPτ or untick the override.", "τ override")
        try:
            on, off = float(tau_on), float(tau_off)
        except (TypeError, ValueError):
            raise RaceError(f"τ_on and τ_off must be numbers, got {tau_on!r} and {tau_off!r}.", "Out of range") from None
        if not (TAU_RANGE[0] <= off <= TAU_RANGE[1] and TAU_RANGE[0] <= on <= TAU_RANGE[1]):
            raise RaceError(f"τ_on and τ_off must lie in [0, 1], got {on} and {off}.", "Out of range")
        if off > on:
            raise RaceError(f"τ_off ({off}) must not exceed τ_on ({on}).", "Out of range")
        tau = (on, off)
    return Request(prompt.strip(), task, policy, baseline, int(n), t, int(s), tau)


# -- locks made in the process that uses them -----------------------------------------------------


_made = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_made=threading.Lock()))


class PerProcess:
    """A lock (or any object `make` builds) made in the process that uses it: a forked process (a
    ZeroGPU worker) makes its own instead of using a copy, which another thread of the parent may
    have held at the fork and nobody would ever release."""

    def __init__(self, make: Callable[[], Any] = threading.Lock):
        self._make, self._pid, self._obj = make, None, None

    def get(self) -> Any:
        with _made:
            if self._pid != os.getpid():
                self._obj, self._pid = self._make(), os.getpid()
            return self._obj


# -- models: an allow-list, one load per model, never blocking another model's races ------------


class Models:
    """Runtimes by model name, loaded once each; only names in `allowed` are ever loaded.

    Each model has its own load lock, so a slow first load (a hub download) of one model does not
    hold up races on another that is already loaded; each loaded runtime comes with its own lock
    (`runtime_lock`), held while a race sets up on it (its heads load lazily). Every lock is made
    in the process that takes it (`PerProcess`).
    """

    def __init__(self, default: str, allowed: tuple[str, ...], hydra_heads: str | None = None,
                 medusa_heads: str | None = None, fit_mode: str = "auto", model_heads: dict[str, str] | None = None,
                 build: BankBuildConfig | None = None):
        self.default, self.allowed = default, tuple(dict.fromkeys((default, *allowed)))
        self.heads = {"hydra": hydra_heads, "medusa": medusa_heads}
        self.model_heads = dict(model_heads or {})  # another model's Hydra heads (ENTMTP_APP_MODELS' model=heads)
        self.fit_mode = fit_mode
        self.build = build or BankBuildConfig()  # the budget of a bank built here (`bank.ondemand`)
        self._runtimes: dict[str, Runtime] = {}
        self._runtime_locks: dict[str, PerProcess] = {}
        self._locks: dict[str, PerProcess] = {}
        self._guard = PerProcess()

    def check(self, model: str | None) -> str:
        name = (model or "").strip() or self.default
        if name not in self.allowed:
            raise RaceError(f"Model {name!r} is not offered here: this server runs {', '.join(self.allowed)}. "
                            "(Its owner can allow more with ENTMTP_APP_MODELS.)", "Model not allowed")
        return name

    def lock(self, name: str) -> threading.Lock:
        with self._guard.get():
            return self._locks.setdefault(name, PerProcess()).get()

    def get(self, model: str | None) -> Runtime:
        name = self.check(model)
        if name in self._runtimes:
            return self._runtimes[name]
        with self.lock(name):
            if name not in self._runtimes:
                own = name == self.default  # head paths from the environment apply to the app's own model
                rt = load_runtime(ModelConfig(model=name), self.heads["hydra"] if own else self.model_heads.get(name),
                                  self.heads["medusa"] if own else None, fit_mode=self.fit_mode)
                rt.fingerprint_from = gpu.page_fingerprint
                rt.build_config = self.build
                self._runtime_locks[name] = PerProcess()
                self._runtimes[name] = rt
        return self._runtimes[name]

    def loaded(self, model: str | None) -> Runtime | None:
        return self._runtimes.get((model or "").strip() or self.default)

    def runtime_lock(self, model: str | None) -> threading.Lock:
        """The lock of a loaded model's runtime (`get` it first)."""
        return self._runtime_locks[self.check(model)].get()


# -- banks -------------------------------------------------------------------------------------


def fallback_bank() -> TopologyBank:
    """A small uncalibrated bank for when banks/<model>/<task>.json does not exist yet."""
    specs = [("root", []), ("chain2", chain_paths(2)), ("t4", [[0], [1], [0, 0]]),
             ("t8", [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])]
    trees = [compile_tree(p, name) for name, p in specs]
    policies = {"static": StaticPolicy(2), "ladder": LadderPolicy((0, 1, 2, 3), (0.3, 0.6, 0.85)),
                "tau": TauPolicy(1, 3, 0.8, 0.5)}
    return TopologyBank(trees, [{} for _ in trees], policies, {"fallback": True})


def has_bank(rt: Runtime | str, task: str) -> bool:
    """Whether a bank file exists for the task: a runtime's (in its banks folder, or built here:
    `Runtime.bank_file`), or a model name's in the default banks folder (a model not loaded yet)."""
    if isinstance(rt, str):
        return bank_path(rt, task).exists()
    return rt.bank_file(task) is not None


def bank_for(rt: Runtime, task: str, progress: Callable | None = None, mode: str | None = None,
             turn: Callable | None = None) -> TopologyBank:
    """The task's bank under the fit `mode` asks for (default: the runtime's; fitted now, once, if
    needed); the fallback if none."""
    if not has_bank(rt, task):
        return fallback_bank()
    try:
        return rt.banks([task], progress, mode, turn)[task]
    except LoadError as e:
        raise RaceError(str(e)) from None


def bank_trees(rt: Runtime, task: str) -> TopologyBank:
    """The task's bank as its file has it (the trees are the same under every fit): never times anything."""
    if not has_bank(rt, task):
        return fallback_bank()
    try:
        return rt.bank_from_file(task)
    except LoadError as e:
        raise RaceError(str(e)) from None


def needs_fit(rt: Runtime, task: str) -> bool:
    """True when the first race on `task` will time the bank's trees on this machine first."""
    return has_bank(rt, task) and rt.needs_calibration(task)


def bank_note(rt: Runtime, task: str, bank: TopologyBank) -> str:
    """One truthful line on where the bank's numbers come from."""
    if bank.meta.get("fallback"):
        return (f"⚠️ **Built-in fallback bank** (4 small trees, thresholds not calibrated): no `{task}` bank for "
                f"`{rt.name}` yet. " + building_note(rt, task) + prompt_note(rt))
    fit = bank.fit
    where = ("fitted to **this machine**" if fit.get("fingerprint") == rt.fingerprint
             else "⚠️ shipped fit, measured on **another machine**")
    if bank.meta.get("provenance", {}).get("built_here"):
        where = f"**built here** on first use (its traces and fit measured on this machine; {bank.meta['provenance'].get('calibration', '')}), " + where
    degenerate = "; ".join(f"{k} {v}" for k, v in fit.get("degenerate", {}).items())
    return (f"Bank `{task}`: {len(bank)} trees ({', '.join(t.name for t in bank.trees)}); {where}: "
            f"{fit.get('hardware', '?')}, {fit.get('date', '')}. Policy feature: `{fit.get('feature', 'p0')}`"
            + through_heads(fit) + "."
            + (f" Note: {degenerate}." if degenerate else "")
            + (f" Ceiling: {ceiling_text(fit)}." if fit.get("ceiling") else "") + served_note(rt, task) + prompt_note(rt))


def building_note(rt: Runtime, task: str) -> str:
    """How far this model's bank for the task is built here (`bank.ondemand`), or how to build one."""
    where = rt.built_file(task)
    if where is None:  # no Hydra heads to trace
        return f"Build one with `python -m entmtp build-bank --task {task}` once the model has Hydra heads."
    st = read_status(where)
    if st.get("stage") == "waiting":
        return "It is built here after the first race on this task (traces of its calibration prompts, then every tree timed)."
    return f"**Building it here**: {status_text(st)}. Races use the fallback until it is done."


def prompt_note(rt: Runtime) -> str:
    """The prompt format where the model has no chat template of its own."""
    fmt = rt.prompt_format
    return "" if fmt == CHAT_TEMPLATE else f" Prompts: {fmt}."


def served_note(rt: Runtime, task: str) -> str:
    """The policies races serve now, where the live costs refitted them (`bank.refit`), else ""."""
    got = rt.live_fit(task)
    if got is None or not got.refits:
        return ""
    last = got.refits[-1]
    pol = got.fit["policies"]
    return (f" **Served now, refitted at the live step costs** ({len(got.refits)} refit(s) here; the last: {last['why']}): "
            f"τ {policy_text(pol, 'tau')}; ladder {policy_text(pol, 'ladder')}; static {policy_text(pol, 'static')}.")


def entmtp_policy(bank: TopologyBank, req: Request) -> tuple[Policy, str]:
    """The policy the left pane runs and the label it shows."""
    label = POLICIES[req.policy].split(" (")[0]
    pol = bank.policy(req.policy)
    if req.tau is None:
        return pol, label
    fitted = bank.policies.get("tau")
    small, large, feature, depth = ((fitted.small, fitted.large, fitted.feature, fitted.depth) if isinstance(fitted, TauPolicy)
                                    else (0, len(bank) - 1, "p0", 0))
    if small == large:  # a degenerate fit: switch from its tree to the next larger tree of the front
        front = sorted(bank.front, key=lambda i: bank.trees[i].n_nodes)
        bigger = [i for i in front if bank.trees[i].n_nodes > bank.trees[small].n_nodes]
        large = bigger[0] if bigger else large
    return TauPolicy(small, large, req.tau[0], req.tau[1], feature, depth), f"{label} (your τ {req.tau[0]:.2f}/{req.tau[1]:.2f})"


# -- one side of the race ------------------------------------------------------------------------


@dataclass
class Side:
    """A generator of step records plus what the page shows of it. Where the steps run (a ZeroGPU
    worker) the side sends `delta()`s; the page's copy (no steps) takes them in with `apply`."""

    name: str
    steps: Iterator[StepRecord] | None = None
    records: list[StepRecord] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    spans: list[tuple[str, str | None]] = field(default_factory=list)  # (text, "accepted draft" or None)
    done: bool = False
    cut: str = ""  # why the race ended this side early, if it did
    forecast: dict[str, Any] | None = None  # what `forecast` returns: the prediction for this prompt
    prompt_tokens: int | None = None  # where the page observes this side's steps (`apply`): the prompt's length
    _sent: tuple[int, int, int] = (0, 0, 0)  # records, ids and spans already in a delta

    def advance(self, rt: Runtime) -> None:
        rec = next(self.steps)
        self.records.append(rec)
        if rec.tokens:
            # the root token is the model's own prediction; the rest were drafts it accepted
            n = len(self.ids)
            self.ids += rec.tokens
            with_root = rt.decode(self.ids[: n + 1])
            full = rt.decode(self.ids)
            self.spans.append((with_root[len(self.text):], None))
            if len(rec.tokens) > 1:
                self.spans.append((full[len(with_root):], "accepted draft"))
            self.text = full
        self.done = rec.finished

    def stop(self, why: str) -> None:
        """End this side before its generator did (Stop, or the GPU time asked for ran out)."""
        if not self.done:
            self.done, self.cut = True, why
        if self.steps is not None:
            self.steps.close()

    def delta(self) -> dict[str, Any]:
        """What changed since the last delta, as plain picklable data (no tensor, no model object)."""
        r, i, s = self._sent
        self._sent = (len(self.records), len(self.ids), len(self.spans))
        return {"records": self.records[r:], "ids": self.ids[i:], "spans": self.spans[s:], "text": self.text,
                "done": self.done, "cut": self.cut}

    def apply(self, delta: dict[str, Any], live: LiveCosts | None = None) -> None:
        """Take in a delta; with `live`, its steps are observed there (the page's runtime, where
        the steps ran in another process: ZeroGPU's worker)."""
        if live is not None and self.prompt_tokens is not None:
            for _ in live.observe_run(delta["records"], self.prompt_tokens, len(self.ids), self.records[-1].tree if self.records else None):
                pass
        self.records += delta["records"]
        self.ids += delta["ids"]
        self.spans += delta["spans"]
        self.text, self.done, self.cut = delta["text"], delta["done"], delta["cut"]

    @property
    def seconds(self) -> float:
        clock = plots.own_clock(self.records)
        return clock[-1] if clock else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0

    def predicted(self) -> str:
        """The tokens/s predicted for this prompt, in words: at its budget while racing, at the
        tokens emitted once done; "" without a forecast."""
        f = self.forecast
        if not f:
            return ""
        emitted = self.done and self.ids
        tps = predict(f["fit"], f["method"], f["prompt_tokens"], len(self.ids) if emitted else f["budget"])
        costs = (f"at the costs of the last {f['live_steps']} steps timed here" if f.get("live_steps")
                 else "at calibration's costs (no step timed here yet)")
        return (f"predicted here for this prompt ({f['prompt_tokens']} tokens, "
                + (f"{len(self.ids)} new" if emitted else f"up to {f['budget']} new") + f", {costs}): {tps:.1f} tokens/s")

    def slowdown(self) -> float | None:
        """This side's decode steps' time over what the fit measured for the same trees on this
        machine (None before SLOW_STEPS steps or without those costs). Well above 1 means something
        else used the machine during the race, e.g. a browser drawing this page on the same CPU."""
        costs = (self.forecast or {}).get("step_ms") or {}
        timed = [(r.step_ms, costs[r.tree]) for r in self.records if r.tree in costs]
        if len(timed) < SLOW_STEPS:
            return None
        return sum(m for m, _ in timed) / max(1e-9, sum(c for _, c in timed))

    def stats(self, other: "Side | None" = None) -> str:
        head = f"#### {self.name}\n"
        said = self.predicted()
        if not self.records:
            return head + "*prefill…*" + (f"  \n<small>{said}</small>" if said else "")
        steps = len(self.records)
        line = f"**{self.tokens_per_s:.1f} tokens/s** · **{len(self.ids) / steps:.2f} tokens/step**"
        if other is not None and other.tokens_per_s > 0:
            line += f" · **{self.tokens_per_s / other.tokens_per_s:.2f}×** baseline"
        detail = (f"{len(self.ids)} tokens in {steps} steps, {self.seconds:.2f} s "
                  f"(prefill {self.records[0].prefill_ms / 1e3:.2f} s)" + (f", stopped: {self.cut or self.records[-1].stop_reason}" if self.done else ""))
        slow = self.slowdown() if self.done else None
        busy = (f"; ⚠️ its steps took {slow:.1f}× what calibrating measured for the same trees here: something else used "
                "the machine meanwhile (on a CPU, a browser on the same machine drawing this page counts)") if slow and slow >= SLOW_RATIO else ""
        return f"{head}{line}  \n<small>{detail}" + (f"; {said}" if said else "") + busy + "</small>" + self.live_line()

    def live_line(self) -> str:
        """The refits at the live costs during this side's decode and its probe steps, in words ("" without any)."""
        refits = [r for r in self.records if r.refit]
        probes = sum(r.probe for r in self.records)
        parts = [f"**refit** before step {r.step}: {r.refit['why']}; refitted in {r.refit['refit_ms']:.1f} ms: "
                 + (f"{r.refit['old']} → **{r.refit['new']}**" if r.refit["changed"] else f"kept {r.refit['old']}") for r in refits]
        if probes:
            parts.append(f"{probes} step(s) timed a tree not run lately (a probe of the live costs; the output is the same)")
        return ("  \n<small>" + "  \n".join(parts) + "</small>") if parts else ""


def forecast(bank: TopologyBank, method: str, prompt_tokens: int, budget: int, live: LiveCosts | None = None) -> dict[str, Any] | None:
    """What a side needs to predict its tokens/s for this prompt (`bank.predict`), as plain data;
    None where the bank's fit cannot (a fit made before it timed cost against context, or a method
    it does not fit: Medusa). With `live`, the fit is priced at the step costs of this moment
    (`LiveCosts.priced`: the races before this one on this machine), else at calibration's."""
    fit = bank.fit or {}
    if not fit.get("context_cost") or method not in (fit.get("per_method") or {}):
        return None
    priced = live.priced(fit, method) if live is not None else None
    step_ms = {name: t["step_ms"] for name, t in (fit.get("trees") or {}).items()}
    if fit.get("baseline"):
        step_ms[fit["baseline"]["name"]] = fit["baseline"]["step_ms"]
    if "ar" in fit["per_method"]:  # plain decoding's steps are named after the method
        step_ms["ar"] = fit["per_method"]["ar"]["step_ms"]
    return {"fit": priced or {k: fit[k] for k in ("context", "context_cost", "per_method")}, "method": method,
            "prompt_tokens": prompt_tokens, "budget": budget, "step_ms": step_ms,
            "live_steps": priced["live_steps"] if priced else 0}


def badge(ent: Side, base: Side, temperature: float) -> str:
    """What the race checked, and only that."""
    if not (ent.done and base.done):
        return "<span class='badge running'>racing…</span>"
    if temperature > 0:
        return ("<span class='badge info'>sampling (T > 0): each side draws its own sample, so the texts may differ; "
                "both samplers are exact (the test suite checks their distributions)</span>")
    if ent.ids == base.ids:
        extra = ": plain decoding is the model's own greedy output" if base.name.startswith("Plain") else ""
        return f"<span class='badge same'>✓ identical output: {ent.name} and {base.name} emitted the same {len(ent.ids)} token ids{extra}</span>"
    k = next((i for i, (a, b) in enumerate(zip(ent.ids, base.ids)) if a != b), min(len(ent.ids), len(base.ids)))
    return f"<span class='badge diff'>✗ {ent.name} and {base.name} differ from token {k}</span>"


def start(rt: Runtime, req: Request, bank: TopologyBank, lock: threading.Lock) -> tuple[Side, Side, Policy]:
    """Both sides ready to step, with their kernels built off the clocks. `lock` is the runtime's
    (`Models.runtime_lock`): races set up on one runtime one at a time."""
    # the bank as served now (its policies refitted at the live costs, `bank.refit`), where the race
    # runs the task's own bank with its fitted policy; a τ of the visitor's own is left as chosen
    served = rt.served(req.task) if req.tau is None and rt.follow_live and rt.serves(req.task, bank) else None
    bank = served.served if served is not None else bank
    policy, label = entmtp_policy(bank, req)
    method = f"entmtp-{req.policy}"
    with lock:  # heads load lazily inside the runtime
        ent_s = Strategy(method, bank, policy, rt.heads("hydra"), *rt.book_for(bank),  # the phrasebook: built once, here
                         serving=served.session(method) if served is not None else None)
        base_s = rt.strategy(req.baseline, req.task)
        if rt.engine.device.type == "cuda" or rt.model.dtype != torch.float32:
            # the first forward of each new shape builds kernels: keep that off both clocks
            # only the trees this race can verify: a cold GPU worker captures no graph it will not use
            picks = [bank.trees[i] for i in sorted(policy_trees(policy))]
            rt.engine.warmup(sorted({t.n_nodes for t in (*picks, *base_s.trees)}))
            rt.engine.warmup_drafts(ent_s.heads, picks)
            rt.engine.warmup_drafts(base_s.heads, base_s.trees)
    ids = rt.encode(req.prompt)
    if len(ids) > MAX_PROMPT_TOKENS or len(ids) + req.max_new_tokens > rt.engine.max_positions:
        raise RaceError(f"The prompt has {len(ids)} tokens; the demo takes up to {MAX_PROMPT_TOKENS} and prompt + "
                        f"max_new_tokens must fit the model's {rt.engine.max_positions}.", "Prompt too long")
    gen = GenerationConfig(max_new_tokens=req.max_new_tokens, temperature=req.temperature, seed=req.seed)
    # each side's steps feed the runtime's live costs, which the next race's predictions are priced at
    # (on ZeroGPU this runs in a GPU worker whose state is dropped: the page observes the deltas instead)
    observed = (lambda steps: steps) if gpu.zero_gpu() else (lambda steps: rt.live.observe_run(steps, len(ids)))
    ent = Side(label, observed(rt.engine.generate(ids, ent_s, gen)),
               forecast=None if req.tau else forecast(bank, f"entmtp-{req.policy}", len(ids), req.max_new_tokens, rt.live))
    base = Side(BASELINES[req.baseline].split(" (")[0], observed(rt.engine.generate(ids, base_s, gen)),
                forecast=forecast(bank, req.baseline, len(ids), req.max_new_tokens, rt.live))
    return ent, base, policy


def tree_view(rt: Runtime, bank: TopologyBank, rec: StepRecord | None) -> dict[str, Any] | None:
    """What the tree chart needs of one step (picklable, no model objects)."""
    if rec is None:
        return None
    labels = [t.replace(" ", "␣").replace("\n", "↵")[:10] or "∅" for t in rt.tokenizer.batch_decode([[t] for t in rec.draft_tokens])]
    return {"tree": bank[rec.tree_index], "accepted": rec.accepted_nodes, "labels": labels, "step": rec.step, "s": rec.feature}


# -- the Bank tab ----------------------------------------------------------------------------------


def tau_defaults(bank: TopologyBank) -> tuple[float, float]:
    """Slider values for the τ override: the fitted thresholds when they lie in the sliders' range [0, 1].

    A degenerate fit (one tree, thresholds parked at or above 1) must not reach the sliders:
    Gradio refuses out-of-range slider values on every race, whether or not the override is ticked.
    """
    pol = bank.policies.get("tau")
    if isinstance(pol, TauPolicy) and pol.small != pol.large and 0.0 <= pol.tau_off <= pol.tau_on <= 1.0:
        return pol.tau_on, pol.tau_off
    return 0.8, 0.5


def live_bank(models: Models, task: str, model: str | None, status: str = "") -> tuple[TopologyBank, str]:
    """(bank, note): the task's bank as races use it now, and one truthful line on its fit.

    Never times anything: a bank not yet fitted here has its shipped fit, labelled so, with
    `status` (what the background fit is doing) when there is one.
    """
    name = models.check(model)
    rt = models.loaded(name)
    if rt is None or (has_bank(rt, task) and rt.needs_calibration(task)):
        bank = (fallback_bank() if not has_bank(name, task) else resolve_bank(name, task)) if rt is None else rt.bank_from_file(task)
        hw = bank.fit.get("hardware", "?")
        note = (f"Bank `{task}`: {len(bank)} trees; showing its **shipped fit, measured on another machine** ({hw}, "
                f"{bank.fit.get('date', '')}). Races use it until a fit measured here exists"
                f"{f' ({status})' if status else ' (measured in the background after the start, or press Refit)'}.")
        if bank.meta.get("fallback"):
            note = f"⚠️ No `{task}` bank for `{name}`: races use a small built-in fallback bank."
        return bank, note
    bank = bank_for(rt, task)
    return bank, bank_note(rt, task, bank)


def bank_rows(bank: TopologyBank) -> list[list]:
    """The Bank tab's table: per tree, its size, acceptance, cost and predicted speed, and its policies."""
    return [[t.name, t.n_nodes, t.max_depth, st.get("mean_accepted"), st.get("step_ms"), st.get("tokens_per_s"),
             "yes" if i in bank.front else "", ", ".join(k for k, p in bank.policies.items() if i in policy_trees(p))]
            for i, (t, st) in enumerate(zip(bank.trees, bank.stats))]


def policy_trees(pol) -> set[int]:
    """The indices of the bank trees a policy can pick."""
    if isinstance(pol, StaticPolicy):
        return {pol.tree}
    if isinstance(pol, LadderPolicy):
        return set(pol.trees)
    return {pol.small, pol.large}
