"""The rules every generated lab keeps (DESIGN.md § Labs make the learner think; issue 31):

* every section of a lab that holds a TODO has a ladder of folded hints, each one markdown cell
  that is a ``<details>`` block labelled "▶ Hint 1 — a question" (then 2, 3), numbered from 1,
  at most three rungs — help that waits to be asked for, folded in every viewer (GitHub's static
  view ignores the ``source_hidden`` flag, so no hint is folded by the flag alone);
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
HINT = re.compile(r"^▶ Hint (\d) — ")
OLD_LABEL = re.compile(r"^\*\*▶ Hint")  # the old form: a bold label cell, then a flag-folded cell
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


def _hint(cell) -> str | None:
    """The label of a hint ("▶ Hint 1 — a question"): a markdown cell that is one ``<details>``
    block whose summary starts with "▶ Hint", folded in every viewer; None for any other cell."""
    label = authoring.details_label(cell)
    return label if label is not None and label.startswith("▶ Hint") else None


def ladder_problems(nb, name: str) -> list[str]:
    problems = []
    expected = 1
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        label = _hint(cell)
        if _hidden(cell) and label is None:
            problems.append(f"{name} cell {i}: a text cell folded by the source_hidden flag "
                            f"alone shows open on GitHub; make the hint one <details> block "
                            f"with its '▶ Hint k — …' label as the summary")
        if label is None:
            if OLD_LABEL.match(cell.source.lstrip()):
                problems.append(f"{name} cell {i}: the label '{cell.source.strip()[:30]}' "
                                f"stands outside its hint; put it in the <details> block's "
                                f"summary, with the hint's text inside")
            continue
        numbered = HINT.match(label)
        if not numbered:
            continue  # a lone hint ("▶ Hint — a question"), not a ladder's rung
        k = int(numbered.group(1))
        if k != expected and k != 1:
            problems.append(f"{name} cell {i}: Hint {k} follows Hint {expected - 1}; number "
                            f"a ladder 1, 2, 3")
        if k > MAX_RUNGS:
            problems.append(f"{name} cell {i}: Hint {k}: a ladder has at most {MAX_RUNGS} "
                            f"rungs (a question, the idea, the shape of the code)")
        if not authoring._DETAILS.match(cell.source).group(2).strip():
            problems.append(f"{name} cell {i}: '{label}' folds no text")
        expected = k + 1
    for heading, cells in _sections(nb):
        if any(_has_todo(c) for c in cells) and not any(
                (m := HINT.match(_hint(c) or "")) and m.group(1) == "1" for c in cells):
            problems.append(f"{name}: the section {heading!r} holds a TODO but no hint ladder "
                            f"(a <details> block summarised '▶ Hint 1 — …')")
    return problems


def hint_leaks(nb, regions: list[list[str]], name: str) -> list[str]:
    """Lines of the answer (12 significant characters or more) found inside a hint's text."""
    leaks = []
    for i, cell in enumerate(nb.cells):
        if _hint(cell) is None:
            continue
        text = re.sub(r"\s+", "", authoring._DETAILS.match(cell.source).group(2).replace("`", ""))
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


def _h(label, text="why?"):
    return _md(f"<details><summary>{label}</summary>\n\n{text}\n\n</details>")


def test_the_ladder_rules_can_fail():
    good = _lab(_md("## Part 1"), _h("▶ Hint 1 — a question"), _h("▶ Hint 2 — the idea", "this."),
                TODO, _h("▶ Hint — a question", "a lone hint before a prediction"))
    assert ladder_problems(good, "x") == []
    no_ladder = _lab(_md("## Part 1"), TODO, _md("## Part 2"), _h("▶ Hint 1 — q"), TODO)
    assert any("'## Part 1' holds a TODO but no hint ladder" in p
               for p in ladder_problems(no_ladder, "x"))
    old_form = _lab(_md("## P"), _md("**▶ Hint 1 — q**"), _md("why?", True), TODO)
    found = ladder_problems(old_form, "x")
    assert any("stands outside its hint" in p for p in found)
    assert any("folded by the source_hidden flag alone" in p for p in found)
    assert any("holds a TODO but no hint ladder" in p for p in found)
    empty = _lab(_md("## P"), _h("▶ Hint 1 — q", ""), TODO)
    assert any("folds no text" in p for p in ladder_problems(empty, "x"))
    skipped = _lab(_md("## P"), _h("▶ Hint 1 — q"), _h("▶ Hint 3 — s", "!"), TODO)
    assert any("Hint 3 follows Hint 1" in p for p in ladder_problems(skipped, "x"))
    four = _lab(_md("## P"), *[_h(f"▶ Hint {k} — r") for k in range(1, 5)], TODO)
    assert any("at most 3 rungs" in p for p in ladder_problems(four, "x"))


def test_the_hint_leak_rule_can_fail():
    regions = solution_regions("### BEGIN SOLUTION\nfor p in model.parameters():\n"
                               "    dist.all_reduce(p.grad)\n### END SOLUTION\n")
    leaky = _lab(_h("▶ Hint 3 — shape", "Write `dist.all_reduce( p.grad )` for each."))
    assert hint_leaks(leaky, regions, "x")
    fine = _lab(_h("▶ Hint 3 — shape", "One collective per parameter's gradient."))
    assert hint_leaks(fine, regions, "x") == []
    assert _significant("    dist.all_reduce(p.grad)  # sum") == "dist.all_reduce(p.grad)"
