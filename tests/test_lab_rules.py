"""The rules every generated lab keeps (DESIGN.md § Labs make the learner think; issue 31):

* every section of a lab that holds a TODO has a ladder of folded hints: a visible label
  ("**▶ Hint 1 — a question**", then 2, 3) right before each folded text cell, numbered from 1,
  at most three rungs — help that waits to be asked for;
* no hint holds a line of its lab's answer (a hint is a question, an idea or the shape of the
  code, never the code);
* every lab names the design decision the learner makes ("**Your design decision:**");
* every lab from 03 on asks for a prediction before a measurement (``dpcourse.checks.predict``),
  and its solution, executed, shows the prediction compared with what was measured;
* a TODO line names the piece to write in at most 80 characters, never its steps.

Each rule is tried on a small notebook that breaks it, so none of them can pass by accident.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from dpcourse.tools import authoring
from test_lesson_rules import _significant, solution_regions

ROOT = authoring.ROOT
LABS = sorted((ROOT / "labs").glob("lab[0-9][0-9]_*.ipynb"))
HINT = re.compile(r"^\*\*▶ Hint (\d) — ")
DECISION = "**Your design decision:**"
MAX_RUNGS = 3
TODO_LIMIT = 80


def _hidden(cell) -> bool:
    return bool(cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"))


def _has_todo(cell) -> bool:
    return cell.cell_type == "code" and "raise NotImplementedError" in cell.source


def _sections(nb) -> list[tuple[str, list]]:
    """The lab cut at its '## ' headings: (heading, cells) pairs, the part before the first
    heading included."""
    out = [("(top)", [])]
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("## "):
            out.append((cell.source.strip().splitlines()[0], []))
        out[-1][1].append(cell)
    return out


def ladder_problems(nb, name: str) -> list[str]:
    problems = []
    expected = 1
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        label = HINT.match(cell.source.lstrip())
        if label:
            k = int(label.group(1))
            if k != expected and k != 1:
                problems.append(f"{name} cell {i}: Hint {k} follows Hint {expected - 1}; number "
                                f"a ladder 1, 2, 3")
            if k > MAX_RUNGS:
                problems.append(f"{name} cell {i}: Hint {k}: a ladder has at most {MAX_RUNGS} "
                                f"rungs (a question, the idea, the shape of the code)")
            expected = k + 1
            after = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
            if after is None or after.cell_type != "markdown" or not _hidden(after):
                problems.append(f"{name} cell {i}: the label '{cell.source.strip()[:30]}' is not "
                                f"followed by a folded text cell (jupyter.source_hidden)")
        elif _hidden(cell):
            before = nb.cells[i - 1] if i else None
            if before is None or before.cell_type != "markdown" or "▶" not in before.source:
                problems.append(f"{name} cell {i}: a folded text cell without a visible '▶' "
                                f"label right before it")
    for heading, cells in _sections(nb):
        if any(_has_todo(c) for c in cells) and not any(
                c.cell_type == "markdown" and (m := HINT.match(c.source.lstrip()))
                and m.group(1) == "1" for c in cells):
            problems.append(f"{name}: the section {heading!r} holds a TODO but no hint ladder "
                            f"(a '**▶ Hint 1 — …**' label and its folded cell)")
    return problems


def hint_leaks(nb, regions: list[list[str]], name: str) -> list[str]:
    """Lines of the answer (12 significant characters or more) found inside a hint's text."""
    leaks = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown" or not _hidden(cell):
            continue
        text = re.sub(r"\s+", "", cell.source.replace("`", ""))
        for region in regions:
            for line in region:
                if line and line in text:
                    leaks.append(f"{name} cell {i}: a hint holds a line of the answer: {line[:60]!r}")
    return leaks


def _solution_for(lab: Path) -> Path:
    return ROOT / "solutions" / (lab.stem + ".py")


