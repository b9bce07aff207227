"""Fixtures for the browser tests: headless Chromium driven by Playwright, one JupyterLab server.

The browser is the system's Chromium (Debian's `chromium` package, /usr/bin/chromium; set
COURSE_LIB_CHROMIUM to use another), launched by Playwright's Python package: `playwright install`
downloads browsers, which this project's machines cannot do. Without Chromium or Playwright the
tests skip with the reason, except under CI (CI=true), where a missing browser is a failure:
`.ci/run` installs it.

JupyterLab runs once per test session on a free loopback port, without a token, in a temporary
copy of the notebooks, with its own settings (no kernel-choice dialog, no news, every cell in the
page), so the tests see what a learner sees without touching the repository or the user's setup.

On failure a screenshot of the page goes to build/browser-artifacts/<test>.png (git-ignored); the
steppers' screenshots go there too.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "build" / "browser-artifacts"
# --disable-dev-shm-usage: the browser's shared memory goes to /tmp, not /dev/shm, whose use the grading battery
# (test_grade_isolation.py) measures while the other worker may be running these tests.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
# What the session writes into JupyterLab's user settings.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
        # every cell in the page (the default leaves cells out of view out of the DOM), and start the
        # notebook's own kernel without asking which one
        {"windowingMode": "none", "autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"checkForUpdates": False, "fetchNews": "false"},
}


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} Under CI the browser tests must run: .ci/run installs Chromium "
                    "(apt-get install chromium) and requirements/test.txt installs Playwright.", pytrace=False)
    pytest.skip(reason)


def chromium_path() -> str | None:
    for candidate in (os.environ.get("COURSE_LIB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright is not installed (pip install -r requirements/test.txt).")
    executable = chromium_path()
    if executable is None:
        _missing("No Chromium found (/usr/bin/chromium; on Debian/Ubuntu: apt-get install chromium).")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def artifacts():
    """build/browser-artifacts/: screenshots of failures, and of the steppers."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture
def page(browser, request):
    """A fresh page (1280 x 900 CSS pixels at device pixel ratio 2, like a laptop's high-density screen);
    a screenshot is saved if the test fails."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=2)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.errors = errors
    yield page
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{request.node.name.replace('/', '_')}.png"
        try:
            page.screenshot(path=str(path), full_page=False)
            print(f"screenshot of the failed page: {path}")
        except Exception as exc:  # noqa: BLE001 - a failed screenshot must not hide the failure
            print(f"no screenshot: {exc}")
    context.close()


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory):
    """A JupyterLab server on a free port with a copy of notebooks/ (and assignments/ if there is one).

    Yields (base URL, root folder of the copy).
    """
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (pip install -r requirements/test.txt)")
    home = tmp_path_factory.mktemp("jupyterlab")
    root = home / "root"
    for folder in ("notebooks", "assignments"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name, values in LAB_SETTINGS.items():
        path = home / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--IdentityProvider.token=",
               "--ServerApp.password=", f"--ServerApp.root_dir={root}", "--LabApp.extension_manager=readonly",
               # window.jupyterapp, so the tests can run JupyterLab's own commands (Run All Cells, Save)
               "--LabApp.expose_app_in_browser=True"]
    log = open(home / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (home / "server.log").read_text()[-3000:])
                time.sleep(0.3)
        yield url, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="session")
def static_server():
    """serve(folder) -> base URL of a loopback HTTP server for that folder (for the built book)."""
    servers = []

    def serve(folder) -> str:
        handler = functools.partial(QuietHandler, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
