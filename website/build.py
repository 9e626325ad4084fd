"""Build the course's website into ``_site/`` from the stored notebooks, offline:

    python website/build.py            # then open _site/index.html

What it does, in order, without executing any notebook (CI already executed and compared them):

1. stages a copy of the pages under ``build/site-src/``: README.md as the home page, every
   lesson, lab and solution notebook, the instructor guide, and two generated pages (the
   benchmark commands, and the numbers the lessons measured with the machine they ran on);
2. on the staged notebooks only: a folded cell (``metadata.jupyter.source_hidden`` /
   ``outputs_hidden``, what JupyterLab folds) gets myst-nb's ``hide-input`` / ``hide-output`` /
   ``hide-cell`` tag, so it stays folded on the page as a click-to-open block (a folded text
   cell, a lab's hint, becomes an HTML ``<details>`` block); a widget's output
   (it needs a live kernel) is replaced by its stored plain-text fallback, the static figure
   beside it stays; a "Run this page" box (local command, Binder, Colab) follows the title;
   a link to a file that is not a page goes to the file in the repository;
3. runs Sphinx (myst-nb, sphinx-book-theme) into ``_site/``.

The repository's address is read from pyproject.toml's ``[project.urls] Repository`` — the one
place it is written.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import shutil
import sys
import time
import tomllib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
BRANCH = "main"
NUMBER = re.compile(r"^(?:lab)?(\d\d)_")
WIDGET = "application/vnd.jupyter.widget-view+json"
# a printed measurement: a number followed by a unit of time, rate or ratio
MEASURED = re.compile(r"\d[\d.,]*\s*(?:ms|s|us|µs|GB/s|MB/s|samples/s|x|×|%)(?![A-Za-z])")
# Markdown pages of the repository that become pages of the site (under "Reference")
DOC_PAGES = (Path("lessons/INSTRUCTOR_GUIDE.md"), Path("lessons/HANDOUT.md"),
             Path("ARCHITECTURE.md"))
BENCH_MODULES = [("bench/allreduce", "python -m dpcourse.bench allreduce"),
                 ("bench/ddp", "python -m dpcourse.bench ddp"),
                 ("bench/scaling", "python -m dpcourse.bench scaling"),
                 ("bench/single", "python -m dpcourse.bench single"),
                 ("bench/scaling_tf", "python -m dpcourse.bench scaling --tf")]


def repository() -> str:
    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    return url.rstrip("/").removesuffix(".git")


def _number(path: Path) -> str:
    match = NUMBER.match(path.name)
    return match.group(1) if match else ""


def course_pages() -> dict[str, list[Path]]:
    """The notebooks, relative to the root, in course order: lesson NN then its lab."""
    lessons = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
    labs = {_number(p): p for p in sorted((ROOT / "labs").glob("lab[0-9][0-9]_*.ipynb"))}
    solutions = sorted((ROOT / "solutions").glob("lab[0-9][0-9]_*.ipynb"))
    course = []
    for lesson in lessons:
        course.append(lesson)
        if _number(lesson) in labs:
            course.append(labs.pop(_number(lesson)))
    course.extend(labs.values())  # a lab without its lesson still gets a page
    rel = lambda paths: [p.relative_to(ROOT) for p in paths]  # noqa: E731
    return {"course": rel(course), "solutions": rel(solutions)}


# ---------------------------------------------------------------------------------------------
# links

LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def rewrite_links(text: str, page: Path, pages: set[Path], repo: str) -> str:
    """Relative links in markdown: to a page, kept (README.md becomes the home page); to any
    other file of the repository, the file on GitHub."""
    def fix(match):
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = Path(os.path.normpath(page.parent / path))
        if resolved == Path("README.md"):
            new = os.path.relpath("index.md", page.parent)
        elif resolved in pages:
            return match.group(0)
        elif (ROOT / resolved).exists():
            kind = "tree" if (ROOT / resolved).is_dir() else "blob"
            new = f"{repo}/{kind}/{BRANCH}/{resolved.as_posix()}"
        else:
            return match.group(0)
        return f"{match.group(1)}{new}{'#' + anchor if anchor else ''}{match.group(3)}"
    return LINK.sub(fix, text)


# ---------------------------------------------------------------------------------------------
# notebooks

def install_line(repo: str) -> str:
    """What every notebook's first cell runs where the course is missing (dpcourse.tools.authoring
    writes that cell): pip install from the repository at the tag of this version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return f"pip install git+{repo}@v{version}"


