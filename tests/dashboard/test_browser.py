"""A real browser (headless Chromium through selenium and the system chromedriver) against a live
dashboard: the cards fill, the charts draw, polling fetches only new steps, hover shows values, drag
zooms, three runs compare, the view survives a reload from its URL, dark theme, a phone's 390 px (no
page or tab scrolls sideways), numbers formatted as the server formats them, and a killed run reads
"dead". Screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from werkzeug.serving import make_server

from dashboard import create_app
from dashboard.views import format_number
from tests.dashboard.fixtures import (
    DEMO,
    LAST_STEP,
    NUMBER_CASES,
    append,
    build_log_root,
    demo_loss,
    train_record,
    write_config,
)
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


def live(root: Path):
    """A live dashboard (threaded werkzeug server) over ``root``, with a token: (server, its URL)."""
    server = make_server("127.0.0.1", 0, create_app(root, {"DASHBOARD_TOKEN": TOKEN}), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The dashboard over the hand-made log root."""
    root = build_log_root(tmp_path_factory.mktemp("browser"))
    server, url = live(root)
    yield {"url": url, "root": root}
    server.shutdown()


# A sweep's jobs: long run names without a space, and two throughputs an order of magnitude apart.
SWEEP_RUNS = {
    "sweep-example/tiny_instructions_variant-rslora_r16_seed1": 40980.4,
    "sweep-example/tiny_corpus_variant-lora_r8_seed2": 7648.0,
}


@pytest.fixture(scope="module")
def sweep_served(tmp_path_factory):
    """The dashboard over a sweep folder (sweep.json) holding the SWEEP_RUNS."""
    root = tmp_path_factory.mktemp("sweep") / "runs"
    now = time.time()
    for rank, (name, speed) in enumerate(SWEEP_RUNS.items()):
        records = [{**train_record(s, now - 30 + s, 3.0 / s), "tokens_per_sec": speed} for s in range(1, 21)]
        append(root / name / runfolder.LOGS_DIR / runfolder.TRAINING_LOG, records)
        write_config(root / name, 1e-4, 8 << rank)  # the config tab shows the keys that differ
    jobs = [{"name": n.split("/")[1], "state": "running", "output_dir": str(root / n)} for n in SWEEP_RUNS]
    summary = {"sweep": "sweep-example", "status": "running", "updated_at": now, "jobs": jobs,
               "counts": {"queued": 0, "running": 2, "done": 0, "failed": 0}}  # fmt: skip
    (root / "sweep-example" / "sweep.json").write_text(json.dumps(summary))
    server, url = live(root)
    yield {"url": url, "root": root}
    server.shutdown()


def wait(driver, condition, timeout: float = 20.0, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d), message)


def text_of(driver, stat: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, f'[data-stat="{stat}"]').text


def charts_drawn(driver, names=("loss", "lr", "throughput", "grad_norm", "memory")) -> bool:
    """The named uPlot charts exist and hold points (figure[data-points] is set after each draw)."""
    return driver.execute_script(
        "return arguments[0].every(n => { const f = document.querySelector(`figure[data-chart='${n}']`);"
        " return f && Number(f.dataset.points) > 0 && f.querySelector('.uplot canvas'); });",
        list(names),
    )


def legend(driver, chart: str) -> dict[str, str]:
    """Series label -> the value the legend shows for the point under the cursor."""
    return driver.execute_script(
        "const rows = document.querySelectorAll(`figure[data-chart='${arguments[0]}'] .u-legend .u-series`);"
        "return Object.fromEntries([...rows].map(r => [r.querySelector('.u-label').textContent,"
        " r.querySelector('.u-value').textContent]));",
        chart,
    )


