"""The app in Debian's Chromium: a race fills both panes and draws the charts; saves a screenshot."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import ALL_THREADS
from test_app import free_port, head_paths, import_app

pytestmark = [pytest.mark.browser, pytest.mark.slow]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = os.path.join(os.path.dirname(__file__), "..", "assets", "screenshot.png")
PROMPT = "Write a Python function `is_palindrome(s)` that ignores case and spaces."


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (`make browser` installs it)")
    torch.set_num_threads(ALL_THREADS)
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


def test_race_in_the_browser(url):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, wait_until="domcontentloaded")  # never "networkidle": Gradio keeps a stream open
            page.get_by_label("Prompt").fill(PROMPT)
            budget = page.locator("input[aria-label='number input for Max new tokens']")
            budget.fill("32")
            budget.press("Enter")
            page.get_by_role("button", name="Run the race").click()

            expect(page.locator(".badge.same")).to_be_visible(timeout=420_000)
            panes = page.locator(".pane")
            expect(panes).to_have_count(2)
            texts = [panes.nth(i).inner_text() for i in range(2)]
            # highlighted tokens are separate spans: inner_text may break a word between them
            assert all("palindrome" in "".join(t.split()) for t in texts), texts
            # every chart is drawn by plotly, with the race's traces in it
            expect(page.locator(".js-plotly-plot .main-svg").first).to_be_visible()
            assert page.locator(".js-plotly-plot").count() >= 5
            expect(page.locator(".js-plotly-plot", has_text="tok/s").first).to_be_visible()
            page.wait_for_timeout(500)  # let the last figures settle before the picture
            page.screenshot(path=SCREENSHOT, full_page=True)
        finally:
            browser.close()
