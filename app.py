"""EntMTP demo: EntMTP and a baseline (Hydra, Medusa or plain decoding) race side by side.

Layout and wiring only; the race itself (models, validation, strategies, sides, badge) is
`entmtp.app.race`. Builds `demo` at import and keeps each user's last race in `gr.State`.
`python app.py` serves it locally (CPU, the default model, offline). Environment:
ENTMTP_APP_MODEL (model id or path), ENTMTP_APP_MODELS (comma-separated models the Advanced box
may load, each `model` or `model=its Hydra heads`; default: only the app's model),
ENTMTP_APP_HYDRA_HEADS / ENTMTP_APP_MEDUSA_HEADS (the app's model's head folders or hub repos),
ENTMTP_APP_FIT (auto: fit the banks to this machine once, in the background, the default;
shipped: the fit in the bank files), ENTMTP_APP_CONCURRENCY (races served at once; default 1 so
that two races do not share the CPU and skew each other's clocks), ENTMTP_APP_BUILD_PROMPTS /
ENTMTP_APP_BUILD_TOKENS (a bank built here where a model has none: calibration prompts and greedy
tokens each; default 24 and 128, as build-bank; docs/space.md).
"""

from __future__ import annotations

try:  # on a ZeroGPU Space `spaces` must be imported before anything initialises CUDA
    import spaces
except ImportError:
    spaces = None

import contextvars
import os
import threading
import time
from dataclasses import dataclass

import gradio as gr

from entmtp.app import gpu, whatif
from entmtp.app.race import (BASELINES, MAX_NEW_TOKENS, POLICIES, TEMPERATURE, Models, RaceError, Side, badge, bank_rows,
                             bank_trees, fallback_bank, live_bank, tau_defaults, tree_view, validate)
from entmtp.app.lesson import explain
from entmtp.app.service import Service, cadence, lesson, page_errors, race_steps
from entmtp.config import DEFAULT_MODEL, TASKS, BankBuildConfig
from entmtp.figures import plots
from entmtp.runtime.weights import LoadError, cache_root
from entmtp.spec.topology import compile_tree

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
    models: tuple[str, ...] = ()  # further models the Advanced box may load (the app's own always)
    fit: str = "auto"  # auto: banks fitted to this machine (timed once) | shipped: the bank files' fit
    model_heads: tuple[tuple[str, str], ...] = ()  # (model, its Hydra heads) for further models
    build_prompts: int = BankBuildConfig.calib_prompts  # a bank built here where a model has none: its calibration prompts
    build_tokens: int = BankBuildConfig.calib_new_tokens  # and greedy tokens a prompt

    @classmethod
    def from_env(cls) -> "AppConfig":
        entries = [m.strip() for m in os.environ.get("ENTMTP_APP_MODELS", "").split(",") if m.strip()]
        return cls(
            model=os.environ.get("ENTMTP_APP_MODEL") or DEFAULT_MODEL,
            hydra_heads=os.environ.get("ENTMTP_APP_HYDRA_HEADS") or None,
            medusa_heads=os.environ.get("ENTMTP_APP_MEDUSA_HEADS") or None,
            concurrency=int(os.environ.get("ENTMTP_APP_CONCURRENCY", "1")),
            models=tuple(m.split("=", 1)[0].strip() for m in entries),
            fit=os.environ.get("ENTMTP_APP_FIT", "auto"),
            model_heads=tuple((m.split("=", 1)[0].strip(), m.split("=", 1)[1].strip()) for m in entries if "=" in m),
            build_prompts=int(os.environ.get("ENTMTP_APP_BUILD_PROMPTS", BankBuildConfig.calib_prompts)),
            build_tokens=int(os.environ.get("ENTMTP_APP_BUILD_TOKENS", BankBuildConfig.calib_new_tokens)),
        )

    def registry(self) -> Models:
        build = BankBuildConfig(calib_prompts=self.build_prompts, calib_new_tokens=self.build_tokens)
        return Models(self.model, self.models, self.hydra_heads, self.medusa_heads, self.fit, dict(self.model_heads), build)