def series_labels(driver, chart: str) -> list[str]:
    """The chart's series labels; empty while the page has not built that chart yet (polled by ``wait``)."""
    return driver.execute_script(
        "const c = window.dashboard && window.dashboard.hub.charts[arguments[0]];"
        "return c && c.plot ? c.plot.series.slice(1).map(s => s.label) : [];",
        chart,
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
    wait(browser, charts_drawn, message="charts did not draw")
    rows = browser.find_elements(By.CSS_SELECTOR, "#checkpoint-table tbody tr")
    assert len(rows) == 4
    assert [r.get_attribute("data-step") for r in rows if "best" in r.get_attribute("class")] == ["30"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#gpu-cards .gpu-card")) == 3
    assert "resume" in browser.find_element(By.ID, "event-timeline").get_attribute("textContent")
    save(browser, "dashboard.png")

    # New records arrive: the page follows by polling, fetching only the new steps, without reloading.
    browser.execute_script("window.__stillHere = true;")
    points = int(
        browser.find_element(By.CSS_SELECTOR, "figure[data-chart='loss']").get_attribute("data-points")
    )
    with open(log, "ab") as handle:
        handle.write(b"\n")  # ends the half-written line the fixture left
    append(log, [train_record(last_step + 1, time.time(), 0.123)])
    wait(browser, lambda d: text_of(d, "step") == str(last_step + 1), message="step did not update")
    assert text_of(browser, "loss") == "0.123"
    assert browser.execute_script("return window.__stillHere === true;")
    loss_chart = browser.find_element(By.CSS_SELECTOR, "figure[data-chart='loss']")
    wait(
        browser,
        lambda d: int(loss_chart.get_attribute("data-points")) == points + 1,
        message="chart did not grow",
    )
    fetched = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).filter(n => n.includes('/api/series'));"
    )
    assert any(f"since_step={last_step + 1}" in name for name in fetched)  # only the new step was fetched
    assert not any("/api/gpu?" in n and "field=" in n for n in fetched)  # telemetry unchanged: not re-fetched
    assert console_errors(browser) == []  # no CSP violations, no failed fetches


def test_run_picker_error_panel_and_compare(browser, served):
    browser.get(f"{served['url']}/?token={TOKEN}&interval=30")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    wait(browser, charts_drawn)
    Select(browser.find_element(By.ID, "compare-picker")).select_by_value("failed")
    wait(browser, lambda d: "failed" in series_labels(d, "loss"), message="the compared run is not drawn")
    assert "compare=failed" in browser.find_element(By.CSS_SELECTOR, "a.png[data-plot='loss']").get_attribute(
        "href"
    )
    Select(browser.find_element(By.ID, "run-picker")).select_by_value("failed")
    wait(browser, lambda d: text_of(d, "step") == "5", message="run switch did not update the cards")
    panel = browser.find_element(By.ID, "error-panel")
    wait(browser, lambda d: panel.is_displayed())
    assert (
        "CUDA out of memory" in panel.text
        and "Traceback" in browser.find_element(By.ID, "error-traceback").text
    )
    assert "run=failed" in browser.current_url
    wait(browser, lambda d: charts_drawn(d, ("loss",)))
    save(browser, "dashboard-failed-run.png")
    assert console_errors(browser) == []


def test_readable_on_a_phone(browser, served):
    browser.set_window_size(390, 844)
    try:
        browser.get(f"{served['url']}/?token={TOKEN}")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
        wait(browser, charts_drawn)
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth;")
        assert overflow <= 1
        chart_width = browser.execute_script(
            "return document.querySelector(\"figure[data-chart='loss'] canvas\").getBoundingClientRect().width;"
        )
        assert 300 < chart_width <= 390  # full width, drawn at that size (ticks stay 12 px)
        save(browser, "dashboard-phone.png")
        browser.execute_script("document.querySelector(\"figure[data-chart='loss']\").scrollIntoView();")
        save(browser, "dashboard-phone-charts.png")
        browser.find_element(By.ID, "tab-checkpoints").click()
        cell = browser.find_element(By.CSS_SELECTOR, "#checkpoint-table tbody tr td")
        assert cell.value_of_css_property("display") == "flex"  # rows reflow to labelled cards
        assert (
            browser.execute_script("return getComputedStyle(arguments[0], '::before').content;", cell)
            == '"step"'
        )
        assert browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth;") <= 1
        save(browser, "dashboard-phone-checkpoints.png")
    finally:
        browser.set_window_size(1280, 2400)


def overflow(driver) -> int:
    """How far the page reaches past the screen sideways. clientWidth, not innerWidth: the vertical
    scrollbar takes its width from the page, and anything under it scrolls sideways too."""
    return driver.execute_script(
        "const e = document.documentElement; return e.scrollWidth - Math.min(e.clientWidth, window.innerWidth);"
    )