def run_box(path: Path, repo: str) -> str:
    owner_repo = repo.removeprefix("https://github.com/")
    binder = f"https://mybinder.org/v2/gh/{owner_repo}/{BRANCH}?urlpath=lab/tree/{path.as_posix()}"
    colab = f"https://colab.research.google.com/github/{owner_repo}/blob/{BRANCH}/{path.as_posix()}"
    return "\n".join([
        ":::{admonition} Run this page",
        ":class: tip dpcourse-run",
        f"- **On your machine**, after README's install, from the repository root: "
        f"`jupyter lab --notebook-dir=. {path.as_posix()}`.",
        f"- **[Open in Binder]({binder})**: the pinned CPU environment (the `cpu` profile) in "
        "JupyterLab, widgets included; the first start builds the image and is slow (its build "
        "with PyTorch's CPU-only index has not run yet).",
        f"- **[Open in Colab]({colab})**: run the page from the top. Its first cell installs the "
        f"course into Colab (`{install_line(repo)}`, the version this page was built from) "
        "and names a torch or TensorFlow the course cannot use, with the `%pip` line that fixes "
        "it. A CPU runtime uses the `cpu` profile, a GPU runtime the `one-gpu` profile on "
        "Colab's GPU. Not tried on Colab itself: that cell's install is tested offline, on a "
        "lesson and a lab opened alone (README, *Which install?*).",
        ":::",
    ])


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _fallback(output: dict) -> dict | None:
    """A widget's display without the widget: the course's one-line text fallback (it starts
    with '['); None for a bare repr such as ``VBox(children=...)``."""
    text = output.get("data", {}).get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    if not text.startswith("["):
        return None
    return {"output_type": "display_data", "metadata": {}, "data": {"text/plain": text}}