def tree_plot(view: dict | None):
    if view is None:
        return plots.empty_figure("The tree verified at the current step", "The tree of the latest step, with its accepted path, appears here.", 300)
    t = view["tree"]
    title = f"Step {view['step']}: tree {t.name} ({t.n_nodes} nodes, picked at feature {view['s']:.2f}), {len(view['accepted'])} accepted"
    return plots.tree_figure(t, view["accepted"], view["labels"], title=title)


# -- the race ------------------------------------------------------------------------------------


def make_race(service: Service):
    models = service.models

    def race(prompt, task, policy, baseline, max_new_tokens, temperature,
             model=None, seed=0, custom_tau=False, tau_on=0.8, tau_off=0.5):
        def status(text):
            return (gr.skip(),) * 6 + (f"<span class='badge running'>{text}</span>",) + (gr.skip(),) * 9

        with page_errors("Cannot run this race"):
            req = validate(prompt, task, policy, baseline, max_new_tokens, temperature, seed, custom_tau, tau_on, tau_off)
            models.check(model)
            for text in service.wait_ready():
                yield status(text)
            if models.loaded(model) is None:
                yield status("loading this model (once)…")
            rt = models.get(model)
            every = cadence(rt)[1]
            trees = bank_trees(rt, req.task)
            service.queue_fit(model, req.task)
            service.queue_build(model, req.task)  # a model with no bank for the task: built here meanwhile
        steps = race_steps(service.key, req, model)
        try:
            head = next(steps)
            if gpu.zero_gpu():
                gpu.remember(head["fingerprint"])
            # on ZeroGPU the steps run in the GPU worker: the page's runtime observes them from the deltas
            # (its live costs are what the next race's worker starts from); elsewhere `start` observed them
            prompt_tokens = len(rt.encode(req.prompt)) if gpu.zero_gpu() else None
            ent, base = (Side(name, forecast=f, prompt_tokens=prompt_tokens) for name, f in zip(head["names"], head["forecasts"]))
            pol = head["policy"]
            shipped = "" if head["fitted"] else ("  \n<small>⚠️ with the bank's shipped fit: this machine's fit is "
                                                 "being measured in the background (Bank tab)</small>")
            # before the first step: each side's prediction for this prompt
            last_chart, final = 0.0, (gr.skip(),) * 4 + (ent.stats(base) + shipped, base.stats()) + (gr.skip(),) * 8
            yield final + (plots.counterfactual_figure(None), [])
            for update in steps:
                if "counterfactual" in update:  # after the last step: the final outputs again, with it
                    cf = update["counterfactual"]
                    yield final[:14] + (plots.counterfactual_figure(cf), counterfactual_rows(cf, ent))
                    continue
                ent.apply(update["sides"][0], rt.live if prompt_tokens is not None else None)
                base.apply(update["sides"][1], rt.live if prompt_tokens is not None else None)
                finished = ent.done and base.done
                charts = finished or time.perf_counter() - last_chart > every
                view = tree_view(rt, trees, ent.records[-1]) if charts and ent.records else None
                sides = {ent.name: ent.records, base.name: base.records}
                final = (
                    ent.text, base.text, ent.spans, base.spans, ent.stats(base) + shipped, base.stats(),
                    badge(ent, base, req.temperature),
                    plots.race_figure(sides) if charts else gr.skip(),
                    plots.accepted_figure(sides) if charts else gr.skip(),
                    plots.features_figure(ent.records, pol["tau"], pol["feature"], depth=pol["depth"]) if charts else gr.skip(),
                    plots.usage_figure(ent.records) if charts else gr.skip(),
                    tree_plot(view) if charts else gr.skip(),
                    gr.update(maximum=max(2, len(ent.records)), value=len(ent.records), interactive=finished) if finished else gr.skip(),
                    [tree_view(rt, trees, r) for r in ent.records] if finished else gr.skip(),
                    gr.skip(), gr.skip(),
                )
                yield final
                if charts:
                    last_chart = time.perf_counter()
        finally:
            steps.close()  # a Stop closes this generator: the device work ends with it

    return race


