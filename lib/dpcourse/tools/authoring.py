"""The course build: jupytext sources -> executed notebooks -> generated labs.

Run from the repository root (``python -m dpcourse build ...`` forwards here)::

    python -m dpcourse build            # everything (what CI's outputs come from)
    python -m dpcourse build 01 lab01   # only sources whose name contains these
    python -m dpcourse check            # sync check, executes nothing
    python -m dpcourse times            # each lesson's honest time against its header

Sources are ``lessons/NN_name.py`` and ``solutions/labNN_name.py`` in jupytext's py:percent
format. ``build`` executes each in a fresh kernel, top to bottom, in its own folder, and writes
the paired ``.ipynb`` next to it with the outputs learners see and nbval compares; before the
first code cell it puts the install cell (``add_install_cell``: silent where the course is
installed, ``pip install`` from the repository at this version's tag where not). For every
solution it then writes ``labs/labNN_name.ipynb``: each region between ``### BEGIN SOLUTION``
and ``### END SOLUTION`` becomes a TODO that raises NotImplementedError, outputs are cleared,
cells tagged ``solution-only`` are dropped, and a first cell says where the lab came from.
A hint for the TODO may follow the marker: ``### BEGIN SOLUTION: average the gradients``.

Cell ids are stable across builds (``keep_ids``): a rebuilt notebook's cells take the ids of
the cells they replace, so the Chinese edition's translations (``dpcourse.tools.translate``),
keyed by cell id, survive a rebuild; only a genuinely new cell gets a fresh id. A lab's cells
carry the ids of their solution's cells.

Never edit an .ipynb by hand: tests/test_authoring.py fails when a notebook and its source, or
a lab and its solution, are out of sync.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# jupytext and nbformat are imported inside the functions that use them: nbformat pulls in
# jsonschema's format checkers, about 2.5 s of CPU, which `python -m dpcourse build --help`
# (and every `--help` the docs test runs) should not pay.

__all__ = ["build", "make_lab", "check_sync", "sources", "main", "ROOT", "TimeEstimate",
           "estimate_time", "header_minutes", "folded", "keep_ids", "write_keeping_ids"]

ROOT = Path(__file__).resolve().parents[3]   # lib/dpcourse/tools/ -> the clone
SOURCE_DIRS = ("lessons", "solutions")
LAB_DIR = "labs"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
_BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION(?::\s*(?P<hint>.*\S))?\s*$")
_END = re.compile(r"^[ \t]*### END SOLUTION\s*$")


def sources(root: Path = ROOT, names: list[str] | None = None) -> list[Path]:
    """The py:percent sources, lessons first, filtered by substrings of their names. A name
    with a slash is matched against folder/name, so ``lessons/05`` is lesson 05 alone (a lesson
    and its lab's solution share their name: ``05_mirrored_strategy`` matches both)."""
    found = [p for d in SOURCE_DIRS for p in sorted((root / d).glob("*.py"))]
    if names:
        found = [p for p in found
                 if any(n.strip("/") in (f"{p.parent.name}/{p.stem}" if "/" in n else p.stem)
                        for n in names)]
    return found


# ---- the first cell every notebook runs: the course library where it is missing ------------
INSTALL_TAG = "install-course"
_INSTALL = """\
# The course library, where it is missing (Colab, a notebook opened alone): installed as tagged
# {tag} ($DPCOURSE_SOURCE overrides: a wheel, a path). Silent where it is installed and fits.
import importlib, importlib.util, os, subprocess, sys
if importlib.util.find_spec("dpcourse") is None:
    _source = os.environ.get("DPCOURSE_SOURCE") or "git+{repo}@{tag}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", _source], check=True)
    importlib.invalidate_caches()
    print(f"Installed the course library (dpcourse) from {{_source}}.")
from dpcourse.versions import check_versions
check_versions()  # prints nothing when torch, TensorFlow and Python fit the course"""


def install_source(root: Path = ROOT) -> str:
    """The install cell's code: pyproject's repository at the tag of this version (``v`` +
    ``dpcourse.__version__``), so every notebook built from one version has the same cell and a
    learner who opens it alone gets the library it was built with."""
    import tomllib

    import dpcourse

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    if project["version"] != dpcourse.__version__:
        raise ValueError(f"pyproject.toml's version {project['version']} differs from "
                         f"dpcourse.__version__ {dpcourse.__version__}: make them one")
    return _INSTALL.format(repo=project["urls"]["Repository"], tag=f"v{dpcourse.__version__}")


def add_install_cell(nb: nbformat.NotebookNode, root: Path = ROOT) -> nbformat.NotebookNode:
    """Put the install cell before the notebook's first code cell (after the title and frame, so
    it is the first cell that runs); a notebook that has one already keeps it."""
    import nbformat
    if any(INSTALL_TAG in c.metadata.get("tags", []) for c in nb.cells):
        return nb
    cell = nbformat.v4.new_code_cell(install_source(root))
    cell.metadata["tags"] = [INSTALL_TAG]
    cell.id = INSTALL_TAG
    first = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells))
    nb.cells.insert(first, cell)
    return nb


