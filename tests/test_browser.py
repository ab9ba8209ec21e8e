"""The course in a real JupyterLab, driven by a real (headless) Chromium.

nbval runs the notebooks' code but no front end. This test starts JupyterLab from this
environment on a free loopback port with a token, opens notebook 01b, runs the calculator cell,
checks that the widget's controls render, moves one and checks that the output changes, then
opens another notebook and checks that a stored plot shows as an image. Screenshots go to
artifacts/browser/ (or $ZEROLAB_ARTIFACTS).

Needs Debian's chromium (/usr/bin/chromium) and the Python playwright package (no browser
download); .ci/run installs both. Skipped, with the reason, only where they cannot be had.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = Path(os.environ.get("ZEROLAB_NOTEBOOKS", ROOT / "notebooks"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WIDGET_NOTEBOOK = "01b_memory.ipynb"
PLOT_NOTEBOOK = "04_zero2.ipynb"
ARTIFACTS = Path(os.environ.get("ZEROLAB_ARTIFACTS", ROOT / "artifacts" / "browser"))
# Chromium flags for a closed network and no display (no sandbox: CI runs as root).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]

playwright = pytest.importorskip(
    "playwright.sync_api", reason="the Python playwright package is not installed "
    "(.ci/run installs it: pip install playwright)")
if not os.path.exists(CHROMIUM):
    pytest.skip("no Chromium at /usr/bin/chromium (.ci/run installs Debian's chromium)",
                allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a copy of the notebooks (running cells must not touch the repo's)."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copytree(NOTEBOOKS, work / "notebooks")
    port, token = free_port(), secrets.token_hex(16)
    # Render every cell (JupyterLab 4 renders only the cells in view by default).
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(work / "config"),
               JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
               JUPYTER_RUNTIME_DIR=str(work / "runtime"), PYTHONPATH=str(ROOT))
    log = open(work / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={work / 'notebooks'}", "--ServerApp.port_retries=0",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    json.load(r)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + (work / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()  # JupyterLab shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def open_notebook(browser, lab, name: str):
    base, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # reset: a fresh workspace, with only this notebook open (not the last test's tabs)
    page.goto(f"{base}/lab/tree/{name}?token={token}&reset")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-KernelStatus, "
                           ".jp-Toolbar-kernelStatus", state="attached", timeout=60_000)
    dismiss_popups(page)
    return page


def dismiss_popups(page) -> None:
    """Accept a dialog JupyterLab may open (e.g. kernel selection) so nothing covers the page."""
    news = page.locator(".jp-Notification-Toast button:has-text('No')")
    if news.count():  # "Would you like to get notified about official Jupyter news?"
        news.first.click()
    dialog = page.locator(".jp-Dialog")
    try:
        dialog.first.wait_for(timeout=3000)
    except playwright.TimeoutError:
        return
    dialog.locator(".jp-mod-accept").first.click()
    dialog.first.wait_for(state="detached", timeout=10_000)


def shot(target, name: str) -> None:
    """Screenshot of a page or of one element (a cell), kept as a test artifact."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    target.screenshot(path=str(ARTIFACTS / name))


def calculator_output_text(cell) -> str:
    return cell.locator(".jp-OutputArea-output").inner_text()


def run_cell(page, cell, attempts: int = 3) -> None:
    """Run one cell, and return once the kernel has taken it (its prompt changed to [*] or [n]).

    A keystroke can be lost: a dialog JupyterLab opens late, or a click that lands while the
    notebook is still laying out, takes the focus. So wait for an idle kernel, press Shift+Enter,
    and press again if the prompt did not change.
    """
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text()
    for _ in range(attempts):
        # The kernel imports torch and zerolab first: seconds on a quiet machine, minutes when
        # the suite's other worker runs ranks beside it.
        page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]',
                               state="attached", timeout=300_000)
        dismiss_popups(page)
        cell.scroll_into_view_if_needed()
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function("([el, before]) => el.innerText !== before",
                                   arg=[prompt.element_handle(), before], timeout=30_000)
            return
        except playwright.TimeoutError:
            continue
    shot(page, "run-cell-failed.png")
    raise AssertionError(f"the cell did not run after {attempts} tries (prompt still {before!r});"
                         f" see {ARTIFACTS / 'run-cell-failed.png'}")


def test_calculator_widget_renders_and_updates(browser, lab):
    page = open_notebook(browser, lab, WIDGET_NOTEBOOK)
    cell = page.locator(".jp-CodeCell", has_text="calculator(").last
    run_cell(page, cell)
    controls = cell.locator(".jupyter-widgets select, .jupyter-widgets input, "
                            ".jupyter-widgets .widget-slider")
    try:
        controls.first.wait_for(timeout=300_000)
    except playwright.TimeoutError:
        shot(page, "calculator-failed.png")
        raise
    page.wait_for_timeout(1000)
    shot(cell, "calculator-before.png")
    before = calculator_output_text(cell)
    assert "GB" in before, before[:500]

    selects = cell.locator(".jupyter-widgets select")
    assert selects.count() >= 2, "the calculator's dropdowns did not render"
    changed = False
    for i in range(selects.count()):  # move the first control whose choice changes the table
        select = selects.nth(i)
        options = select.locator("option").all_inner_texts()
        current = select.input_value()
        for option in options:
            if option != current:
                select.select_option(label=option)
                break
        page.wait_for_timeout(1500)
        if calculator_output_text(cell) != before:
            changed = True
            break
    shot(cell, "calculator-after.png")
    page.close()
    assert changed, "moving the calculator's controls did not change its output"


def test_a_plot_shows_as_an_image(browser, lab):
    page = open_notebook(browser, lab, PLOT_NOTEBOOK)
    image = page.locator(".jp-OutputArea-output img").first
    image.scroll_into_view_if_needed(timeout=60_000)
    image.wait_for(timeout=60_000)
    width = image.evaluate("img => img.naturalWidth")
    shot(page, "plot.png")  # the whole page: JupyterLab around the notebook
    page.close()
    assert width > 200, f"the plot image did not load (natural width {width})"