def make_lesson(service: Service, first: bool):
    """Step through: the first step (`first`), or the step after the one shown, explained."""
    models = service.models

    def lesson_click(state, prompt, task, policy, baseline, max_new_tokens, temperature,
                     model=None, seed=0, custom_tau=False, tau_on=0.8, tau_off=0.5):
        with page_errors("Cannot run this step"):
            req = validate(prompt, task, policy, baseline, max_new_tokens, temperature, seed, custom_tau, tau_on, tau_off)
            models.check(model)
            for _ in service.wait_ready():
                pass
            models.get(model)
        if not first and state and state.get("done"):
            return (gr.skip(), gr.skip(), "<span class='badge info'>the lesson's output is complete: press Step through "
                    "to start again, or Continue for the whole race</span>", gr.skip(), state)
        k = 1 if first or not state else state["k"] + 1
        view = lesson(service.key, req, model, k)
        tree = compile_tree(view["tree"]["paths"], view["tree"]["name"])
        title = f"Lesson step {view['step']}: tree {tree.name} ({tree.n_nodes} nodes), {len(view['tokens'])} emitted"
        badge_html = (f"<span class='badge info'>lesson: step {view['step']} of {view['label']}"
                      + (" — output complete" if view["done"] else " — press Next step") + "</span>")
        return (explain(view), plots.tree_figure(tree, view["accepted_nodes"], view["labels"], title=title), badge_html,
                view["emitted"], {"k": view["step"], "done": view["done"]})

    return lesson_click


def counterfactual_rows(cf: dict, ent: Side) -> list[list]:
    """The counterfactual's table: predicted tokens/step and tokens/s at this machine's step costs per
    tree and policy on this output, and what the race measured."""
    rows = [[name, per_step, tps, ""] for name, per_step, tps in cf["rows"]]
    rows.append([f"measured in this race: {ent.name}", round(len(ent.ids) / max(1, len(ent.records)), 2), round(ent.tokens_per_s, 1),
                 f"the counterfactual of the tree that ran equals what it accepted at {cf['agree']} of {len(cf['steps'])} steps"])
    return rows


def show_step(views, step):
    """Redraw the tree chart for a step of the last race (per-user state)."""
    if not views:
        return tree_plot(None)
    return tree_plot(views[max(1, min(int(step), len(views))) - 1])


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
   model's own output**, only faster. The *identical output* badge checks, token by token, that
   EntMTP and the baseline emitted the same tokens; the project's test suite checks every method
   against transformers' own `generate` on the model as served.

