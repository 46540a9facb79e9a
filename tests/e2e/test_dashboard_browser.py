"""In a real browser: Debian's headless Chromium (selenium + chromedriver) drives the dashboard of a real
`lorad serve` training the quickstart job: jobs page → job page → pause → resume, with screenshots.

`make test` installs chromium and chromium-driver when they are missing and it runs as root with apt-get
(the Makefile's `system-deps` target); elsewhere this test is skipped, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from daemon import protocol as p
from engine.report.events import read_events
from tests.helpers.daemon import Daemon, fast_config, wait_until
from tests.helpers.processes import REPO

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SHOTS = Path(os.environ.get("LORAD_SCREENSHOTS", tempfile.gettempdir())) / "lorad-web-screens"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1500"]
# About 30 s on a quiet 2-core machine (two trainer start-ups dominate); a machine shared with other work may
# take minutes to import torch, so the waits are generous.
PATIENCE = 240


def _browser(profile: Path):
    missing = [x for x in (CHROMIUM, CHROMEDRIVER) if not os.access(x, os.X_OK)]
    if missing:
        pytest.skip(f"no browser: {', '.join(missing)} missing (`make test` installs Debian's chromium and "
                    "chromium-driver with apt-get when run as root)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in [*FLAGS, f"--user-data-dir={profile}"]:
        opts.add_argument(f)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def quickstart(tmp: Path, steps: int) -> str:
    """configs/examples/quickstart.yaml (builtin tiny Llama, built offline) with its data path made absolute."""
    job = yaml.safe_load((REPO / "configs/examples/quickstart.yaml").read_text())
    job["data"]["path"] = str(REPO / "configs/examples" / job["data"]["path"])
    job["train"]["steps"] = steps
    return yaml.safe_dump(job, sort_keys=False)


def steps_reported(workdir: Path) -> int:
    return len({e["step"] for e in read_events(workdir) if e.get("event") == "step"})


def _text_of(browser, css: str) -> str:
    """The element's text, or "" while the page that has it is still loading (or a refresh replaced it)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return browser.find_element(By.CSS_SELECTOR, css).text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def test_jobs_page_job_page_pause_resume_in_chromium(tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    SHOTS.mkdir(parents=True, exist_ok=True)
    d = Daemon(tmp_path / "home", fast_config(tmp_path, web={"listen": "127.0.0.1:0", "poll_s": 0.5}))
    browser = None
    try:
        d.start()
        # Submitted first: the trainer imports torch while Chromium starts, side by side on the two cores.
        job_id = d.call(p.Submit(name="quickstart.yaml", text=quickstart(tmp_path, steps=150)))["job"]
        browser = _browser(tmp_path / "chromium-profile")
        browser.set_page_load_timeout(20)
        workdir = d.home / "jobs" / job_id
        d.wait_job(lambda js: js[0]["state"] == "running" and js[0]["step"] >= 2, PATIENCE, "the job to train")

        def shown(css: str) -> str:
            return _text_of(browser, css)

        def state_shown() -> str:
            return shown("table.summary .st")

        def click(by: str, what: str) -> None:
            """Click, looking the element up again if a refresh of the live part replaced it meanwhile."""
            def once():
                try:
                    browser.find_element(by, what).click()
                    return True
                except StaleElementReferenceException:
                    return False
            wait_until(once, 10, f"a click on {what}")

        def loss_line() -> tuple[int, int]:
            """(data-points, pairs in points) of the loss curve, read in one go (a refresh may replace it)."""
            got = browser.execute_script("var l = document.querySelector('#chart-loss polyline');"
                                         "return l ? [l.dataset.points, l.getAttribute('points')] : null")
            assert got is not None, "no loss curve on the page"
            return int(got[0]), len(got[1].split())

        browser.get(d.cli("web-url", real=True).stdout.strip())  # the token once; a cookie from then on
        assert browser.current_url.endswith("/jobs") and "token" not in browser.current_url
        assert "running" in shown(f"tr[data-job='{job_id}']")
        browser.save_screenshot(str(SHOTS / "1-jobs.png"))

        click(By.LINK_TEXT, job_id)
        wait_until(lambda: browser.current_url.endswith(f"/jobs/{job_id}"), 10, "the job page")
        browser.save_screenshot(str(SHOTS / "2-job.png"))

        click(By.ID, "pause")
        wait_until(lambda: "pausing" in shown(".said"), 20, "the handler's answer on the page")
        wait_until(lambda: state_shown() == "paused", PATIENCE, "the page to show the job paused", poll=0.2)
        n = steps_reported(workdir)  # stable while paused
        assert loss_line() == (n, n) and n > 0
        browser.save_screenshot(str(SHOTS / "3-paused.png"))

        click(By.ID, "resume")
        wait_until(lambda: "queued" in shown(".said"), 20, "the handler's answer on the page")
        wait_until(lambda: state_shown() == "running", PATIENCE, "the page to show the job running again", poll=0.2)
        wait_until(lambda: steps_reported(workdir) >= n + 5, PATIENCE, "steps after the resume")
        wait_until(lambda: loss_line()[0] >= n + 5, 10, "a refresh of the live part with those steps", poll=0.1)
        points, pairs = loss_line()
        assert n + 5 <= points == pairs <= steps_reported(workdir)
        assert re.search(r"\d+/150", shown("table.summary"))
        browser.save_screenshot(str(SHOTS / "4-resumed.png"))
        too_wide = browser.execute_script(
            "var w = document.documentElement.clientWidth, out = [];"
            "document.querySelectorAll('main *').forEach(function (e) {"
            "  if (e.getBoundingClientRect().right > w + 1) out.push(e.tagName + '#' + e.id + '.' + e.className); });"
            "return out.slice(0, 8)")
        assert too_wide == [], f"wider than the window: {too_wide}"
        assert d.terminate() == 0
    finally:
        if browser is not None:
            browser.quit()
        d.cleanup()


