"""The Chinese edition: translations keyed to the English cells they translate.

The English notebooks stay the single source of code, claims and outputs; the Chinese edition
translates only their markdown. Each notebook's translation is one readable file,
``zh/text/<folder>/<stem>.md``, made of blocks; each block starts with a marker line naming the
English cell's id and a hash of the English text it was translated from::

    <!-- cell 4729d2b3 en:1f0c9e2a77b1 -->
    ## 在 notebook 中运行多个进程
    ...

A block whose English cell is gone is *orphaned*; one whose English text changed since (the
hash differs) is *stale*; a markdown cell without a block, or whose block is still marked
``untranslated`` (``update`` writes the English there), is *missing*. The build
(``python -m dpcourse build``) keeps cell ids across rebuilds (``authoring.keep_ids``), so an
English edit shows up as a stale block, never as a lost one. Labs need no file: a lab's prose
is its solution's, under the same cell ids (``authoring.make_lab`` copies them), and the lab's
generated header is translated once, here (``LAB_HEADER_ZH``).

The course's documents (``DOCUMENTS``: README.md, lessons/HANDOUT.md,
lessons/INSTRUCTOR_GUIDE.md) are translated the same way, a block per *section*: a document is
split at its ``## `` headings (outside code fences), the text before the first one being the
section ``top``; a section's id is a slug of its English heading (``quick-start``), its hash the
same ``english_hash`` of its text. Their files are ``zh/text/docs/<name>.md``; ``build`` writes
``zh/<name>.md``.

Run from the repository root::

    python -m dpcourse translate status                  # every notebook: missing, stale, orphaned
    python -m dpcourse translate update lessons/00_start_here   # add blocks for new cells, re-key
    python -m dpcourse translate update solutions/lab01_single_device --accept 4729d2b3
    python -m dpcourse translate update README.md --accept quick-start   # a document's section
    python -m dpcourse translate build                   # zh/lessons, labs, solutions, zh/*.md

``--accept ID`` says "I brought this block's Chinese up to date with the English": it writes the
English cell's current hash into the marker (and drops ``untranslated``). ``build`` executes
nothing: code cells, outputs and metadata are the stored English notebook's own.
tests/test_translations.py fails, naming the notebook and the cell, when a translation file is
stale, incomplete or orphaned, or a Chinese notebook is out of step with ``build``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import re
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

# nbformat is imported where it is used, for the reason tools/authoring.py gives.
from dpcourse.tools.authoring import ROOT

__all__ = ["Block", "Report", "english_hash", "shape", "parse", "render", "read_blocks", "status",
           "update", "translated_notebook", "build", "out_of_date", "text_path", "main",
           "EDITIONS", "Glossary", "read_glossary", "glossary_problems", "DOCUMENTS", "Section",
           "sections", "translated_document"]

EDITIONS = ("lessons", "solutions")   # the folders with a translation file per notebook
ZH = "zh"                             # the edition's own folder at the root
# the documents translated a block per `## ` section, written to zh/<name>.md
DOCUMENTS = ("README.md", "lessons/HANDOUT.md", "lessons/INSTRUCTOR_GUIDE.md")
_MARKER = re.compile(r"^<!-- cell (?P<id>[\w-]+) en:(?P<hash>[0-9a-f]{12})"
                     r"(?P<untranslated> untranslated)? -->\s*$")


def english_hash(source: str) -> str:
    """12 hex digits of sha256 over the English cell's words: whitespace is normalised, so a
    re-wrapped line, or jupytext's trailing newline, does not make a block stale."""
    return hashlib.sha256(" ".join(source.split()).encode()).hexdigest()[:12]


def first_words(source: str, n: int = 8) -> str:
    words = source.split()
    return " ".join(words[:n]) + (" …" if len(words) > n else "")


# ---- the translation file: blocks in, blocks out ------------------------------------------

@dataclass
class Block:
    """One English markdown cell's translation."""

    cell_id: str
    en_hash: str          # english_hash of the English text this was translated from
    text: str             # the Chinese markdown (or the English, while untranslated)
    untranslated: bool = False


