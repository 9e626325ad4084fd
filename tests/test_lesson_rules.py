"""The rules ARCHITECTURE.md § Design rules sets for every lesson, checked on the executed
notebooks.

* **Labs make the learner think.** No new line of a lab's answer (a ``### BEGIN SOLUTION`` region of
  ``solutions/labNN_*.py``) is readable without a click in its own lesson or any earlier one: the
  unfolded cell sources and the unfolded outputs (``viz.show_code`` included) are searched. A
  folded cell (``metadata.jupyter.source_hidden``) has a visible one-line label right before it.
  And in every viewer: GitHub's static view ignores the fold flags, so no lab answer is in any
  cell's source or any output's plain text, and in HTML only inside ``<details>``
  (``viz.show_code(..., folded="▶ label")``). A folded text cell (a hint, a reference answer's
  prose) is folded in its markdown, as one ``<details><summary>▶ label</summary>`` …
  ``</details>`` block, never by the ``source_hidden`` flag alone, which GitHub ignores; and a
  cell's outputs hidden by ``outputs_hidden`` are ``<details>`` blocks too
  (``viz.folded_output``, ``viz.show(..., folded=)``), whatever they hold.
* **Sources.** Every lesson ends with a ``## Sources`` list naming, for each statement about a
  framework's internals, the installed file it was checked in; every file named exists in the
  installed torch / tensorflow / keras.
* **Honest times.** The header's "about N minutes" is not below the estimate from the lesson's
  prose, displayed code and stored run time (``dpcourse.tools.authoring.estimate_time``).
"""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from dpcourse.tools import authoring

ROOT = authoring.ROOT
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
SOLUTION_SOURCES = sorted((ROOT / "solutions").glob("lab[0-9][0-9]_*.py"))
LABEL = "▶"


# --------------------------------------------------------------------------------------------
# Lab answers
# --------------------------------------------------------------------------------------------


def _significant(line: str) -> str:
    """A code line as compared: comments dropped, all whitespace removed."""
    if not line.lstrip().startswith(("'", '"')):
        line = line.split("#", 1)[0]
    return re.sub(r"\s+", "", line)


def significant_lines(texts) -> set[str]:
    """Every line of ``texts`` as compared; a unified diff's ``+``/``-`` line also without its
    marker (a diff of a lab's answer shows its lines, each behind one character)."""
    lines = set()
    for line in (line for text in texts for line in text.splitlines()):
        lines.add(_significant(line))
        if line[:1] in "+-" and not line.startswith(("+++", "---")):
            lines.add(_significant(line[1:]))
    return lines


def solution_regions(source: str) -> list[list[str]]:
    """Each BEGIN/END SOLUTION region's significant lines (12 characters or more)."""
    regions, current = [], None
    for line in source.splitlines():
        if line.strip().startswith("### BEGIN SOLUTION"):
            current = []
        elif line.strip().startswith("### END SOLUTION"):
            if current:
                regions.append(current)
            current = None
        elif current is not None:
            text = _significant(line)
            if len(text) >= 12:
                current.append(text)
    return regions


def readable_lines(nb) -> set[str]:
    """Every significant line a learner reads without opening a folded cell."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            texts.append(cell.source)  # markdown code blocks are readable too
            continue
        if not authoring.folded(cell, "source_hidden"):
            texts.append(cell.source)
        if authoring.folded(cell, "outputs_hidden"):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out.get("text", ""))
            for key, value in out.get("data", {}).items():
                if key.startswith("text/"):
                    value = "".join(value) if isinstance(value, list) else value
                    if key == "text/html":
                        value = html.unescape(re.sub(r"<[^>]+>", "", value))
                    texts.append(value)
    return significant_lines(texts)


DETAILS = re.compile(r"<details\b.*?</details>", re.S | re.I)


def readable_lines_in_every_viewer(nb) -> set[str]:
    """Every significant line a learner reads without a click in SOME viewer the course sends
    them to. GitHub's static view (and the classic Notebook) ignore ``metadata.jupyter``'s fold
    flags: they show every cell's source, every stream and ``text/plain`` (or ``text/markdown``)
    output, and every HTML output, where only a ``<details>`` block waits for a click
    (``viz.show_code(..., folded=...)`` puts a lab's answer in one and leaves its ``text/plain``
    without code)."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            texts.append(DETAILS.sub("", cell.source))  # a <details> block waits for a click
            continue
        texts.append(cell.source)
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out.get("text", ""))
            if out.get("output_type") == "error":
                texts.extend(out.get("traceback", []))
            for key, value in out.get("data", {}).items():
                if key.startswith("text/"):
                    value = "".join(value) if isinstance(value, list) else value
                    if key == "text/html":
                        value = html.unescape(re.sub(r"<[^>]+>", "", DETAILS.sub("", value)))
                    texts.append(value)
    return significant_lines(texts)


