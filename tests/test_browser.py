"""The app in Debian's Chromium, driven through the page as a user would: every task, every policy,
every baseline and the custom τ override each run a race that ends with the badge and no error
toast; one screenshot per task is saved under assets/."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from conftest import SERVE_THREADS
from test_app import free_port, head_paths, import_app

pytestmark = [pytest.mark.browser, pytest.mark.slow]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ASSETS = os.path.join(os.path.dirname(__file__), "..", "assets")
PROMPTS = {
    "code": "Write a Python function `is_palindrome(s)` that ignores case and spaces.",
    "math": "Tom has 3 times as many apples as Ann. Together they have 48 apples. How many does Tom have?",
    "chat": "Give me three tips for staying focused while working from home.",
}
# (task, policy label, baseline label, custom τ): each task, policy and baseline at least once
RACES = [
    ("code", "EntMTPτ (two trees, hysteresis)", "Hydra (63-node default tree)", False),
    ("math", "EntMTP-ladder (thresholds)", "Medusa (63-node default tree)", False),
    ("chat", "EntMTP* (one static tree)", "Plain decoding (AR)", False),
    ("math", "EntMTPτ (two trees, hysteresis)", "Plain decoding (AR)", True),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    assert shutil.which(CHROMIUM), "Debian's chromium is not installed (`make browser` installs it)"
    torch.set_num_threads(SERVE_THREADS)
    app = import_app()
    paths = head_paths(tmp_path_factory)
    demo = app.build_demo(app.AppConfig(hydra_heads=paths["hydra"], medusa_heads=paths["medusa"]))
    port = free_port()
    app.launch(demo, prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def page(url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1280, "height": 900})
            pg.goto(url, wait_until="domcontentloaded")  # never "networkidle": Gradio keeps a stream open
            yield pg
        finally:
            browser.close()


@pytest.mark.parametrize("task, policy, baseline, custom_tau", RACES)
def test_race_in_the_browser(page, task, policy, baseline, custom_tau):
    from playwright.sync_api import expect

    page.get_by_label("Prompt").fill(PROMPTS[task])
    page.get_by_role("radio", name=task, exact=True).check()
    page.get_by_role("radio", name=policy, exact=True).check()
    page.get_by_role("radio", name=baseline, exact=True).check()
    budget = page.locator("input[aria-label='number input for Max new tokens']")
    budget.fill("32")
    budget.press("Enter")
    page.wait_for_timeout(700)  # the task change refills the bank note and the τ sliders
    box = page.get_by_label("Use my own τ_on / τ_off (EntMTPτ only)")
    if custom_tau:
        if not box.is_visible():
            page.get_by_text("Advanced", exact=True).click()
        expect(box).to_be_enabled()
        box.check()
        for name, value in (("τ_on", "0.6"), ("τ_off", "0.3")):
            field = page.locator(f"input[aria-label^='number input for {name}']")
            field.fill(value)
            field.press("Enter")
    elif box.is_visible() and box.is_checked():
        box.uncheck()
    page.get_by_role("button", name="Run the race").click()

    # this race's result, not the one before it on the page (each race here has its own pair): a
    # race of 32 tokens can be over before its running badge is ever read
    done = page.locator(".badge.same", has_text=re.compile(f"{re.escape(policy.split(' (')[0])}.* and {re.escape(baseline.split(' (')[0])} emitted"))
    expect(done).to_be_visible(timeout=420_000)
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    badge = done.inner_text()
    assert baseline.split(" (")[0] in badge and "token ids" in badge
    panes = page.locator(".pane")
    expect(panes).to_have_count(2)
    texts = ["".join(panes.nth(i).inner_text().split()) for i in range(2)]  # spans may break words
    texts = [t.removeprefix(label) for t, label in zip(texts, ("EntMTPoutput", "Baselineoutput"))]  # pane labels
    assert len(texts[0]) > 20 and texts[0] == texts[1]
    stats = page.locator(".stats").first.inner_text()
    assert ("your τ 0.60/0.30" in stats) == custom_tau
    assert policy.split(" (")[0] in stats
    # each side's tokens/s predicted for this prompt (the fit's, for its length and tokens): not for
    # hand-set thresholds, nor for Medusa, which no fit prices
    base_stats = page.locator(".stats", has_text=baseline.split(" (")[0]).last.inner_text()
    assert ("predicted here for this prompt" in stats) != custom_tau, stats
    assert ("predicted here for this prompt" in base_stats) == (not baseline.startswith("Medusa")), base_stats
    # every chart is drawn by plotly, with the race's traces in it
    expect(page.locator(".js-plotly-plot .main-svg").first).to_be_visible()
    assert page.locator(".js-plotly-plot").count() >= 5
    expect(page.locator(".js-plotly-plot", has_text="tok/s").first).to_be_visible()
    # and what every tree would have done on this output (temperature 0)
    expect(page.locator(".js-plotly-plot", has_text="What every tree would have accepted").first).to_be_visible(timeout=60_000)
    expect(page.get_by_role("grid", name="This output under each tree and policy")).to_contain_text("tree n1-d0", timeout=60_000)
    if not custom_tau:
        page.wait_for_timeout(500)  # let the last figures settle before the picture
        page.screenshot(path=os.path.join(ASSETS, f"screenshot-{task}.png"), full_page=True)


def test_bank_tab_says_where_it_was_measured(page):
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Bank").click()
    info = page.locator("text=/measured on|fitted to/").first
    expect(info).to_be_visible(timeout=60_000)
    expect(page.get_by_role("button", name="Refit on this machine")).to_be_visible()
    expect(page.locator(".js-plotly-plot", has_text="mc_sim_7b_63").first).to_be_visible()
    page.get_by_role("tab", name="Race").click()


def test_bank_what_if_changes_with_the_hardware(page):
    """The Bank tab's what-if: each machine's step costs refit the bank (front, policies, predictions)."""
    from playwright.sync_api import expect

    page.get_by_role("radio", name="code", exact=True).check()
    page.get_by_role("tab", name="Bank").click()
    summary = page.locator("p:visible", has_text="Step costs:")
    expect(summary.first).to_be_visible(timeout=120_000)
    predicted = page.locator("li:visible", has_text="predicted tokens/s").first  # the what-if's predictions
    expect(predicted).to_be_visible(timeout=60_000)
    here = predicted.inner_text()
    # this machine now: the races before this test timed its steps; the tab refits at those costs
    # and charts every step's cost over time beside the fit's
    expect(page.locator(".js-plotly-plot", has_text="Step cost on this machine").first).to_be_visible(timeout=60_000)
    page.get_by_role("radio", name="this machine, now (the steps timed lately)").check()
    expect(page.locator("p:visible", has_text="timed on this machine lately").first).to_be_visible(timeout=120_000)
    expect(predicted).to_be_visible(timeout=60_000)
    page.get_by_role("radio", name="NVIDIA H200 (GPU check)").check()
    expect(page.locator("p:visible", has_text="measured on NVIDIA H200 by the GPU check").first).to_be_visible(timeout=120_000)
    expect(predicted).not_to_have_text(here, timeout=60_000)  # other step costs, other predictions
    gpu = predicted.inner_text()
    page.get_by_role("radio", name="idealised: an extra row costs r × a plain step").check()
    expect(page.locator("p:visible", has_text="r = 0.10").first).to_be_visible(timeout=120_000)
    ratio = page.locator("input[aria-label^='number input for r:']")
    ratio.fill("0.02")
    ratio.press("Enter")
    expect(page.locator("p:visible", has_text="r = 0.02").first).to_be_visible(timeout=120_000)
    assert predicted.inner_text() not in (here, gpu)
    expect(page.locator("li:visible", has_text="front:").first).to_be_visible()
    expect(page.locator("table:visible", has_text="Spearman").first).to_be_visible()
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    page.screenshot(path=os.path.join(ASSETS, "screenshot-bank-whatif.png"), full_page=True)
    page.get_by_role("radio", name="this machine's fit").check()
    page.get_by_role("tab", name="Race").click()


def test_step_through_then_continue(page):
    """Lesson mode: one decode step per click, each explained; Continue then runs the whole race,
    which ends with the badge (the same output as a normal race)."""
    from playwright.sync_api import expect

    page.get_by_label("Prompt").fill(PROMPTS["code"])
    page.get_by_role("radio", name="code", exact=True).check()
    page.get_by_role("radio", name="EntMTPτ (two trees, hysteresis)", exact=True).check()
    page.get_by_role("radio", name="Hydra (63-node default tree)", exact=True).check()
    page.get_by_role("button", name="Step through EntMTP", exact=True).click()
    expect(page.locator("h3", has_text="Step 1:")).to_be_visible(timeout=180_000)
    expect(page.locator(".badge.info", has_text="lesson: step 1")).to_be_visible()
    expect(page.locator("td", has_text="root: the model's own token").first).to_be_visible()
    for k in (2, 3):
        page.get_by_role("button", name="Next step", exact=True).click()
        expect(page.locator("h3", has_text=f"Step {k}:")).to_be_visible(timeout=120_000)
        expect(page.locator("p", has_text="Why this tree:").first).to_be_visible()
    expect(page.locator(".js-plotly-plot", has_text="Lesson step 3").first).to_be_visible()
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    page.screenshot(path=os.path.join(ASSETS, "screenshot-lesson.png"), full_page=True)
    page.get_by_role("button", name="Continue to the end", exact=True).click()
    expect(page.locator(".badge.same")).to_be_visible(timeout=300_000)
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