_PREAMBLE = ("<!-- {english} 的译文。每个块以一行标记开头：英文单元格的 id 和英文原文的哈希。"
             "只改标记下面的中文；标记由 `python -m dpcourse translate update` 维护。 -->\n"
             "<!-- Translation of {english}. Edit the Chinese under each marker; the markers "
             "belong to `python -m dpcourse translate update`. -->\n")


def parse(text: str) -> list[Block]:
    """The blocks of a translation file; what precedes the first marker is its preamble."""
    blocks: list[Block] = []
    lines: list[str] = []

    def close():
        if blocks:
            blocks[-1].text = "\n".join(lines).strip("\n")

    for line in text.splitlines():
        m = _MARKER.match(line)
        if m:
            close()
            blocks.append(Block(m["id"], m["hash"], "", bool(m["untranslated"])))
            lines = []
        else:
            lines.append(line)
    close()
    ids = [b.cell_id for b in blocks]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"cell id(s) {twice} have two blocks each: keep one")
    return blocks


def render(blocks: list[Block], english: str) -> str:
    """The file for ``blocks``: a preamble, then each marker and its text, a blank line apart,
    so a translator's edit is a diff of its own lines and nothing else."""
    preamble = _PREAMBLE.format(english=english)
    if english.endswith(".md"):     # a document: a block per ## section, keyed by its heading
        preamble = preamble.replace("英文单元格的 id 和", "英文小节的 id（由它的 `## ` 标题而来）和")
    out = [preamble]
    for b in blocks:
        flag = " untranslated" if b.untranslated else ""
        out.append(f"<!-- cell {b.cell_id} en:{b.en_hash}{flag} -->\n{b.text}\n")
    return "\n".join(out)


def text_path(notebook: Path, root: Path = ROOT) -> Path:
    """``lessons/00_start_here.ipynb`` -> ``zh/text/lessons/00_start_here.md``; a document,
    ``lessons/HANDOUT.md`` -> ``zh/text/docs/HANDOUT.md``."""
    if notebook.suffix == ".md":
        return root / ZH / "text" / "docs" / notebook.name
    return root / ZH / "text" / notebook.parent.name / (notebook.stem + ".md")


def read_blocks(path: Path) -> list[Block]:
    return parse(path.read_text(encoding="utf-8")) if path.exists() else []


def _markdown(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "markdown"]


@dataclass
class Section:
    """One ``## `` section of a document: what a notebook's markdown cell is to a notebook."""

    id: str
    source: str


def _slug(heading: str) -> str:
    """A short, stable id for a heading: its first few ASCII words, lower case, hyphenated
    ("For instructors: a workshop on a shared server" -> "for-instructors-workshop-on")."""
    words = [w for w in re.findall(r"[a-z0-9]+", heading.lower()) if w not in ("a", "an", "the")]
    return "-".join(words[:4]) or "section"


def sections(markdown: str) -> list[Section]:
    """A document cut at its ``## `` headings (not at a ``## `` line inside a code fence): the
    text before the first heading is ``top``; ids are unique within the document (``-2`` …)."""
    parts: list[tuple[str, list[str]]] = [("top", [])]
    fence = None
    for line in markdown.splitlines():
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if m and fence is None:
            fence = m.group(1)
        elif m and line.strip().startswith(fence):
            fence = None
        if fence is None and line.startswith("## "):
            parts.append((_slug(line[3:]), [line]))
        else:
            parts[-1][1].append(line)
    out, seen = [], {}
    for i, (slug, lines) in enumerate(parts):
        text = "\n".join(lines).strip("\n")
        if i == 0 and not text:
            continue
        seen[slug] = seen.get(slug, 0) + 1
        out.append(Section(slug if seen[slug] == 1 else f"{slug}-{seen[slug]}", text))
    return out


def _is_document(path: Path) -> bool:
    return path.suffix == ".md"


def _units(path: Path) -> list:
    """What is translated a block each: a notebook's markdown cells, or a document's sections
    (both with ``.id`` and ``.source``)."""
    import nbformat
    if _is_document(path):
        return sections(path.read_text(encoding="utf-8"))
    return _markdown(nbformat.read(path, as_version=4))


def _documents(root: Path) -> list[Path]:
    return [root / d for d in DOCUMENTS if (root / d).exists()]


