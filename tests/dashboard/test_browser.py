"""A real browser (headless Chromium through selenium and the system chromedriver) against a live
dashboard: the cards fill, the plots load, polling updates the page in place, and it fits a phone.
Screenshots go to test-artifacts/."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from werkzeug.serving import make_server

from dashboard import create_app
from tests.dashboard.fixtures import DEMO, append, build_log_root, train_record
from tests.helpers import REPO
from trainer import runfolder

pytestmark = pytest.mark.browser

ARTIFACTS = REPO / "test-artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TOKEN = "browser-token"


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,2400"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live dashboard (threaded werkzeug server) over the hand-made log root, with a token."""
    root = build_log_root(tmp_path_factory.mktemp("browser"))
    app = create_app(root, {"DASHBOARD_TOKEN": TOKEN})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_port}", "root": root}
    server.shutdown()


def wait(driver, condition, timeout: float = 20.0, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d), message)


def text_of(driver, stat: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'[data-stat="{stat}"]').text


def plots_loaded(driver) -> bool:
    return driver.execute_script(
        "const imgs = [...document.querySelectorAll('img[data-plot]')];"
        "return imgs.length > 0 && imgs.every(i => i.complete && i.naturalWidth > 0 && i.src.includes('/api/plots/'));"
    )


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def save(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def test_page_fills_plots_load_and_updates_in_place(browser, served):
    log = served["root"] / DEMO / runfolder.LOGS_DIR / runfolder.TRAINING_LOG
    last_step = runfolder.last_per_step(list(runfolder.iter_records(log)))[-1]["step"]
    browser.get(f"{served['url']}/?token={TOKEN}&interval=0.5")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    assert text_of(browser, "step") == str(last_step)
    assert text_of(browser, "status") == "running"
    wait(browser, plots_loaded, message="plots did not load")
    rows = browser.find_elements(By.CSS_SELECTOR, "#checkpoint-table tbody tr")
    assert len(rows) == 4
    assert [r.get_attribute("data-step") for r in rows if "best" in r.get_attribute("class")] == ["30"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#gpu-cards .gpu-card")) == 3
    assert "resume" in browser.find_element(By.ID, "event-timeline").text
    save(browser, "dashboard.png")

    # New records arrive: the page follows by polling, without reloading.
    browser.execute_script("window.__stillHere = true;")
    loss_src = browser.find_element(By.ID, "plot-loss").get_attribute("src")
    gpu_src = browser.find_element(By.ID, "plot-gpu_util").get_attribute("src")
    with open(log, "ab") as handle:
        handle.write(b"\n")  # ends the half-written line the fixture left
    append(log, [train_record(last_step + 1, time.time(), 0.123)])
    wait(browser, lambda d: text_of(d, "step") == str(last_step + 1), message="step did not update")
    assert text_of(browser, "loss") == "0.123"
    assert browser.execute_script("return window.__stillHere === true;")
    wait(browser, lambda d: d.find_element(By.ID, "plot-loss").get_attribute("src") != loss_src)
    wait(browser, plots_loaded)
    assert browser.find_element(By.ID, "plot-gpu_util").get_attribute("src") == gpu_src  # telemetry unchanged
    assert console_errors(browser) == []  # no CSP violations, no failed fetches


def test_run_picker_error_panel_and_compare(browser, served):
    browser.get(f"{served['url']}/?token={TOKEN}&interval=30")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    Select(browser.find_element(By.ID, "compare-picker")).select_by_value("failed")
    wait(browser, lambda d: "compare=failed" in d.find_element(By.ID, "plot-loss").get_attribute("src"))
    Select(browser.find_element(By.ID, "run-picker")).select_by_value("failed")
    wait(browser, lambda d: text_of(d, "step") == "5", message="run switch did not update the cards")
    panel = browser.find_element(By.ID, "error-panel")
    wait(browser, lambda d: panel.is_displayed())
    assert (
        "CUDA out of memory" in panel.text
        and "Traceback" in browser.find_element(By.ID, "error-traceback").text
    )
    assert "run=failed" in browser.current_url
    wait(browser, plots_loaded)
    save(browser, "dashboard-failed-run.png")
    assert console_errors(browser) == []


def test_readable_on_a_phone(browser, served):
    browser.set_window_size(390, 844)
    try:
        browser.get(f"{served['url']}/?token={TOKEN}")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
        wait(browser, plots_loaded)
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth;")
        assert overflow <= 1
        image_width = browser.execute_script(
            "return document.getElementById('plot-loss').getBoundingClientRect().width;"
        )
        assert 300 < image_width <= 390
        save(browser, "dashboard-phone.png")
    finally:
        browser.set_window_size(1280, 2400)


def test_empty_root_page_fills_once_a_run_appears(browser, tmp_path: Path):
    root = tmp_path / "runs"
    root.mkdir()
    server = make_server("127.0.0.1", 0, create_app(root), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{server.server_port}/?interval=0.5")
        assert "No runs under" in browser.find_element(By.ID, "empty-root").text
        append(
            root / "fresh" / runfolder.LOGS_DIR / runfolder.TRAINING_LOG,
            [train_record(s, time.time(), 1.0) for s in (1, 2, 3)],
        )
        wait(browser, lambda d: text_of(d, "step") == "3", message="the new run did not show up")
        assert browser.find_elements(By.ID, "empty-root") == []
        assert (
            Select(browser.find_element(By.ID, "run-picker")).first_selected_option.get_attribute("value")
            == "fresh"
        )
        wait(browser, plots_loaded)
    finally:
        browser.get("about:blank")  # stop the page polling before its server goes
        server.shutdown()


@pytest.mark.parametrize("run", ["junk", "empty"])
def test_odd_runs_render_without_script_errors(browser, served, run: str):
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(f"{served['url']}/?token={TOKEN}&run={run}&interval=30")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    wait(browser, plots_loaded)
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-error") in (None, "")
    assert console_errors(browser) == []
