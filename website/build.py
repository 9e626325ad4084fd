"""Build the course's website into ``_site/`` from the stored notebooks, offline:

    python website/build.py            # then open _site/index.html (中文版: _site/zh/index.html)

Two editions, one build: the English site in ``_site/`` and the Chinese edition in
``_site/zh/``, from the generated Chinese notebooks ``zh/lessons``, ``zh/labs`` and
``zh/solutions`` (ARCHITECTURE, "The Chinese edition"). What it does, in order, without executing
any notebook (CI already executed and compared them):

1. stages a copy of the English pages under ``<work>/en/src/``: README.md as the home page, every
   lesson, lab and solution notebook, the instructor guide, and two generated pages (the
   benchmark commands, and the numbers the lessons measured with the machine they ran on);
   and the Chinese pages under ``<work>/zh/src/``, at the same paths: every Chinese notebook
   built so far, the Chinese README, guide and handout where ``zh/`` holds them (``ZH_DOCS``),
   and a generated Chinese home page. A page without its Chinese version yet is the English
   page in the Chinese site's table of contents and links;
2. on the staged notebooks only: a folded cell (``metadata.jupyter.source_hidden`` /
   ``outputs_hidden``, what JupyterLab folds) gets myst-nb's ``hide-input`` / ``hide-output`` /
   ``hide-cell`` tag, so it stays folded on the page as a click-to-open block (a folded text
   cell, a lab's hint, becomes an HTML ``<details>`` block); a widget's output
   (it needs a live kernel) is replaced by its stored plain-text fallback, the static figure
   beside it stays; a "Run this page" box (local command, Binder, Colab; in Chinese on a
   Chinese page, for the ``zh/`` notebook) follows the title;
   a link to a file that is not a page goes to the file in the repository;
3. runs Sphinx (myst-nb, sphinx-book-theme) on both editions side by side (two processes), the
   Chinese one with ``language = zh_CN`` (its search index cuts Chinese into words with
   ``jieba``, the glossary's terms as whole words), into ``_site/`` and ``_site/zh/``. Every page
   has a language switch near its top (``website/_templates/dpcourse-language.html``): the same
   page in the other edition, or its home page where the other edition has none. Every link
   between the editions is relative, so the site works from ``file://`` and from any subpath.

The repository's address is read from pyproject.toml's ``[project.urls] Repository`` — the one
place it is written.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import subprocess
import tomllib
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
ZH = Path("zh")  # the Chinese edition's notebooks, at the English ones' paths below it
# A link from one edition to a page of the other is written with one of these placeholder
# addresses (a toctree entry is a page of its own project or an absolute URL, nothing else) and
# made relative in the built pages (``relink``): the site must work from file:// and from any
# subpath. ``.invalid`` can never resolve (RFC 2606), so a placeholder left behind fails loudly.
TO_EN = "https://en.dpcourse.invalid/"
TO_ZH = "https://zh.dpcourse.invalid/"
# the language switch on every page: the other edition's root, from this edition's root
SWITCH = {"en": {"other": "zh/", "label": "中文", "lang": "zh-CN", "title": "中文版"},
          "zh": {"other": "../", "label": "English", "lang": "en",
                 "title": "The English edition"}}
# The Chinese documents (``python -m dpcourse translate build`` writes them from zh/text/docs/):
# where each is a page of the Chinese site -> its file. The guide and the handout take the
# English pages' paths (the language switch keeps the path); the Chinese README is a page of its
# own, beside the generated home page.
ZH_DOCS = {Path("README.md"): ZH / "README.md",
           Path("lessons/INSTRUCTOR_GUIDE.md"): ZH / "INSTRUCTOR_GUIDE.md",
           Path("lessons/HANDOUT.md"): ZH / "HANDOUT.md"}
# the Chinese home page's names for the reference pages (English only where zh/ has none)
ZH_REFERENCE = {Path("lessons/INSTRUCTOR_GUIDE.md"): "讲师指南",
                Path("lessons/HANDOUT.md"): "学员讲义",
                Path("ARCHITECTURE.md"): "课程架构",
                Path("benchmarks.md"): "基准测试命令",
                Path("measured.md"): "实测数据"}


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


def zh_pages() -> dict[Path, Path]:
    """English notebook -> its Chinese notebook (``zh/`` + the same path), relative to the root,
    for those built so far (``python -m dpcourse translate build``), in course order."""
    pages = course_pages()
    return {page: ZH / page for page in pages["course"] + pages["solutions"]
            if (ROOT / ZH / page).is_file()}


def zh_docs() -> dict[Path, Path]:
    """The Chinese documents built so far: their page in the Chinese site -> their file."""
    return {page: doc for page, doc in ZH_DOCS.items() if (ROOT / doc).is_file()}


def html(page: Path) -> str:
    """A staged page's address in its edition, relative to the edition's root."""
    return page.with_suffix(".html").as_posix()


# ---------------------------------------------------------------------------------------------
# links

LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def rewrite_links(text: str, page: Path, pages: set[Path] | dict[Path, Path], repo: str,
                  elsewhere: dict[Path, str] | None = None, at: Path | None = None) -> str:
    """Relative links in markdown, resolved from ``page`` (its path in the repository), for the
    page staged ``at`` (default: the same path): to a page of this edition (``pages``: their
    paths in the repository, or a mapping of those to where they are staged), a link to it;
    to a page of the other edition (``elsewhere``: repository path -> placeholder address), that
    page; README.md, the home page; any other file of the repository, the file on GitHub."""
    elsewhere = elsewhere or {}
    at = at or page
    staged = pages if isinstance(pages, dict) else {p: p for p in pages}

    def fix(match):
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = Path(os.path.normpath(page.parent / path))
        if resolved in staged:
            if at == page and staged[resolved] == resolved:
                return match.group(0)
            new = Path(os.path.relpath(staged[resolved], at.parent)).as_posix()
        elif resolved in elsewhere:
            new = elsewhere[resolved]
        elif resolved == Path("README.md"):
            new = os.path.relpath("index.md", at.parent)
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


def run_box(path: Path, repo: str, lang: str = "en") -> str:
    """The "Run this page" box for the notebook at ``path`` (its path in the repository: a
    Chinese page's commands open its ``zh/`` notebook), in the page's language."""
    owner_repo = repo.removeprefix("https://github.com/")
    binder = f"https://mybinder.org/v2/gh/{owner_repo}/{BRANCH}?urlpath=lab/tree/{path.as_posix()}"
    colab = f"https://colab.research.google.com/github/{owner_repo}/blob/{BRANCH}/{path.as_posix()}"
    if lang == "zh":
        return "\n".join([
            ":::{admonition} 运行本页",
            ":class: tip dpcourse-run",
            f"- **在你自己的机器上**：按 README 的说明安装之后，在仓库根目录运行 "
            f"`jupyter lab --notebook-dir=. {path.as_posix()}`。",
            f"- **[在 Binder 中打开]({binder})**：在 JupyterLab 中使用固定版本的 CPU 环境"
            "（`cpu` 配置），交互部件（widget）可用；第一次启动要先构建镜像，速度较慢"
            "（使用 PyTorch 仅 CPU 索引的镜像构建尚未实际运行过）。",
            f"- **[在 Colab 中打开]({colab})**：从头运行本页。它的第一个单元格会把课程安装到 "
            f"Colab 中（`{install_line(repo)}`，即生成本页的版本）；如果 Colab 自带的 torch 或 "
            "TensorFlow 版本课程无法使用，它会指出来，并给出修复用的 `%pip` 命令。CPU 运行时"
            "使用 `cpu` 配置，GPU 运行时在 Colab 的 GPU 上使用 `one-gpu` 配置。尚未在 Colab "
            "上实际试过：这个单元格的安装过程已在离线环境中测试过，测试对象是单独打开的一课和"
            "一个实验（见 README 的 *Which install?*）。",
            ":::",
        ])
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


def _title_cell(cells: list[dict]) -> int:
    """The index of the cell holding the page's title (its first "# " heading); else of the
    first text cell (a generated lab's or Chinese notebook's header comes before the title);
    -1 when there is no text cell."""
    texts = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    for i in texts:
        if any(line.startswith("# ") for line in _source(cells[i]).splitlines()):
            return i
    return texts[0] if texts else -1


def stage_notebook(path: Path, dest: Path, pages: set[Path] | dict[Path, Path], repo: str,
                   elsewhere: dict[Path, str] | None = None, lang: str = "en",
                   at: Path | None = None) -> dict:
    """Stage the notebook at ``path`` (in the repository) as ``dest`` (its page ``at``, when
    not at ``path``): folded cells stay folded, widgets leave their fallback, the run box (in
    ``lang``) follows the title."""
    nb = json.loads((ROOT / path).read_text())
    counts = {"folded": 0, "widgets": 0}
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            cell["source"] = rewrite_links(_source(cell), path, pages, repo, elsewhere, at)
            if (cell.get("metadata", {}).get("jupyter", {}).get("source_hidden")
                    and not cell["source"].lstrip().startswith("<details")):
                # A folded text cell (a lab's hint): a click-to-open block on the page too. The
                # visible label before it says what it holds. (A lesson's folded text is its
                # own <details> block already: never folded twice.)
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
           "source": run_box(path, repo, lang)}
    nb["cells"].insert(_title_cell(nb["cells"]) + 1, box)
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


def _toctree(caption: str, entries: list[str]) -> str:
    names = "\n".join(entries)
    return f"```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{names}\n```\n"


def _docname(page: Path) -> str:
    return page.with_suffix("").as_posix()


def home_page(pages: dict[str, list[Path]], repo: str, known: set[Path],
              elsewhere: dict[Path, str] | None = None) -> str:
    readme = rewrite_links((ROOT / "README.md").read_text(), Path("index.md"), known, repo,
                           elsewhere)
    reference = [p for p in (*DOC_PAGES, Path("benchmarks.md"), Path("measured.md"))
                 if p in known]
    return "\n".join([readme.rstrip(), "",
                      _toctree("Course: lessons and labs", [_docname(p) for p in pages["course"]]),
                      _toctree("Solutions", [_docname(p) for p in pages["solutions"]]),
                      _toctree("Reference", [_docname(p) for p in reference])])


def zh_home_page(pages: dict[str, list[Path]], zh: dict[Path, Path], repo: str,
                 reference: list[Path], docs: dict[Path, Path] | None = None) -> str:
    """The Chinese edition's home page, generated: what the edition is (lab check messages
    stay in English), how to run it, the lessons with their labs and solutions, and the
    reference pages (English only). A page without its Chinese notebook yet is its English
    page, in the list and in the table of contents."""
    def title(page: Path) -> str:
        return _title(json.loads((ROOT / zh.get(page, page)).read_text()), page.stem)

    def link(page: Path, label: str | None = None) -> str:
        if page in zh:
            return f"[{label or title(page)}]({page.as_posix()})"
        return f"[{label or title(page)}（英文）]({TO_EN}{html(page)})"

    def entry(page: Path) -> str:  # a toctree line: this edition's page, or the English one
        return _docname(page) if page in zh else f"{title(page)}（英文） <{TO_EN}{html(page)}>"

    by_number = lambda folder: {_number(p): p for p in pages["course"] + pages["solutions"]  # noqa: E731
                                if p.parts[0] == folder}
    labs, solutions = by_number("labs"), by_number("solutions")
    course = []
    for lesson in (p for p in pages["course"] if p.parts[0] == "lessons"):
        course.append(f"- {link(lesson)}")
        number = _number(lesson)
        if number in labs:
            answer = f"（{link(solutions[number], '参考答案')}）" if number in solutions else ""
            course.append(f"  - {link(labs[number])}{answer}")
    docs = docs or {}

    def ref_name(page: Path) -> str:
        return ZH_REFERENCE.get(page, page.stem) + ("" if page in docs else "（英文）")

    def ref_link(page: Path) -> str:
        return page.as_posix() if page in docs else f"{TO_EN}{html(page)}"

    def ref_entry(page: Path) -> str:
        return _docname(page) if page in docs else f"{ref_name(page)} <{TO_EN}{html(page)}>"

    readme = Path("README.md")
    glossary = f"{repo}/blob/{BRANCH}/zh/glossary.md"
    first = next(iter(zh.values()), ZH / "lessons" / "00_start_here.ipynb").as_posix()
    parts = [
        "# dpcourse 中文版：数据并行，从单个设备到环形 AllReduce", "",
        "这是 dpcourse 的中文版。dpcourse 是一门动手实践的数据并行课程：从单个设备上的 PyTorch "
        "训练循环讲起，经过 `nn.DataParallel`、DistributedDataParallel (DDP) 和 TensorFlow 的 "
        "`MirroredStrategy`，深入到搬运梯度的环形 AllReduce、ZeRO 与 FSDP，最后说明数据并行在"
        "哪里走到尽头、之后是什么。每一课都是一个 Jupyter notebook，在只有 CPU 的机器上也能"
        "运行；大多数课后面跟着一个实验，实验的参考答案单独成页。", "",
        "**这一版是怎么来的。** 中文 notebook 由英文 notebook 自动生成：只翻译了正文，代码单元格、"
        "输出和图都与英文版完全相同，没有重新执行。术语的译法统一遵循"
        f"[术语表]({glossary})。", "",
        "**实验检查的提示信息是英文的。** 实验的检查单元格（lab check）在中文版中仍用英文报告"
        "结果：通过时打印一行以 ✔ 开头的英文，出错时抛出 `LabCheckError`，用一句英文指出错误的"
        "原因和改法。", "",
        "**怎样运行。** 按 "
        + (f"[中文 README]({readme.as_posix()})（或[英文主页]({TO_EN}index.html)）"
           if readme in docs else f"英文主页（[README]({TO_EN}index.html)）")
        + "的说明安装课程之后，在仓库根目录运行：", "",
        "```bash", f"jupyter lab --notebook-dir=. {first}", "```", "",
        "每一页标题下的“运行本页”方框给出这一页的本地命令，以及 Binder 和 Colab 的链接；"
        "每页顶部的 **English** 链接切换到同一页的英文版。本站的搜索能找到中文词语，"
        "例如“梯度”“数据并行”。", "",
        "## 课程", "",
        *course, "",
        "## 参考资料", "",
        "标有“（英文）”的页面暂时只有英文版：", "",
        *([f"- [完整的中文 README]({readme.as_posix()})"] if readme in docs else []),
        *[f"- [{ref_name(p)}]({ref_link(p)})" for p in reference], "",
        _toctree("课程：课与实验", [entry(p) for p in pages["course"]]),
        _toctree("参考答案", [entry(p) for p in pages["solutions"]]),
        _toctree("参考资料", ([_docname(readme)] if readme in docs else [])
                 + [ref_entry(p) for p in reference]),
    ]
    return "\n".join(parts)


def search_words() -> list[str]:
    """The glossary's Chinese renderings (zh/glossary.md, second column), for jieba as whole
    words: without them the Chinese search index cuts 数据并行 into 数据 and 并行 only, and a
    search for the course's own term finds nothing."""
    words = []
    glossary = ROOT / ZH / "glossary.md"
    if not glossary.exists():
        return words
    for line in glossary.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not line.lstrip().startswith("|"):
            continue
        for word in cells[1].split("/"):
            word = word.strip()
            if re.fullmatch(r"[\u4e00-\u9fff]{2,}", word) and word not in words:
                words.append(word)
    return words