def find_leaks(lessons: list[Path], solutions: list[Path], read=readable_lines) -> list[str]:
    """'labNN region k: m/n lines readable in LESSON' for each region half (or more) readable in
    its own lesson or an earlier one (``read``: what a viewer shows without a click). Lines of an
    earlier lab's answer (a training loop the learner wrote in lab01, met again in lab03) are not
    counted: they are not new to the lab."""
    readable = {p.stem[:2]: read(nbformat.read(p, as_version=4)) for p in lessons}
    names = {p.stem[:2]: p.name for p in lessons}
    leaks = []
    earlier: set[str] = set()  # lines of earlier labs' answers: the learner wrote them already
    for sol in sorted(solutions, key=lambda p: p.stem):
        number = sol.stem[3:5]
        regions = solution_regions(sol.read_text())
        for k, whole in enumerate(regions):
            region = [line for line in whole if line not in earlier]
            for lesson, seen in readable.items():
                if lesson > number:
                    continue
                shown = [line for line in region if line in seen]
                if shown and len(shown) * 2 >= len(region):
                    leaks.append(f"lab{number} region {k}: {len(shown)}/{len(region)} lines "
                                 f"readable in {names[lesson]}, e.g. {shown[0][:60]!r}")
        earlier.update(line for region in regions for line in region)
    return leaks


def test_no_lab_answer_readable_without_a_click():
    leaks = find_leaks(LESSONS, SOLUTION_SOURCES)
    assert not leaks, ("a lab's answer is readable in a lesson: fold the cell after the lab "
                       "pointer (ARCHITECTURE.md § Design rules)\n" + "\n".join(leaks))


def test_no_lab_answer_readable_in_any_viewer():
    """GitHub's static view, which the README sends learners to, shows a folded cell's source
    and its stored outputs: a lab's answer is kept out of the lesson's cell sources and out of
    every output's plain text, and its HTML keeps it inside ``<details>``."""
    leaks = find_leaks(LESSONS, SOLUTION_SOURCES, read=readable_lines_in_every_viewer)
    assert not leaks, ("a lab's answer is readable in a lesson where the fold metadata is "
                       "ignored (GitHub's static view): show it with viz.show_code(..., "
                       "folded='▶ label') and keep it out of cell sources\n" + "\n".join(leaks))


def test_the_every_viewer_finder_ignores_the_fold_flags(tmp_path):
    """The test above can fail: an answer in a folded cell's source, or in its stored plain-text
    output, or in HTML outside ``<details>``, is found; the same answer shown by
    ``viz.show_code(..., folded=...)`` (HTML inside ``<details>``, plain text without code) is
    not."""
    from dpcourse import viz

    sol = tmp_path / "lab03_x.py"
    sol.write_text("# %%\n### BEGIN SOLUTION\nfor p in model.parameters():\n"
                   "    dist.all_reduce(p.grad)   # sum\n    p.grad /= world_size\n"
                   "### END SOLUTION\n")
    code = "for p in model.parameters():\n    dist.all_reduce(p.grad)\n"
    code_html = "<pre>" + html.escape(code) + "</pre>"

    def lesson(name, source="viz.show_code(answer)", data=None):
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
        if data:
            cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
        path = tmp_path / f"{name}.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
        return path

    def leaks(path):
        return find_leaks([path], [sol], read=readable_lines_in_every_viewer)

    in_source = lesson("03_a", source=code)
    in_plain = lesson("03_b", data={"text/plain": code, "text/html": "<details>x</details>"})
    in_html = lesson("03_c", data={"text/plain": "folded", "text/html": code_html})
    folded = lesson("03_d", data=viz.folded_code_bundle(code_html, "▶ the answer"))
    for path in (in_source, in_plain, in_html):
        assert leaks(path) and not find_leaks([path], [sol]), path.name
    assert not leaks(folded)


