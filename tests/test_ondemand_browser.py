"""A bank built where it is needed, through the page on ZeroGPU (tests/fake_spaces): a second model
with official-format Hydra heads and no bank (tests/echo_model.py) races first on the built-in
fallback bank, the page shows the build's progress while it is built in several GPU calls (one
prompt each), then races on the bank built here, fitted to this machine, and offers its file.
Screenshots: assets/screenshot-ondemand-building.png, assets/screenshot-ondemand-built.png."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from echo_model import echo_model
from test_app import free_port
from test_browser import ARGS, ASSETS, CHROMIUM
from test_space import stop, wait_until_served
from test_zerogpu import FAKE, entries, fresh_cache

from entmtp.config import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.browser]
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."
PROMPTS, TOKENS = 6, 48  # the build's budget: six prompts, one GPU call each (ENTMTP_APP_BUILD_PIECE_S=0), then the timing


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """(url, log path, echo model folder) of app.py served under the fake `spaces` package, with the
    echo model and its Hydra heads allowed beside the app's own model."""
    tmp = tmp_path_factory.mktemp("ondemand-space")
    model, heads = echo_model(tmp / "echo")
    port, log = free_port(), tmp / "gpu.jsonl"
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False",
               FAKE_SPACES_LOG=str(log), ENTMTP_CACHE=str(fresh_cache(tmp)), ENTMTP_APP_MODELS=f"{model}={heads}",
               ENTMTP_APP_BUILD_PROMPTS=str(PROMPTS), ENTMTP_APP_BUILD_TOKENS=str(TOKENS), ENTMTP_APP_BUILD_PIECE_S="0")
    out = open(tmp / "app.log", "w")
    proc = subprocess.Popen([sys.executable, str(FAKE / "serve.py")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until_served(proc, url, tmp / "app.log")
        yield url, log, str(model)
    finally:
        stop(proc)
        print((tmp / "app.log").read_text()[-3000:])


def pieces(log) -> int:
    return sum(e.get("function") == "build_piece" for e in entries(log))


def races_closed(log) -> int:
    return sum(e.get("closed") == "race_steps" for e in entries(log))


def no_toast(page) -> None:
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()


def test_a_bank_built_here_through_the_page(space):
    from playwright.sync_api import expect, sync_playwright

    url, log, model = space
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            # tall enough for the status line, the badge and the bank note in one screenshot
            page = browser.new_page(viewport={"width": 1280, "height": 1700})
            page.goto(url, wait_until="domcontentloaded")
            page.get_by_label("Prompt").fill(PROMPT)
            page.get_by_role("radio", name="code", exact=True).check()
            page.get_by_role("radio", name="EntMTPτ (two trees, hysteresis)", exact=True).check()
            page.get_by_role("radio", name="Plain decoding (AR)", exact=True).check()
            budget = page.locator("input[aria-label='number input for Max new tokens']")
            budget.fill("24")
            budget.press("Enter")
            page.get_by_text("Advanced", exact=True).click()
            box = page.get_by_label("Model (allowed here", exact=False)
            expect(box).to_be_visible(timeout=10_000)
            box.fill(model)
            box.press("Tab")  # its blur shows the note of that model's bank
            note = page.locator("p:visible", has_text="fallback bank")
            expect(note.first).to_be_visible(timeout=30_000)

            # the first race: on the built-in fallback bank, while the bank is built in the background
            page.get_by_role("button", name="Run the race").click()
            expect(page.locator(".badge.same")).to_be_visible(timeout=300_000)
            no_toast(page)
            expect(page.locator("p:visible", has_text="Built-in fallback bank").first).to_be_visible(timeout=30_000)

            # the build's progress, on the status line and in the bank note, until it is done
            progress = page.locator("p:visible", has_text="building banks here")
            building = page.locator("p:visible", has_text="Building it here")
            built = page.locator("p:visible", has_text="built here on first use")
            seen: list[str] = []  # every text of the status line and the note, as they changed
            agreed = shot = False  # the note said what the status line said (both follow the build), the screenshot taken
            deadline = time.monotonic() + 600
            while True:
                line, notes = progress.all_inner_texts(), building.all_inner_texts()
                seen += [t for t in line + notes if t not in seen]
                now = [t.split("building banks here: code ", 1)[-1] for t in line]
                agreed = agreed or any(stage in note for stage in now for note in notes)
                if line and notes and not shot:  # both say how far the build is: the page while it builds
                    page.screenshot(path=os.path.join(ASSETS, "screenshot-ondemand-building.png"))
                    shot = True
                if built.count() and progress.count() == 0 and pieces(log) >= 3:
                    break
                assert time.monotonic() < deadline, (pieces(log), seen)
                page.wait_for_timeout(200)
            assert any("building banks here: code" in t for t in seen), seen
            assert any("Building it here: " in t for t in seen), seen  # tracing, or timing already (a fast machine)
            assert shot and agreed, seen
            no_toast(page)

            # the second race: on the bank built here, fitted to this machine
            races = races_closed(log)
            page.get_by_role("button", name="Run the race").click()
            deadline = time.monotonic() + 300
            while races_closed(log) == races:  # the second race's GPU call ended
                assert time.monotonic() < deadline, entries(log)
                page.wait_for_timeout(250)
            expect(page.locator(".badge.same")).to_be_visible(timeout=60_000)
            note = page.locator("p:visible", has_text="built here on first use")
            expect(note.first).to_be_visible(timeout=30_000)
            expect(note.first).to_contain_text("fitted to this machine")
            expect(page.locator("p:visible", has_text="fallback")).to_have_count(0)
            no_toast(page)
            expect(page.locator(".pending")).to_have_count(0, timeout=30_000)  # the note drawn, not faded as it updates
            page.screenshot(path=os.path.join(ASSETS, "screenshot-ondemand-built.png"))

            # the Bank tab offers the file built here
            page.get_by_role("tab", name="Bank").click()
            expect(page.get_by_role("button", name="Download this bank (built here)")).to_be_visible(timeout=30_000)
            expect(page.locator("p:visible", has_text="built here on first use").first).to_be_visible(timeout=30_000)
            no_toast(page)
        finally:
            browser.close()
    calls = entries(log)
    assert not [e for e in calls if "violation" in e], calls
    assert all(e["seconds"] <= 120 for e in calls if "seconds" in e), calls
    assert pieces(log) >= 3, calls
