"""EntMTP demo: EntMTP and a baseline (Hydra, Medusa or plain decoding) race side by side.

Gradio UI only: it builds `demo` at import, loads the engine lazily once per model, keeps each
user's last race in `gr.State`, and formats the engine's step records into panes and charts.
`python app.py` serves it locally (CPU, the default model, no download). Environment:
ENTMTP_APP_MODEL (model id or path), ENTMTP_APP_HYDRA_HEADS / ENTMTP_APP_MEDUSA_HEADS (head
folders or hub repos), ENTMTP_APP_CONCURRENCY (races served at once; default 1 so that two
races do not share the CPU and skew each other's clocks).
"""

from __future__ import annotations

try:  # on a ZeroGPU Space `spaces` must be imported before anything initialises CUDA
    import spaces
except ImportError:
    spaces = None

import functools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import gradio as gr
import torch

from entmtp import plots
from entmtp.bank import TopologyBank
from entmtp.config import BASELINE_TREE, DEFAULT_MODEL, TASKS, GenerationConfig, ModelConfig
from entmtp.engine import GenerationError, StepRecord, Strategy
from entmtp.loading import LoadError, Runtime, bank_path, load_runtime, resolve_bank
from entmtp.policy import LadderPolicy, StaticPolicy, TauPolicy
from entmtp.topology import chain, compile_tree

POLICIES = {"tau": "EntMTPτ (two trees, hysteresis)", "ladder": "EntMTP-ladder (thresholds)", "static": "EntMTP* (one static tree)"}
BASELINES = {"hydra": "Hydra (63-node default tree)", "medusa": "Medusa (63-node default tree)", "ar": "Plain decoding (AR)"}
MAX_NEW_TOKENS = (1, 1024)
TEMPERATURE = (0.0, 2.0)
MAX_PROMPT_TOKENS = 2048  # a CPU prefill of more takes tens of seconds; the model allows 8192
MAX_PROMPT_CHARS = 20_000  # refused before tokenising
CHART_EVERY_S = 0.8  # charts are re-sent whole: at most this often while streaming
EXAMPLES = [
    ["Write a Python function `is_palindrome(s)` that ignores case and spaces, with a docstring.", "code"],
    ["Write a Python function that returns the n-th Fibonacci number iteratively.", "code"],
    ["A baker makes 24 muffins and sells them in boxes of 4. Each box costs $6. How much money does she make if she sells all boxes? Think step by step.", "math"],
    ["Tom has 3 times as many apples as Ann. Together they have 48 apples. How many does Tom have? Explain.", "math"],
    ["Give me three tips for staying focused while working from home.", "chat"],
    ["Explain what a hash table is to a beginner, in one short paragraph.", "chat"],
]


@dataclass(frozen=True)
class AppConfig:
    model: str = DEFAULT_MODEL
    hydra_heads: str | None = None
    medusa_heads: str | None = None
    concurrency: int = 1

    @classmethod
    def from_env(cls) -> "AppConfig":
        return cls(
            model=os.environ.get("ENTMTP_APP_MODEL") or DEFAULT_MODEL,
            hydra_heads=os.environ.get("ENTMTP_APP_HYDRA_HEADS") or None,
            medusa_heads=os.environ.get("ENTMTP_APP_MEDUSA_HEADS") or None,
            concurrency=int(os.environ.get("ENTMTP_APP_CONCURRENCY", "1")),
        )


# -- engine and banks, loaded lazily once --------------------------------------------------------

_LOAD_LOCK = threading.Lock()  # two first requests must not load the same model twice


@functools.lru_cache(maxsize=2)
def _load(model: str, hydra_heads: str | None, medusa_heads: str | None) -> Runtime:
    return load_runtime(ModelConfig(model=model), hydra_heads=hydra_heads, medusa_heads=medusa_heads)


def get_runtime(cfg: AppConfig, model: str) -> Runtime:
    """The runtime of `model`; head paths from the environment apply to the app's own model."""
    own = model == cfg.model
    with _LOAD_LOCK:
        return _load(model, cfg.hydra_heads if own else None, cfg.medusa_heads if own else None)


