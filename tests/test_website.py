"""The course's website (README, "The course as a website"): fast checks without a browser.

The site itself is built (with the network cut off) and read in Chromium by
tests/browser/test_site.py; here: the staged pages the build makes from the stored notebooks —
the English edition and the Chinese one (``_site/zh/``, from ``zh/``), with the language switch
between them —, the one setting the run links come from, the Chinese search index (one small
Sphinx build), and that README, requirements and the Pages workflow agree on one command. (Not
named test_site.py: two test modules may not share a basename.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import posixpath
import re
import subprocess
import sys
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
def work(tmp_path_factory):
    """Both editions staged, as `python website/build.py` stages them (Sphinx not run)."""
    work = tmp_path_factory.mktemp("site")
    totals = build.stage_site(work, build.repository())
    return work, totals


@pytest.fixture(scope="module")
def staged(work):
    """The English edition: its staged sources and its counts."""
    return work[0] / "en" / "src", work[1]["en"]


@pytest.fixture(scope="module")
def staged_zh(work):
    """The Chinese edition: its staged sources and its counts."""
    return work[0] / "zh" / "src", work[1]["zh"]


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


def _check_staged(src: Path, totals: dict, pages: dict[Path, Path]) -> None:
    """Each staged page (``pages``: staged path -> the notebook it was made from) keeps every
    cell and figure, gains the run box right after its title, keeps folded cells folded and
    shows no widget; the build's counts are those cells."""
    folded = widgets = 0
    for page, source in pages.items():
        original, copy = _cells(ROOT / source), _cells(src / page)
        assert len(copy) == len(original) + 1  # the "Run this page" box
        box = next(i for i, c in enumerate(copy) if c.get("id") == "dpcourse-run-this-page")
        title = next((i for i, c in enumerate(original) if c["cell_type"] == "markdown"
                      and re.search(r"^# ", _source(c), re.M)), None)
        if title is not None:  # the box follows the title, not a generated header above it
            assert box == title + 1, (page, box, title)
        copy = [c for c in copy if c.get("id") != "dpcourse-run-this-page"]
        for before, after in zip(original, copy):
            hidden = before.get("metadata", {}).get("jupyter", {})
            tags = set(after.get("metadata", {}).get("tags", []))
            if before["cell_type"] == "markdown":
                if hidden.get("source_hidden") and not _source(before).lstrip().startswith(
                        "<details"):  # a lab's hint: a <details> block on the page
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
    assert totals["notebooks"] == len(pages)


def test_folded_cells_stay_folded_and_widgets_leave_their_static_fallback(staged):
    src, totals = staged
    pages = build.course_pages()
    _check_staged(src, totals, {p: p for p in pages["course"] + pages["solutions"]})


def test_the_chinese_edition_stages_every_chinese_notebook_by_the_same_rules(staged_zh):
    src, totals = staged_zh
    zh = build.zh_pages()
    built = sorted(p.relative_to(ROOT / "zh") for folder in ("lessons", "labs", "solutions")
                   for p in (ROOT / "zh" / folder).glob("*.ipynb"))
    assert sorted(zh) == built and zh, "a Chinese notebook without its page (or none at all)"
    assert all(chinese == Path("zh") / english for english, chinese in zh.items())
    # the Chinese pages sit at the English pages' paths: the language switch keeps the path
    staged = sorted(p.relative_to(src) for p in src.rglob("*.ipynb"))
    assert staged == sorted(zh)
    _check_staged(src, totals, zh)
    # the Chinese documents (README, guide, handout) that zh/ holds are pages too
    docs = build.zh_docs()
    assert sorted(p.relative_to(src) for p in src.rglob("*.md")) == sorted([*docs, Path("index.md")])
    for page, doc in docs.items():
        assert (src / page).read_text().split("\n# ", 1)[-1][:40] == \
            (ROOT / doc).read_text().split("\n# ", 1)[-1][:40], page


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


@pytest.mark.parametrize("edition", ["en", "zh"])
def test_every_relative_link_in_the_staged_pages_is_a_page_or_an_anchor(work, edition):
    src = work[0] / edition / "src"
    other = build.TO_ZH if edition == "en" else build.TO_EN
    other_pages = {p.relative_to(work[0]).as_posix() for p in work[0].rglob("*")
                   if p.suffix in (".md", ".ipynb")}
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
            if target.startswith(other):  # a page of the other edition: it must be there
                name = target.removeprefix(other).partition("#")[0].removesuffix(".html")
                theirs = "zh" if edition == "en" else "en"
                if not ({f"{theirs}/src/{name}.md", f"{theirs}/src/{name}.ipynb"} & other_pages):
                    bad.append(f"{page}: {target}")
                continue
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


