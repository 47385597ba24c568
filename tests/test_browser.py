"""The live status page in a real browser (make test-browser: Debian's Chromium and ChromeDriver,
selenium): during a tiny swarm, the page lists both samplers and its step advances with no reload;
its screenshot is docs/status-page.png."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import serving
from tests.swarms import up_command

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


def wait_for(what, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "not seen in time"
        time.sleep(0.2)
    return found


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
                assert len(wait_for(lambda: browser.execute_script(rows))) == 2  # the last step's completions
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
        swarm.send_signal(signal.SIGINT)
        swarm.wait(timeout=60)
    assert SCREENSHOT.stat().st_size > 10_000


def test_a_finished_run_shows_as_finished(tmp_path):
    from selenium.webdriver.common.by import By

    subprocess.run(up_command(tmp_path, "done", 3), capture_output=True, timeout=600, check=True)
    with serving(tmp_path / "done") as url:  # from the finished run's own store
        browser = chromium(tmp_path)
        try:
            browser.get(url)
            said = wait_for(lambda: browser.find_element(By.ID, "progress").text.startswith("finished")
                            and browser.find_element(By.ID, "progress").text)
            assert said.startswith("finished at step 3/3")
            assert browser.find_element(By.ID, "connection").text == "finished"
            shown = "return [...document.querySelectorAll('#samples tbody tr')].length"
            assert browser.execute_script(shown) == 2
        finally:
            browser.quit()
        # A headless browser waiting for the page to finish loading (a screenshot, a DOM dump):
        # /?once draws one snapshot and opens no event stream, so the load ends.
        dumped = subprocess.run(["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu",
                                 f"--user-data-dir={tmp_path / 'dump'}", "--virtual-time-budget=10000", "--dump-dom",
                                 url + "?once"], capture_output=True, text=True, timeout=120)
        assert "finished at step 3/3" in dumped.stdout, dumped.stderr[-2000:]