def stage_notebook(path: Path, dest: Path, pages: set[Path], repo: str) -> dict:
    nb = json.loads((ROOT / path).read_text())
    counts = {"folded": 0, "widgets": 0}
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = rewrite_links(_source(cell), path, pages, repo)
            if cell.get("metadata", {}).get("jupyter", {}).get("source_hidden"):
                # A folded text cell (a lab's hint): a click-to-open block on the page too. The
                # visible label before it says what it holds.
                counts["folded"] += 1
                cell["source"] = (f'<details class="dpcourse-folded">\n<summary>open</summary>'
                                  f'\n\n{cell["source"]}\n\n</details>')
            continue
        if cell["cell_type"] != "code":
            continue
        folded = cell.get("metadata", {}).get("jupyter", {})
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        hidden_in, hidden_out = folded.get("source_hidden"), folded.get("outputs_hidden")
        if hidden_in or hidden_out:
            counts["folded"] += 1
            tags.append("hide-cell" if hidden_in and hidden_out else
                        "hide-input" if hidden_in else "hide-output")
        outputs = []
        for output in cell.get("outputs", []):
            if WIDGET in output.get("data", {}):
                counts["widgets"] += 1
                output = _fallback(output)
            if output is not None:
                outputs.append(output)
        cell["outputs"] = outputs
    box = {"cell_type": "markdown", "id": "dpcourse-run-this-page", "metadata": {},
           "source": run_box(path, repo)}
    first = next((i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"), -1)
    nb["cells"].insert(first + 1, box)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(nb, ensure_ascii=False))
    return counts


# ---------------------------------------------------------------------------------------------
# generated pages

def _title(nb: dict, fallback: str) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in _source(cell).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def _stdout(cell) -> str:
    return "".join("".join(o["text"]) if isinstance(o["text"], list) else o["text"]
                   for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def _fence(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```"


def measured_page(lessons: list[Path]) -> str:
    """The lessons' timing-dependent printouts (cells marked ``NBVAL_IGNORE_OUTPUT`` whose
    output holds a measurement), as stored, under the machine that printed them."""
    parts = ["# Measured numbers", "",
             "The numbers below are what the lessons printed when the stored notebooks were last "
             "built, copied from the notebooks as they are: the cells whose output depends on the "
             "machine's speed (marked `# NBVAL_IGNORE_OUTPUT`, so CI does not compare them). Your "
             "own machine prints its own; run a lesson, or the [benchmark commands](benchmarks.md), "
             "to get them.", ""]
    machine, date = "", ""
    for path in lessons:
        nb = json.loads((ROOT / path).read_text())
        for cell in nb["cells"]:
            out = _stdout(cell) if cell["cell_type"] == "code" else ""
            if not machine and out.startswith("dpcourse doctor"):
                machine = out
                stamp = cell.get("metadata", {}).get("execution", {}).get("iopub.execute_input", "")
                date = stamp[:10]
    if machine:
        parts += ["## The machine", "",
                  f"Lesson 00's `python -m dpcourse doctor`, run{' on ' + date if date else ''} "
                  "by the build that stored these notebooks:", "", _fence(machine), ""]
    for path in lessons:
        nb = json.loads((ROOT / path).read_text())
        found = []
        for cell in nb["cells"]:
            if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" not in _source(cell):
                continue
            out = _stdout(cell)
            if MEASURED.search(out) and not out.startswith("dpcourse doctor"):
                found.append(out)
        if found:
            stamps = [c.get("metadata", {}).get("execution", {}).get("iopub.execute_input", "")
                      for c in nb["cells"] if c["cell_type"] == "code"]
            stamps = sorted(s[:16].replace("T", " ") for s in stamps if s)
            parts += [f"## [{_title(nb, path.stem)}]({path.as_posix()})", ""]
            if stamps:
                parts += [f"Run from {stamps[0]} to {stamps[-1]} UTC.", ""]
            for out in found:
                parts += [_fence(out), ""]
    return "\n".join(parts)


def benchmarks_page() -> str:
    parts = ["# Benchmark commands", "",
             "The course's measurements as command-line tools, run from the repository root "
             "after README's install (each prints a table; `--json` prints one JSON document). "
             "What each does, from its own documentation:", ""]
    for module, command in BENCH_MODULES:
        source = ROOT / "lib" / "dpcourse" / f"{module}.py"
        if not source.exists():  # a moved benchmark must move here too, not vanish from the page
            raise FileNotFoundError(f"benchmarks page: {source.relative_to(ROOT)} is gone; "
                                    f"update BENCH_MODULES in website/build.py")
        doc = ast.get_docstring(ast.parse(source.read_text())) or ""
        parts += [f"## `{command}`", "", _fence(doc), ""]
    parts += ["Lesson 10's detectors on your own script: "
              "`python -m dpcourse diagnose [--nproc 2] [--timeout 10] script.py [args]`.", ""]
    return "\n".join(parts)


def home_page(pages: dict[str, list[Path]], repo: str, known: set[Path]) -> str:
    readme = rewrite_links((ROOT / "README.md").read_text(), Path("index.md"), known, repo)
    def toctree(caption, entries):
        names = "\n".join(p.with_suffix("").as_posix() for p in entries)
        return f"```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{names}\n```\n"
    reference = [p for p in (*DOC_PAGES, Path("benchmarks.md"), Path("measured.md"))
                 if p in known]
    return "\n".join([readme.rstrip(), "",
                      toctree("Course: lessons and labs", pages["course"]),
                      toctree("Solutions", pages["solutions"]),
                      toctree("Reference", reference)])


# ---------------------------------------------------------------------------------------------

def stage(src: Path, repo: str) -> dict:
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    pages = course_pages()
    lessons = [p for p in pages["course"] if p.parts[0] == "lessons"]
    known = set(pages["course"]) | set(pages["solutions"])
    known |= {Path("benchmarks.md"), Path("measured.md")}
    docs = [doc for doc in DOC_PAGES if (ROOT / doc).exists()]
    known |= set(docs)   # all of them first: the guide and README link to each other's pages
    for doc in docs:
        (src / doc).parent.mkdir(parents=True, exist_ok=True)
        (src / doc).write_text(rewrite_links((ROOT / doc).read_text(), doc, known, repo))
    totals = {"folded": 0, "widgets": 0, "notebooks": 0}
    for path in pages["course"] + pages["solutions"]:
        counts = stage_notebook(path, src / path, known, repo)
        totals["folded"] += counts["folded"]
        totals["widgets"] += counts["widgets"]
        totals["notebooks"] += 1
    (src / "benchmarks.md").write_text(benchmarks_page())
    (src / "measured.md").write_text(measured_page(lessons))
    (src / "index.md").write_text(home_page(pages, repo, known))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "_site"), help="where the site goes")
    parser.add_argument("--work", default=str(ROOT / "build" / "site"),
                        help="staged sources and Sphinx's cache (rebuilt from scratch)")
    args = parser.parse_args(argv)
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    start = time.monotonic()
    repo = repository()
    os.environ["DPCOURSE_SITE_REPOSITORY"] = repo
    totals = stage(work / "src", repo)
    if out.exists():
        shutil.rmtree(out)
    doctrees = work / "doctrees"
    if doctrees.exists():
        shutil.rmtree(doctrees)
    # the stored notebooks' cells have no "id" (nbformat 4.4); nbformat says so once per cell
    warnings.filterwarnings("ignore", message="Cell is missing an id field")
    from sphinx.cmd.build import build_main
    # Sphinx writes into the work folder, then the pages move to ``out``: myst-nb keeps a copy
    # of every notebook in "jupyter_execute/" beside its output folder, which must not land in
    # the repository's root.
    html = work / "html"
    if html.exists():
        shutil.rmtree(html)
    rc = build_main(["-b", "html", "-q", "-c", str(HERE), "-d", str(doctrees),
                     str(work / "src"), str(html)])
    if rc:
        print(f"sphinx-build failed with exit code {rc}", file=sys.stderr)
        return rc
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(html), str(out))
    (out / ".nojekyll").write_text("")  # GitHub Pages: serve _static/ and _images/ as they are
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"site: {totals['notebooks']} notebooks ({totals['folded']} folded cells, "
          f"{totals['widgets']} widgets shown by their static fallback) -> {out}/index.html, "
          f"{size / 2**20:.1f} MiB, {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