# ---------------------------------------------------------------------------------------------

def _reset(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _reference() -> list[Path]:
    """The reference pages of the English site: the repository's documents, then the two
    generated pages."""
    docs = [doc for doc in DOC_PAGES if (ROOT / doc).exists()]
    return docs + [Path("benchmarks.md"), Path("measured.md")]


def stage(src: Path, repo: str) -> dict:
    """The English edition's pages, staged into ``src``."""
    _reset(src)
    pages = course_pages()
    lessons = [p for p in pages["course"] if p.parts[0] == "lessons"]
    known = set(pages["course"]) | set(pages["solutions"])
    known |= {Path("benchmarks.md"), Path("measured.md")}
    docs = [doc for doc in DOC_PAGES if (ROOT / doc).exists()]
    known |= set(docs)   # all of them first: the guide and README link to each other's pages
    # README's links to a Chinese notebook or document: that page of the Chinese site
    elsewhere = {ZH / page: TO_ZH + html(page) for page in zh_pages()}
    elsewhere |= {doc: TO_ZH + html(page) for page, doc in zh_docs().items()}
    for doc in docs:
        (src / doc).parent.mkdir(parents=True, exist_ok=True)
        (src / doc).write_text(rewrite_links((ROOT / doc).read_text(), doc, known, repo,
                                             elsewhere))
    totals = {"folded": 0, "widgets": 0, "notebooks": 0}
    for path in pages["course"] + pages["solutions"]:
        counts = stage_notebook(path, src / path, known, repo, elsewhere)
        totals["folded"] += counts["folded"]
        totals["widgets"] += counts["widgets"]
        totals["notebooks"] += 1
    (src / "benchmarks.md").write_text(benchmarks_page())
    (src / "measured.md").write_text(measured_page(lessons))
    (src / "index.md").write_text(home_page(pages, repo, known, elsewhere))
    return totals


def stage_zh(src: Path, repo: str) -> dict:
    """The Chinese edition's pages, staged into ``src``: every Chinese notebook built so far at
    its English page's path, the Chinese documents (``ZH_DOCS``), and the Chinese home page. A
    link to a page with no Chinese version, to README or to ARCHITECTURE goes to the English
    site."""
    _reset(src)
    pages = course_pages()
    zh, docs = zh_pages(), zh_docs()
    # links are resolved from each file's place in zh/, and point to where its page is staged
    known = {chinese: english for english, chinese in zh.items()}
    known |= {doc: page for page, doc in docs.items()}
    reference = _reference()
    elsewhere = {Path("README.md"): TO_EN + "index.html"}
    for page in pages["course"] + pages["solutions"] + reference:
        elsewhere[page] = TO_EN + html(page)
        elsewhere[ZH / page] = TO_EN + html(page)  # a Chinese page not built yet
    for page, doc in docs.items():
        (src / page).parent.mkdir(parents=True, exist_ok=True)
        (src / page).write_text(rewrite_links((ROOT / doc).read_text(), doc, known, repo,
                                              elsewhere, at=page))
    totals = {"folded": 0, "widgets": 0, "notebooks": 0}
    for english, chinese in zh.items():
        counts = stage_notebook(chinese, src / english, known, repo, elsewhere, lang="zh",
                                at=english)
        totals["folded"] += counts["folded"]
        totals["widgets"] += counts["widgets"]
        totals["notebooks"] += 1
    (src / "index.md").write_text(zh_home_page(pages, zh, repo, reference, docs))
    return totals


def docnames(src: Path) -> set[str]:
    """The pages Sphinx makes from a staged edition: one per source, plus its own two."""
    return {_docname(p.relative_to(src)) for p in src.rglob("*")
            if p.suffix in (".md", ".ipynb")} | {"search", "genindex"}


def language_switch(edition: str, pages: set[str], other: set[str]) -> dict[str, dict]:
    """Every page's link to the other edition, relative: the same page where the other edition
    has it, else the other edition's home page."""
    switch = SWITCH[edition]
    links = {}
    for page in sorted(pages):
        target = page if page in other else "index"
        href = "../" * page.count("/") + switch["other"] + target + ".html"
        links[page] = {"href": href, "label": switch["label"], "lang": switch["lang"],
                       "title": switch["title"], "same": target == page}
    return links


def stage_site(work: Path, repo: str) -> dict:
    """Both editions, staged into ``<work>/en/src`` and ``<work>/zh/src``, each with its pages'
    language switch (``_switch.json``, read by conf.py) and the Chinese search's word list."""
    totals = {"en": stage(work / "en" / "src", repo), "zh": stage_zh(work / "zh" / "src", repo)}
    names = {edition: docnames(work / edition / "src") for edition in ("en", "zh")}
    for edition, other in (("en", "zh"), ("zh", "en")):
        links = language_switch(edition, names[edition], names[other])
        (work / edition / "src" / "_switch.json").write_text(
            json.dumps(links, ensure_ascii=False, indent=1))
    (work / "zh" / "search-words.txt").write_text("".join(f"{w}\n" for w in search_words()))
    return totals


def relink(folder: Path, placeholder: str, other_root: str) -> int:
    """In the built pages of one edition, the placeholder address of the other edition's root
    becomes a relative one (``other_root`` from this edition's root). Returns the pages changed."""
    changed = 0
    for page in folder.rglob("*.html"):
        text = page.read_text()
        if placeholder in text:
            up = "../" * (len(page.relative_to(folder).parts) - 1)
            page.write_text(text.replace(placeholder, up + other_root))
            changed += 1
    return changed


def sphinx_command(work: Path, edition: str) -> list[str]:
    """Sphinx on one staged edition: ``<work>/<edition>/src`` into ``<work>/<edition>/html``.
    Each edition has a folder of its own because myst-nb writes the notebooks' images into
    "jupyter_execute/" beside its output folder, and the two editions' notebooks share names."""
    base = work / edition
    extra = []
    if edition == "zh":
        extra = ["-D", "language=zh_CN",
                 "-D", f"html_search_options.dict={base / 'search-words.txt'}",
                 "-D", "html_title=dpcourse 中文版 —— 数据并行，从单个设备到环形 AllReduce",
                 # the theme's launch buttons open the Chinese notebook
                 "-D", f"html_theme_options.path_to_docs={ZH.as_posix()}"]
    return [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(HERE),
            "-d", str(base / "doctrees"), *extra, str(base / "src"), str(base / "html")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "_site"), help="where the site goes")
    parser.add_argument("--work", default=str(ROOT / "build" / "site"),
                        help="staged sources and Sphinx's cache (rebuilt from scratch)")
    args = parser.parse_args(argv)
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    start = time.monotonic()
    repo = repository()
    totals = stage_site(work, repo)
    if importlib.util.find_spec("jieba") is None:
        print("website: jieba is not installed, so the Chinese site's search finds English words "
              "only (pip install -r requirements.txt)", file=sys.stderr)
    # the stored notebooks' cells have no "id" (nbformat 4.4); nbformat says so once per cell
    env = dict(os.environ, DPCOURSE_SITE_REPOSITORY=repo,
               PYTHONWARNINGS="ignore:Cell is missing an id field")
    # The two editions build side by side, one process each. Sphinx writes into the work
    # folder, then the pages move to ``out``: myst-nb keeps a copy of every notebook in
    # "jupyter_execute/" beside its output folder, which must not land in the repository's root.
    runs = {}
    for edition in ("en", "zh"):
        for folder in ("doctrees", "html", "jupyter_execute"):
            if (work / edition / folder).exists():
                shutil.rmtree(work / edition / folder)
        runs[edition] = subprocess.Popen(sphinx_command(work, edition), env=env, cwd=ROOT)
    failed = {edition: run.wait() for edition, run in runs.items()}
    failed = {edition: rc for edition, rc in failed.items() if rc}
    if failed:
        print(f"sphinx-build failed: {failed}", file=sys.stderr)
        return next(iter(failed.values()))
    relink(work / "en" / "html", TO_ZH, SWITCH["en"]["other"])
    relink(work / "zh" / "html", TO_EN, SWITCH["zh"]["other"])
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(work / "en" / "html"), str(out))
    shutil.move(str(work / "zh" / "html"), str(out / "zh"))
    (out / ".nojekyll").write_text("")  # GitHub Pages: serve _static/ and _images/ as they are
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    en, zh = totals["en"], totals["zh"]
    print(f"site: {en['notebooks']} notebooks ({en['folded']} folded cells, "
          f"{en['widgets']} widgets shown by their static fallback) -> {out}/index.html; "
          f"中文版: {zh['notebooks']} notebooks ({zh['folded']} folded cells, {zh['widgets']} "
          f"widgets) -> {out}/zh/index.html; {size / 2**20:.1f} MiB, "
          f"{time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
