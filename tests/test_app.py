"""The Gradio app, launched and driven through `gradio_client` on the real default model."""

from __future__ import annotations

import importlib
import socket
import sys
import time

import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError

from entmtp.config import DEFAULT_MODEL, ROOT, TASKS, GenerationConfig
from entmtp.spec.engine import StepRecord, collect
from entmtp.spec.heads import HydraHeads, MedusaHeads
from entmtp.spec.headfiles import save_heads
from entmtp.runtime.runtime import default_heads_dir
from entmtp.app import race
from entmtp.figures import plots
from conftest import SERVE_THREADS

pytestmark = pytest.mark.slow
N_NEW = 24
PROMPT = "Write a Python function that returns the sum of a list of numbers."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_app():
    """The top-level app.py, whichever way pytest was started."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("app")


def head_paths(tmp_path_factory) -> dict[str, str | None]:
    """The shipped heads when they exist, else random ones (losslessness holds for any heads)."""
    paths: dict[str, str | None] = {}
    for kind, cls in (("hydra", HydraHeads), ("medusa", MedusaHeads)):
        if default_heads_dir(DEFAULT_MODEL, kind).exists():
            paths[kind] = None
            continue
        torch.manual_seed(0)
        d = tmp_path_factory.mktemp(kind)
        save_heads(cls(576, 49152, 4), d, {"note": "random heads for the app tests"})
        paths[kind] = str(d)
    return paths


SLOW_MODEL = "slow/model"  # allowed, and its load takes long: other races must not wait for it


def settle(service, timeout_s: float = 1200.0) -> None:
    """Until the app has started and this machine's fit of every task's bank exists (measured by the
    fits the start-up queues, on a machine that had none at these threads). The tests then see the
    server's own work only: a fit measured in the background is this process's CPU time too (the
    Stop test reads it) and, adopted in the middle of a race, changes the policy the refit test
    watches."""
    for _ in service.wait_ready():
        pass
    rt = service.models.get(None)
    deadline = time.monotonic() + timeout_s
    while service.fits or service.builds or any(race.needs_fit(rt, task) for task in TASKS):
        failed = [s for s in (*service.fits.values(), *service.builds.values()) if s.startswith("failed")]
        assert not failed, f"a background fit or build failed: {failed}"
        assert time.monotonic() < deadline, f"the background fits never ended: {service.fits} {service.builds}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(app module, models, client) for one launched demo that serves two races at once."""
    torch.set_num_threads(SERVE_THREADS)
    app = import_app()
    paths = head_paths(tmp_path_factory)
    cfg = app.AppConfig(hydra_heads=paths["hydra"], medusa_heads=paths["medusa"], concurrency=2, models=(SLOW_MODEL,))
    models = cfg.registry()
    service = app.Service(models).start()
    demo = app.build_demo(cfg, models, service)
    port = free_port()
    app.launch(demo, prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    try:
        settle(service)
        yield app, models, Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        demo.close()
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ar_text(served):
    """`ar`'s greedy text for PROMPT, decoded straight from the engine."""
    _, models, _ = served
    rt = models.get(None)
    res = collect(rt.run("ar", "code", rt.encode(PROMPT), GenerationConfig(max_new_tokens=N_NEW)))
    return rt.decode(res.token_ids)


def test_race_streams_and_matches_ar(served, ar_text):
    _, _, client = served
    job = client.submit(PROMPT, "code", "tau", "ar", N_NEW, 0.0, api_name="/race")
    out = job.result(timeout=600)
    ent_text, base_text = out[0], out[1]
    assert len(job.outputs()) > 1, "the race should stream step by step"
    assert ent_text and base_text
    assert ent_text == base_text == ar_text
    assert "identical output" in out[6] and "Plain decoding" in out[6]
    # each side's prediction for this prompt: before the first step (prefill) and after the last
    assert all("predicted here for this prompt" in s for s in (out[4], out[5])), (out[4], out[5])
    first = next(o for o in job.outputs() if isinstance(o[4], str))
    assert "prefill…" in first[4] and "up to 24 new" in first[4]
    # the streamed panes grow: every update holds a prefix of the final text, and some are partial
    streamed = [o[0] for o in job.outputs() if isinstance(o[0], str)]
    assert all(ent_text.startswith(t) for t in streamed)
    assert any(len(t) < len(ent_text) for t in streamed)
    # the next race's predictions are priced at the steps this one timed (the runtime's live costs)
    again = client.predict(PROMPT, "code", "tau", "ar", N_NEW, 0.0, api_name="/race")
    assert all("at the costs of the last" in s and "steps timed here" in s for s in (again[4], again[5])), (again[4], again[5])


def test_a_race_shows_its_refits_at_the_live_costs(served, monkeypatch):
    """Every look at the live costs departs (threshold below 0, one look enough, a look every 4
    steps): EntMTP's side refits while the race runs, says so under its figures and on the feature
    chart, the Bank tab's note names the policies served now and its cost chart marks the refits;
    the output stays plain decoding's. A τ of the visitor's own is served as chosen: no refit."""
    import json

    from entmtp.bank import refit

    monkeypatch.setattr(refit, "DEPART", -1.0)
    monkeypatch.setattr(refit, "CONFIRM", 1)
    monkeypatch.setattr(refit, "CHECK_EVERY", 4)
    _, models, client = served
    models.get(None).served("code").wait()  # the candidates' simulation, built in the background since the first race
    out = client.predict(PROMPT, "code", "tau", "ar", 48, 0.0, api_name="/race")
    assert out[0] == out[1] and "identical output" in out[6]
    assert "**refit** before step 4:" in out[4] and "refitted in" in out[4], out[4]
    assert "refit:" in json.dumps(out[9])  # the dashed line on the feature chart, labelled
    rt = models.get(None)
    served_now = rt.live_fit("code")
    assert served_now.refits and served_now.refits[0]["step"] == 4
    assert "Served now, refitted at the live step costs" in race.bank_note(rt, "code", rt.bank("code"))
    fig = plots.step_cost_figure(rt.live.history(), {}, refits=served_now.marks_ago())
    assert any((a.text or "").startswith("refit:") for a in fig.layout.annotations)
    own = client.predict(PROMPT, "code", "tau", "ar", 24, 0.0, None, 0, True, 0.6, 0.3, api_name="/race")
    assert "your τ 0.60/0.30" in own[4] and "**refit**" not in own[4]


def test_counterfactual_of_a_greedy_race(served):
    """After a race at temperature 0: every bank tree's and policy's outcome on its output, and the
    tree that ran reproduced exactly by the counterfactual pass at every step."""
    _, models, client = served
    out = client.predict(PROMPT, "code", "tau", "hydra", N_NEW, 0.0, api_name="/race")
    rows = out[14]["data"]
    bank = models.get(None).bank("code")
    names = [r[0] for r in rows]
    assert [n for n in names if n.startswith("tree ")] == [f"tree {t.name} ({t.n_nodes} nodes)" for t in bank.trees]
    assert {f"policy {p}" for p in bank.policies} <= set(names) and any(n.startswith("foresight") for n in names)
    foresight = next(r for r in rows if r[0].startswith("foresight"))
    assert all(foresight[2] >= r[2] - 1e-6 for r in rows if r[0].startswith(("tree ", "policy ", "this race")))  # the ceiling
    agree = rows[-1][3]
    steps = agree.split(" of ")[-1].split()[0]
    assert f"at {steps} of {steps} steps" in agree, agree


def test_two_races_at_once(served, ar_text):
    _, _, client = served
    jobs = [
        client.submit(PROMPT, "code", "ladder", "medusa", N_NEW, 0.0, api_name="/race"),
        client.submit(PROMPT, "math", "static", "ar", N_NEW, 0.0, api_name="/race"),
    ]
    # they really overlap: both have streamed before either has finished
    deadline = time.monotonic() + 600
    while not all(len(j.outputs()) >= 1 for j in jobs):
        assert time.monotonic() < deadline and not any(j.done() for j in jobs), "the races did not run at the same time"
        time.sleep(0.05)
    for job in jobs:
        ent_text, base_text = job.result(timeout=600)[:2]
        assert ent_text == base_text == ar_text


def test_sampling_race_completes(served):
    _, _, client = served
    out = client.predict(PROMPT, "chat", "tau", "ar", 8, 0.8, api_name="/race")
    assert out[0] and out[1]
    assert "sampling" in out[6]


def streaming_race(client, updates: int):
    """A 1024-token race, once it has streamed `updates` updates."""
    job = client.submit(PROMPT, "chat", "static", "ar", 1024, 0.0, api_name="/race")
    deadline = time.monotonic() + 300
    while len(job.outputs()) < updates:
        assert time.monotonic() < deadline and not job.done(), "the race never streamed"
        time.sleep(0.1)
    return job


def test_stop_cancels_a_running_race(served):
    _, _, client = served
    job = streaming_race(client, 2)
    job.cancel()
    time.sleep(3.0)  # the step in flight finishes, then the generator is closed
    n = len(job.outputs())
    cpu = time.process_time()
    time.sleep(2.0)
    assert len(job.outputs()) == n, "updates kept coming after Stop"
    assert time.process_time() - cpu < 1.0, "the server kept decoding after Stop"
    assert len(job.outputs()[-1][0]) < 1024  # far from the budget: it was cut short


@pytest.mark.parametrize(
    "args, message",
    [
        (("", "code", "tau", "ar", N_NEW, 0.0), "empty"),
        (("   \n ", "code", "tau", "ar", N_NEW, 0.0), "empty"),
        (("word " * 30_000, "code", "tau", "ar", N_NEW, 0.0), "characters"),
        (("word " * 3_000, "code", "tau", "ar", N_NEW, 0.0), "tokens"),
        # the sliders refuse out-of-range values themselves ("Value 0 is less than minimum value 1.")
        ((PROMPT, "code", "tau", "ar", 0, 0.0), "max_new_tokens|less than minimum value 1"),
        ((PROMPT, "code", "tau", "ar", 5000, 0.0), "max_new_tokens|greater than maximum value 1024"),
        ((PROMPT, "code", "tau", "ar", 2.5, 0.0), "max_new_tokens"),
        ((PROMPT, "code", "tau", "ar", N_NEW, -0.1), "temperature|less than minimum value 0"),
        ((PROMPT, "code", "tau", "ar", N_NEW, 2.5), "temperature|greater than maximum value 2"),
        ((PROMPT, "poetry", "tau", "ar", N_NEW, 0.0), "task|not in the list of choices"),
        ((PROMPT, "code", "greedy", "ar", N_NEW, 0.0), "policy|not in the list of choices"),
    ],
)
def test_bad_input_gets_a_message(served, args, message):
    _, _, client = served
    with pytest.raises(AppError, match=message):
        client.predict(*args, api_name="/race")


def test_custom_tau_is_checked(served):
    _, _, client = served
    with pytest.raises(AppError, match="τ_off"):
        client.predict(PROMPT, "code", "tau", "ar", N_NEW, 0.0, None, 0, True, 0.3, 0.6, api_name="/race")
    with pytest.raises(AppError, match="EntMTPτ policy only"):
        client.predict(PROMPT, "code", "ladder", "ar", N_NEW, 0.0, None, 0, True, 0.8, 0.5, api_name="/race")


@pytest.mark.parametrize("task", ["math", "chat"])
def test_custom_tau_races_on_every_task(served, task):
    """The τ override runs the τ policy with the user's thresholds, and the pane says so."""
    _, _, client = served
    out = client.predict(PROMPT, task, "tau", "ar", 16, 0.0, None, 0, True, 0.6, 0.3, api_name="/race")
    assert out[0] == out[1] and "identical output" in out[6]
    assert "your τ 0.60/0.30" in out[4]


def test_disallowed_model_is_refused_without_loading(served):
    _, models, client = served
    with pytest.raises(AppError, match="not offered here"):
        client.predict(PROMPT, "code", "tau", "ar", N_NEW, 0.0, "someone/huge-model", api_name="/race")
    assert models.loaded("someone/huge-model") is None


def test_a_slow_model_load_blocks_no_other_race(served, ar_text, monkeypatch):
    """While one user's model loads (a long hub download, say), a race on a loaded model goes on."""


    started, release = __import__("threading").Event(), __import__("threading").Event()

    def slow_load(cfg, *a, **k):
        started.set()
        release.wait(120)
        raise race.LoadError("the test's slow model never finishes loading")

    monkeypatch.setattr(race, "load_runtime", slow_load)
    _, _, client = served
    slow = client.submit(PROMPT, "code", "static", "ar", N_NEW, 0.0, SLOW_MODEL, api_name="/race")
    assert started.wait(120), "the slow load never started"
    try:
        out = client.predict(PROMPT, "code", "static", "ar", N_NEW, 0.0, api_name="/race")
        assert out[0] == ar_text and not slow.done()
    finally:
        release.set()
    with pytest.raises(AppError, match="never finishes loading"):
        slow.result(timeout=120)


def test_still_serves_after_errors(served, ar_text):
    _, _, client = served
    out = client.predict(PROMPT, "code", "static", "ar", N_NEW, 0.0, api_name="/race")
    assert out[0] == ar_text


def test_fallback_bank_is_flagged(served, monkeypatch, tmp_path):


    _, models, _ = served
    rt = models.get(None)
    monkeypatch.setattr(race, "has_bank", lambda rt, task: False)
    bank = race.bank_for(rt, "code")
    assert bank.meta.get("fallback") and "fallback" in race.bank_note(rt, "code", bank)
    assert set(bank.policies) == {"static", "ladder", "tau"}


def test_bank_view_says_where_its_numbers_come_from(served):
    app, models, _ = served
    rt = models.get(None)
    for task in ("code", "math", "chat"):
        bank = rt.bank(task)  # this machine's fit (measured now if the background fit has not yet)
        shown, note = race.live_bank(models, task, None)
        fig, rows = plots.front_figure(shown, shown.fit.get("baseline")), race.bank_rows(shown)
        on, off = race.tau_defaults(shown)
        assert bank.fit["hardware"] in note
        assert ("this machine" in note) == rt.fitted_here(task)
        assert ("Ceiling:" in note) == bool(bank.fit.get("ceiling"))  # what no policy over this bank can beat
        assert 0 <= off <= on <= 1  # never out of the sliders' range, even for a degenerate τ fit
        assert len(rows) == len(bank.trees) and sum(r[6] == "yes" for r in rows) == len(bank.front)
        names = [t.name for t in fig.data]
        assert "mc_sim_7b_63" in names  # the measured baseline, not a stub line


def test_the_bank_tab_refits_at_the_costs_of_now(served, ar_text):
    """The what-if "this machine, now": the bank refitted by exact simulation at the costs the
    runtime's live model holds (each tree run lately at its own steps, the rest carried); before
    any step, a message instead; the chart of step cost over time draws every step kept."""
    from entmtp.app import whatif
    from entmtp.bank.live import LiveCosts

    _, models, _ = served
    rt = models.get(None)
    bank = rt.bank("code")
    fresh = LiveCosts()
    assert whatif.now(bank, bank.fit, fresh) is None
    for ctx in range(192, 200):  # plain steps at twice the fit's cost, the 4-node tree's at three times
        fresh.observe("ar", 1, ctx, 2 * bank.fit["per_method"]["ar"]["step_ms"])
        fresh.observe("n4-d3", 4, ctx, 3 * bank.fit["trees"]["n4-d3"]["step_ms"])
    curve = whatif.now(bank, bank.fit, fresh)
    costs = dict(zip([t.name for t in bank.trees], curve.step_ms))
    assert costs["n4-d3"] == pytest.approx(3 * bank.fit["trees"]["n4-d3"]["step_ms"], rel=0.02)
    assert costs["n1-d0"] == pytest.approx(2 * bank.fit["trees"]["n1-d0"]["step_ms"], rel=0.02)
    assert "n4-d3" in curve.source and "carried" in curve.source
    refitted = whatif.refit(bank, curve)
    assert refitted.fit["trees"]["n4-d3"]["measured_ms"] == pytest.approx(costs["n4-d3"], rel=1e-3)
    fig = plots.step_cost_figure(fresh.history(), {"ar": 1.0})
    assert {t.name for t in fig.data} == {"ar (1 nodes)", "n4-d3 (4 nodes)"} and len(fig.data[0].x) == 8


def test_the_lesson_says_when_fewer_heads_settled_the_choice():
    """A path value read through fewer heads than the policy's depth (the first already settled
    the choice) is named as such in the lesson's reason, not as the full depth's value."""
    from entmtp.app.lesson import why
    from entmtp.bank.bank import TopologyBank
    from entmtp.spec.policy import TauPolicy
    from entmtp.spec.topology import chain_paths, compile_tree

    trees = [compile_tree([], "n1"), compile_tree([[0]], "n2"), compile_tree(chain_paths(3), "n4")]
    bank = TopologyBank(trees, [{}] * 3, {})
    pol = TauPolicy(1, 2, 0.4, 0.2, "path_value", 2)
    early = why(pol, bank, 0.3, 1, heads_read=1)
    assert "after 1 of 2 heads" in early and "≤ τ_on 0.400" in early and "stays" in early
    full = why(pol, bank, 0.5, 1, heads_read=2)
    assert "through 2 heads = 0.500" in full and "up to `n4`" in full


def _step(tree: str, ms: float, last: bool = False) -> StepRecord:
    return StepRecord(step=1, tokens=[1], tree=tree, tree_index=0, tree_nodes=4, s=0.5, entropy=1.0, path_value=0.5, feature=0.5,
                      accepted=1, accepted_nodes=[0], draft_tokens=[1], ms={}, step_ms=ms, elapsed_s=0.0, prefill_ms=1.0,
                      finished=last)


def test_a_side_says_when_its_steps_ran_far_slower_than_calibrated():
    """Steps timed well above the fit's cost of the same trees (here: a browser drawing the page on the
    same CPU) get a note under the side's figures; steps near their cost, too few steps, or no costs do not."""
    costs = {"n4-d3": 10.0, "n2-d1": 8.0}

    def side(times, trees=("n4-d3", "n2-d1"), step_ms=costs):
        s = race.Side("EntMTPτ", forecast=None if step_ms is None else {"step_ms": step_ms})
        s.records = [_step(trees[i % len(trees)], t, i == len(times) - 1) for i, t in enumerate(times)]
        s.ids, s.done = [1] * len(times), True
        s.predicted = lambda: ""  # no fit to predict from here
        return s

    busy = side([20.0, 16.0] * 6)
    assert busy.slowdown() == pytest.approx(2.0)
    assert "its steps took 2.0× what calibrating measured for the same trees here" in busy.stats()
    calm = side([11.0, 8.5] * 6)
    assert calm.slowdown() == pytest.approx(19.5 / 18.0) and "calibrating measured" not in calm.stats()
    assert side([30.0] * 7).slowdown() is None  # too few steps to say
    assert side([30.0] * 12, trees=("mc_sim_7b_63",)).slowdown() is None  # no cost for that tree
    assert side([30.0] * 12, step_ms=None).slowdown() is None