def test_a_caption_is_edited_on_the_job_page_and_refused_without_the_token_in_chromium(tmp_path):
    """A drained daemon holds the job queued after its caption stage (captions.json written as the stage writes
    it): the job page shows each image with its caption, an edit lands in caption_edits.json for the trainer, and a
    browser without the token is refused and changes nothing."""
    import json
    from urllib.parse import urlsplit

    from selenium.webdriver.common.by import By

    from engine.config.caption_edits import read_edits
    from tests.helpers.images import flux_job_dict, make_images

    SHOTS.mkdir(parents=True, exist_ok=True)
    d = Daemon(tmp_path / "home", fast_config(tmp_path, web={"listen": "127.0.0.1:0", "poll_s": 0.5}))
    browser = None
    try:
        d.start()
        d.call(p.Drain(on=True))  # nothing starts: the job stays before training
        data = make_images(tmp_path / "data")
        job = flux_job_dict("builtin:tiny-flux", data, data={"captions": "auto"})
        job_id = d.call(p.Submit(name="captioned.yaml", text=yaml.safe_dump(job)))["job"]
        workdir = d.home / "jobs" / job_id
        names = sorted(p_.name for p_ in data.glob("*.png"))
        (workdir / "captions.json").write_text(json.dumps({n: f"sks, caption of {n}" for n in names}))
        browser = _browser(tmp_path / "chromium-profile")
        browser.set_page_load_timeout(20)
        url = urlsplit(d.cli("web-url", real=True).stdout.strip())
        page = f"{url.scheme}://{url.netloc}/jobs/{job_id}"
        browser.get(f"{page}?{url.query}")  # the token once (it signs the browser in), then the page
        assert browser.current_url == page
        assert f"Captions ({len(names)} images)" in browser.find_element(By.ID, "captions").text
        browser.execute_script("document.getElementById('captions').scrollIntoView()")  # lazy images load in view
        wait_until(lambda: browser.execute_script(
            "return Array.from(document.querySelectorAll('#captions img'))"
            ".every(function (i) { return i.complete && i.naturalWidth > 0; })"), 20, "the images beside the captions")
        box = browser.find_element(By.ID, "caption-0")
        box.clear()
        box.send_keys("sks, a square my way")
        browser.find_element(By.ID, "save-caption-0").click()
        wait_until(lambda: "edited" in _text_of(browser, ".said"), 20, "the answer")
        assert read_edits(workdir) == {names[0]: "sks, a square my way"}
        browser.execute_script("document.getElementById('captions').scrollIntoView()")
        browser.save_screenshot(str(SHOTS / "5-caption-edited.png"))
        too_wide = browser.execute_script(
            "var w = document.documentElement.clientWidth, out = [];"
            "document.querySelectorAll('#captions *').forEach(function (e) {"
            "  if (e.getBoundingClientRect().right > w + 1) out.push(e.tagName + '#' + e.id); });"
            "return out.slice(0, 8)")
        assert too_wide == [], f"wider than the window: {too_wide}"

        browser.delete_all_cookies()  # a browser without the token
        browser.get(page)
        assert "Token required" in browser.page_source and "captions" not in browser.page_source.lower()
        status = browser.execute_script(
            "var f = new FormData(); f.append('image', arguments[0]); f.append('caption', 'sks, theirs');"
            "return fetch(arguments[1], {method: 'POST', body: f}).then(function (r) { return r.status; })",
            names[1], f"/jobs/{job_id}/caption")
        assert status == 401
        assert read_edits(workdir) == {names[0]: "sks, a square my way"}
        assert d.terminate() == 0
    finally:
        if browser is not None:
            browser.quit()
        d.cleanup()