LONG, OTHER = SWEEP_RUNS
PHONE_PAGES = [
    ("served", ""),
    ("served", "&compare=failed,sweep/lr-1e-4"),
    ("served", "&run=failed"),
    ("sweep_served", f"&run={LONG}&compare={OTHER}"),  # long names in the pickers, chips and legends
]


@pytest.mark.parametrize("fixture, query", PHONE_PAGES, ids=["demo", "compare", "failed", "sweep-compare"])
def test_every_tab_fits_a_phone_screen(browser, request, fixture, query):
    """At 390 px nothing scrolls sideways, on any tab: charts, tables, legends, pickers."""
    base = request.getfixturevalue(fixture)["url"]
    browser.set_window_size(390, 844)
    try:
        browser.get(f"{base}/?token={TOKEN}&interval=30{query}")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
        wait(browser, lambda d: charts_drawn(d, ("loss",)), message="charts did not draw")
        compared = query.partition("compare=")[2].split(",") if "compare=" in query else []
        wait(
            browser,
            lambda d: set(compared) <= set(series_labels(d, "loss")),
            message="compared runs not drawn",
        )
        assert overflow(browser) <= 0, "charts"
        for tab in ("evals", "checkpoints", "events", "devices", "config"):
            browser.find_element(By.ID, f"tab-{tab}").click()
            wait(browser, lambda d, tab=tab: d.find_element(By.ID, f"panel-{tab}").is_displayed())
            if tab == "config":
                wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#config-table tbody tr"))
            assert overflow(browser) <= 0, tab
        browser.execute_script("document.getElementById('panel-config').scrollIntoView();")
        save(browser, f"phone-config-{request.node.callspec.id}.png")
    finally:
        browser.set_window_size(1280, 2400)


@pytest.mark.parametrize(
    "fixture, path", [("served", "/runs"), ("sweep_served", "/runs"), ("served", "/nope")]
)
def test_the_other_pages_fit_a_phone_screen(browser, request, fixture, path):
    base = request.getfixturevalue(fixture)["url"]
    browser.set_window_size(390, 844)
    try:
        browser.get(f"{base}{path}?token={TOKEN}")
        assert browser.find_element(By.TAG_NAME, "main").is_displayed()
        assert overflow(browser) <= 0
    finally:
        browser.set_window_size(1280, 2400)


def test_runs_table_shows_tokens_per_sec_one_way(browser, sweep_served):
    """Thousands separators, no exponent, whatever the magnitude (it once read 4.098e+04 beside 7648)."""
    browser.get(f"{sweep_served['url']}/runs?token={TOKEN}")
    shown = {
        row.get_attribute("data-run"): row.find_element(By.CSS_SELECTOR, "td[data-label='tokens/s']").text
        for row in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
    }
    assert shown == {LONG: "40,980", OTHER: "7,648"}
    browser.get(f"{sweep_served['url']}/?token={TOKEN}&interval=30&run={LONG}")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    assert text_of(browser, "tokens_per_sec") == "40,980"  # the card, after the page's own refresh


def test_the_page_formats_numbers_as_the_server_does(browser, served):
    """static/charts.js's fmt and the server's num filter: one rule, the same text for every case."""
    open_page(browser, served["url"])
    values = [(text, digits) for text, digits, _ in NUMBER_CASES]
    in_browser = browser.execute_script(
        "return arguments[0].map(([text, digits]) => Charts.fmt(Number(text), digits));", values
    )
    assert in_browser == [format_number(float(text), digits) for text, digits in values]
    assert in_browser == [shown for _, _, shown in NUMBER_CASES]


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
        wait(browser, lambda d: charts_drawn(d, ("loss",)))
    finally:
        browser.get("about:blank")  # stop the page polling before its server goes
        server.shutdown()


@pytest.mark.parametrize("run", ["junk", "empty"])
def test_odd_runs_render_without_script_errors(browser, served, run: str):
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(f"{served['url']}/?token={TOKEN}&run={run}&interval=30")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-charts"))
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-error") in (None, "")
    assert console_errors(browser) == []


def open_page(driver, base: str, query: str = "") -> None:
    driver.get(f"{base}/?token={TOKEN}&interval=30{query}")
    wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    wait(driver, charts_drawn, message="charts did not draw")


