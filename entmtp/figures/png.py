"""PNG export of Plotly figures, with Debian's Chromium through Playwright (no browser download).

Used where a figure is saved to the repository (`build-bank`, `calibrate --ship`, `bench --out`);
without Chromium or Playwright nothing is written and the caller keeps the HTML figure.
"""

from __future__ import annotations

import os
import tempfile

import plotly.graph_objects as go

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def save_png(fig: go.Figure, path, width: int = 1100, height: int | None = None) -> bool:
    """Render a figure to PNG at `path`; False, writing nothing, when Chromium or Playwright is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return False
    if not os.path.exists(CHROMIUM):
        return False
    height = height or int(fig.layout.height or 450)
    with tempfile.TemporaryDirectory() as tmp:
        page_file = os.path.join(tmp, "fig.html")
        fig.write_html(page_file, include_plotlyjs=True, full_html=True, config={"staticPlot": True},
                       default_width=f"{width}px", default_height=f"{height}px")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": width + 20, "height": height + 20})
            page.goto(f"file://{page_file}")
            page.wait_for_selector(".main-svg")
            page.locator(".plotly-graph-div").first.screenshot(path=str(path))
            browser.close()
    return True
