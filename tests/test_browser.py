"""The live status page in a real browser (make test-browser: Debian's Chromium and ChromeDriver,
selenium): during a tiny swarm, the page lists both samplers and its step advances with no reload;
its screenshot is docs/status-page.png."""

from __future__ import annotations

import re
import signal
import subprocess
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import eventually, serving, stopped
from tests.swarms import up_command

# Each thing the page shows, looked for until it is seen (a page draws as events arrive).
wait_for = partial(eventually, timeout=120, every=0.2, why=lambda _: "not seen in time")

pytestmark = pytest.mark.browser

SCREENSHOT = Path(__file__).parent.parent / "docs" / "status-page.png"


def chromium(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    # The flags a closed network needs (no background connections), and root's --no-sandbox.
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,900"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def test_the_live_page_shows_the_samplers_and_its_step_advances_without_a_reload(tmp_path):
    from selenium.webdriver.common.by import By

    swarm = subprocess.Popen(up_command(tmp_path, "page", 10_000, "sampler.heartbeat_s=0.5"), stderr=subprocess.PIPE,
                             text=True)
    try:
        for line in swarm.stderr:  # a step trained: the trainer's status exists
            if "step=" in line:
                break
        with serving(tmp_path / "page") as url:
            browser = chromium(tmp_path)
            try:
                browser.get(url)
                # Read in one script: the page replaces its rows at every event, so a row found by one
                # call may be gone (stale) by the next.
                shown = "return [...document.querySelectorAll('#samplers tr')].map(row => row.dataset.sampler)"
                assert sorted(wait_for(lambda: len(ids := browser.execute_script(shown)) == 2 and ids)) == ["s1", "s2"]
                # The fleet at a glance, and a filter that applies at once (at 1,000 samplers the rows are not drawn)
                fleet = wait_for(lambda: "slowest" in (said := browser.find_element(By.ID, "fleet").text) and said)
                assert re.match(r"(active|standby|draining) \d", fleet) and "groups/s of the active" in fleet, fleet
                browser.find_element(By.ID, "filter").send_keys("s2")
                assert browser.execute_script(shown) == ["s2"]
                browser.find_element(By.ID, "filter").clear()  # the next snapshot draws every row again
                wait_for(lambda: len(browser.execute_script(shown)) == 2)
                first = wait_for(lambda: browser.find_element(By.ID, "progress").text.startswith("step")
                                 and browser.find_element(By.ID, "progress").text)
                later = wait_for(lambda: browser.find_element(By.ID, "progress").text.split(",")[0]
                                 != first.split(",")[0] and browser.find_element(By.ID, "progress").text)
                step = lambda said: int(said.split()[1].split("/")[0])  # noqa: E731 - "step 7/10000, elapsed ..."
                assert step(later) > step(first) and "/10000, elapsed" in later and "ETA" in later
                assert browser.find_element(By.ID, "connection").text == "live"
                assert browser.find_element(By.ID, "about").text == "model tiny · task math"
                config = browser.execute_script("return JSON.parse(document.getElementById('config').textContent)")
                assert config["run"]["id"] == "page" and config["task"]["name"] == "math"  # the run's config
                assert re.match(r"last step: reward \d\.\d{3}, loss -?\d\.\d{4}, KL \d\.\d{4}, entropy \d",
                                browser.find_element(By.ID, "step").text)
                rows = "return [...document.querySelectorAll('#samples tbody tr')].map(r => r.innerText)"
                # the last 5 steps' completions (served with --run), 2 a step, newest first
                shown_rows = wait_for(lambda: len(r := browser.execute_script(rows)) == 10 and r)
                steps_shown = [int(r.split("\t")[0]) for r in shown_rows]
                assert steps_shown == sorted(steps_shown, reverse=True) and len(set(steps_shown)) == 5
                for chart in ("reward", "loss", "kl", "entropy", "grad_norm", "lr", "length", "zero_spread",
                              "staleness"):
                    wait_for(lambda chart=chart: browser.find_elements(By.CSS_SELECTOR, f"#{chart} canvas"))
                # The x axis reads as steps: whole numbers at its ticks.
                ticks = wait_for(lambda: browser.execute_script("return charts.reward.axes[0]._splits"))
                assert ticks and all(float(t).is_integer() for t in ticks), ticks
                browser.save_screenshot(str(SCREENSHOT))
            finally:
                browser.quit()
    finally:
        stopped(swarm, sig=signal.SIGINT)
    assert SCREENSHOT.stat().st_size > 10_000


def documented_screenshot() -> str:
    """The picture's command, as docs/operations.md gives it."""
    docs = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    return next(line for line in docs.splitlines() if line.startswith("chromium --headless"))


def test_a_finished_run_shows_as_finished_and_the_documented_screenshot_is_the_whole_page(tmp_path):
    """The screenshot in the docs: it was blank ("connecting", "no step yet": drawn after an
    asynchronous fetch the load event did not wait for); the learning rate's axis read 0 0 0 0;
    no held-out chart; only the last step's completions."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    subprocess.run(up_command(tmp_path, "done", 3, "run.eval_every=1", "run.eval_prompts=2"), capture_output=True,
                   timeout=600, check=True)
    with serving(tmp_path / "done") as url:  # from the finished run's own store and its directory
        browser = chromium(tmp_path)
        try:
            browser.get(url)
            said = wait_for(lambda: browser.find_element(By.ID, "progress").text.startswith("finished")
                            and browser.find_element(By.ID, "progress").text)
            assert said.startswith("finished at step 3/3")
            assert browser.find_element(By.ID, "connection").text == "finished"
            shown = "return [...document.querySelectorAll('#samples tbody tr')].length"
            assert browser.execute_script(shown) == 6  # the last 5 steps' (of 3), 2 a step
            # /?once is drawn by its load event, which a screenshot waits for, however slow the
            # snapshot's answer (2 s more for each request here: drawn after it, it was blank)
            browser.execute_cdp_cmd("Network.enable", {})
            browser.execute_cdp_cmd("Network.emulateNetworkConditions", {
                "offline": False, "latency": 2000, "downloadThroughput": -1, "uploadThroughput": -1})
            browser.get(url + "?once")  # returns at the load event
            assert browser.find_element(By.ID, "progress").text.startswith("finished at step 3/3")
            browser.execute_cdp_cmd("Network.emulateNetworkConditions", {
                "offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
            ticks = "return charts.lr.axes[1].values(charts.lr, [0, 5e-5, 1e-4, 0.25, 120])"  # drawn on a canvas
            assert browser.execute_script(ticks) == ["0", "5.0e-5", "1.0e-4", "0.25", "120"]  # not 0 0 0 0
            assert browser.find_element(By.CSS_SELECTOR, "#held_out .u-title").text == "held-out reward (greedy)"
        finally:
            browser.quit()
        # The documented command, as given (a profile of its own: HOME), on this page
        command = documented_screenshot().replace("http://127.0.0.1:8080/", url).replace("page.png",
                                                                                      str(tmp_path / "page.png"))
        subprocess.run(["bash", "-c", command], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       capture_output=True, timeout=120, check=True)
        picture = Image.open(tmp_path / "page.png").convert("RGB")
        drawn = sum(1 for pixel in picture.getdata() if pixel == (31, 119, 180))  # the charts' lines, #1f77b4
        assert drawn > 1000, drawn  # a blank page ("connecting") has none
        # A headless browser waiting for the page to finish loading (a screenshot, a DOM dump):
        # /?once draws one snapshot and opens no event stream, so the load ends.
        dumped = subprocess.run(["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu",
                                 f"--user-data-dir={tmp_path / 'dump'}", "--virtual-time-budget=10000", "--dump-dom",
                                 url + "?once"], capture_output=True, text=True, timeout=120)
        assert "finished at step 3/3" in dumped.stdout, dumped.stderr[-2000:]