def read_source(path: Path) -> nbformat.NotebookNode:
    import jupytext
    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata.setdefault("language_info", {"name": "python"})
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    return add_install_cell(nb)   # every notebook, lab included, first runs the install cell


def lab_path_for(solution: Path) -> Path:
    return solution.parent.parent / LAB_DIR / (solution.stem + ".ipynb")


def _strip_solution(source: str, where: str) -> str:
    out: list[str] = []
    inside = False
    for line in source.splitlines():
        begin = _BEGIN.match(line)
        if begin:
            if inside:
                raise ValueError(f"{where}: nested ### BEGIN SOLUTION")
            inside = True
            indent = begin["indent"]
            hint = begin["hint"] or "write this part"
            out.append(f"{indent}# TODO: {hint}")
            out.append(f"{indent}raise NotImplementedError({('TODO: ' + hint)!r})")
        elif _END.match(line):
            if not inside:
                raise ValueError(f"{where}: ### END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: ### BEGIN SOLUTION without END")
    return "\n".join(out)


def make_lab(solution_nb: nbformat.NotebookNode, source_name: str) -> nbformat.NotebookNode:
    """The learner's lab from an (executed or not) solution notebook."""
    import nbformat
    lab = copy.deepcopy(solution_nb)
    cells = []
    n_todo = 0
    for i, cell in enumerate(lab.cells):
        if "solution-only" in cell.metadata.get("tags", []):
            continue
        if cell.cell_type == "code":
            n_todo += sum(bool(_BEGIN.match(line)) for line in cell.source.splitlines())
            cell.source = _strip_solution(cell.source, f"{source_name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
        cells.append(cell)
    if n_todo == 0:
        raise ValueError(f"{source_name} has no ### BEGIN SOLUTION region: nothing to turn into a lab")
    header = nbformat.v4.new_markdown_cell(
        f"> **Generated lab** — made from `{source_name}` by `python -m dpcourse build`. "
        f"Do not edit this file in the repository: edit the solution source and rebuild. "
        f"(Learners: this copy is yours to fill in — replace each `raise NotImplementedError` "
        f"under a `# TODO`, then run the check cell below it.)"
    )
    header.metadata["tags"] = ["generated-header"]
    header.id = "generated-header"
    lab.cells = [header] + cells
    lab.metadata.pop("jupytext", None)
    return lab


# ---- stable cell ids ----------------------------------------------------------------------
# jupytext gives every cell a random id each time a source is read, so before this every build
# renamed every cell (git log -p of any notebook showed each "id" line changed). The Chinese
# edition keys each translation by its English cell's id, so a rebuild must keep them.
# The cells the build names itself keep their names and are never paired with others.
FIXED_IDS = frozenset({INSTALL_TAG, "generated-header"})


def keep_ids(new: nbformat.NotebookNode, old: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Give ``new``'s cells the ids of the ``old`` cells they stand for, in place, and return it.

    The two cell lists are aligned with difflib over (cell type, source): a cell in an equal run
    keeps its old id; in a replaced run (edited cells) the cells paired one to one by position
    keep the old ids, so an edited cell keeps its id and its translation turns stale rather
    than missing; cells left over (inserted) keep the fresh ids they came with. A moved cell is
    a delete plus an insert to difflib, so it is matched afterwards by its exact content."""
    import nbformat
    def key(c):
        return (c.cell_type, c.source)

    old_cells = [c for c in old.cells if c.get("id") not in FIXED_IDS]
    new_cells = [c for c in new.cells if c.get("id") not in FIXED_IDS]
    taken: dict[int, str] = {}   # index in new_cells -> the old id it inherits
    used: set[int] = set()       # indices in old_cells whose id is given away
    matcher = difflib.SequenceMatcher(None, [key(c) for c in old_cells],
                                      [key(c) for c in new_cells], autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op in ("equal", "replace"):
            for i, j in zip(range(i1, i2), range(j1, j2)):
                if op == "equal" or old_cells[i].cell_type == new_cells[j].cell_type:
                    taken[j] = old_cells[i].id
                    used.add(i)
    # moved cells: an unmatched new cell equal to an unmatched old one takes its id
    spare = {}
    for i, c in enumerate(old_cells):
        if i not in used:
            spare.setdefault(key(c), []).append(i)
    for j, c in enumerate(new_cells):
        if j not in taken and spare.get(key(c)):
            taken[j] = old_cells[spare[key(c)].pop(0)].id
    for j, old_id in taken.items():
        new_cells[j].id = old_id
    # a fresh id that happens to equal an inherited one would make two cells one
    seen = set(FIXED_IDS) | set(taken.values())
    for j, c in enumerate(new_cells):
        if j not in taken:
            while c.id in seen:
                c.id = nbformat.v4.new_markdown_cell().id
            seen.add(c.id)
    return new


def write_keeping_ids(nb: nbformat.NotebookNode, path: Path) -> None:
    """``nbformat.write``, after ``keep_ids`` against the notebook already at ``path``."""
    import nbformat
    if path.exists():
        keep_ids(nb, nbformat.read(path, as_version=4))
    nbformat.write(nb, path)


@dataclass
class BuildResult:
    path: Path
    seconds: float


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def _write_lab(solution: Path, nb: nbformat.NotebookNode) -> Path:
    import nbformat
    lab = make_lab(nb, f"{solution.parent.name}/{solution.name}")
    out = lab_path_for(solution)
    out.parent.mkdir(exist_ok=True)
    # No keep_ids against the old lab: make_lab copied the solution's cells, ids included, and
    # the solution kept its ids, so the lab's ids are already the ones it had (and its prose is
    # translated once, under the solution's ids).
    nbformat.write(lab, out)
    return out


def build(names: list[str] | None = None, root: Path = ROOT, run: bool = True) -> list[BuildResult]:
    """Execute each source into its .ipynb and regenerate the labs. Returns the timings."""
    results = []
    todo = sources(root, names)
    if not todo:
        raise SystemExit(f"no sources match {names}")
    for src in todo:
        nb = read_source(src)
        t0 = time.perf_counter()
        if run:
            print(f"executing {src.relative_to(root)} ...", flush=True)
            execute(nb, src.parent)
        seconds = time.perf_counter() - t0
        write_keeping_ids(nb, src.with_suffix(".ipynb"))
        results.append(BuildResult(src, seconds))
        if src.parent.name == "solutions":
            _write_lab(src, nb)
        print(f"  {src.with_suffix('.ipynb').relative_to(root)}  {seconds:6.1f} s", flush=True)
    return results


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def check_sync(root: Path = ROOT) -> list[str]:
    """Every way the notebooks disagree with their sources; empty when all is in sync."""
    import nbformat
    problems = []
    srcs = sources(root)
    for src in srcs:
        rel = src.relative_to(root)
        ipynb = src.with_suffix(".ipynb")
        if not ipynb.exists():
            problems.append(f"{rel}: no {ipynb.name}; run the build")
            continue
        nb = nbformat.read(ipynb, as_version=4)
        if _cells(nb) != _cells(read_source(src)):
            problems.append(f"{rel}: {ipynb.name} does not match its source; run the build")
            continue
        counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
        if counts != list(range(1, len(counts) + 1)):
            problems.append(f"{ipynb.relative_to(root)}: not executed top to bottom in one "
                            f"fresh kernel (execution counts {counts})")
        if src.parent.name == "solutions":
            lab = lab_path_for(src)
            if not lab.exists():
                problems.append(f"{rel}: its lab {lab.relative_to(root)} is missing")
            elif _cells(nbformat.read(lab, as_version=4)) != _cells(
                    make_lab(nb, f"{src.parent.name}/{src.name}")):
                problems.append(f"{lab.relative_to(root)} is out of sync with {rel}; run the build")
    expected = {lab_path_for(s) for s in srcs if s.parent.name == "solutions"}
    for lab in sorted((root / LAB_DIR).glob("*.ipynb")):
        if lab not in expected:
            problems.append(f"{lab.relative_to(root)} has no source in solutions/")
    for d in SOURCE_DIRS:
        for nbpath in sorted((root / d).glob("*.ipynb")):
            if not nbpath.with_suffix(".py").exists():
                problems.append(f"{nbpath.relative_to(root)} has no .py source")
    return problems


# --------------------------------------------------------------------------------------------
# Honest lesson times (ARCHITECTURE.md § Design rules: honest times)
# --------------------------------------------------------------------------------------------

WORDS_PER_MINUTE = 200   # technical prose, read with care
CODE_LINES_PER_MINUTE = 20   # about 3 s a line: code is read, not skimmed
_TIME = re.compile(r"\*\*Time:\*\*\s*about\s+(\d+)\s+minutes", re.I)


@dataclass
class TimeEstimate:
    """What a learner reads and waits for in one executed lesson, and the minutes it adds to."""

    words: int          # prose: markdown cells, the Sources list left out
    code_lines: int     # non-blank lines of unfolded code cells and of unfolded displayed source
    run_seconds: float  # the stored run: each cell's execute_input -> execute_reply, summed

    @property
    def minutes(self) -> int:
        import math

        return math.ceil(self.words / WORDS_PER_MINUTE + self.code_lines / CODE_LINES_PER_MINUTE
                         + self.run_seconds / 60)


_DETAILS = re.compile(r"\A\s*<details>\s*<summary>(.*?)</summary>(.*)</details>\s*\Z", re.S)


_FOLD_TAGS = re.compile(r"</?(?:details|summary)\b[^>]*>", re.I)


def details_label(cell) -> str | None:
    """The summary of a markdown cell that is one ``<details>`` block (folded in every viewer:
    JupyterLab, GitHub's static view, the website), e.g. "▶ open"; None for any other cell."""
    if cell.get("cell_type") != "markdown":
        return None
    m = _DETAILS.match(cell.get("source", ""))
    return m.group(1).strip() if m else None


def folded(cell, what: str) -> bool:
    """Whether JupyterLab shows ``cell`` folded: ``what`` is "source_hidden" (its code, or a
    markdown cell's text: by the flag or as one ``<details>`` block) or "outputs_hidden" (its
    outputs), as ``metadata.jupyter`` holds them."""
    if what == "source_hidden" and details_label(cell) is not None:
        return True
    return bool(cell.get("metadata", {}).get("jupyter", {}).get(what, False))


def _cell_seconds(cell) -> float:
    from datetime import datetime

    ex = cell.get("metadata", {}).get("execution", {})
    try:
        start = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return 0.0
    return max(0.0, (end - start).total_seconds())


def estimate_time(nb: nbformat.NotebookNode) -> TimeEstimate:
    """The estimate the header's minutes must not fall below (tests/test_lesson_rules.py)."""
    words = lines = 0
    seconds = 0.0
    for cell in nb.cells:
        if INSTALL_TAG in cell.get("metadata", {}).get("tags", []):
            continue  # the build's install cell: silent where the course runs, not the lesson
        if cell.cell_type == "markdown":
            folded_block = _DETAILS.match(cell.source)
            # A folded Sources list counts as Sources too: read what the fold holds.
            text = (folded_block.group(2) if folded_block else cell.source).strip()
            if re.match(r"#+\s*Sources\b", text):
                continue
            words += len(_FOLD_TAGS.sub(" ", cell.source).split())  # tags are not read
        elif cell.cell_type == "code":
            seconds += _cell_seconds(cell)
            if not folded(cell, "source_hidden"):
                lines += sum(1 for line in cell.source.splitlines() if line.strip())
            if folded(cell, "outputs_hidden"):
                continue
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if 'class="highlight' in str(data.get("text/html", "")):  # viz.show_code
                    lines += sum(1 for line in data.get("text/plain", "").splitlines()
                                 if line.strip())
    return TimeEstimate(words, lines, seconds)


def header_minutes(nb: nbformat.NotebookNode) -> int | None:
    """The minutes the lesson's first cell promises ("**Time:** about N minutes")."""
    m = _TIME.search(nb.cells[0].source) if nb.cells else None
    return int(m.group(1)) if m else None


def main(argv: list[str] | None = None,
         prog: str = "python -m dpcourse.tools.authoring") -> int:
    """``build``, ``check`` and ``times``; ``python -m dpcourse build|check|times`` comes here."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="execute sources into notebooks and generate the labs")
    b.add_argument("names", nargs="*", help="only sources whose file name contains one of these "
                   "(lessons/05: the lesson alone, not its lab's solution)")
    b.add_argument("--times", type=Path, help="also write the timings as JSON to this file")
    sub.add_parser("check", help="report notebooks out of sync with their sources")
    t = sub.add_parser("times", help="each executed lesson's time estimate against its header")
    t.add_argument("paths", nargs="*", type=Path, help="notebooks (default: every lesson)")
    args = parser.parse_args(argv)
    if args.cmd == "times":
        import nbformat
        paths = args.paths or sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
        worst = 0
        print(f"{'lesson':34} {'words':>6} {'lines':>6} {'run s':>6} {'estimate':>8} {'header':>6}")
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            est, head = estimate_time(nb), header_minutes(nb)
            flag = "" if head is not None and head >= est.minutes else "  <- header too low"
            worst |= bool(flag)
            print(f"{path.name:34} {est.words:6d} {est.code_lines:6d} {est.run_seconds:6.0f} "
                  f"{est.minutes:8d} {head if head is not None else '-':>6}{flag}")
        return int(worst)
    if args.cmd == "build":
        results = build(args.names or None)
        total = sum(r.seconds for r in results)
        print(f"built {len(results)} notebook(s) in {total:.1f} s")
        if args.times:
            args.times.write_text(json.dumps(
                {str(r.path.relative_to(ROOT)): round(r.seconds, 1) for r in results}, indent=1))
        return 0
    problems = check_sync()
    for p in problems:
        print(p)
    print("in sync" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