def test_hover_shows_every_series_value(browser, served):
    open_page(browser, served["url"])
    over = browser.find_element(By.CSS_SELECTOR, "figure[data-chart='loss'] .u-over")
    ActionChains(browser).move_to_element_with_offset(over, over.size["width"] // 4, 10).perform()
    wait(browser, lambda d: legend(d, "loss")["step"] not in ("-", "", "--"), message="no hover values")
    shown = legend(browser, "loss")
    index = browser.execute_script("return window.dashboard.hub.charts.loss.plot.cursor.idx;")
    data = browser.execute_script("return window.dashboard.hub.charts.loss.plot.data;")
    assert shown["step"] == str(data[0][index])
    assert float(shown["loss"]) == pytest.approx(data[2][index], rel=1e-3)  # the smoothed value at that step
    assert float(shown["loss (raw)"]) == pytest.approx(
        demo_loss(data[0][index], replay=data[0][index] > 20), rel=1e-3
    )
    # The cursor is shared: the learning-rate chart shows its value at the same step.
    assert legend(browser, "lr")["step"] == shown["step"] and legend(browser, "lr")["learning rate"] != "-"


def test_drag_zooms_every_chart_and_reset_zooms_out(browser, served):
    open_page(browser, served["url"])
    over = browser.find_element(By.CSS_SELECTOR, "figure[data-chart='loss'] .u-over")
    width = over.size["width"]
    ActionChains(browser).move_to_element_with_offset(over, -width // 4, 0).click_and_hold().move_by_offset(
        width // 4, 0
    ).release().perform()
    scale = "return window.dashboard.hub.charts[arguments[0]].plot.scales.x;"
    wait(browser, lambda d: "zoom=" in d.current_url, message="zoom not in the URL")
    loss, lr = browser.execute_script(scale, "loss"), browser.execute_script(scale, "lr")
    assert 5 < loss["min"] < loss["max"] < 25 and (lr["min"], lr["max"]) == (loss["min"], loss["max"])
    save(browser, "dashboard-zoomed.png")
    browser.find_element(By.ID, "reset-zoom").click()
    wait(browser, lambda d: "zoom=" not in d.current_url)
    full = browser.execute_script(scale, "loss")
    assert full["min"] <= 1 and full["max"] >= LAST_STEP


def test_three_runs_compared_with_one_colour_each_and_a_config_diff(browser, served):
    open_page(browser, served["url"], "&compare=failed,sweep/lr-1e-4")
    labels = series_labels(browser, "loss")
    assert {DEMO, "failed", "sweep/lr-1e-4"} <= set(labels)
    colours = browser.execute_script(
        "const chart = window.dashboard.hub.charts[arguments[0]].plot;"
        "return Object.fromEntries(chart.series.slice(1).filter(s => !s.label.endsWith('(raw)') && !s.label.endsWith('eval'))"
        ".map(s => [s.label, s._stroke || s.stroke()]));",
        "loss",
    )
    lr_colours = browser.execute_script(
        "const chart = window.dashboard.hub.charts.lr.plot;"
        "return Object.fromEntries(chart.series.slice(1).map(s => [s.label, s._stroke || s.stroke()]));"
    )
    assert len(set(colours.values())) == 3 and colours == lr_colours  # the same run, the same colour
    save(browser, "dashboard-compare.png")
    browser.find_element(By.ID, "tab-config").click()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#config-table tbody tr")) == 2)
    assert [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#config-table tbody td:first-child")] == [
        "lora.r",
        "optimization.learning_rate",
    ]  # only the keys that differ
    assert "tab=config" in browser.current_url


def test_the_view_is_a_url_that_reloads_as_it_was(browser, served):
    open_page(browser, served["url"])
    Select(browser.find_element(By.ID, "x-axis")).select_by_value("tokens")
    browser.find_element(By.ID, "log-y").click()
    slider = browser.find_element(By.ID, "smoothing")
    browser.execute_script(
        "arguments[0].value = '0.9'; arguments[0].dispatchEvent(new Event('input'));", slider
    )
    Select(browser.find_element(By.ID, "compare-picker")).select_by_value("failed")
    browser.find_element(By.ID, "tab-events").click()
    wait(browser, lambda d: "tab=events" in d.current_url)
    url = browser.current_url
    for part in ("x=tokens", "log=1", "smooth=0.9", "compare=failed", f"run={DEMO}"):
        assert part in url
    browser.get(url)
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    assert (
        Select(browser.find_element(By.ID, "x-axis")).first_selected_option.get_attribute("value") == "tokens"
    )
    assert browser.find_element(By.ID, "log-y").is_selected()
    assert browser.find_element(By.ID, "smoothing").get_attribute("value") == "0.9"
    assert browser.find_element(By.ID, "panel-events").is_displayed()
    assert not browser.find_element(By.ID, "panel-charts").is_displayed()
    assert [
        c.get_attribute("data-run") for c in browser.find_elements(By.CSS_SELECTOR, "#compare-chips .chip")
    ] == [
        DEMO,
        "failed",
    ]
    timeline = browser.find_element(By.ID, "event-timeline").text
    assert "/elsewhere/" not in timeline and "checkpoint-20" in timeline  # paths shortened
    browser.find_element(By.ID, "tab-charts").click()
    wait(browser, charts_drawn)
    x_max = browser.execute_script("return window.dashboard.hub.charts.loss.plot.scales.x.max;")
    assert x_max >= 512 * LAST_STEP * 0.99  # tokens seen, not steps
    assert browser.execute_script("return window.dashboard.hub.charts.loss.plot.scales.y.distr;") == 3  # log


def test_dark_theme_follows_the_system(browser, served):
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    )
    try:
        open_page(browser, served["url"])
        background = browser.execute_script("return getComputedStyle(document.body).backgroundColor;")
        assert background == "rgb(13, 17, 23)"
        save(browser, "dashboard-dark.png")
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
    open_page(browser, served["url"])
    assert (
        browser.execute_script("return getComputedStyle(document.body).backgroundColor;")
        == "rgb(246, 247, 249)"
    )