def fallback_bank() -> TopologyBank:
    """A small uncalibrated bank for when banks/<model>/<task>.json does not exist yet."""
    specs = [("root", []), ("chain2", chain(2)), ("t4", [[0], [1], [0, 0]]),
             ("t8", [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])]
    trees = [compile_tree(p, name) for name, p in specs]
    policies = {"static": StaticPolicy(2), "ladder": LadderPolicy((0, 1, 2, 3), (0.3, 0.6, 0.85)),
                "tau": TauPolicy(1, 3, 0.8, 0.5)}
    return TopologyBank(trees, [{} for _ in trees], policies, {"fallback": True})


def bank_for(model: str, task: str) -> tuple[TopologyBank, str]:
    """(bank, one-line provenance for the UI). A missing file gives the fallback; a bad one raises."""
    path = bank_path(model, task)
    if not path.exists():
        return fallback_bank(), (
            f"⚠️ **Built-in fallback bank** (4 small trees, thresholds not calibrated): `{path.name}` "
            f"for this model does not exist yet. Build it with `python -m entmtp build-bank --task {task}`."
        )
    bank = resolve_bank(model, task)
    prov = bank.meta.get("provenance", {})
    hw = prov.get("hardware", "?")
    hw = hw.get("device", hw.get("cpu", hw)) if isinstance(hw, dict) else hw
    return bank, f"Bank `{task}`: {len(bank)} trees ({', '.join(t.name for t in bank.trees)}), measured on {hw}, {prov.get('date', '')}."


def tau_defaults(bank: TopologyBank) -> tuple[float, float]:
    """Slider values for the τ override: the fitted thresholds when they lie in the sliders' range [0, 1].

    A degenerate fit (one tree, thresholds parked above 1) must not reach the sliders: Gradio
    refuses out-of-range slider values on every race, whether or not the override is ticked.
    """
    pol = bank.policies.get("tau")
    if isinstance(pol, TauPolicy) and 0.0 <= pol.tau_off <= pol.tau_on <= 1.0:
        return pol.tau_on, pol.tau_off
    return 0.8, 0.5


# -- one side of the race ------------------------------------------------------------------------


@dataclass
class Side:
    """A generator of step records plus what the UI shows of it."""

    name: str
    steps: Iterator[StepRecord]
    records: list[StepRecord] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    spans: list[tuple[str, str | None]] = field(default_factory=list)  # (text, "accepted draft" or None)
    done: bool = False

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

    @property
    def seconds(self) -> float:
        clock = plots.own_clock(self.records)
        return clock[-1] if clock else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0

    def stats(self, other: "Side | None" = None) -> str:
        head = f"#### {self.name}\n"
        if not self.records:
            return head + "*prefill…*"
        steps = len(self.records)
        line = f"**{self.tokens_per_s:.1f} tokens/s** · **{len(self.ids) / steps:.2f} tokens/step**"
        if other is not None and other.tokens_per_s > 0:
            line += f" · **{self.tokens_per_s / other.tokens_per_s:.2f}×** baseline"
        detail = (f"{len(self.ids)} tokens in {steps} steps, {self.seconds:.2f} s "
                  f"(prefill {self.records[0].prefill_ms / 1e3:.2f} s)" + (f", stopped: {self.records[-1].stop_reason}" if self.done else ""))
        return f"{head}{line}  \n<small>{detail}</small>"


def badge(ent: Side, base: Side, temperature: float) -> str:
    if not (ent.done and base.done):
        return "<span class='badge running'>racing…</span>"
    if temperature > 0:
        return ("<span class='badge info'>sampling (T > 0): each side draws its own sample; both are exact samples "
                "of the model, so texts may differ</span>")
    if ent.ids == base.ids:
        return f"<span class='badge same'>✓ identical output: {len(ent.ids)} token ids equal</span>"
    k = next((i for i, (a, b) in enumerate(zip(ent.ids, base.ids)) if a != b), min(len(ent.ids), len(base.ids)))
    return f"<span class='badge diff'>✗ outputs differ from token {k}</span>"