def test_the_leak_finder_finds_a_leak(tmp_path):
    """The test above can fail: a region shown in a lesson, unfolded, is found; folded, it is not;
    a later lab's answer in an earlier lesson is found; an earlier lab's in a later one is not."""
    sol = tmp_path / "lab03_x.py"
    sol.write_text("# %%\n### BEGIN SOLUTION\nfor p in model.parameters():\n"
                   "    dist.all_reduce(p.grad)   # sum\n    p.grad /= world_size\n"
                   "### END SOLUTION\n")
    code = "for p in model.parameters():\n    dist.all_reduce(p.grad)\n"

    def lesson(name, folded):
        cell = nbformat.v4.new_code_cell(code)
        if folded:
            cell.metadata["jupyter"] = {"source_hidden": True}
        path = tmp_path / f"{name}.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
        return path

    assert find_leaks([lesson("03_x", folded=False)], [sol])
    assert find_leaks([lesson("02_x", folded=False)], [sol])
    as_diff = lesson("03_d", folded=True)   # the answer printed as a diff, in plain sight
    nb = nbformat.read(as_diff, as_version=4)
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="".join(
        f"+{line}\n" for line in code.splitlines()))]
    nbformat.write(nb, as_diff)
    assert find_leaks([as_diff], [sol], read=readable_lines_in_every_viewer)
    assert not find_leaks([lesson("03_x", folded=True)], [sol])
    assert not find_leaks([lesson("04_x", folded=False)], [sol])


def metadata_only_folds(nb) -> list[int]:
    """The markdown cells folded by ``metadata.jupyter.source_hidden`` but not as one
    ``<details>`` block: GitHub's static view ignores the flag and shows their text."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
            and cell.get("metadata", {}).get("jupyter", {}).get("source_hidden")
            and authoring.details_label(cell) is None]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_folded_text_is_folded_in_every_viewer(path):
    """A lesson's folded text (a lab's hint, answer or design decision, an aside) is one
    ``<details><summary>▶ label</summary>`` … ``</details>`` markdown block, folded in
    JupyterLab, on GitHub and on the website alike; a markdown cell folded by ``source_hidden`` alone is
    refused."""
    bad = metadata_only_folds(nbformat.read(path, as_version=4))
    assert not bad, (f"{path.name} cells {bad}: folded by jupyter.source_hidden alone, which "
                     f"GitHub ignores: write the text as <details><summary>▶ label</summary> "
                     f"(blank line) … (blank line) </details> and drop the flag")


def test_a_markdown_cell_folded_by_metadata_alone_is_found(tmp_path):
    """The test above can fail: a flag-only fold is found; the same text in a <details> block
    is not, counts as folded with its summary as label, and hides its text from the
    every-viewer leak finder."""
    sol = tmp_path / "lab03_x.py"
    sol.write_text("# %%\n### BEGIN SOLUTION\nfor p in model.parameters():\n"
                   "    dist.all_reduce(p.grad)   # sum\n### END SOLUTION\n")
    text = "```python\nfor p in model.parameters():\n    dist.all_reduce(p.grad)\n```"
    flag = nbformat.v4.new_markdown_cell(text)
    flag.metadata["jupyter"] = {"source_hidden": True}
    details = nbformat.v4.new_markdown_cell(
        f"<details><summary>▶ the answer</summary>\n\n{text}\n\n</details>")
    assert metadata_only_folds(nbformat.v4.new_notebook(cells=[flag])) == [0]
    assert metadata_only_folds(nbformat.v4.new_notebook(cells=[details])) == []
    assert authoring.folded(details, "source_hidden")
    assert not authoring.folded(nbformat.v4.new_markdown_cell(text), "source_hidden")
    assert authoring.details_label(details) == "▶ the answer"
    for name, cell in (("03_a", flag), ("03_b", details)):
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / f"{name}.ipynb")
    assert find_leaks([tmp_path / "03_a.ipynb"], [sol], read=readable_lines_in_every_viewer)
    assert not find_leaks([tmp_path / "03_b.ipynb"], [sol], read=readable_lines_in_every_viewer)


def code_shown_by_flag_alone(nb) -> list[int]:
    """The code cells folded by ``source_hidden`` whose ``show_code`` output prints code
    without ``folded=``: GitHub ignores the flag, so that code is printed in full there."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and authoring.folded(cell, "source_hidden") and "show_code(" in cell.source
            and "folded=" not in cell.source]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_folded_code_is_folded_in_every_viewer(path):
    """A folded cell that shows code passes ``folded="▶ label"`` to ``viz.show_code``, so the
    code prints inside a ``<details>`` block in every viewer, not only where the cell's fold
    flag is honoured."""
    bad = code_shown_by_flag_alone(nbformat.read(path, as_version=4))
    assert not bad, (f"{path.name} cells {bad}: show_code in a cell folded by "
                     "jupyter.source_hidden alone, which GitHub ignores: pass "
                     'folded="▶ label" to viz.show_code')