def _todo_lines(source: str) -> list[str]:
    return [m.group("hint") or "" for line in source.splitlines()
            if (m := authoring._BEGIN.match(line))]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_section_with_a_todo_has_a_folded_hint_ladder(lab):
    problems = ladder_problems(nbformat.read(lab, as_version=4), lab.name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_no_hint_holds_a_line_of_the_answer(lab):
    regions = solution_regions(_solution_for(lab).read_text())
    leaks = hint_leaks(nbformat.read(lab, as_version=4), regions, lab.name)
    assert not leaks, "\n".join(leaks)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_lab_names_its_design_decision(lab):
    nb = nbformat.read(lab, as_version=4)
    assert any(c.cell_type == "markdown" and DECISION in c.source for c in nb.cells), (
        f"{lab.name}: no part says '{DECISION} …' — which choice the lesson left to the learner")


@pytest.mark.parametrize("lab", [p for p in LABS if p.stem[3:5] >= "03"], ids=lambda p: p.stem)
def test_every_lab_from_03_asks_for_a_prediction_then_compares(lab):
    nb = nbformat.read(lab, as_version=4)
    assert any(c.cell_type == "code" and "predict(" in c.source for c in nb.cells), (
        f"{lab.name}: no cell asks for a prediction (dpcourse.checks.predict) before a "
        f"measurement")
    solved = nbformat.read(_solution_for(lab).with_suffix(".ipynb"), as_version=4)
    text = "".join(o.get("text", "") for c in solved.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "Prediction recorded —" in text and "Your prediction:" in text, (
        f"{lab.stem}: the executed solution does not show the prediction recorded and then "
        f"compared with the measurement (checks.reveal)")


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_todo_lines_name_the_piece_not_its_steps(lab):
    long = [t for t in _todo_lines(_solution_for(lab).read_text()) if len(t) > TODO_LIMIT]
    assert not long, (f"{lab.stem}: TODO lines over {TODO_LIMIT} characters read as recipes; "
                      f"name the piece, let the contract and the hints say the rest: {long}")


# --- the rules can fail ------------------------------------------------------------------------


def _md(text, hidden=False):
    cell = nbformat.v4.new_markdown_cell(text)
    if hidden:
        cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


def _lab(*cells):
    return nbformat.v4.new_notebook(cells=list(cells))


TODO = nbformat.v4.new_code_cell("# TODO: the piece\nraise NotImplementedError('TODO')")


def test_the_ladder_rules_can_fail():
    good = _lab(_md("## Part 1"), _md("**▶ Hint 1 — a question**"), _md("why?", True),
                _md("**▶ Hint 2 — the idea**"), _md("this.", True), TODO)
    assert ladder_problems(good, "x") == []
    no_ladder = _lab(_md("## Part 1"), TODO, _md("## Part 2"), _md("**▶ Hint 1 — q**"),
                     _md("?", True), TODO)
    assert any("'## Part 1' holds a TODO but no hint ladder" in p
               for p in ladder_problems(no_ladder, "x"))
    unfolded = _lab(_md("## P"), _md("**▶ Hint 1 — q**"), _md("shown"), TODO)
    assert any("not followed by a folded text cell" in p for p in ladder_problems(unfolded, "x"))
    unlabelled = _lab(_md("## P"), _md("**▶ Hint 1 — q**"), _md("?", True), _md("x", True), TODO)
    assert any("without a visible '▶' label" in p for p in ladder_problems(unlabelled, "x"))
    skipped = _lab(_md("## P"), _md("**▶ Hint 1 — q**"), _md("?", True),
                   _md("**▶ Hint 3 — s**"), _md("!", True), TODO)
    assert any("Hint 3 follows Hint 1" in p for p in ladder_problems(skipped, "x"))
    four = _lab(_md("## P"), *[c for k in range(1, 5) for c in
                               (_md(f"**▶ Hint {k} — r**"), _md("?", True))], TODO)
    assert any("at most 3 rungs" in p for p in ladder_problems(four, "x"))


def test_the_hint_leak_rule_can_fail():
    regions = solution_regions("### BEGIN SOLUTION\nfor p in model.parameters():\n"
                               "    dist.all_reduce(p.grad)\n### END SOLUTION\n")
    leaky = _lab(_md("**▶ Hint 3 — shape**"), _md("Write `dist.all_reduce( p.grad )` for each.",
                                                   True))
    assert hint_leaks(leaky, regions, "x")
    fine = _lab(_md("**▶ Hint 3 — shape**"), _md("One collective per parameter's gradient.", True))
    assert hint_leaks(fine, regions, "x") == []
    assert _significant("    dist.all_reduce(p.grad)  # sum") == "dist.all_reduce(p.grad)"