def tree_view(rt: Runtime, bank: TopologyBank, rec: StepRecord | None) -> dict | None:
    """What the tree chart needs of one step, kept in gr.State (picklable, no model objects)."""
    if rec is None:
        return None
    labels = [t.replace(" ", "␣").replace("\n", "↵")[:10] or "∅" for t in rt.tokenizer.batch_decode([[t] for t in rec.draft_tokens])]
    return {"tree": bank[rec.tree_index], "accepted": rec.accepted_nodes, "labels": labels, "step": rec.step, "s": rec.s}


def tree_plot(view: dict | None):
    if view is None:
        return plots.empty_figure("The tree verified at the current step", "The tree of the latest step, with its accepted path, appears here.", 300)
    t = view["tree"]
    title = f"Step {view['step']}: tree {t.name} ({t.n_nodes} nodes, picked at s = {view['s']:.2f}), {len(view['accepted'])} accepted"
    return plots.tree_figure(t, view["accepted"], view["labels"], title=title)


# -- the race ------------------------------------------------------------------------------------


def validate(prompt, task, policy, baseline, max_new_tokens, temperature) -> tuple[str, int, float]:
    """Clean inputs or a gr.Error that names the bad value (the API receives raw values too)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("The prompt is empty: type a question or pick an example.", title="Empty prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise gr.Error(f"The prompt has {len(prompt):,} characters; the demo accepts up to {MAX_PROMPT_CHARS:,}.", title="Prompt too long")
    if task not in TASKS:
        raise gr.Error(f"Unknown task {task!r}: choose one of {', '.join(TASKS)}.")
    if policy not in POLICIES:
        raise gr.Error(f"Unknown policy {policy!r}: choose one of {', '.join(POLICIES)}.")
    if baseline not in BASELINES:
        raise gr.Error(f"Unknown baseline {baseline!r}: choose one of {', '.join(BASELINES)}.")
    try:
        n, t = float(max_new_tokens), float(temperature)
    except (TypeError, ValueError):
        raise gr.Error(f"max_new_tokens and temperature must be numbers, got {max_new_tokens!r} and {temperature!r}.") from None
    if not (MAX_NEW_TOKENS[0] <= n <= MAX_NEW_TOKENS[1]) or n != int(n):
        raise gr.Error(f"max_new_tokens must be a whole number from {MAX_NEW_TOKENS[0]} to {MAX_NEW_TOKENS[1]}, got {max_new_tokens}.", title="Out of range")
    if not (TEMPERATURE[0] <= t <= TEMPERATURE[1]):
        raise gr.Error(f"temperature must be between {TEMPERATURE[0]} and {TEMPERATURE[1]}, got {temperature}.", title="Out of range")
    return prompt.strip(), int(n), t


def strategies(rt: Runtime, model: str, task: str, policy: str, baseline: str,
               tau: tuple[float, float] | None) -> tuple[Strategy, Strategy, TopologyBank]:
    bank, _ = bank_for(model, task)
    pol = bank.policy(policy)
    if tau is not None:
        fitted = bank.policies.get("tau")
        if not isinstance(fitted, TauPolicy):
            raise gr.Error("This bank has no τ policy whose trees the custom thresholds could use.")
        if tau[1] > tau[0]:
            raise gr.Error(f"τ_off ({tau[1]}) must not exceed τ_on ({tau[0]}).", title="Out of range")
        pol = TauPolicy(fitted.small, fitted.large, tau[0], tau[1])
    with _LOAD_LOCK:  # heads load lazily inside the runtime
        ent = Strategy(f"entmtp-{policy}", bank, pol, rt.heads("hydra"))
        base = rt.strategy(baseline, task)
        if rt.engine.device.type == "cuda" or rt.model.dtype != torch.float32:
            # the first forward of each new shape builds kernels: keep that off both clocks
            rt.engine.warmup([t.n_nodes for t in (*bank.trees, *base.bank.trees)])
    return ent, base, bank


def make_race(cfg: AppConfig):
    def race(prompt, task, policy, baseline, max_new_tokens, temperature,
             model=None, seed=0, custom_tau=False, tau_on=0.8, tau_off=0.5):
        prompt, n_new, temp = validate(prompt, task, policy, baseline, max_new_tokens, temperature)
        model = (model or "").strip() or cfg.model
        try:
            rt = get_runtime(cfg, model)
            ids = rt.encode(prompt)
            if len(ids) > MAX_PROMPT_TOKENS or len(ids) + n_new > rt.engine.max_positions:
                raise gr.Error(
                    f"The prompt has {len(ids)} tokens; the demo takes up to {MAX_PROMPT_TOKENS} "
                    f"and prompt + max_new_tokens must fit the model's {rt.engine.max_positions}.",
                    title="Prompt too long",
                )
            ent_s, base_s, bank = strategies(rt, model, task, policy, baseline,
                                             (float(tau_on), float(tau_off)) if custom_tau else None)
            gen = GenerationConfig(max_new_tokens=n_new, temperature=temp, seed=int(seed or 0))
            ent = Side(POLICIES[policy].split(" (")[0], rt.engine.generate(ids, ent_s, gen))
            base = Side(BASELINES[baseline].split(" (")[0], rt.engine.generate(ids, base_s, gen))
        except (LoadError, GenerationError, ValueError) as e:
            raise gr.Error(str(e), title="Cannot run this race") from None
        tau = (ent_s.policy.tau_on, ent_s.policy.tau_off) if isinstance(ent_s.policy, TauPolicy) else None
        last_chart = 0.0
        while not (ent.done and base.done):
            # one step of each side per iteration: both stream at once, each timed on its own clock
            for side in (ent, base):
                if not side.done:
                    side.advance(rt)
            finished = ent.done and base.done
            charts = finished or time.perf_counter() - last_chart > CHART_EVERY_S
            view = tree_view(rt, bank, ent.records[-1]) if charts else None
            sides = {ent.name: ent.records, base.name: base.records}
            yield (
                ent.text, base.text, ent.spans, base.spans, ent.stats(base), base.stats(),
                badge(ent, base, temp),
                plots.race_figure(sides) if charts else gr.skip(),
                plots.accepted_figure(sides) if charts else gr.skip(),
                plots.features_figure(ent.records, tau) if charts else gr.skip(),
                plots.usage_figure(ent.records) if charts else gr.skip(),
                tree_plot(view) if charts else gr.skip(),
                gr.update(maximum=max(2, len(ent.records)), value=len(ent.records), interactive=finished) if finished else gr.skip(),
                [tree_view(rt, bank, r) for r in ent.records] if finished else gr.skip(),
            )
            if charts:
                last_chart = time.perf_counter()

    return spaces.GPU(duration=180)(race) if spaces is not None else race


def show_step(views, step):
    """Redraw the tree chart for a step of the last race (per-user state)."""
    if not views:
        return tree_plot(None)
    return tree_plot(views[max(1, min(int(step), len(views))) - 1])


def bank_tab(cfg: AppConfig):
    def show(task, model):
        model = (model or "").strip() or cfg.model
        try:
            bank, note = bank_for(model, task)
        except LoadError as e:
            return f"❌ {e}", f"❌ {e}", plots.front_figure(fallback_bank()), [], gr.skip(), gr.skip()
        baseline = {"name": BASELINE_TREE, "n_nodes": 63}
        rows = [[t.name, t.n_nodes, t.max_depth, st.get("mean_accepted"), st.get("step_ms"), st.get("tokens_per_s"),
                 ", ".join(k for k, p in bank.policies.items() if i in _policy_trees(p))]
                for i, (t, st) in enumerate(zip(bank.trees, bank.stats))]
        on, off = tau_defaults(bank)
        return note, note, plots.front_figure(bank, baseline), rows, on, off

    return show


def _policy_trees(pol) -> set[int]:
    if isinstance(pol, StaticPolicy):
        return {pol.tree}
    if isinstance(pol, LadderPolicy):
        return set(pol.trees)
    return {pol.small, pol.large}


HOW_IT_WORKS = """
### Speculative decoding in one picture
A language model normally produces **one token per forward pass**, and each pass must read all
the weights. A pass that checks 8 tokens reads them once too, so it costs far less than 8 passes:
we can *guess* several future tokens cheaply and let the model **verify all guesses in one pass**.