def test_code_folded_by_the_flag_alone_is_found():
    """The test above can fail: a flagged cell calling show_code without folded= is found; with
    folded=, or unflagged, it is not."""
    def cell(source, flag=True):
        c = nbformat.v4.new_code_cell(source)
        if flag:
            c.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
        return c
    nb = nbformat.v4.new_notebook(cells=[
        cell("viz.show_code(ring.cost)"),
        cell('viz.show_code(ring.cost, folded="▶ code: ring.cost")'),
        cell("viz.show_code(ring.cost)", flag=False)])
    assert code_shown_by_flag_alone(nb) == [0]


def _folded_in_every_viewer(output) -> bool:
    """An output whose HTML is one ``<details>`` block and whose plain text holds none of it
    (``viz.show_code(folded=)``, ``viz.folded_output``, ``viz.show(folded=)``); a widget, which
    no static viewer draws, counts as folded too."""
    data = output.get("data", {})
    if "application/vnd.jupyter.widget-view+json" in data:
        return True
    return (output.get("output_type") in ("display_data", "execute_result")
            and "<details" in "".join(data.get("text/html", ""))
            and "[folded:" in "".join(data.get("text/plain", "")))


def outputs_shown_by_flag_alone(nb) -> list[int]:
    """The code cells folded by ``outputs_hidden`` with an output that GitHub prints in full:
    a print or a claim's line, a PNG, plain text or Markdown outside a ``<details>`` block."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and authoring.folded(cell, "outputs_hidden")
            and not all(_folded_in_every_viewer(o) for o in cell.outputs)]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_folded_outputs_are_folded_in_every_viewer(path):
    """Whatever a cell's fold flag hides in JupyterLab is folded on GitHub too, which ignores
    the flag: its prints and claims go through ``viz.folded_output``, its figures through
    ``viz.show(..., folded=)``, its code through ``viz.show_code(..., folded=)``."""
    bad = outputs_shown_by_flag_alone(nbformat.read(path, as_version=4))
    assert not bad, (f"{path.name} cells {bad}: outputs folded by jupyter.outputs_hidden "
                     "alone, which GitHub ignores: print inside viz.folded_output('▶ label'), "
                     "show figures with viz.show(..., folded='▶ label')")


def test_outputs_folded_by_the_flag_alone_are_found():
    """The test above can fail: a flagged cell with a print or a PNG is found; a flagged cell
    whose only output is a <details> bundle is not, nor an unflagged cell that prints."""
    from dpcourse import viz

    def cell(outputs, flag=True):
        c = nbformat.v4.new_code_cell("...")
        c.outputs = outputs
        if flag:
            c.metadata["jupyter"] = {"outputs_hidden": True}
        return c
    printed = nbformat.v4.new_output("stream", name="stdout", text="✔ an answer\n")
    png = nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo="})
    folded = nbformat.v4.new_output("display_data", data=viz.folded_code_bundle(
        "<pre>✔ an answer</pre>", "▶ open after your lab passes", what="output"))
    nb = nbformat.v4.new_notebook(cells=[cell([printed]), cell([png]), cell([folded]),
                                         cell([printed], flag=False), cell([folded, printed])])
    assert outputs_shown_by_flag_alone(nb) == [0, 1, 4]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_folded_cell_has_a_visible_label(path):
    """A folded cell shows only '…' in JupyterLab: the markdown cell right before it says what it
    holds and when to open it ("▶ The reference answer — open after your lab passes"). A
    ``<details>`` text cell carries its label itself, in its summary."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        label = authoring.details_label(cell)
        if label is not None:
            assert LABEL in label, f"{path.name} cell {i}: a <details> summary without '{LABEL}'"
        if cell.cell_type == "code" and authoring.folded(cell, "source_hidden"):
            before = nb.cells[i - 1] if i else None
            assert before is not None and before.cell_type == "markdown" \
                and LABEL in before.source, \
                f"{path.name} cell {i}: a folded cell without a '{LABEL}' label right before it"


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------

