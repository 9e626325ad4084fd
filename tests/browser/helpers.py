"""What a learner does in JupyterLab, as Playwright steps: open a notebook, run everything
from the menu, wait for the kernel, read outputs. Every wait is bounded."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"  # git-ignored: screenshots for a person to look at
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"


def open_notebook(page, server, path: str, limit_ms: int = 90_000, url: str | None = None) -> None:
    page.goto(url or server.url(path), timeout=limit_ms)
    page.wait_for_selector(f"{NOTEBOOK} .jp-Cell", timeout=limit_ms)
    wait_for_kernel(page, server, path, limit_s=limit_ms / 1000)


def kernel_status(page) -> str:
    """The notebook toolbar's kernel indicator: 'idle', 'busy', 'starting', ... ('' if absent)."""
    return page.evaluate("""() => {
        const el = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) '
                                          + '.jp-Notebook-ExecutionIndicator');
        return el ? (el.getAttribute('data-status') || '') : '';
    }""")


def server_kernel_state(server, path: str) -> str:
    """The server's word on the notebook's kernel: 'idle', 'busy', 'starting', ... ('' when the
    notebook has no session yet). A server behind JupyterHub (tests/browser/test_hub.py) lists
    its sessions itself (``server.sessions()``): its API takes the learner's login, not a token."""
    if hasattr(server, "sessions"):
        sessions = server.sessions()
    else:
        url = f"http://127.0.0.1:{server.port}/api/sessions?token={server.token}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            sessions = json.load(reply)
    for session in sessions:
        if session.get("path") == path and session.get("kernel"):
            return session["kernel"].get("execution_state", "")
    return ""


def accept_kernel_dialog(page) -> None:
    """Click 'Select' if JupyterLab asks which kernel to start (what a learner does). It asks
    when the notebook opens before the server's list of kernels has arrived; the notebook's own
    kernel (Python 3) is the one already selected."""
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    if dialog.count():
        dialog.locator(".jp-Dialog-button.jp-mod-accept").first.click()


def wait_for_kernel(page, server, path: str, limit_s: float = 90) -> None:
    """Wait until the notebook's kernel has started and is idle, by the page *and* the server.
    The page alone is not enough: its indicator reads 'idle' before any kernel exists (measured:
    'idle' at 4.3 s, the session appeared at 5.8 s), and a Run All sent then runs one cell."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        accept_kernel_dialog(page)
        if server_kernel_state(server, path) == "idle" and kernel_status(page) == "idle":
            return
        time.sleep(0.25)
    raise TimeoutError(f"the kernel was not idle within {limit_s:g} s (page "
                       f"{kernel_status(page)!r}, server {server_kernel_state(server, path)!r})")


def prompts(page) -> list[str]:
    return page.eval_on_selector_all(f"{NOTEBOOK} .jp-CodeCell .jp-InputPrompt",
                                     "els => els.map(e => e.textContent.trim())")


def assert_every_cell_ran(page) -> None:
    """Every code cell shows an execution count: none is still queued ([*]) or was skipped
    ([ ]). A folded cell (the quiz, a reference answer) shows an empty prompt with its hidden
    source, so an empty prompt is not counted; the numbered ones must run in order."""
    numbers = prompts(page)
    shown = [p for p in numbers if p]
    assert shown and all(re.fullmatch(r"\[\d+\]:", p) for p in shown), numbers
    counts = [int(p[1:-2]) for p in shown]
    assert counts == sorted(set(counts)), numbers


def run_menu(page, item: str) -> None:
    """Click Run > ``item`` in the menu bar, as a learner would."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def wait_until_done(page, limit_s: float, before: list[str] | None = None) -> None:
    """Wait until no cell is queued or running ([*]) and the kernel is idle, twice in a row
    half a second apart (a cell can start right after the previous one ends).

    ``before``: the prompts before the run was asked for. Then the run must be seen to start
    (a cell busy, or the prompts changed) within 30 s; a run that never started is named as
    such, instead of failing later on a missing output."""
    deadline = time.monotonic() + limit_s
    start_deadline = time.monotonic() + min(30.0, limit_s)
    calm, started = 0, before is None
    time.sleep(1.0)  # let the run start
    while time.monotonic() < deadline:
        now = prompts(page)
        busy = any("*" in p for p in now) or kernel_status(page) != "idle"
        started = started or busy or now != before
        calm = 0 if busy else calm + 1
        if calm >= 2 and started:
            return
        if not started and time.monotonic() > start_deadline:
            raise TimeoutError("the run did not start: no cell ran within 30 s")
        time.sleep(0.5)
    raise TimeoutError(f"the notebook was still running after {limit_s:g} s")


def run_all(page, limit_s: float) -> None:
    before = prompts(page)
    run_menu(page, "Run All Cells")
    wait_until_done(page, limit_s, before=before)


def error_outputs(page) -> list[str]:
    """The text of every error (traceback) output on the page."""
    return page.eval_on_selector_all(
        f"{NOTEBOOK} .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
        "els => els.map(e => e.innerText)")


def save(page) -> None:
    page.keyboard.press("Control+s")
    time.sleep(1.0)


def saved_errors(path: Path) -> list[dict]:
    """Error outputs in the notebook file as saved by JupyterLab."""
    nb = json.loads(path.read_text())
    return [out for cell in nb["cells"] if cell["cell_type"] == "code"
            for out in cell.get("outputs", []) if out["output_type"] == "error"]
