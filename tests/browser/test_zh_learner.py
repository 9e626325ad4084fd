"""The Chinese edition (zh/) in a real JupyterLab and a real (headless) Chromium, as a learner on
it meets it: lesson 00 opened from zh/lessons and run from the Run menu, its kernel working in
zh/lessons, a link in its prose opening the Chinese lesson 01; and a Chinese lab run from zh/labs
to its first TODO, which stops with the English check message, then solved by typing the answer.

    python -m pytest tests/browser -p no:xdist

The server is the session's (conftest.py); its copy of the course is completed here the way the
classroom hub makes a learner's (``workshop_hub.copy_course``, whose parts include zh/).
Screenshots land in tests/artifacts/.
"""

from __future__ import annotations

import pytest

from dpcourse.tools.workshop_hub import copy_course
from helpers import (NOTEBOOK, assert_every_cell_ran, error_outputs, open_notebook, prompts,
                     run_all, save, saved_errors, wait_until_done)
from test_learner_path import _solution_source, shot

TAB = ".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel"


@pytest.fixture(scope="module")
def zh_server(lab_server):
    """The session's JupyterLab, with zh/ in its course copy (only missing files are copied)."""
    copy_course(lab_server.root)
    assert (lab_server.root / "zh" / "lessons" / "00_start_here.ipynb").is_file()
    return lab_server


def _type_and_run(page, cell, text: str, runs: int = 1) -> None:
    """Type ``text`` into ``cell`` as a learner would, then Shift+Enter ``runs`` times."""
    editor = cell.locator(".cm-content").first
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(text)
    before = prompts(page)
    for _ in range(runs):
        page.keyboard.press("Shift+Enter")
    wait_until_done(page, limit_s=90, before=before)


def test_the_chinese_lesson_00_runs_from_zh_lessons_without_an_error(zh_server, page):
    path = "zh/lessons/00_start_here.ipynb"
    open_notebook(page, zh_server, path)
    assert page.locator(TAB).first.inner_text() == "00_start_here.ipynb"
    heading = page.locator(f"{NOTEBOOK} .jp-MarkdownCell h1").first.inner_text()
    assert "从这里开始" in heading, heading
    crumbs = page.locator(".jp-BreadCrumbs").first.inner_text()
    assert "zh" in crumbs and "lessons" in crumbs, crumbs
    run_all(page, limit_s=180)
    assert_every_cell_ran(page)
    assert error_outputs(page) == []
    save(page)
    assert saved_errors(zh_server.root / path) == []
    shot(page, "zh-lesson00-ran")

    # The kernel works in the notebook's folder, zh/lessons: a cell the learner adds says so.
    page.locator(f"{NOTEBOOK} .jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below the last one
    _type_and_run(page, page.locator(f"{NOTEBOOK} .jp-CodeCell").last,
                  "import os; print('CWD', os.getcwd())")
    added = page.locator(f"{NOTEBOOK} .jp-CodeCell",  # (Shift+Enter added an empty cell below)
                         has=page.locator(".cm-content", has_text="print('CWD'")).first
    cwd = added.locator(".jp-OutputArea-output").first.inner_text().strip()
    assert cwd == f"CWD {(zh_server.root / 'zh' / 'lessons').resolve()}", cwd

    # A link in the Chinese prose opens the Chinese lesson 01 beside it.
    link = page.locator(f"{NOTEBOOK} .jp-MarkdownCell a", has_text="01 单设备").first
    link.scroll_into_view_if_needed()
    link.click()
    page.locator(TAB, has_text="01_single_device.ipynb").first.wait_for(timeout=60_000)
    page.locator(f"{NOTEBOOK} .jp-MarkdownCell h1", has_text="01 · 单设备").first.wait_for(
        timeout=60_000)
    shot(page, "zh-lesson01-from-a-link")


def test_a_chinese_lab_stops_at_its_todo_with_the_english_check_message(zh_server, page):
    lab = "lab03_ddp_first_principles"
    open_notebook(page, zh_server, f"zh/labs/{lab}.ipynb")
    heading = page.locator(f"{NOTEBOOK} .jp-MarkdownCell h1").first.inner_text()
    assert "实验 03" in heading, heading
    run_all(page, limit_s=120)

    # The run stops at part 1's check, whose last line names the TODO in English (lab checks
    # answer in English in both editions). (Unlike lab06's, whose TODO raises in the learner's
    # own cell, this traceback shows lab03's checking frames, in the English lab as here.)
    error = page.locator(f"{NOTEBOOK} .jp-OutputArea-output"
                         f"[data-mime-type='application/vnd.jupyter.stderr']").first
    error.scroll_into_view_if_needed()
    text = error.inner_text().strip()
    assert text.splitlines()[-1] == ("NotImplementedError: average_gradients still raises "
                                     "NotImplementedError: replace the TODO with your answer."), text
    assert len(error_outputs(page)) == 1
    shot(page, "zh-lab03-todo")

    # The English solution typed into the Chinese lab's cell passes the same check.
    cell = page.locator(f"{NOTEBOOK} .jp-CodeCell",
                        has=page.locator(".cm-content", has_text="def average_gradients(")).first
    _type_and_run(page, cell, _solution_source(lab, "def average_gradients("))
    output = cell.locator(".jp-OutputArea-output").first.inner_text().strip()
    assert output.startswith("✔ average_gradients on 2 and 3 ranks: every p.grad is the mean "
                             "over the ranks"), output
    save(page)
    assert saved_errors(zh_server.root / "zh" / "labs" / f"{lab}.ipynb") == []
    shot(page, "zh-lab03-solved")