CITED = re.compile(r"\b((?:torch|tensorflow|keras)/[\w/.-]+\.(?:py|pyi|hpp|h|cpp))\b")


def site_packages() -> Path:
    return Path(importlib.util.find_spec("torch").origin).parents[1]


def sources_problems(path: Path, site: Path) -> tuple[list[str], int]:
    nb = nbformat.read(path, as_version=4)
    md = [c.source for c in nb.cells if c.cell_type == "markdown"]
    at = [i for i, text in enumerate(md) if re.search(r"^#+\s*Sources\b", text, re.M)]
    if not at:
        return [f"{path.name}: no '## Sources' section"], 0
    cited = sorted(set(CITED.findall("\n".join(md[at[-1]:]))))
    if not cited:
        return [f"{path.name}: its Sources name no installed torch/tensorflow/keras file"], 0
    return [f"{path.name}: {rel} is not in the installed packages ({site})"
            for rel in cited if not (site / rel).exists()], len(cited)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_sources_name_installed_files(path):
    problems, _ = sources_problems(path, site_packages())
    assert not problems, "\n".join(problems)


def test_a_missing_source_file_is_reported(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "## Sources\n- `torch/nn/parallel/distributed.py` — DDP\n"
        "- `torch/no/such_file.py` — gone\n")])
    path = tmp_path / "99_x.ipynb"
    nbformat.write(nb, path)
    problems, cited = sources_problems(path, site_packages())
    assert cited == 2 and len(problems) == 1 and "torch/no/such_file.py" in problems[0]


# --------------------------------------------------------------------------------------------
# Honest times
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_header_minutes_are_not_below_the_estimate(path):
    nb = nbformat.read(path, as_version=4)
    est, head = authoring.estimate_time(nb), authoring.header_minutes(nb)
    assert head is not None, f"{path.name}: no '**Time:** about N minutes' in its first cell"
    assert head >= est.minutes, (
        f"{path.name} says about {head} minutes, but {est.words} words of prose, "
        f"{est.code_lines} lines of code on the page and {est.run_seconds:.0f} s of running "
        f"take about {est.minutes} (`python -m dpcourse times`)")


def test_the_estimate_counts_prose_code_and_run_time():
    md = nbformat.v4.new_markdown_cell("**Time:** about 1 minutes\n" + "word " * 396)
    code = nbformat.v4.new_code_cell("\n".join(f"x{i} = {i}" for i in range(20)))
    code.metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00.000Z",
                                  "shell.execute_reply": "2026-01-01T00:01:00.000Z"}
    folded = nbformat.v4.new_code_cell("\n".join(f"y{i} = {i}" for i in range(40)))
    folded.metadata["jupyter"] = {"source_hidden": True}
    sources = nbformat.v4.new_markdown_cell("## Sources\n" + "word " * 1000)
    nb = nbformat.v4.new_notebook(cells=[md, code, folded, sources])
    est = authoring.estimate_time(nb)
    assert (est.words, est.code_lines, round(est.run_seconds)) == (400, 20, 60)
    assert est.minutes == 2 + 1 + 1 and authoring.header_minutes(nb) == 1