### Why EntMTP
A big tree (Hydra's 63 nodes) accepts more tokens per step but every step costs more, and on a
CPU verification cost grows quickly with tree size. **EntMTP keeps a bank of trees**, and which
of them pay depends on the machine: the bank file carries, for calibration prompts, how many
drafted tokens each tree *would* have accepted at every position (a fact about the model and its
heads), and the app times one step with each tree on the machine serving this page (in the
background after it starts; races meanwhile use the file's fit) and fits the policies to those
costs (the *Bank* tab says which machine its numbers come from). EntMTP then
picks a tree **every step** from a cheap confidence signal: the model's top-1 probability *s*,
the heads' path value *g_D*, or exp(−entropy), whichever predicted best for the task:

- **EntMTP\\***: always the task's single best tree.
- **EntMTP-ladder**: thresholds on *s*; more confident → bigger tree.
- **EntMTPτ**: two trees with hysteresis: switch to the big tree when the signal > τ_on, back to
  the small one when it is ≤ τ_off. Where the fit finds that no switching pays, the Bank tab says
  so and τ runs one tree.

### One step, slowly
**Step through EntMTP** (under Run) decodes one step per click with the same engine and explains
it: why the policy chose this tree (its confidence signal against the thresholds), every drafted
node with the probability its head gave it, and the verdict of the one verification pass: accepted,
or the token the model itself chose there (the first rejection ends the accepted path; nodes below
it are never reached). The model's own token after the accepted path, the *bonus*, is the next
step's root. **Continue to the end** then runs the whole race.

### Reading the charts
- **Race**: tokens vs seconds. Both sides run interleaved, one step each in turn, and each side's
  clock adds up only *its own* measured prefill and step times, so neither is charged for the other.
- **Tokens per step**: 1 means no draft was accepted; the dashed line is the mean.
- **Confidence and tree**: *s* and the entropy of the model's next-token distribution; below, the
  size of the tree the policy picked at each step and the step's wall time. A dashed orange line
  is a **refit**: the step costs timed here lately had moved away from those the policy was fitted
  at, so its trees and thresholds were fitted again on the bank's traces at the costs of now (in a
  millisecond or so) and the policy changes from that step on; the line under EntMTP's figures says
  why and what changed. Now and then a step times a tree the policy has not used lately (a
  *probe*), so that its cost now is known too; the output is the same whatever tree verifies it.
- **Tree**: the tree verified at a step, each node labelled with its drafted token (␣ = space,
  ↵ = newline); the orange path was accepted. After a race, the slider replays any step.
- **Tree usage**: how many steps each tree was used and how many tokens it produced.
- **What every tree would have done** (temperature 0): at temperature 0 the output is the model's
  own whatever tree verifies it, so one pass over it tells exactly how many tokens every bank tree
  would have accepted at every step (the heatmap), which tree the policy picked (●) and which one
  a policy that knew the outcome would have picked at this machine's step costs (✕); the table
  gives this prompt's tokens/step and predicted tokens/s under each tree and policy.
- **Bank tab, what if**: the same traces under other step costs (this machine now, from the steps
  the races here timed lately; the H200 of the GPU check; the bank file's machine; or an idealised
  one where an extra tree row costs *r* × a plain step): cheap rows move the front to deep trees,
  costly ones back to one or two nodes. Beside it, every step's cost over time on this machine:
  on a shared machine it moves 2–3× within minutes, and each side's prediction in a race is priced
  at the costs of the races before it; the dashed lines mark the refits.

Every race number is measured live on the machine serving this page; no token is made up.
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


def build_demo(cfg: AppConfig = AppConfig(), models: Models | None = None, service: Service | None = None) -> gr.Blocks:
    """The page. Without `service`, one for `models` (default: the config's) is made and started:
    the model loads in the background while the page is served."""
    service = service or Service(models or cfg.registry()).start()
    models = service.models
    with gr.Blocks(title="EntMTP: entropy-guided speculative decoding") as demo:
        gr.Markdown(
            "# EntMTP: pick the draft tree every step\n"
            "Speculative decoding that stays **exactly** the model's output. EntMTP (left) chooses a "
            "draft tree per step from a bank fitted to the machine it runs on; the baseline (right) always "
            f"verifies one tree. Model: `{cfg.model}`"
            + (" (Advanced may pick another; the line below names the one picked)" if len(models.allowed) > 1 else "")
            + ". Highlighted tokens came from accepted drafts."
        )
        weights_note = gr.Markdown("<small>start-up: loading…</small>")
        timer = gr.Timer(1.0)  # refreshes the start-up and fit status while either is under way
        busy = gr.State(True)
        views = gr.State(None)
        with gr.Tab("Race"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=1, min_width=320):
                    prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, placeholder="Ask something, or pick an example below")
                    with gr.Row():
                        run = gr.Button("Run the race", variant="primary")
                        stop = gr.Button("Stop", variant="stop")
                    with gr.Row():
                        lesson_btn = gr.Button("Step through EntMTP", size="sm")
                        next_btn = gr.Button("Next step", size="sm")
                        cont_btn = gr.Button("Continue to the end", size="sm")
                    task = gr.Radio([(t, t) for t in TASKS], value="code", label="Task (chooses the tree bank)")
                    gr.Examples(EXAMPLES, inputs=[prompt, task], label="Examples",
                                example_labels=[f"{t}: {p[:34]}…" for p, t in EXAMPLES])
                    policy = gr.Radio([(v, k) for k, v in POLICIES.items()], value="tau", label="EntMTP policy (left pane)")
                    baseline = gr.Radio([(v, k) for k, v in BASELINES.items()], value="hydra", label="Baseline (right pane)")
                    with gr.Row():
                        max_new = gr.Slider(*MAX_NEW_TOKENS, value=96, step=1, label="Max new tokens")
                        temperature = gr.Slider(*TEMPERATURE, value=0.0, step=0.05, label="Temperature")
                    bank_note_md = gr.Markdown()
                    with gr.Accordion("Advanced", open=False):
                        model = gr.Textbox(value=cfg.model, label=f"Model (allowed here: {', '.join(models.allowed)})")
                        seed = gr.Number(value=0, precision=0, label="Seed (sampling)")
                        custom_tau = gr.Checkbox(value=False, label="Use my own τ_on / τ_off (EntMTPτ only)")
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
            with gr.Accordion("Lesson: one EntMTP step at a time (Step through, then Next step)", open=True):
                lesson_md = gr.Markdown("*Press **Step through EntMTP** to run the race one decode step per click; the tree "
                                        "chart above shows the step's tree with each node's head probability.*")
                lesson_state = gr.State(None)
            with gr.Accordion("What every tree would have done on this output (temperature 0)", open=True):
                cf_plot = gr.Plot(plots.counterfactual_figure(None), show_label=False)
                cf_table = gr.Dataframe(headers=["tree or policy", "tokens/step", "tokens/s (predicted at this machine's costs)", "note"],
                                        interactive=False, label="This output under each tree and policy")
            with gr.Accordion("Plain text", open=False):
                with gr.Row():
                    ent_text = gr.Textbox(label="EntMTP text", lines=6)
                    base_text = gr.Textbox(label="Baseline text", lines=6)
        with gr.Tab("Bank") as bank_tab:
            gr.Markdown("The trees EntMTP chooses from for the task selected on the Race tab. Acceptance comes "
                        "from the bank's traces (machine-independent); step times come from the machine chosen "
                        "below, and tokens/s is what they predict. Filled markers: trees used by a policy.")
            bank_info = gr.Markdown()
            with gr.Row():
                refit = gr.Button("Refit on this machine", size="sm")
                # a bank built here (`bank.ondemand`): its file, to commit beside a Space (docs/space.md)
                download = gr.DownloadButton("Download this bank (built here)", visible=False, size="sm")
            with gr.Row():
                hardware = gr.Radio([(label, key) for key, label in whatif.CHOICES.items()], value="here", scale=3,
                                    label="What if the step costs were those of… (refits the bank by exact simulation of its traces)")
                ratio = gr.Slider(0, 1, value=0.1, step=0.01, scale=2, label="r: what an extra tree row costs, × a plain step (idealised)")
            whatif_md = gr.Markdown()
            front = gr.Plot(show_label=False)
            costs_plot = gr.Plot(show_label=False)  # step cost over time on this machine (the runtime's live costs)
            table = gr.Dataframe(headers=["tree", "nodes", "depth", "mean accepted", "step ms", "predicted tokens/s",
                                          "front", "policies"], interactive=False, label="Trees")
            features = gr.Dataframe(headers=["feature", "Spearman ρ with accepted length", "best ladder tok/s", "best τ tok/s", "kept"],
                                    interactive=False, label="Which confidence signal predicts how many drafted tokens a step accepts "
                                                             "(on the traces, the largest tree)")
        with gr.Tab("How it works"):
            gr.Markdown(HOW_IT_WORKS)

        outputs = [ent_text, base_text, ent_hl, base_hl, ent_stats, base_stats, out_badge,
                   race_plot, acc_plot, feat_plot, usage_plot, tree_out, step, views, cf_plot, cf_table]
        race_inputs = [prompt, task, policy, baseline, max_new, temperature, model, seed, custom_tau, tau_on, tau_off]
        event = run.click(make_race(service), race_inputs, outputs, api_name="race",
                          concurrency_limit=cfg.concurrency, concurrency_id="race", show_progress="hidden")
        lesson_outputs = [lesson_md, tree_out, out_badge, ent_text, lesson_state]
        lesson_btn.click(make_lesson(service, first=True), [lesson_state, *race_inputs], lesson_outputs, api_name="lesson_step",
                         concurrency_limit=cfg.concurrency, concurrency_id="race")
        next_btn.click(make_lesson(service, first=False), [lesson_state, *race_inputs], lesson_outputs, api_visibility="private",
                       concurrency_limit=cfg.concurrency, concurrency_id="race")
        continued = cont_btn.click(make_race(service), race_inputs, outputs, api_visibility="private",
                                   concurrency_limit=cfg.concurrency, concurrency_id="race", show_progress="hidden")
        stop.click(None, None, None, cancels=[event, continued])
        step.release(show_step, [views, step], tree_out, api_visibility="private")

        def what_if(bank, task, model, choice="here", r=0.1, progress=None):
            """The Bank tab for `bank` (the live one) under the chosen machine's step costs: figure,
            table, summary, feature ranks."""
            try:
                rt = models.loaded(model)
                if rt is None:
                    return (plots.front_figure(bank, bank.fit.get("baseline")), bank_rows(bank),
                            "The what-if appears once the model has loaded.", [])
                if choice != "here" and progress is not None:
                    progress(0, desc=f"refitting the bank to {whatif.CHOICES.get(choice, choice)}")
                summary, shown = whatif.bank_tab(rt, task, choice, float(r), bank, bank.fit.get("fingerprint") == rt.fingerprint)
                return plots.front_figure(shown, shown.fit.get("baseline")), bank_rows(shown), summary, whatif.feature_table(shown.fit)
            except (RaceError, LoadError, ValueError) as e:
                return gr.skip(), gr.skip(), f"❌ {e}", []

        def live(task, model):
            """(bank, note) as races use them now, or the error as the note."""
            try:
                return live_bank(models, task, model, service.fit_status(model, task))
            except (RaceError, LoadError) as e:
                return None, f"❌ {e}"

        def cost_history(bank, model):
            """The chart of step cost over time here: every step the runtime timed lately, beside the fit's costs."""
            rt = models.loaded(model)
            fitted = {name: t["step_ms"] for name, t in (bank.fit.get("trees") or {}).items()} if bank is not None else {}
            if bank is not None and "ar" in (bank.fit.get("per_method") or {}):
                fitted["ar"] = bank.fit["per_method"]["ar"]["step_ms"]
            task = bank.meta.get("task") if bank is not None else None
            served = rt.live_fit(task) if rt is not None and task else None
            marks = served.marks_ago() if served is not None else []
            return plots.step_cost_figure(rt.live.history() if rt is not None else [], fitted, refits=marks)

        def built_file(task, model):
            """The Bank tab's download: the task's bank file where it was built here, else hidden."""
            rt = models.loaded(model)
            try:
                if rt is not None and rt.built_here(task):
                    return gr.update(value=str(rt.bank_file(task)), visible=True)
            except (RaceError, LoadError):
                pass
            return gr.update(value=None, visible=False)

        def show(task, model, choice="here", r=0.1):
            """The race column's note and τ sliders (the bank as races use it), and the Bank tab."""
            bank, note = live(task, model)
            if bank is None:
                return (note, note, 0.8, 0.5, plots.front_figure(fallback_bank()), [], "", [], cost_history(None, model),
                        built_file(task, model))
            return (note, note, *tau_defaults(bank), *what_if(bank, task, model, choice, r), cost_history(bank, model),
                    built_file(task, model))

        def what_if_event(task, model, choice, r, progress=gr.Progress()):
            bank, note = live(task, model)
            return what_if(bank, task, model, choice, r, progress) if bank is not None else (gr.skip(), gr.skip(), note, [])

        def do_refit(task, model, choice, r):
            """Refit on this machine (a GPU call on ZeroGPU), the status line following it from this
            event itself (the page's timer may not tick while an event of the page runs), then the
            Bank tab redrawn."""
            done, failed = threading.Event(), []

            def work():
                try:
                    service.fit(model, [task], "refit")
                except Exception as e:  # raised below, as the page shows errors
                    failed.append(e)
                finally:
                    done.set()

            context = contextvars.copy_context()  # a GPU call is charged to this request
            threading.Thread(target=context.run, args=(work,), name="entmtp-refit", daemon=True).start()
            while not done.wait(0.5):
                yield (status_line(model)[0],) + (gr.skip(),) * len(bank_outputs)
            with page_errors("Cannot fit the bank", (LoadError,)):
                if failed:
                    raise failed[0]
            yield (status_line(model)[0], *show(task, model, choice, r))

        bank_outputs = [bank_info, bank_note_md, tau_on, tau_off, front, table, whatif_md, features, costs_plot, download]
        bank_inputs = [task, model, hardware, ratio]
        for trigger in (task.change, model.blur, demo.load, event.then):
            trigger(show, bank_inputs, bank_outputs, api_visibility="private")
        hardware.change(what_if_event, bank_inputs, bank_outputs[4:8], api_visibility="private")
        # the step costs move on between events: the chart is drawn again whenever the tab is opened
        bank_tab.select(lambda task, model: cost_history(live(task, model)[0], model), [task, model], costs_plot,
                        api_visibility="private", show_progress="hidden")
        ratio.input(what_if_event, bank_inputs, bank_outputs[4:8], api_visibility="private", trigger_mode="always_last")
        refit.click(lambda: gr.Timer(active=True), None, timer, api_visibility="private").then(
            do_refit, bank_inputs, [weights_note, *bank_outputs], api_visibility="private", concurrency_id="race")

        def tau_controls(policy):  # the τ override exists for the τ policy only
            on = policy == "tau"
            return gr.update(interactive=on, value=False if not on else gr.skip())

        policy.change(tau_controls, policy, custom_tau, api_visibility="private")

        def status_line(model) -> tuple[str, bool]:
            """What the page's process is doing (start-up, background fits), and whether it is busy."""
            try:
                name = models.check(model)
            except RaceError:
                name = models.default
            rt = models.loaded(name)
            if not service.ready.is_set():
                parts = [f"start-up: {service.status}"]
            elif service.error:
                parts = [f"❌ {service.status}"]
            else:
                parts = [f"weights: {rt.weights}" if rt else "weights: loaded with this model's first race"]
            fits = [f"`{task}` {st}" for (m, task), st in sorted(service.fits.items()) if m == name]
            if fits:
                parts.append("fitting the banks to this machine: " + "; ".join(fits))
            builds = [f"`{task}` {service.build_status(m, task)}" for (m, task) in sorted(service.builds) if m == name]
            if builds:
                parts.append("building banks here: " + "; ".join(builds))
            working = (not service.ready.is_set() or any(not f.startswith("failed") for f in service.fits.values())
                       or any(not b.startswith("failed") for b in service.builds.values()))
            return "<small>" + " · ".join(parts) + "</small>", working

        def building(task, model) -> bool:
            """Whether the task's bank for the model is being built here now."""
            try:
                state = service.builds.get((models.check(model), task))
            except RaceError:
                return False
            return state is not None and not state.startswith("failed")

        def tick(task, model, was_busy, choice, r):
            line, working = status_line(model)
            if was_busy and not working:
                refresh = show(task, model, choice, r)
            elif building(task, model):  # the notes follow the build's progress (its status file), the rest waits for its end
                note = live(task, model)[1]
                refresh = (note, note) + (gr.skip(),) * (len(bank_outputs) - 2)
            else:
                refresh = (gr.skip(),) * len(bank_outputs)
            return line, working, gr.Timer(active=working), *refresh

        timer.tick(tick, [task, model, busy, hardware, ratio], [weights_note, busy, timer, *bank_outputs], api_visibility="private",
                   show_progress="hidden")
        for trigger in (demo.load, event.then):
            trigger(lambda: (True, gr.Timer(active=True)), None, [busy, timer], api_visibility="private")
    return demo


CONFIG = AppConfig.from_env()
SERVICE = Service(CONFIG.registry())
if gpu.zero_gpu():  # the model must be on the (emulated) device before launch: load it now, on this thread
    SERVICE.start()
demo = build_demo(CONFIG, service=SERVICE)


def launch(app: gr.Blocks = demo, **kwargs):
    """Serve `app` with the page styling (in Gradio 6 css belongs to launch()); the banks built here
    (under ENTMTP_CACHE) may be downloaded."""
    built = cache_root() / "banks"
    built.mkdir(parents=True, exist_ok=True)
    return app.launch(css=CSS, allowed_paths=[*kwargs.pop("allowed_paths", []), str(built)], **kwargs)


if __name__ == "__main__":
    launch(prevent_thread_lock=True)  # the page first: the model loads while a visitor reads it
    print(f"page served; loading {CONFIG.model} in the background…", flush=True)
    SERVICE.start()
    demo.block_thread()
