"""The HTML report of a real `decide-eval` run, as people read it: in a real headless browser.

A run against the real server on the bundled model, with its thresholds, is opened in Chromium
(Debian's, driven by Playwright): every plot decodes and shows with content, every table has rows,
nothing is wider than the window, and a full-page screenshot is saved for a person to look at.

`make report-browser` installs the browser and runs this file with DECIDER_REQUIRE_BROWSER=1 (a
missing browser fails it there); `make test` skips it where no Chromium is installed.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
from test_eval_e2e_server import small_subset

from decider_cli.evaluate.cli import main
from decider_dev import REPO_ROOT
from decider_dev.local_server import run_local_server

pytestmark = [pytest.mark.server, pytest.mark.model]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("DECIDER_REQUIRE_BROWSER") == "1"
SCREENSHOT = REPO_ROOT / "runs" / "report-browser" / "report.png"
WIDTH = 1280
PLOTS = {"latency CDF and histogram", "reliability diagram", "coverage-accuracy curve"}


def _browser() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if REQUIRED:
            raise
        pytest.skip("Playwright is not installed: `make report-browser` installs it and Chromium")
    if CHROMIUM is None:
        if REQUIRED:
            pytest.fail("no chromium on PATH")
        pytest.skip("no Chromium here: `make report-browser` installs Debian's")
    return CHROMIUM


def test_a_real_run_s_report_reads_in_a_headless_browser(jevbench_cases, jevbench_gold, tmp_path) -> None:
    chromium = _browser()
    from PIL import Image, ImageStat
    from playwright.sync_api import sync_playwright

    cases, gold = small_subset(jevbench_cases, jevbench_gold, tmp_path)
    out = tmp_path / "run"
    with run_local_server() as server:
        argv = ["run", "--target", server.base_url, "--cases", str(cases), "--gold", str(gold)]
        assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    assert main(["thresholds", str(out), "--target-accuracy", "0.95", "--min-accepted", "1"]) == 0
    report = out / "report.html"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        page.goto(report.as_uri())
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all(
            "img",
            "els => els.map(e => ({alt: e.alt, complete: e.complete, natural: e.naturalWidth,"
            " shown: e.getBoundingClientRect().width}))",
        )
        rows = page.eval_on_selector_all("table", "els => els.map(e => e.tBodies[0].rows.length)")
        headings = page.eval_on_selector_all("h1, h2, h3", "els => els.map(e => e.textContent)")
        root = "document.documentElement"
        overflow = page.evaluate(f"{root}.scrollWidth - {root}.clientWidth")
        plots = [page.locator("img").nth(i).screenshot() for i in range(len(images))]
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        full = page.screenshot(full_page=True, path=str(SCREENSHOT))
        browser.close()

    assert {image["alt"] for image in images} == PLOTS
    for image in images:  # decoded, and shown at a readable size inside the page
        assert image["complete"] and image["natural"] > 0, image
        assert 300 <= image["shown"] <= WIDTH, image
    for alt, png in zip([image["alt"] for image in images], plots, strict=True):
        spread = ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]
        assert spread > 10, f"{alt}: the plot shows as a blank area (pixel spread {spread:.1f})"
    assert len(rows) >= 5 and all(count >= 1 for count in rows), rows  # latency, types, domains, cuts, errors
    for wanted in ("Latency per request (seconds)", "By question type", "By domain", "Reliability diagram"):
        assert any(heading.startswith(wanted) for heading in headings), (wanted, headings)
    assert overflow <= 0, f"the page is {overflow} px wider than a {WIDTH} px window"
    shot = Image.open(io.BytesIO(full))
    assert shot.width == WIDTH and shot.height > 1500  # the whole report, plots included