def _notebooks(root: Path) -> list[Path]:
    return [p for d in EDITIONS for p in sorted((root / d).glob("*.ipynb"))]


def _resolve(name: str, root: Path) -> Path:
    """``lessons/00_start_here``, ``00_start_here`` or a path to the .ipynb -> the notebook;
    ``README.md``, ``lessons/HANDOUT.md``, ``HANDOUT.md`` or ``HANDOUT`` -> the document."""
    docs = [p for p in _documents(root)
            if name.strip("/") in (p.relative_to(root).as_posix(), p.name, p.stem)]
    if len(docs) == 1:
        return docs[0]
    wanted = [p for p in _notebooks(root)
              if name.removesuffix(".ipynb").strip("/") in (f"{p.parent.name}/{p.stem}", p.stem)]
    if len(wanted) != 1:
        raise SystemExit(f"{name!r} names {len(wanted)} notebooks in {EDITIONS}: give "
                         f"folder/stem, e.g. lessons/00_start_here, or a document of "
                         f"{DOCUMENTS}")
    return wanted[0]


# ---- status: what is missing, stale or orphaned -------------------------------------------

@dataclass
class Report:
    """One notebook's translation state: lists of (cell id, the English cell's first words)."""

    notebook: str                  # relative to the root
    translation: str               # relative to the root
    exists: bool
    missing: list = field(default_factory=list)
    stale: list = field(default_factory=list)
    orphaned: list = field(default_factory=list)
    structure: list = field(default_factory=list)
    cells: int = 0                 # markdown cells in the English notebook (a document: sections)
    unit: str = "cell"             # what a block translates: "cell", or a document's "section"

    @property
    def ok(self) -> bool:
        return self.exists and not (self.missing or self.stale or self.orphaned or self.structure)

    def problems(self) -> list[str]:
        """One sentence per problem, naming the notebook, the cell and its first words."""
        say = {"missing": "has no Chinese yet (translate it, then --accept the id)",
               "stale": "changed in English since it was translated (update the Chinese, then "
                        "--accept the id)",
               "orphaned": "is no longer in the English notebook (delete the block)",
               "structure": "is shaped differently in Chinese: keep the English cell's headings "
                            "and its <details>/<summary> tags, in the same order"}
        return [f"{self.notebook} {self.unit} {cid} ({words!r}) {say[kind]} [{self.translation}]"
                for kind in say for cid, words in getattr(self, kind)]