def test_a_killed_run_shows_dead(browser, tmp_path: Path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    run = tmp_path / "runs" / "victim"
    now = time.time()
    append(
        run / runfolder.LOGS_DIR / runfolder.TRAINING_LOG,
        [train_record(s, now - 10 + s, 1.0) for s in range(1, 6)],
    )
    runfolder.write_json_atomic(
        run / runfolder.RUN_JSON,
        {"status": "running", "started_at": now - 20, "pid": victim.pid, "hosts": [socket.gethostname()]},
    )
    server = make_server("127.0.0.1", 0, create_app(tmp_path / "runs"), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{server.server_port}/?interval=0.5")
        wait(browser, lambda d: text_of(d, "status") == "running")
        victim.kill()
        victim.wait()
        wait(
            browser, lambda d: text_of(d, "status") == "dead", timeout=5, message="the killed run is not dead"
        )
        assert f"pid {victim.pid}" in text_of(browser, "status_reason")
        save(browser, "dashboard-dead.png")
    finally:
        victim.kill()
        browser.get("about:blank")
        server.shutdown()


def test_runs_page_filters_and_opens_a_comparison(browser, served):
    browser.get(f"{served['url']}/runs?token={TOKEN}")
    browser.find_element(By.ID, "run-filter").send_keys("stalled")
    visible = [
        r.get_attribute("data-run")
        for r in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")
        if r.is_displayed()
    ]
    assert visible and all(name not in visible for name in (DEMO, "failed"))
    browser.find_element(By.ID, "run-filter").clear()
    browser.execute_script(
        "const f = document.getElementById('run-filter'); f.value = ''; f.dispatchEvent(new Event('input'));"
    )
    for name in (DEMO, "failed", "sweep/lr-1e-4"):
        browser.find_element(By.CSS_SELECTOR, f"input.pick[value='{name}']").click()
    assert "selected=" in browser.current_url
    browser.find_element(By.ID, "compare-selected").click()
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "1")
    wait(browser, lambda d: {DEMO, "failed", "sweep/lr-1e-4"} <= set(series_labels(d, "loss")))
    browser.set_window_size(390, 844)
    try:
        browser.get(f"{served['url']}/runs?token={TOKEN}")
        assert browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth;") <= 1
        save(browser, "runs-phone.png")
    finally:
        browser.set_window_size(1280, 2400)
