"""Fixtures for the real-browser tests: a JupyterLab server on 127.0.0.1 over a throw-away copy
of the course, and headless Chromium driven by Playwright.

These tests run as their own command (README, "Browser tests"), not inside the main suite:

    python -m pytest tests/browser -p no:xdist

Why a copy: running a notebook in JupyterLab edits it (outputs, execution counts) and the
server may autosave — the stored notebooks must only ever be written by the build.
Why our own settings directory: a learner's own JupyterLab settings must not change what the
test sees, and two JupyterLab 4 defaults get in the way of a test: notebooks render only the
cells in view ("windowing"), and a news/update toast may cover the page.

Everything is bounded: the server must answer within 90 s, each wait in the tests has its own
limit, and the server, its kernels and the browser are killed whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dpcourse import launch
from helpers import ARTIFACTS, ROOT

# Chromium flags for a machine with no network but loopback: without the background-networking
# ones, Chromium keeps trying to reach its update and sync services (measured: refused connections,
# many at a time). --no-sandbox because CI runs as root, where Chromium's sandbox refuses to start.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]

LAB_SETTINGS = {
    # every cell in the DOM, so a test can find a widget far down the page
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def find_chromium() -> str | None:
    """DPCOURSE_CHROMIUM if set, else a Chromium or Chrome on PATH (Debian: apt-get install
    chromium). Playwright's own browser download is never used: it needs the internet."""
    explicit = os.environ.get("DPCOURSE_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _copy_course(dest: Path) -> None:
    def ignore(folder, names):
        return {n for n in names if n in {".git", ".venv", "__pycache__", "artifacts",
                                          ".ipynb_checkpoints", "build", ".whl"}}
    for part in ("lessons", "labs", "solutions"):
        shutil.copytree(ROOT / part, dest / part, ignore=ignore)
    for name in ("jupytext.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer within {limit:g} s:\n{log.read_text()[-3000:]}")


class LabServer:
    def __init__(self, root: Path, port: int, token: str, first_url: str):
        self.root, self.port, self.token = root, port, token
        self.first_url = first_url  # what `jupyter lab ... lessons/00_start_here.ipynb` opens

    def url(self, path: str) -> str:
        """A JupyterLab URL for ``path`` (relative to the course copy), in a fresh workspace so
        no earlier layout is restored."""
        return (f"http://127.0.0.1:{self.port}/lab/workspaces/test/tree/{path}"
                f"?reset&token={self.token}")


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """JupyterLab on 127.0.0.1, a free port and a random token, serving a copy of the course."""
    base = tmp_path_factory.mktemp("lab")
    course = base / "course"
    _copy_course(course)
    settings = base / "settings"
    for name, values in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ,
               JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
               JUPYTER_CONFIG_DIR=str(base / "config"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"),
               MPLBACKEND="module://matplotlib_inline.backend_inline")
    port, token = launch.free_port(), secrets.token_hex(16)
    log = base / "server.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}",
           # exactly README's start: the course as the root, lesson 00 as the page to open
           f"--notebook-dir={course}", "lessons/00_start_here.ipynb",
           # no extension catalogue look-ups (there is no network to look them up on)
           "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI runs as root; Jupyter refuses that without the flag
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=course, start_new_session=True)
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/api/status?token={token}", proc, log)
        opener = next((base / "runtime").glob("jpserver-file-to-run-*-open.html"))
        first = re.search(r'href="([^"]+)"', opener.read_text()).group(1)
        yield LabServer(course, port, token, first)
    finally:
        launch.kill_tree(proc.pid)  # the server and every kernel it started
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("playwright is not installed on CI: it is pinned in requirements.txt")
        pytest.skip("playwright is not installed: pip install -r requirements.txt")
    executable = find_chromium()
    if executable is None:
        if os.environ.get("CI"):  # CI installs Chromium (README's browser block): never skip there
            pytest.fail("no Chromium found on CI: README's browser block should have installed it")
        pytest.skip("no Chromium found: install Debian's chromium (apt-get install chromium) or "
                    "set DPCOURSE_CHROMIUM to a Chromium/Chrome binary")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, headless=True,
                                      args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, request):
    """A fresh page (1400×1000) whose console errors are kept; a screenshot of it is saved under
    tests/artifacts/ when the test ends, passed or failed."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        yield page
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-end.png"))
        except Exception:  # noqa: BLE001 — a failed screenshot must not hide the test's result
            pass
        context.close()
