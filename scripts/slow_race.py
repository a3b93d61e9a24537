"""A race on a machine slowed on purpose halfway: the app refitting its policy at the live costs.

Serves the app (default model, this machine's fit), opens it in Debian's Chromium, races EntMTP
(τ by default) against plain decoding on a long budget and, once the race is under way, starts two
busy processes (one a core) until it ends. Saves four screenshots: the Race tab just before the
slowdown and after the race, the feature chart after it (each refit a dashed line, each step's wall
time below), and the Bank tab's step cost over time; prints the lines the page wrote under EntMTP's
figures (each refit: when, why, old and new policy).

    python scripts/slow_race.py [--task code] [--tokens 768] [--hog-after 4] [--out assets]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROMPTS = {
    "code": "Write a Python class for an LRU cache with get, put and delete, with docstrings and a short usage example.",
    "math": "A shop sells pens at 3 dollars and notebooks at 5 dollars. Sam buys 12 items for 44 dollars. "
            "How many notebooks did he buy? Explain each step.",
    "chat": "Explain in detail how a hash map works, with its collision handling, resizing and complexity.",
}
POLICY = {"tau": "EntMTPτ (two trees, hysteresis)", "ladder": "EntMTP-ladder (thresholds)", "static": "EntMTP* (one static tree)"}
HOG = "while True:\n    pass\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=list(PROMPTS), default="code")
    ap.add_argument("--policy", choices=list(POLICY), default="tau")
    ap.add_argument("--tokens", type=int, default=768, help="the race's budget (default: %(default)s)")
    ap.add_argument("--hog-after", type=float, default=4.0, help="seconds into the race to start the busy processes")
    ap.add_argument("--out", default=str(ROOT / "assets"), help="folder for the screenshots")
    args = ap.parse_args()

    import torch
    from playwright.sync_api import expect, sync_playwright

    import app

    torch.set_num_threads(os.cpu_count() or 1)
    demo = app.build_demo(app.AppConfig())
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app.launch(demo, prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    out = Path(args.out)
    hogs: list[subprocess.Popen] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
            page.get_by_label("Prompt").fill(PROMPTS[args.task])
            page.get_by_role("radio", name=args.task, exact=True).check()
            page.get_by_role("radio", name=POLICY[args.policy], exact=True).check()
            page.get_by_role("radio", name="Plain decoding (AR)", exact=True).check()
            budget = page.locator("input[aria-label='number input for Max new tokens']")
            budget.fill(str(args.tokens))
            budget.press("Enter")
            page.wait_for_timeout(1000)
            page.get_by_role("button", name="Run the race").click()
            expect(page.locator(".badge.running", has_text="racing")).to_be_visible(timeout=600_000)
            page.wait_for_timeout(args.hog_after * 1e3)
            page.screenshot(path=str(out / "screenshot-refit-before.png"), full_page=False)
            hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 2)]
            started = time.monotonic()
            print(f"busy processes started {args.hog_after:.0f} s into the race", flush=True)
            expect(page.locator(".badge.same")).to_be_visible(timeout=900_000)
            print(f"race over {time.monotonic() - started:.0f} s later", flush=True)
            for h in hogs:
                h.kill()
            hogs = []
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out / "screenshot-refit-after.png"), full_page=False)
            feature = page.locator(".js-plotly-plot", has_text="What the policy sees").first
            feature.scroll_into_view_if_needed()
            feature.screenshot(path=str(out / "screenshot-refit-feature.png"))
            print(page.locator(".stats").first.inner_text(), flush=True)
            page.get_by_role("tab", name="Bank").click()
            chart = page.locator(".js-plotly-plot", has_text="Step cost on this machine").first
            expect(chart).to_contain_text("seconds (0: now)", timeout=120_000)  # drawn again with the race's steps
            page.wait_for_timeout(3000)  # the tab's other figures settle (a redraw detaches the old chart)
            chart = page.locator(".js-plotly-plot", has_text="Step cost on this machine").first
            chart.scroll_into_view_if_needed()
            chart.screenshot(path=str(out / "screenshot-refit-costs.png"))
            browser.close()
    finally:
        for h in hogs:
            h.kill()
        demo.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
