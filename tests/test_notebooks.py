"""The course's promises about what a learner reads, checked on the executed notebooks.

* Every claim goes through ``dpcourse.checks.claim`` (printed as ``✔ statement``): no stored
  output prints a bare True/False, and no claim is made of a literal.
* Every figure is a PNG with a one-line caption, and lessons 01–06 have at least 15 of them.
* Every lesson opens with its frame (prerequisites, objectives, time, lab) and ends with a
  summary and check-yourself questions.
* No lab's answer readable in a lesson: see tests/test_lesson_rules.py.
"""

from __future__ import annotations

import ast
import re

import nbformat
import pytest

from dpcourse import quizzes
from dpcourse.tools import authoring

ROOT = authoring.ROOT
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
EXECUTED = LESSONS + SOLUTIONS
# A printed boolean: True/False as a value, not as code in a sentence ("find_unused_parameters=True").
BOOLEAN = re.compile(r"(?<![=\w.])(True|False)\b")
CAPTION = "*Figure — "


def _outputs(nb):
    """(cell index, output) for every stored output of every code cell."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                yield i, out


def _text(out) -> str:
    if out.get("output_type") == "stream":
        return out.get("text", "")
    data = out.get("data", {})
    if "application/vnd.jupyter.widget-view+json" in data or "image/png" in data:
        return ""
    if 'class="highlight' in str(data.get("text/html", "")):
        return ""  # source code shown with viz.show_code: code, not a claim
    if "text/markdown" in data:
        return data["text/markdown"]
    return data.get("text/plain", "")


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_no_bare_booleans_and_no_failed_claims(path):
    """A printed True/False is a claim nobody asserted: print it through ``claim`` instead."""
    nb = nbformat.read(path, as_version=4)
    bad = []
    for i, out in _outputs(nb):
        if out.get("output_type") == "error":
            bad.append(f"cell {i}: stored error {out.get('ename')}")
        for line in _text(out).splitlines():
            if line.lstrip().startswith("✔"):
                continue  # a claim, proven by claim() or a lab check
            if BOOLEAN.search(line) or line.lstrip().startswith("✘"):
                bad.append(f"cell {i}: {line.strip()[:120]}")
    assert not bad, f"{path.name} prints booleans or failed claims:\n" + "\n".join(bad)


def _claim_calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name == "claim":
                yield node


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_claims_are_computed_not_literal(path):
    """``claim("...", True)`` proves nothing: the condition must be computed."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse("\n".join(l for l in cell.source.splitlines()
                                       if not l.lstrip().startswith(("%", "!"))))
        except SyntaxError:
            continue
        for call in _claim_calls(tree):
            assert len(call.args) >= 2, f"{path.name} cell {i}: claim() needs a condition"
            assert not isinstance(call.args[1], ast.Constant), \
                f"{path.name} cell {i}: claim() of a literal proves nothing"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_figure_has_a_caption(path):
    """Each PNG is followed, in the same cell, by its caption (``viz.show(fig, caption)``)."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outs = cell.get("outputs", [])
        for k, out in enumerate(outs):
            if "image/png" in out.get("data", {}):
                rest = [_text(o) for o in outs[k + 1:]]
                nxt = next((t for t in rest if t.strip()), "")
                assert nxt.startswith(CAPTION), \
                    f"{path.name} cell {i}: a figure without a caption (use viz.show(fig, caption))"


def test_lessons_have_at_least_fifteen_figures():
    count = sum("image/png" in out.get("data", {})
                for path in LESSONS if not path.stem.startswith("00")
                for _, out in _outputs(nbformat.read(path, as_version=4)))
    assert count >= 15, f"lessons 01-06 show {count} figures"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_has_its_frame(path):
    """Header: prerequisites, objectives, time, lab. End: a summary and check-yourself questions."""
    nb = nbformat.read(path, as_version=4)
    head = nb.cells[0].source.lower()
    for word in ("prerequisites", "you will be able to", "time", "lab"):
        assert word in head, f"{path.name}: the first cell does not state its {word!r}"
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert any(re.search(r"^#+ .*summary", m, re.I | re.M) for m in markdown), \
        f"{path.name}: no Summary section"
    quiz = [c for c in nb.cells if c.cell_type == "code" and "quiz(" in c.source]
    assert quiz, f"{path.name}: no check-yourself questions (viz.quiz)"
    n_questions = len(quizzes.questions(path.stem))
    assert 3 <= n_questions <= 6, f"{path.name}: {n_questions} check-yourself questions"
    assert all(f'quizzes.questions("{path.stem[:2]}")' in c.source for c in quiz), (
        f"{path.name}: the quiz cell must show dpcourse.quizzes' questions, not its own")
    in_sight = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                and re.search(r"""["']answer["']\s*:""", c.source)]
    assert not in_sight, (f"{path.name}: cell(s) {in_sight} hold a quiz's answers in their code, "
                          f"which GitHub's view shows even when the cell is folded; keep the "
                          f"questions in dpcourse/quizzes/l{path.stem[:2]}.py")