def shape(markdown: str) -> list[str]:
    """What a translation must keep of its English cell's structure: heading levels (lesson
    rules and the website find sections by them) and folding HTML (``<details>``,
    ``<summary>``), in order. Folded cells are folded by their metadata, which build copies."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found = re.finditer(r"^(#{1,6})\s|<(/?(?:details|summary))\b", text, flags=re.M | re.I)
    return [m.group(1) or f"<{m.group(2).lower()}>" for m in found]


def status(notebook: Path, root: Path = ROOT) -> Report:
    """A notebook's (or a document's) translation state."""
    units = _units(notebook)
    path = text_path(notebook, root)
    rep = Report(str(notebook.relative_to(root)), str(path.relative_to(root)), path.exists(),
                 cells=len(units), unit="section" if _is_document(notebook) else "cell")
    blocks = {b.cell_id: b for b in read_blocks(path)}
    cells = {c.id: c for c in units}
    for cid, cell in cells.items():
        b = blocks.get(cid)
        if b is None or b.untranslated:
            rep.missing.append((cid, first_words(cell.source)))
        elif b.en_hash != english_hash(cell.source):
            rep.stale.append((cid, first_words(cell.source)))
        elif shape(b.text) != shape(cell.source):
            rep.structure.append((cid, first_words(cell.source)))
    rep.orphaned = [(cid, first_words(b.text)) for cid, b in blocks.items() if cid not in cells]
    return rep


# ---- update: a block for every cell, blocks re-keyed to ids that moved --------------------

def update(notebook: Path, root: Path = ROOT, accept: tuple[str, ...] = ()) -> Path:
    """Rewrite ``notebook``'s translation file in the notebook's order: a block for every
    markdown cell without one (its English text, marked ``untranslated``); an orphaned block
    re-keyed to the cell whose English hash it matches, when exactly one cell without a block
    has that hash (notebooks built before ids were stable renamed every cell); ``accept``ed
    ids take the current English hash. Orphans that match nothing stay, at the end, for a
    person to delete. A document's sections are its cells (a renamed heading is a new id).
    Returns the file's path."""
    path = text_path(notebook, root)
    blocks = {b.cell_id: b for b in read_blocks(path)}
    cells = _units(notebook)
    unclaimed = [c for c in cells if c.id not in blocks]
    for b in [b for cid, b in blocks.items() if cid not in {c.id for c in cells}]:
        same = [c for c in unclaimed if english_hash(c.source) == b.en_hash]
        if len(same) == 1:
            del blocks[b.cell_id]
            b.cell_id = same[0].id
            blocks[b.cell_id] = b
            unclaimed.remove(same[0])
    for cid in accept:
        cell = next((c for c in cells if c.id == cid), None)
        if cell is None or cid not in blocks:
            raise SystemExit(f"--accept {cid}: no such markdown cell or section with a block in "
                             f"{notebook}")
        blocks[cid].en_hash, blocks[cid].untranslated = english_hash(cell.source), False
    ordered = []
    for c in cells:
        ordered.append(blocks.pop(c.id, None) or
                       Block(c.id, english_hash(c.source), c.source.strip("\n"), True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(ordered + list(blocks.values()), str(notebook.relative_to(root))),
                    encoding="utf-8")
    return path


# ---- build: the Chinese notebooks ---------------------------------------------------------

HEADER_ZH = ("> **中文版（自动生成）** — 由 `python -m dpcourse translate build` 根据英文 notebook "
             "`{english}` 与译文 `{translation}` 生成。请勿在仓库中直接编辑此文件：修改译文后重新运行 "
             "build。代码、输出和图都与英文版相同；实验检查（lab check）的提示信息暂时保持英文。")
LAB_HEADER_ZH = ("> **自动生成的实验** — 由 `python -m dpcourse build` 从 `{source}` 生成。"
                 "请勿在仓库中编辑此文件：修改参考答案的源文件后重新构建。（学员：这份副本归你填写 —— "
                 "把每个 `# TODO` 下的 `raise NotImplementedError` 换成你的代码，然后运行它下面的检查单元格。）")
DOC_HEADER_ZH = ("> **中文版（自动生成）** — 由 `python -m dpcourse translate build` 根据英文文档 "
                 "`{english}` 与译文 `{translation}` 生成。请勿直接编辑此文件：修改译文后重新运行 "
                 "build。")
_LINK = re.compile(r"(\]\()([^)\s#]+)([^)]*\))")


def _zh_twin(english: Path, root: Path) -> Path | None:
    """Where ``english``'s Chinese edition is written, when it has one (labs follow their
    solution's translation file; a document, its translation file)."""
    rel = english.relative_to(root).as_posix() if english.is_relative_to(root) else None
    if rel in DOCUMENTS:
        return root / ZH / english.name if text_path(english, root).exists() else None
    if english.suffix != ".ipynb" or english.parent.name not in ("lessons", "labs", "solutions"):
        return None
    source = root / "solutions" / english.name if english.parent.name == "labs" else english
    return root / ZH / english.parent.name / english.name if text_path(source, root).exists() \
        else None


def _relink(text: str, english_dir: Path, zh_dir: Path, root: Path) -> str:
    """Relative links, resolved against the English notebook's folder, re-pointed from the
    Chinese folder: to the Chinese notebook where one is built, else to the English file (a
    lesson not translated yet, a file of the repository), so no link in the edition breaks."""
    def fix(m):
        target = m.group(2)
        if re.match(r"^[a-z][a-z+.-]*:", target) or target.startswith("/"):
            return m.group(0)                       # a URL or an absolute path
        english = Path(os.path.normpath(english_dir / target))
        goal = _zh_twin(english, root) or english
        return f"{m.group(1)}{Path(os.path.relpath(goal, zh_dir)).as_posix()}{m.group(3)}"
    # brackets inside code (`replicas[i](inputs[i])`) are code, not a link: leave them alone
    parts = re.split(r"(```.*?```|`[^`]*`)", text, flags=re.S)
    return "".join(p if i % 2 else _LINK.sub(fix, p) for i, p in enumerate(parts))


def _current_block(blocks: dict, block_id: str, english: str, where: str, translation: Path,
                   root: Path):
    """The translation block of one cell or section, if it is translated and current; else a
    ValueError naming the place (``where``) and why: no block, untranslated or stale."""
    b = blocks.get(block_id)
    if b is None or b.untranslated or b.en_hash != english_hash(english):
        why = "no block" if b is None else "untranslated" if b.untranslated else "stale"
        raise ValueError(f"{where} ({first_words(english)!r}): {why} in "
                         f"{translation.relative_to(root)}")
    return b


def translated_notebook(notebook: Path, root: Path = ROOT) -> nbformat.NotebookNode:
    """The Chinese notebook for an English lesson, solution or lab: a copy of the English one
    whose markdown cells hold their translation, with a header cell first. Raises ValueError
    naming the cell when a block is missing, untranslated or stale."""
    import nbformat
    nb = copy.deepcopy(nbformat.read(notebook, as_version=4))
    is_lab = notebook.parent.name == "labs"
    english = (root / "solutions" / notebook.name) if is_lab else notebook
    translation = text_path(english, root)
    blocks = {b.cell_id: b for b in read_blocks(translation)}
    zh_dir = root / ZH / notebook.parent.name
    for cell in _markdown(nb):
        if is_lab and cell.id == "generated-header":
            src = re.search(r"made from `([^`]+)`", cell.source)
            cell.source = LAB_HEADER_ZH.format(source=src.group(1) if src else english.name)
            continue
        b = _current_block(blocks, cell.id, cell.source,
                           f"{notebook.relative_to(root)} cell {cell.id}", translation, root)
        cell.source = _relink(b.text, notebook.parent, zh_dir, root)
    header = nbformat.v4.new_markdown_cell(HEADER_ZH.format(
        english=notebook.relative_to(root).as_posix(),
        translation=translation.relative_to(root).as_posix()))
    header.id = "zh-generated-header"
    header.metadata["tags"] = ["generated-header"]
    nb.cells.insert(0, header)
    return nb


def translated_document(document: Path, root: Path = ROOT) -> str:
    """The Chinese edition of a document: a do-not-edit header, then every section's block, its
    relative links re-pointed from ``zh/``. Raises ValueError naming the section when a block is
    missing, untranslated or stale."""
    translation = text_path(document, root)
    blocks = {b.cell_id: b for b in read_blocks(translation)}
    out = [DOC_HEADER_ZH.format(english=document.relative_to(root).as_posix(),
                                translation=translation.relative_to(root).as_posix())]
    for sec in sections(document.read_text(encoding="utf-8")):
        b = _current_block(blocks, sec.id, sec.source,
                           f"{document.relative_to(root)} section {sec.id}", translation, root)
        out.append(_relink(b.text, document.parent, root / ZH, root))
    return "\n\n".join(out) + "\n"


def _doc_targets(root: Path) -> list[tuple[Path, Path]]:
    """(English document, Chinese document) for every document whose translation file exists."""
    return [(doc, root / ZH / doc.name) for doc in _documents(root)
            if text_path(doc, root).exists()]


def _targets(root: Path) -> list[tuple[Path, Path]]:
    """(English notebook, Chinese notebook) for every notebook whose translation file exists;
    a lab follows its solution's file."""
    out = []
    for nbpath in _notebooks(root) + sorted((root / "labs").glob("*.ipynb")):
        english = root / "solutions" / nbpath.name if nbpath.parent.name == "labs" else nbpath
        if text_path(english, root).exists():
            out.append((nbpath, root / ZH / nbpath.parent.name / nbpath.name))
    return out


def build(root: Path = ROOT) -> list[Path]:
    """Write every Chinese notebook and document whose translation file exists; returns their
    paths. A Chinese notebook or document whose translation file is gone is deleted. One that
    cannot be built (a block missing, untranslated or stale) is left as it is while the others
    are written, then a ValueError names each of them."""
    import nbformat
    written, kept, errors = [], [], []
    for english, out in _targets(root) + _doc_targets(root):
        try:
            made = translated_document(english, root) if _is_document(english) \
                else translated_notebook(english, root)
        except ValueError as err:
            errors.append(str(err))
            kept.append(out)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if _is_document(english):
            out.write_text(made, encoding="utf-8")
        else:
            nbformat.write(made, out)
        written.append(out)
    for stray in _strays(root, written + kept):
        stray.unlink()
    if errors:
        raise ValueError("\n".join(errors))
    return written


def _strays(root: Path, expected) -> list[Path]:
    """Chinese notebooks and documents (never zh/glossary.md) not in ``expected``."""
    found = [p for folder in ("lessons", "labs", "solutions")
             for p in sorted((root / ZH / folder).glob("*.ipynb"))]
    found += [root / ZH / Path(d).name for d in DOCUMENTS if (root / ZH / Path(d).name).exists()]
    return [p for p in found if p not in expected]


def out_of_date(root: Path = ROOT) -> list[str]:
    """The Chinese notebooks and documents that differ from what ``build`` would write now (or
    are missing, or have no translation file any more), each with what to do."""
    import nbformat
    problems = []
    expected = set()
    for english, out in _targets(root):
        expected.add(out)
        try:
            want = nbformat.writes(translated_notebook(english, root))
        except ValueError as err:
            problems.append(f"{out.relative_to(root)} cannot be built: {err}")
            continue
        if not out.exists() or out.read_text(encoding="utf-8").rstrip("\n") != want.rstrip("\n"):
            problems.append(f"{out.relative_to(root)} is out of step with "
                            f"{english.relative_to(root)} and its translation: run "
                            f"python -m dpcourse translate build")
    for english, out in _doc_targets(root):
        expected.add(out)
        try:
            want = translated_document(english, root)
        except ValueError as err:
            problems.append(f"{out.relative_to(root)} cannot be built: {err}")
            continue
        if not out.exists() or out.read_text(encoding="utf-8") != want:
            problems.append(f"{out.relative_to(root)} is out of step with "
                            f"{english.relative_to(root)} and its translation: run "
                            f"python -m dpcourse translate build")
    for stray in _strays(root, expected):
        problems.append(f"{stray.relative_to(root)} has no translation file: delete it")
    return problems


# ---- the glossary: one rendering per term -------------------------------------------------

KEPT = "保留英文"   # the glossary's word for "kept in English"


@dataclass
class Glossary:
    """Term -> the course's Chinese rendering (``KEPT``: the English term stays)."""

    terms: dict[str, str]
    headings_only: frozenset = frozenset()   # terms whose note says "heading:" (e.g. Summary)

    def pattern(self, term: str) -> re.Pattern:
        """The term in English prose: a plural s/es, hyphen or space or nothing between its
        words ("all-reduce", "AllReduce", "all reduce"); any case, except for a name with two
        capitals or more (ZeRO, FSDP), so that the word "zero" is not ZeRO."""
        words = [re.escape(w) for w in re.split(r"[-\s]+", term)]
        flags = 0 if sum(ch.isupper() for ch in term) >= 2 else re.I
        return re.compile(r"(?<![\w-])" + r"[-\s]?".join(words) + r"(?:s|es)?(?![\w-])", flags)


def read_glossary(path: Path | None = None) -> Glossary:
    """The table rows of ``zh/glossary.md``: ``| term | rendering | note |``."""
    path = path or ROOT / ZH / "glossary.md"
    terms, headings_only = {}, set()
    for line in path.read_text(encoding="utf-8").splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cols) >= 2 and cols[0] and not set(cols[0]) <= set("-: ") \
                and cols[0].lower() != "english":
            terms[cols[0].strip("`")] = cols[1]
            if len(cols) >= 3 and cols[2].startswith("heading:"):
                headings_only.add(cols[0].strip("`"))
    return Glossary(terms, frozenset(headings_only))


