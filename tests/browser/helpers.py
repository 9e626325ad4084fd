"""What a learner does in JupyterLab, as Playwright steps: open a notebook, run everything
from the menu, wait for the kernel, read outputs. Every wait is bounded."""

from __future__ import annotations

import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"  # git-ignored: screenshots for a person to look at
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"


def open_notebook(page, server, path: str, limit_ms: int = 90_000, url: str | None = None) -> None:
    page.goto(url or server.url(path), timeout=limit_ms)
    page.wait_for_selector(f"{NOTEBOOK} .jp-Cell", timeout=limit_ms)
    wait_for_kernel(page, limit_s=limit_ms / 1000)


def kernel_status(page) -> str:
    """The notebook toolbar's kernel indicator: 'idle', 'busy', 'starting', ... ('' if absent)."""
    return page.evaluate("""() => {
        const el = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) '
                                          + '.jp-Notebook-ExecutionIndicator');
        return el ? (el.getAttribute('data-status') || '') : '';
    }""")


def wait_for_kernel(page, limit_s: float = 90) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if kernel_status(page) == "idle":
            return
        time.sleep(0.25)
    raise TimeoutError(f"the kernel was not idle within {limit_s:g} s "
                       f"(status {kernel_status(page)!r})")


def prompts(page) -> list[str]:
    return page.eval_on_selector_all(f"{NOTEBOOK} .jp-CodeCell .jp-InputPrompt",
                                     "els => els.map(e => e.textContent.trim())")


def run_menu(page, item: str) -> None:
    """Click Run > ``item`` in the menu bar, as a learner would."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def wait_until_done(page, limit_s: float) -> None:
    """Wait until no cell is queued or running ([*]) and the kernel is idle, twice in a row
    half a second apart (a cell can start right after the previous one ends)."""
    deadline = time.monotonic() + limit_s
    calm = 0
    time.sleep(1.0)  # let the run start
    while time.monotonic() < deadline:
        busy = any("*" in p for p in prompts(page)) or kernel_status(page) != "idle"
        calm = 0 if busy else calm + 1
        if calm >= 2:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the notebook was still running after {limit_s:g} s")


def run_all(page, limit_s: float) -> None:
    run_menu(page, "Run All Cells")
    wait_until_done(page, limit_s)


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