1. **Draft.** Small *draft heads* (Hydra-style: head *d* reads the model's last hidden state and the
   tokens guessed so far) propose the next tokens. Taking the top-k of each head gives a **tree** of
   candidate continuations (the tree chart: root on the left, one column per head).
2. **Verify.** One forward pass of the real model scores every node of the tree at once, with an
   attention mask that lets each node see only its own ancestors.
3. **Accept.** Walk from the root: keep a drafted token only if it is exactly what the model itself
   would have produced there (at temperature 0 the argmax; when sampling, an exact rejection rule).
   The accepted path (orange) is emitted; the rest is thrown away. **The output is exactly the
   model's own output**, only faster: the *identical output* badge checks this token by token.

### Why EntMTP
A big tree (Hydra's 63 nodes) accepts more tokens per step but every step costs more, and on a
CPU verification cost grows quickly with tree size. **EntMTP keeps a bank of trees** that were
measured on this hardware (the *Bank* tab: only trees on the throughput Pareto front are kept)
and picks one **every step** from a cheap confidence signal **s** (the model's top-1 probability):

- **EntMTP\\***: always the task's single best tree.
- **EntMTP-ladder**: thresholds on *s*; more confident → bigger tree.
- **EntMTPτ**: two trees with hysteresis: switch to the big tree when *s* > τ_on, back to the small
  one when *s* ≤ τ_off.

### Reading the charts
- **Race**: tokens vs seconds. Both sides run interleaved, one step each in turn, and each side's
  clock adds up only *its own* measured prefill and step times, so neither is charged for the other.
- **Tokens per step**: 1 means no draft was accepted; the dashed line is the mean.
- **Confidence and tree**: *s* and the entropy of the model's next-token distribution; below, the
  size of the tree the policy picked at each step.
- **Tree**: the tree verified at a step, each node labelled with its drafted token (␣ = space,
  ↵ = newline); the orange path was accepted. After a race, the slider replays any step.
- **Tree usage**: how many steps each tree was used and how many tokens it produced.

Every number is measured live on the machine serving this page; no token is made up.
"""

CSS = """
.pane {max-height: 300px; overflow-y: auto;}
.badge {display: inline-block; padding: 4px 12px; border-radius: 999px; font-weight: 600; font-size: 14px;}
.badge.same {background: #d3f9d8; color: #2b8a3e;}
.badge.diff {background: #ffe3e3; color: #c92a2a;}
.badge.running {background: #f1f3f5; color: #495057;}
.badge.info {background: #e7f5ff; color: #1864ab; font-weight: 500;}
.stats {min-height: 96px;}
"""


def build_demo(cfg: AppConfig = AppConfig()) -> gr.Blocks:
    with gr.Blocks(title="EntMTP: entropy-guided speculative decoding") as demo:
        gr.Markdown(
            "# EntMTP: pick the draft tree every step\n"
            "Speculative decoding that stays **exactly** the model's output. EntMTP (left) chooses a "
            "draft tree per step from a bank measured on this hardware; the baseline (right) always "
            f"verifies one tree. Model: `{cfg.model}`. Highlighted tokens came from accepted drafts."
        )
        views = gr.State(None)
        with gr.Tab("Race"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=1, min_width=320):
                    prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, placeholder="Ask something, or pick an example below")
                    with gr.Row():
                        run = gr.Button("Run the race", variant="primary")
                        stop = gr.Button("Stop", variant="stop")
                    task = gr.Radio([(t, t) for t in TASKS], value="code", label="Task (chooses the tree bank)")
                    gr.Examples(EXAMPLES, inputs=[prompt, task], label="Examples",
                                example_labels=[f"{t}: {p[:34]}…" for p, t in EXAMPLES])
                    policy = gr.Radio([(v, k) for k, v in POLICIES.items()], value="tau", label="EntMTP policy (left pane)")
                    baseline = gr.Radio([(v, k) for k, v in BASELINES.items()], value="hydra", label="Baseline (right pane)")
                    with gr.Row():
                        max_new = gr.Slider(*MAX_NEW_TOKENS, value=96, step=1, label="Max new tokens")
                        temperature = gr.Slider(*TEMPERATURE, value=0.0, step=0.05, label="Temperature")
                    bank_note = gr.Markdown()
                    with gr.Accordion("Advanced", open=False):
                        model = gr.Textbox(value=cfg.model, label="Model (the default runs offline; a hub id downloads it)")
                        seed = gr.Number(value=0, precision=0, label="Seed (sampling)")
                        custom_tau = gr.Checkbox(value=False, label="Override the bank's τ thresholds (EntMTPτ)")
                        with gr.Row():
                            tau_on = gr.Slider(0, 1, value=0.8, step=0.01, label="τ_on (switch to the big tree above)")
                            tau_off = gr.Slider(0, 1, value=0.5, step=0.01, label="τ_off (back to the small tree at or below)")
                with gr.Column(scale=2):
                    out_badge = gr.HTML("<span class='badge running'>ready</span>")
                    with gr.Row(equal_height=True):
                        with gr.Column():
                            ent_stats = gr.Markdown("#### EntMTP\n*waiting for a race*", elem_classes="stats")
                            ent_hl = gr.HighlightedText(label="EntMTP output", color_map={"accepted draft": "#ffd8a8"},
                                                        combine_adjacent=True, show_inline_category=False,
                                                        show_legend=True, elem_classes="pane")
                        with gr.Column():
                            base_stats = gr.Markdown("#### Baseline\n*waiting for a race*", elem_classes="stats")
                            base_hl = gr.HighlightedText(label="Baseline output", color_map={"accepted draft": "#a5d8ff"},
                                                         combine_adjacent=True, show_inline_category=False,
                                                         show_legend=True, elem_classes="pane")
                    with gr.Row():
                        race_plot = gr.Plot(plots.race_figure({}), show_label=False)
                        acc_plot = gr.Plot(plots.accepted_figure({}), show_label=False)
                    feat_plot = gr.Plot(plots.features_figure([]), show_label=False)
            with gr.Row():
                with gr.Column(scale=2):
                    tree_out = gr.Plot(tree_plot(None), show_label=False)
                    step = gr.Slider(1, 2, value=1, step=1, label="Replay the tree of step… (after a race)", interactive=False)
                with gr.Column(scale=1):
                    usage_plot = gr.Plot(plots.usage_figure([]), show_label=False)
            with gr.Accordion("Plain text", open=False):
                with gr.Row():
                    ent_text = gr.Textbox(label="EntMTP text", lines=6)
                    base_text = gr.Textbox(label="Baseline text", lines=6)
        with gr.Tab("Bank"):
            gr.Markdown("The trees EntMTP chooses from for the task selected on the Race tab, with what "
                        "was measured when the bank was built. Filled markers: trees used by a policy.")
            bank_info = gr.Markdown()
            front = gr.Plot(show_label=False)
            table = gr.Dataframe(headers=["tree", "nodes", "depth", "mean accepted", "step ms", "tokens/s", "policies"],
                                 interactive=False, label="Trees")
        with gr.Tab("How it works"):
            gr.Markdown(HOW_IT_WORKS)

        outputs = [ent_text, base_text, ent_hl, base_hl, ent_stats, base_stats, out_badge,
                   race_plot, acc_plot, feat_plot, usage_plot, tree_out, step, views]
        event = run.click(
            make_race(cfg), [prompt, task, policy, baseline, max_new, temperature, model, seed, custom_tau, tau_on, tau_off],
            outputs, api_name="race", concurrency_limit=cfg.concurrency, concurrency_id="race",
        )
        stop.click(None, None, None, cancels=[event])
        step.release(show_step, [views, step], tree_out, api_visibility="private")

        show_bank = bank_tab(cfg)
        for trigger in (task.change, model.blur, demo.load):
            trigger(show_bank, [task, model], [bank_info, bank_note, front, table, tau_on, tau_off], api_visibility="private")
    return demo


demo = build_demo(AppConfig.from_env())


def launch(app: gr.Blocks = demo, **kwargs):
    """Serve `app` with the page styling (in Gradio 6 css belongs to launch())."""
    return app.launch(css=CSS, **kwargs)


if __name__ == "__main__":
    launch()
