"""The course's website (README, "The course as a website"): fast checks without a browser.

The site itself is built (with the network cut off) and read in Chromium by
tests/browser/test_site.py; here: the staged pages the build makes from the stored notebooks,
the one setting the run links come from, and that README, requirements and the Pages workflow
agree on one command. (Not named test_site.py: two test modules may not share a basename.)
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILDER = ["sphinx", "docutils", "myst-parser", "myst-nb", "pydata-sphinx-theme",
           "sphinx-book-theme"]


def _load_build():
    spec = importlib.util.spec_from_file_location("dpcourse_site_build",
                                                  ROOT / "website" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


def _repository() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _readme_block(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)\n```",
                      (ROOT / "README.md").read_text(), re.S)
    assert match, f"README.md has no <!-- {marker} --> bash block"
    return match.group(1)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    src = tmp_path_factory.mktemp("site") / "src"
    totals = build.stage(src, build.repository())
    return src, totals


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_repository_address_comes_from_pyproject():
    assert build.repository() == _repository().rstrip("/")


def test_every_lesson_lab_and_solution_is_a_page_in_course_order():
    pages = build.course_pages()
    lessons = sorted(p.relative_to(ROOT) for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
    labs = sorted(p.relative_to(ROOT) for p in (ROOT / "labs").glob("lab*.ipynb"))
    solutions = sorted(p.relative_to(ROOT) for p in (ROOT / "solutions").glob("lab*.ipynb"))
    assert [p for p in pages["course"] if p.parts[0] == "lessons"] == lessons
    assert sorted(p for p in pages["course"] if p.parts[0] == "labs") == labs
    assert pages["solutions"] == solutions
    for i, page in enumerate(pages["course"]):  # lab NN right after lesson NN
        if page.parts[0] == "labs":
            assert pages["course"][i - 1].name[:2] == page.name[3:5], pages["course"]


def test_folded_cells_stay_folded_and_widgets_leave_their_static_fallback(staged):
    src, totals = staged
    folded = widgets = 0
    for page in build.course_pages()["course"] + build.course_pages()["solutions"]:
        original, copy = _cells(ROOT / page), _cells(src / page)
        assert len(copy) == len(original) + 1  # the "Run this page" box
        copy = [c for c in copy if c.get("id") != "dpcourse-run-this-page"]
        for before, after in zip(original, copy):
            hidden = before.get("metadata", {}).get("jupyter", {})
            tags = set(after.get("metadata", {}).get("tags", []))
            if before["cell_type"] == "markdown":
                if hidden.get("source_hidden"):  # a lab's hint: a <details> block on the page
                    folded += 1
                    assert _source(after).startswith('<details class="dpcourse-folded">'), page
                    assert _source(after).rstrip().endswith("</details>"), page
                continue
            if hidden.get("source_hidden") or hidden.get("outputs_hidden"):
                folded += 1
                assert tags & {"hide-cell", "hide-input", "hide-output"}, (page, _source(before))
                if hidden.get("source_hidden"):
                    assert tags & {"hide-cell", "hide-input"}, page
            for out in before.get("outputs", []):
                widgets += build.WIDGET in out.get("data", {})
            for out in after.get("outputs", []):
                assert build.WIDGET not in out.get("data", {}), page
            # every figure stays
            pngs = lambda cell: sum("image/png" in o.get("data", {})  # noqa: E731
                                    for o in cell.get("outputs", []))
            assert pngs(after) == pngs(before), page
    assert totals["folded"] == folded and totals["widgets"] == widgets


def test_the_run_box_links_binder_and_colab_to_this_notebook(staged):
    src, _ = staged
    repo = _repository().rstrip("/")
    owner_repo = repo.removeprefix("https://github.com/")
    page = build.course_pages()["course"][1]
    box = next(_source(c) for c in _cells(src / page) if c.get("id") == "dpcourse-run-this-page")
    path = page.as_posix()
    assert f"https://mybinder.org/v2/gh/{owner_repo}/main?urlpath=lab/tree/{path}" in box
    assert f"https://colab.research.google.com/github/{owner_repo}/blob/main/{path}" in box
    assert f"jupyter lab --notebook-dir=. {path}" in box
    assert f"git+{repo}" in box and "`cpu` profile" in box and "`one-gpu` profile" in box
    # the box's install line is the one every notebook's first cell runs where the course is missing
    from dpcourse.tools import authoring

    line = build.install_line(repo)
    assert f"`{line}`" in box
    assert line.split(" ", 2)[2] in authoring.install_source() and "pip" in authoring.install_source()
    assert "<owner>" not in box and "{" not in box.replace("{admonition}", "")


def test_every_relative_link_in_the_staged_pages_is_a_page_or_an_anchor(staged):
    src, _ = staged
    pages = {p.relative_to(src) for p in src.rglob("*") if p.suffix in (".md", ".ipynb")}
    bad = []
    for page in pages:
        if page.suffix == ".ipynb":
            text = "\n".join(_source(c) for c in _cells(src / page) if c["cell_type"] == "markdown")
        else:
            text = (src / page).read_text()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code holds no links
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            path = Path(target.partition("#")[0])
            resolved = (src / page.parent / path).resolve()
            if not resolved.is_file() or resolved.relative_to(src.resolve()) not in pages:
                bad.append(f"{page}: {target}")
    assert not bad, bad


def test_the_generated_pages(staged):
    src, _ = staged
    measured = (src / "measured.md").read_text()
    assert measured.startswith("# Measured numbers")
    if "dpcourse doctor" in (ROOT / "lessons" / "00_start_here.ipynb").read_text():
        assert "## The machine" in measured and "dpcourse doctor" in measured
    assert re.search(r"\d\s*(ms|samples/s|GB/s)", measured), "no measurement on the page"
    bench = (src / "benchmarks.md").read_text()
    assert "python -m dpcourse.bench allreduce" in bench
    for command in ("ddp", "scaling", "single", "scaling --tf"):   # one section per benchmark
        assert f"## `python -m dpcourse.bench {command}`" in bench
    index = (src / "index.md").read_text()
    assert index.startswith((ROOT / "README.md").read_text().splitlines()[0])
    assert ":caption: Solutions" in index and "lessons/INSTRUCTOR_GUIDE" in index
    # the maintainers' page is a page of the site, and README's link to it stays on the site
    assert (src / "ARCHITECTURE.md").read_text().startswith("# Architecture")
    assert "\nARCHITECTURE\n" in index and "](ARCHITECTURE.md)" in index
    # the learners' one-page handout is a page too (README and the guide link it)
    assert "lessons/HANDOUT" in index and (src / "lessons" / "HANDOUT.md").exists()


def test_readme_requirements_and_the_pages_workflow_agree_on_one_build():
    site = _readme_block("site")
    assert site.strip() == "python website/build.py"
    readme = (ROOT / "README.md").read_text()
    assert "_site/index.html" in readme.split("<!-- site -->", 1)[1][:600] or \
        "_site/index.html" in readme.split("<!-- site -->", 1)[0][-800:]
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version
    missing = [name for name in BUILDER if name not in pins]
    assert not missing, f"requirements.txt does not pin {missing}"
    workflow = (ROOT / ".github" / "workflows" / "pages.yml").read_text()
    assert "python website/build.py" in workflow
    assert "path: _site" in workflow and "actions/deploy-pages" in workflow
    for name in BUILDER:  # the workflow installs exactly the builder's pins
        assert name in workflow, name
    assert "/_site/" in (ROOT / ".gitignore").read_text().splitlines()
