"""The learner's path through the course in a real JupyterLab and a real (headless) Chromium:
open a lesson and run it from the Run menu, use lesson 06's stepper and cost-model explorer,
and meet a lab's TODO, then solve it by typing the solution into the page.

    python -m pytest tests/browser -p no:xdist

Screenshots land in tests/artifacts/ (git-ignored). The fixtures (conftest.py) skip these tests
with the reason when Playwright or Chromium is missing.
"""

from __future__ import annotations

import json
import time

from helpers import (ARTIFACTS, NOTEBOOK, ROOT, assert_every_cell_ran, error_outputs,
                     open_notebook, prompts, run_all, save, saved_errors, wait_until_done)


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def test_readme_start_opens_lesson_00_which_runs_from_the_menu_without_an_error(lab_server,
                                                                                  page):
    # README's `jupyter lab --notebook-dir=. lessons/00_start_here.ipynb` opens this page:
    # lesson 00 in front, the file browser at the course's root.
    path = "lessons/00_start_here.ipynb"
    assert "/lab/tree/lessons/00_start_here.ipynb" in lab_server.first_url
    open_notebook(page, lab_server, path, url=lab_server.first_url)
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel").first
    assert tab.inner_text() == "00_start_here.ipynb"
    # the file browser shows lesson 00's folder, and the course is its root: labs are one up
    crumbs = page.locator(".jp-BreadCrumbs").first.inner_text()
    assert "lessons" in crumbs, crumbs
    page.locator(".jp-BreadCrumbs-home").first.click()
    page.locator(".jp-DirListing-itemText", has_text="labs").first.wait_for(timeout=15_000)
    listing = {t.strip() for t in page.locator(".jp-DirListing-itemText").all_inner_texts()}
    assert {"lessons", "labs", "solutions"} <= listing, listing
    shot(page, "lesson00-opened")
    run_all(page, limit_s=180)
    assert_every_cell_ran(page)
    save(page)
    assert saved_errors(lab_server.root / path) == []
    shot(page, "lesson00-ran")


def _image_src(locator) -> str:
    return locator.locator("img").first.get_attribute("src") or ""


def _wait_for_change(read, before, limit_s: float = 15):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = read()
        if now != before:
            return now
        time.sleep(0.2)
    return read()


def test_lesson_06_stepper_and_cost_model_explorer_respond(lab_server, page):
    open_notebook(page, lab_server, "lessons/06_ring_allreduce.ipynb")
    run_all(page, limit_s=240)
    assert_every_cell_ran(page)  # and none failed: the widgets below are this run's
    assert error_outputs(page) == []

    stepper = page.locator(f"{NOTEBOOK} .dpcourse-stepper").first
    stepper.scroll_into_view_if_needed()
    counter = stepper.locator(".dpcourse-step-counter").first
    before_text, before_img = counter.inner_text(), _image_src(stepper)
    assert before_text.startswith("start (0 /"), before_text
    stepper.get_by_role("button", name="next").click()
    after_text = _wait_for_change(counter.inner_text, before_text)
    assert after_text.startswith("step 1 /"), after_text
    assert _wait_for_change(lambda: _image_src(stepper), before_img) != before_img
    shot(page, "lesson06-stepper-after-next")

    explorer = page.locator(f"{NOTEBOOK} .dpcourse-explorer").first
    explorer.scroll_into_view_if_needed()
    before_img = _image_src(explorer)
    handle = explorer.locator(".widget-slider .noUi-handle").first
    handle.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    assert _wait_for_change(lambda: _image_src(explorer), before_img) != before_img
    shot(page, "lesson06-explorer-after-slider")


def test_a_lessons_py_source_opens_as_a_notebook_with_jupytext(lab_server, page):
    # what an instructor does to edit a lesson: right-click the .py, Open With > Jupytext Notebook
    page.goto(lab_server.url("lessons"))
    page.locator(".jp-DirListing-item", has_text="00_start_here.py").first.click(button="right")
    page.locator(".lm-Menu-itemLabel", has_text="Open With").first.hover()
    page.locator(".lm-Menu-itemLabel", has_text="Jupytext Notebook").first.click()
    page.wait_for_selector(f"{NOTEBOOK} .jp-MarkdownCell", timeout=30_000)
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel").first
    assert tab.inner_text() == "00_start_here.py"
    heading = page.locator(f"{NOTEBOOK} .jp-MarkdownCell h1").first.inner_text()
    assert "Start here" in heading, heading
    shot(page, "lesson00-py-as-notebook")


def _solution_source(lab: str, starts_with: str) -> str:
    nb = json.loads((ROOT / "solutions" / f"{lab}.ipynb").read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith(starts_with):
            return source
    raise LookupError(f"no solution cell starts with {starts_with!r}")


def test_a_lab_stops_at_its_todo_in_one_line_then_passes_once_solved(lab_server, page):
    lab = "lab06_ring_allreduce"
    open_notebook(page, lab_server, f"labs/{lab}.ipynb")
    run_all(page, limit_s=120)

    # The run stops at the first check: its error names the TODO in one line, and no frame of
    # the course's checking code stands between the learner's cell and their own function.
    error = page.locator(f"{NOTEBOOK} .jp-OutputArea-output"
                         f"[data-mime-type='application/vnd.jupyter.stderr']").first
    error.scroll_into_view_if_needed()
    text = error.inner_text().strip()
    last = text.splitlines()[-1]
    assert last.startswith("NotImplementedError: TODO"), last
    assert "dpcourse/checks" not in text, text
    shot(page, "lab06-todo")

    # Type the solution into the TODO cell, as a learner would, and run it and its check.
    cell = page.locator(f"{NOTEBOOK} .jp-CodeCell",
                        has=page.locator(".cm-content", has_text="def scatter_reduce(")).first
    editor = cell.locator(".cm-content").first
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(_solution_source(lab, "def scatter_reduce("))
    before = prompts(page)
    page.keyboard.press("Shift+Enter")  # run the answer, move to its check cell
    page.keyboard.press("Shift+Enter")  # run the check
    wait_until_done(page, limit_s=60, before=before)
    check = cell.locator("xpath=following-sibling::div[contains(@class,'jp-CodeCell')][1]")
    check.scroll_into_view_if_needed()
    output = check.locator(".jp-OutputArea-output").first.inner_text()
    assert output.strip().startswith("✔"), output
    shot(page, "lab06-solved")