def test_the_chinese_run_box_is_in_chinese_and_opens_the_chinese_notebook(staged_zh):
    src, _ = staged_zh
    repo = _repository().rstrip("/")
    owner_repo = repo.removeprefix("https://github.com/")
    zh = build.zh_pages()
    for page in (next(iter(zh)), next(p for p in zh if p.parts[0] != "lessons")):
        box = next(_source(c) for c in _cells(src / page) if c.get("id") == "dpcourse-run-this-page")
        path = f"zh/{page.as_posix()}"
        assert box.startswith(":::{admonition} 运行本页"), box[:80]
        assert f"https://mybinder.org/v2/gh/{owner_repo}/main?urlpath=lab/tree/{path}" in box
        assert f"https://colab.research.google.com/github/{owner_repo}/blob/main/{path}" in box
        assert f"jupyter lab --notebook-dir=. {path}" in box
        assert f"`{build.install_line(repo)}`" in box
        assert "`cpu` 配置" in box and "`one-gpu` 配置" in box and "Run this page" not in box


def test_the_chinese_home_page(staged_zh):
    src, _ = staged_zh
    index = (src / "index.md").read_text()
    assert index.startswith("# dpcourse 中文版")
    intro = index.split("\n## ", 1)[0]
    cjk = len(re.findall(r"[\u4e00-\u9fff]", intro))
    assert cjk > 0.4 * len(re.sub(r"\s|`[^`]*`|\([^)]*\)", "", intro)), "the intro is not Chinese"
    # it says what a learner meets in a lab: the check messages are in English
    assert "实验检查的提示信息是英文的" in intro and "LabCheckError" in intro
    assert "jupyter lab --notebook-dir=. zh/lessons/00_start_here.ipynb" in intro
    # the tables of contents, in Chinese: every Chinese page, the reference pages in English
    assert ":caption: 课程：课与实验" in index and ":caption: 参考答案" in index
    for page in build.zh_pages():
        assert f"\n{page.with_suffix('').as_posix()}\n" in index, page
        assert f"]({page.as_posix()})" in index, page  # and in the list of lessons
    # the reference pages: the Chinese document where zh/ has one, else the English page
    docs = build.zh_docs()
    for page in build._reference():
        if page in docs:
            assert f"\n{page.with_suffix('').as_posix()}\n" in index, page
        else:
            assert f"（英文） <{build.TO_EN}{build.html(page)}>" in index, page
    if Path("README.md") in docs:  # the whole Chinese README is a page beside the home page
        assert "\nREADME\n" in index and "](README.md)" in index


def _switches(work: Path) -> dict[str, dict]:
    return {e: json.loads((work / e / "src" / "_switch.json").read_text()) for e in ("en", "zh")}


ROOTS = {"en": "", "zh": "zh/"}  # where each edition lies in _site/


def _landing(edition: str, page: str, href: str) -> tuple[str, str]:
    """Where a switch link of ``page`` leads in the built site: (edition, page)."""
    landed = posixpath.normpath(posixpath.join(posixpath.dirname(ROOTS[edition] + page), href))
    assert not landed.startswith("../"), (page, href, "leaves the site")
    if landed.startswith("zh/"):
        return "zh", landed.removeprefix("zh/").removesuffix(".html")
    return "en", landed.removesuffix(".html")


def test_every_page_switches_language_to_the_same_page_and_back(work):
    work, _ = work
    switches = _switches(work)
    names = {e: build.docnames(work / e / "src") for e in ("en", "zh")}
    # the Chinese pages keep the English pages' paths; the Chinese README is the one page of
    # its own (the English README is the home page, where its switch leads)
    assert names["zh"] - {"README"} <= names["en"]
    for edition, other in (("en", "zh"), ("zh", "en")):
        assert set(switches[edition]) == names[edition]  # every page, search and genindex too
        for page, link in switches[edition].items():
            href = link["href"]
            assert not re.match(r"^([a-z][a-z0-9+.-]*:|/)", href), f"{page}: {href} is not relative"
            assert link["label"] == ("中文" if edition == "en" else "English")
            landed_in, target = _landing(edition, page, href)
            assert landed_in == other and target in names[other], (edition, page, href)
            if page in names[other]:  # the same page, and its own switch leads back here
                assert target == page and link["same"], (edition, page, href)
                back = switches[other][target]["href"]
                assert _landing(other, target, back) == (edition, page), (page, href, back)
            else:
                assert target == "index" and not link["same"], (edition, page, href)