def _prose(text: str) -> str:
    """Markdown without code, links' targets, HTML tags and comments: what a term check reads."""
    text = re.sub(r"```.*?```|`[^`]*`", " ", text, flags=re.S)   # inline code may wrap
    text = re.sub(r"<!--.*?-->|<[^>]+>", " ", text, flags=re.S)
    # torch's class name, written in prose without backticks, is not the term "data-parallel"
    # (which the glossary matches with nothing between its words, as "AllReduce" must match).
    text = re.sub(r"\bDataParallel\b", " ", text)
    # Quoted English — an error message, a paper's title, a phrase under discussion — is
    # rendered as the translator sees fit (often kept, with a gloss): no term is required there.
    text = re.sub(r'"[^"\n]{1,300}"|“[^”\n]{1,300}”', " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def _headings(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))


def _squash(text: str) -> str:
    return re.sub(r"[-\s]", "", text).lower()


def glossary_problems(notebook: Path, glossary: Glossary, root: Path = ROOT) -> list[str]:
    """Each translated block whose English cell uses a glossary term that its Chinese does not
    render as the glossary says: the rendering absent, or a kept-in-English term missing. A
    document's sections are checked like cells."""
    unit = "section" if _is_document(notebook) else "cell"
    blocks = {b.cell_id: b for b in read_blocks(text_path(notebook, root))}
    problems = []
    for cell in _units(notebook):
        b = blocks.get(cell.id)
        if b is None or b.untranslated:
            continue
        english, chinese = _prose(cell.source), _prose(b.text)
        for term, zh in glossary.terms.items():
            where = _headings(english) if term in glossary.headings_only else english
            if not glossary.pattern(term).search(where):
                continue
            if zh == KEPT:
                ok = _squash(term) in _squash(chinese)
            else:
                ok = any(r.strip() in chinese for r in zh.split("/"))
            if not ok:
                want = f"keeps {term!r} in English" if zh == KEPT else f"renders {term!r} as {zh}"
                problems.append(f"{notebook.relative_to(root)} {unit} {cell.id} "
                                f"({first_words(cell.source)!r}): the glossary {want}")
    return problems


# ---- the command line ---------------------------------------------------------------------

def main(argv: list[str] | None = None, prog: str = "python -m dpcourse translate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="per notebook and document: missing, stale and orphaned "
                   "blocks; those with no translation file yet are listed, not failed")
    u = sub.add_parser("update", help="add a block for every markdown cell without one and "
                       "re-key blocks whose cell id changed")
    u.add_argument("names", nargs="+", help="notebooks: lessons/00_start_here, solutions/lab01_…; "
                   "documents: README.md, lessons/HANDOUT.md, lessons/INSTRUCTOR_GUIDE.md")
    u.add_argument("--accept", action="append", default=[], metavar="ID",
                   help="mark this cell's (or section's) block as translated from the current "
                   "English")
    sub.add_parser("build", help="write zh/lessons, zh/labs and zh/solutions from the stored "
                   "English notebooks and the translations, and zh/README.md, zh/HANDOUT.md, "
                   "zh/INSTRUCTOR_GUIDE.md from the documents (executes nothing)")
    args = parser.parse_args(argv)
    if args.cmd == "update":
        for name in args.names:
            path = update(_resolve(name, ROOT), ROOT, tuple(args.accept))
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if args.cmd == "build":
        try:
            for path in build(ROOT):
                print(f"wrote {path.relative_to(ROOT)}")
        except ValueError as err:
            print("the rest was written; cannot build:\n" + "\n".join(
                f"  {line}" for line in str(err).splitlines()))
            return 1
        return 0
    glossary = read_glossary()
    bad, without = 0, []
    for nbpath in _notebooks(ROOT) + _documents(ROOT):
        rep = status(nbpath, ROOT)
        if not rep.exists:
            without.append(rep.notebook)
            continue
        done = rep.cells - len(rep.missing) - len(rep.stale)
        what = "sections" if rep.unit == "section" else "markdown cells"
        print(f"{rep.notebook}: {done}/{rep.cells} {what} translated and current")
        for line in rep.problems() + glossary_problems(nbpath, glossary, ROOT):
            print(f"  {line}")
            bad += 1
    print(f"no translation file yet ({len(without)}): " + ", ".join(without))
    print("labs follow their solutions' files.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