def test_a_page_without_its_chinese_notebook_is_the_english_page(tmp_path, monkeypatch):
    """While a notebook waits for its translation, the Chinese site's table of contents, lesson
    list and links lead to the English page, and the English page's switch to the Chinese
    home page."""
    zh = build.zh_pages()
    lesson = next((p for p in zh if p.parts[0] == "lessons" and
                   any(lab.parts[0] == "labs" and lab.name[3:5] == p.name[:2] for lab in zh)),
                  None)
    if lesson is None:
        pytest.skip("no Chinese lesson with its Chinese lab yet")
    lab = next(p for p in zh if p.parts[0] == "labs" and p.name[3:5] == lesson.name[:2])
    monkeypatch.setattr(build, "zh_pages", lambda: {k: v for k, v in zh.items() if k != lab})
    build.stage_site(tmp_path, build.repository())
    src = tmp_path / "zh" / "src"
    assert not (src / lab).exists()
    english = f"{build.TO_EN}{build.html(lab)}"
    index = (src / "index.md").read_text()
    assert f"（英文） <{english}>" in index and f"（英文）]({english})" in index
    text = "\n".join(_source(c) for c in _cells(src / lesson) if c["cell_type"] == "markdown")
    if f"../labs/{lab.name}" in json.dumps(_cells(ROOT / "zh" / lesson)):
        assert english in text and f"](../labs/{lab.name})" not in text
    switches = _switches(tmp_path)
    assert switches["en"][lab.with_suffix("").as_posix()]["href"] == "../zh/index.html"
    assert lab.with_suffix("").as_posix() not in switches["zh"]


def test_relink_makes_the_other_editions_address_relative(tmp_path):
    (tmp_path / "lessons").mkdir()
    (tmp_path / "index.html").write_text(f'<a href="{build.TO_EN}index.html">')
    (tmp_path / "lessons" / "a.html").write_text(f'<a href="{build.TO_EN}labs/b.html#x">')
    (tmp_path / "plain.html").write_text('<a href="lessons/a.html">')
    assert build.relink(tmp_path, build.TO_EN, "../") == 2
    assert (tmp_path / "index.html").read_text() == '<a href="../index.html">'
    assert (tmp_path / "lessons" / "a.html").read_text() == '<a href="../../labs/b.html#x">'


def test_the_chinese_search_index_holds_chinese_words_on_their_pages(staged_zh, tmp_path):
    """The Chinese search of one small Sphinx build (language zh_CN, the site's conf.py): its
    searchindex.js maps 梯度 and the glossary's 数据并行 (a whole word only through build.py's
    word list: jieba alone cuts it into 数据 and 并行) to the page that holds them, and not to
    a page without them."""
    assert importlib.util.find_spec("jieba"), \
        "jieba is not installed: the Chinese site's search finds no Chinese (pip install -r requirements.txt)"
    assert {"数据并行", "梯度"} <= set(build.search_words())
    src_zh, _ = staged_zh
    page = next(p for p in build.zh_pages() if p.parts[0] == "lessons")
    text = "\n".join(_source(c) for c in _cells(src_zh / page) if c["cell_type"] == "markdown")
    assert "数据并行" in text and "梯度" in text, page
    src = tmp_path / "src"
    (src / page.parent).mkdir(parents=True)
    (src / page).write_text((src_zh / page).read_text())
    (src / "plain.md").write_text("# Plain\n\nEnglish only: set_epoch.\n")
    (src / "index.md").write_text(f"# 首页\n\n```{{toctree}}\n{page.with_suffix('').as_posix()}\n"
                                  "plain\n```\n")
    words = tmp_path / "words.txt"
    words.write_text("".join(f"{w}\n" for w in build.search_words()))
    env = dict(os.environ, DPCOURSE_SITE_REPOSITORY=build.repository())
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q",
                           "-c", str(ROOT / "website"), "-D", "language=zh_CN",
                           "-D", f"html_search_options.dict={words}", str(src),
                           str(tmp_path / "html")], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    js = (tmp_path / "html" / "searchindex.js").read_text()
    index = json.loads(js[js.index("(") + 1:js.rindex(")")])
    def pages_of(term):
        found = index["terms"].get(term, [])
        return {index["docnames"][i] for i in ([found] if isinstance(found, int) else found)}
    lesson = page.with_suffix("").as_posix()
    assert pages_of("数据并行") == {lesson} and pages_of("梯度") == {lesson}, \
        (pages_of("数据并行"), pages_of("梯度"))
    assert "plain" in pages_of("set_epoch")  # English words are still found
    # and the search page can use it: Sphinx 9.0's stemmer name is repaired (conf.py)
    assert "window.Stemmer = EnglishStemmer" in \
        (tmp_path / "html" / "_static" / "language_data.js").read_text()


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
    # the Chinese site's search cuts Chinese into words with jieba (Sphinx's zh search)
    assert "jieba" in pins, "requirements.txt does not pin jieba"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(BUILDER) | {"jieba"} <= set(extras["site"]), extras["site"]
    workflow = (ROOT / ".github" / "workflows" / "pages.yml").read_text()
    assert "python website/build.py" in workflow
    assert "path: _site" in workflow and "actions/deploy-pages" in workflow
    for name in BUILDER:  # the workflow installs exactly the builder's pins
        assert name in workflow, name
    assert "/_site/" in (ROOT / ".gitignore").read_text().splitlines()
