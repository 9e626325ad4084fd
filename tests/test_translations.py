"""The Chinese edition's promises (dpcourse.tools.translate): every translation file is current
with its English notebook, the Chinese notebooks are what ``translate build`` writes now, their
code and outputs are the English ones, and the glossary's renderings are used. Also the stable
cell ids the translations are keyed by (authoring.keep_ids). Executes nothing; a few seconds."""

import copy
import re
import shutil

import nbformat
import pytest

from dpcourse.tools import authoring, translate

ROOT = authoring.ROOT
ENGLISH = [p for d in translate.EDITIONS for p in sorted((ROOT / d).glob("*.ipynb"))]
TRANSLATED = [p for p in ENGLISH if translate.text_path(p).exists()]
BUILT = sorted((ROOT / "zh").glob("*/*.ipynb"))


def test_there_is_something_to_check():
    """Lesson 00 is the pilot: without it every test below would pass on nothing."""
    assert ROOT / "lessons" / "00_start_here.ipynb" in TRANSLATED
    assert ROOT / "zh" / "lessons" / "00_start_here.ipynb" in BUILT


@pytest.mark.parametrize("notebook", TRANSLATED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_translation_is_complete_and_current(notebook):
    report = translate.status(notebook)
    assert report.ok, "\n".join(report.problems())


def test_the_chinese_notebooks_are_what_translate_build_writes():
    assert translate.out_of_date() == []


@pytest.mark.parametrize("built", BUILT, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_code_outputs_and_metadata_are_the_english_notebooks(built):
    zh = nbformat.read(built, as_version=4)
    en = nbformat.read(ROOT / built.parent.name / built.name, as_version=4)
    assert zh.cells[0].id == "zh-generated-header" and "请勿" in zh.cells[0].source
    assert zh.metadata == en.metadata
    assert len(zh.cells) == len(en.cells) + 1
    for z, e in zip(zh.cells[1:], en.cells):
        assert (z.id, z.cell_type, z.metadata) == (e.id, e.cell_type, e.metadata), e.id
        if e.cell_type == "code":
            assert z == e, f"{built.name} code cell {e.id} differs from the English one"


def test_the_glossary_is_followed():
    glossary = translate.read_glossary()
    # the course's own terms, not a dictionary: a few dozen, under a hundred
    assert 40 <= len(glossary.terms) <= 100, len(glossary.terms)
    problems = [p for nb in TRANSLATED for p in translate.glossary_problems(nb, glossary)]
    assert problems == []


def test_a_class_name_is_not_the_term_it_spells():
    """torch's DataParallel in prose is a name, not "data-parallel"; AllReduce is the term."""
    g = translate.Glossary({})
    assert not g.pattern("data-parallel").search(translate._prose("torch's nn.DataParallel copies"))
    assert g.pattern("data-parallel").search(translate._prose("data-parallel training"))
    assert g.pattern("data parallel").search(translate._prose("DDP is data parallel too"))
    assert g.pattern("all-reduce").search(translate._prose("the ring AllReduce"))


# ---- the checks notice what they are for (temporary copies) --------------------------------

def _copy_lesson_00(root):
    """A repository of one translated lesson, to break on purpose."""
    for rel in ("lessons/00_start_here.ipynb", "zh/text/lessons/00_start_here.md",
                "zh/lessons/00_start_here.ipynb"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    # lesson 00's links go to the Chinese notebook of every lesson that has a translation file,
    # so the copy needs those files too (only their presence is read) to build the same links
    for text in (ROOT / "zh" / "text").glob("*/*.md"):
        rel = text.relative_to(ROOT)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if not (root / rel).exists():
            shutil.copy(text, root / rel)
    (root / "solutions").mkdir()
    (root / "labs").mkdir()
    return root / "lessons" / "00_start_here.ipynb"


def test_an_english_edit_is_named_with_its_cell(tmp_path):
    path = _copy_lesson_00(tmp_path)
    assert translate.status(path, tmp_path).ok and translate.out_of_date(tmp_path) == []
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "process group" in c.source)
    cell.source = cell.source.replace("process group", "group of processes")
    nbformat.write(nb, path)
    problems = translate.status(path, tmp_path).problems()
    assert len(problems) == 1
    assert f"cell {cell.id}" in problems[0] and "'## Running many processes from a" in problems[0]
    assert "changed in English" in problems[0]
    stale = translate.out_of_date(tmp_path)
    assert len(stale) == 1 and cell.id in stale[0] and "stale" in stale[0]


def test_rewrapping_the_english_is_not_an_edit(tmp_path):
    path = _copy_lesson_00(tmp_path)
    nb = nbformat.read(path, as_version=4)
    md = next(c for c in nb.cells if c.cell_type == "markdown")
    md.source = md.source.replace("\n", "\n\n").replace(" ", "  ") + "\n"
    nbformat.write(nb, path)
    assert translate.status(path, tmp_path).ok


def test_a_new_cell_is_missing_and_update_marks_it_untranslated(tmp_path):
    path = _copy_lesson_00(tmp_path)
    nb = nbformat.read(path, as_version=4)
    new = nbformat.v4.new_markdown_cell("A brand new paragraph about buckets.")
    nb.cells.insert(3, new)
    nbformat.write(nb, path)
    report = translate.status(path, tmp_path)
    assert report.missing == [(new.id, "A brand new paragraph about buckets.")]
    translate.update(path, tmp_path)
    blocks = translate.read_blocks(translate.text_path(path, tmp_path))
    added = next(b for b in blocks if b.cell_id == new.id)
    assert added.untranslated and added.text == new.source
    assert translate.status(path, tmp_path).missing == report.missing   # still to translate
    # the file follows the notebook's order, so the new block sits where its cell does
    assert [b.cell_id for b in blocks] == [c.id for c in nb.cells if c.cell_type == "markdown"]
    with pytest.raises(ValueError, match=f"{new.id}.*untranslated"):
        translate.translated_notebook(path, tmp_path)


def test_accept_clears_a_stale_block(tmp_path):
    path = _copy_lesson_00(tmp_path)
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown")
    cell.source += "\nOne more sentence."
    nbformat.write(nb, path)
    assert [cid for cid, _ in translate.status(path, tmp_path).stale] == [cell.id]
    translate.update(path, tmp_path, accept=(cell.id,))
    assert translate.status(path, tmp_path).ok


def test_update_rekeys_blocks_of_a_notebook_rebuilt_with_new_ids(tmp_path):
    """A notebook built before ids were stable: every id changed, the text did not."""
    path = _copy_lesson_00(tmp_path)
    nb = nbformat.read(path, as_version=4)
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            c.id = f"new{i:05d}"
    nbformat.write(nb, path)
    report = translate.status(path, tmp_path)
    assert len(report.orphaned) == len(report.missing) == report.cells
    before = translate.read_blocks(translate.text_path(path, tmp_path))
    translate.update(path, tmp_path)
    after = translate.read_blocks(translate.text_path(path, tmp_path))
    assert translate.status(path, tmp_path).ok
    assert [b.text for b in after] == [b.text for b in before]
    assert [b.cell_id for b in after] == [c.id for c in nb.cells if c.cell_type == "markdown"]


def test_update_does_not_guess_between_two_cells_with_one_text(tmp_path):
    path = tmp_path / "lessons" / "99_x.ipynb"
    path.parent.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("Same."),
                                         nbformat.v4.new_markdown_cell("Same.")])
    nbformat.write(nb, path)
    text = translate.text_path(path, tmp_path)
    text.parent.mkdir(parents=True)
    text.write_text(translate.render(
        [translate.Block("gone1234", translate.english_hash("Same."), "一样。")], "x"))
    translate.update(path, tmp_path)
    report = translate.status(path, tmp_path)
    assert [cid for cid, _ in report.orphaned] == ["gone1234"]
    assert len(report.missing) == 2


def test_structure_and_glossary_checks_catch_a_careless_block(tmp_path):
    path = tmp_path / "lessons" / "99_x.ipynb"
    path.parent.mkdir()
    english = "## Ranks\n\nEach rank joins the process group.\n<details>\n\nmore\n</details>"
    cell = nbformat.v4.new_markdown_cell(english)
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    text = translate.text_path(path, tmp_path)
    text.parent.mkdir(parents=True)
    blocks = [translate.Block(cell.id, translate.english_hash(english),
                              "## 秩\n\n每个秩都加入进程组。\n\n更多")]   # no <details>, rank translated
    text.write_text(translate.render(blocks, "x"))
    report = translate.status(path, tmp_path)
    assert report.structure and "<details>" in report.problems()[0]
    glossary = translate.Glossary({"rank": translate.KEPT, "process group": "进程组",
                                   "bucket": "桶"})
    problems = translate.glossary_problems(path, glossary, tmp_path)
    assert len(problems) == 1 and "keeps 'rank' in English" in problems[0]


def test_a_lab_is_translated_from_its_solutions_file(tmp_path):
    solution = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## Part 1\n\nWrite the step; see [lesson 03](../lessons/03_x.ipynb)."),
        nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION: the step\n    return 1\n"
                                  "    ### END SOLUTION\n"),
        nbformat.v4.new_markdown_cell("Only in the solution.", metadata={"tags": ["solution-only"]}),
    ])
    for folder in ("solutions", "labs", "lessons"):
        (tmp_path / folder).mkdir()
    nbformat.write(solution, tmp_path / "solutions" / "lab99_x.ipynb")
    nbformat.write(authoring.make_lab(solution, "solutions/lab99_x.py"),
                   tmp_path / "labs" / "lab99_x.ipynb")
    text = translate.text_path(tmp_path / "solutions" / "lab99_x.ipynb", tmp_path)
    text.parent.mkdir(parents=True)
    text.write_text(translate.render([
        translate.Block(solution.cells[0].id, translate.english_hash(solution.cells[0].source),
                        "## 第 1 部分\n\n写出这一步；见[第 03 课](../lessons/03_x.ipynb)。"),
        translate.Block(solution.cells[2].id, translate.english_hash(solution.cells[2].source),
                        "只在参考答案中。")], "x"))
    written = translate.build(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "zh/labs/lab99_x.ipynb", "zh/solutions/lab99_x.ipynb"]
    lab = nbformat.read(tmp_path / "zh" / "labs" / "lab99_x.ipynb", as_version=4)
    assert [c.id for c in lab.cells[:2]] == ["zh-generated-header", "generated-header"]
    assert "自动生成的实验" in lab.cells[1].source and "solutions/lab99_x.py" in lab.cells[1].source
    # lesson 03 has no Chinese edition: the link goes from zh/labs/ to the English lesson
    assert lab.cells[2].source.endswith("见[第 03 课](../../lessons/03_x.ipynb)。")
    assert "raise NotImplementedError" in lab.cells[3].source
    assert translate.out_of_date(tmp_path) == []


def test_hash_and_file_format_round_trip():
    assert translate.english_hash("a  b\n\nc\n") == translate.english_hash("a b c")
    assert translate.english_hash("a b c") != translate.english_hash("a b d")
    blocks = [translate.Block("abc12345", "0" * 12, "# 标题\n\n正文。"),
              translate.Block("def67890", "1" * 12, "English still", untranslated=True)]
    assert translate.parse(translate.render(blocks, "lessons/x.ipynb")) == blocks
    with pytest.raises(ValueError, match="two blocks"):
        translate.parse(translate.render(blocks + blocks[:1], "x"))


# ---- stable cell ids (authoring.keep_ids) --------------------------------------------------

def _nb(*cells):
    """A notebook of (type, source) pairs; "m" markdown, "c" code."""
    make = {"m": nbformat.v4.new_markdown_cell, "c": nbformat.v4.new_code_cell}
    return nbformat.v4.new_notebook(cells=[make[t](s) for t, s in cells])


OLD = (("m", "# Title"), ("c", "x = 1"), ("m", "Some prose."), ("c", "print(x)"), ("m", "End."))


def _rebuilt(old, *cells):
    """What a rebuild produces: the same kind of notebook with fresh random ids."""
    new = _nb(*cells)
    assert not {c.id for c in new.cells} & {c.id for c in old.cells}
    return authoring.keep_ids(new, old)


def test_a_rebuild_that_changes_nothing_keeps_every_id():
    old = _nb(*OLD)
    assert [c.id for c in _rebuilt(old, *OLD).cells] == [c.id for c in old.cells]


def test_an_edited_cell_keeps_its_id():
    old = _nb(*OLD)
    new = _rebuilt(old, *OLD[:2], ("m", "Some prose, edited."), *OLD[3:])
    assert [c.id for c in new.cells] == [c.id for c in old.cells]


def test_an_inserted_cell_gets_a_fresh_id_and_the_others_keep_theirs():
    old = _nb(*OLD)
    new = _rebuilt(old, *OLD[:3], ("m", "New."), *OLD[3:])
    ids = [c.id for c in new.cells]
    assert ids[:3] + ids[4:] == [c.id for c in old.cells]
    assert ids[3] not in {c.id for c in old.cells} and len(set(ids)) == len(ids)


def test_a_deleted_cell_takes_its_id_away():
    old = _nb(*OLD)
    new = _rebuilt(old, *OLD[:2], *OLD[3:])
    assert [c.id for c in new.cells] == [c.id for i, c in enumerate(old.cells) if i != 2]


def test_a_moved_cell_keeps_its_id():
    old = _nb(*OLD)
    new = _rebuilt(old, OLD[2], *OLD[:2], *OLD[3:])
    by_source = {c.source: c.id for c in old.cells}
    assert [c.id for c in new.cells] == [by_source[c.source] for c in new.cells]


def test_an_edit_never_gives_a_markdown_id_to_a_code_cell():
    old = _nb(("m", "A"), ("m", "B"))
    new = _rebuilt(old, ("m", "A"), ("c", "b = 2"))
    assert new.cells[0].id == old.cells[0].id and new.cells[1].id != old.cells[1].id


def test_the_builds_own_cells_keep_their_names():
    old = _nb(("m", "Title"), ("c", "install, version 1"), ("c", "x = 1"))
    old.cells[1].id = authoring.INSTALL_TAG
    new = _nb(("m", "Title"), ("c", "install, version 2"), ("c", "x = 1"))
    new.cells[1].id = authoring.INSTALL_TAG
    authoring.keep_ids(new, old)
    assert [c.id for c in new.cells] == [c.id for c in old.cells]


def test_write_keeping_ids_and_the_lab_inherit_the_solutions_ids(tmp_path):
    path = tmp_path / "lab99.ipynb"
    old = _nb(("m", "Goal."), ("c", "### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))
    nbformat.write(old, path)
    new = copy.deepcopy(old)
    for c in new.cells:
        c.id = nbformat.v4.new_code_cell().id
    new.cells[0].source = "Goal, reworded."
    authoring.write_keeping_ids(new, path)
    assert [c.id for c in nbformat.read(path, as_version=4).cells] == [c.id for c in old.cells]
    lab = authoring.make_lab(new, "solutions/lab99.py")
    assert [c.id for c in lab.cells] == ["generated-header"] + [c.id for c in old.cells]


def test_quoted_english_and_heading_only_terms_are_not_required(tmp_path):
    # A quoted message or title may stay English; "summary" is a term only as the section's name.
    path = tmp_path / "lessons" / "99_x.ipynb"
    path.parent.mkdir()
    english = ('## Summary\n\nNCCL says "the collective timed out", and the run keeps a summary '
               'of each step.')
    cell = nbformat.v4.new_markdown_cell(english)
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    text = translate.text_path(path, tmp_path)
    text.parent.mkdir(parents=True)
    glossary = translate.Glossary({"collective": "集合通信", "summary": "小结"},
                                  frozenset({"summary"}))
    good = "## 小结\n\nNCCL 报告 \"the collective timed out\"，运行时为每一步保留一份概要。"
    text.write_text(translate.render([translate.Block(cell.id, translate.english_hash(english),
                                                      good)], "x"))
    assert translate.glossary_problems(path, glossary, tmp_path) == []
    bad = "## 总结\n\nNCCL 报告 \"the collective timed out\"，运行时为每一步保留一份概要。"
    text.write_text(translate.render([translate.Block(cell.id, translate.english_hash(english),
                                                      bad)], "x"))
    problems = translate.glossary_problems(path, glossary, tmp_path)
    assert len(problems) == 1 and "renders 'summary' as 小结" in problems[0]


def test_relinking_leaves_code_alone(tmp_path):
    # `replicas[i](inputs[i])` looks like a markdown link; inside a code span it is code.
    text = "See [lesson 03](../lessons/03_x.ipynb) and `out = replicas[i](inputs[i])`."
    out = translate._relink(text, tmp_path / "solutions", tmp_path / "zh" / "solutions", tmp_path)
    assert "`out = replicas[i](inputs[i])`" in out
    assert "[lesson 03](../../lessons/03_x.ipynb)" in out


# ---- the documents: README, the handout, the instructor guide (a block per ## section) -----

DOCUMENTS = [ROOT / d for d in translate.DOCUMENTS]


def test_every_document_has_a_translation_file():
    assert [translate.text_path(d).exists() for d in DOCUMENTS] == [True] * len(DOCUMENTS)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_document_translation_is_complete_and_current(document):
    report = translate.status(document)
    assert report.ok, "\n".join(report.problems())
    assert report.cells == len(translate.sections(document.read_text(encoding="utf-8")))


def test_the_documents_follow_the_glossary():
    glossary = translate.read_glossary()
    assert [p for d in DOCUMENTS for p in translate.glossary_problems(d, glossary)] == []


def test_the_chinese_documents_are_what_translate_build_writes():
    docs = {ROOT / "zh" / d.name for d in DOCUMENTS}
    problems = [p for p in translate.out_of_date() if any(p.startswith(f"zh/{d.name} ")
                                                          for d in docs)]
    assert problems == []
    for d in DOCUMENTS:
        built = (ROOT / "zh" / d.name).read_text(encoding="utf-8")
        assert built == translate.translated_document(d)
        assert built.startswith("> **中文版（自动生成）**") and "请勿" in built.splitlines()[0]
        assert d.relative_to(ROOT).as_posix() in built.splitlines()[0]


def _github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation (ASCII and full-width) dropped,
    spaces to hyphens; letters of any script, digits, _ and - kept."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_the_chinese_documents_links_resolve(document):
    """Every relative link of zh/<name>.md reaches a file from zh/, and every #anchor (in the
    page or in another Markdown file) is one of that file's headings."""
    built = ROOT / "zh" / document.name
    text = built.read_text(encoding="utf-8")
    prose = "".join(p for i, p in enumerate(re.split(r"(```.*?```|`[^`]*`)", text, flags=re.S))
                    if i % 2 == 0)
    bad, seen = [], 0
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z][a-z+.-]*:", target):
            continue
        seen += 1
        file, _, anchor = target.partition("#")
        path = (built.parent / file).resolve() if file else built
        if not path.exists():
            bad.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{target}: no heading #{anchor} in {path.name}")
    assert seen and bad == []


def test_a_changed_english_section_is_named(tmp_path):
    (tmp_path / "lessons").mkdir()
    for rel in ("lessons/HANDOUT.md", "zh/text/docs/HANDOUT.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    handout = tmp_path / "lessons" / "HANDOUT.md"
    assert [p.name for p in translate.build(tmp_path)] == ["HANDOUT.md"]
    assert translate.status(handout, tmp_path).ok and translate.out_of_date(tmp_path) == []
    # re-wrapping is not an edit; a changed word is
    handout.write_text(handout.read_text().replace(" in the same order", "\nin  the same order"))
    assert translate.status(handout, tmp_path).ok
    handout.write_text(handout.read_text().replace("one page to keep open", "one page to keep"))
    problems = translate.status(handout, tmp_path).problems()
    assert len(problems) == 1 and "section top" in problems[0]
    assert "changed in English" in problems[0]
    stale = translate.out_of_date(tmp_path)
    assert len(stale) == 1 and "zh/HANDOUT.md cannot be built" in stale[0] and "stale" in stale[0]
    translate.update(handout, tmp_path, accept=("top",))
    assert translate.status(handout, tmp_path).ok
    # a new section is missing, and update adds it untranslated, in the document's order
    handout.write_text(handout.read_text() + "\n## A new section\n\nMore.\n")
    assert [cid for cid, _ in translate.status(handout, tmp_path).missing] == ["new-section"]
    translate.update(handout, tmp_path)
    blocks = translate.read_blocks(translate.text_path(handout, tmp_path))
    assert blocks[-1].cell_id == "new-section" and blocks[-1].untranslated


def test_a_document_is_cut_at_its_level_2_headings_outside_code():
    md = ("# Title\n\nIntro.\n\n## Quick start\n\n```bash\n## not a heading\n```\n\n"
          "### Sub\n\ntext\n\n## The Quick Start\n\nagain\n")
    secs = translate.sections(md)
    assert [s.id for s in secs] == ["top", "quick-start", "quick-start-2"]
    assert "## not a heading" in secs[1].source and "### Sub" in secs[1].source
    assert translate.sections("## 中文版 / Chinese edition\n\nx")[0].id == "chinese-edition"


def test_document_links_point_at_the_chinese_edition_where_there_is_one():
    guide = (ROOT / "zh" / "INSTRUCTOR_GUIDE.md").read_text(encoding="utf-8")
    assert "](HANDOUT.md)" in guide and "](README.md)" in guide       # the Chinese ones, in zh/
    readme = (ROOT / "zh" / "README.md").read_text(encoding="utf-8")
    assert "](lessons/00_start_here.ipynb)" in readme                # zh/lessons/, translated
    assert "](../ARCHITECTURE.md)" in readme                          # English only


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_the_chinese_documents_code_is_the_english_code(document):
    """Commands and code run as written: a Chinese document's ```python and ```bash blocks are
    the English ones, in order (a ```text block, e.g. the message to learners, is prose)."""
    def code(text):
        return re.findall(r"^```(?:python|bash)\n.*?^```", text, flags=re.S | re.M)
    english = code(document.read_text(encoding="utf-8"))
    assert english and code((ROOT / "zh" / document.name).read_text(encoding="utf-8")) == english


def test_the_chinese_guides_stops_are_headings_of_the_chinese_notebooks():
    """The guide's `## …` stops and cuts name the Chinese notebooks' headings (as
    test_instructor_guide does for the English): the row's linked notebook, else lesson 00, 03,
    06 or lab 03, 06 (the cuts table links none)."""
    guide = (ROOT / "zh" / "INSTRUCTOR_GUIDE.md").read_text(encoding="utf-8")
    default = ["lessons/00_start_here.ipynb", "lessons/03_ddp_first_principles.ipynb",
               "lessons/06_ring_allreduce.ipynb", "labs/lab03_ddp_first_principles.ipynb",
               "labs/lab06_ring_allreduce.ipynb"]
    headings = {}
    missing, seen = [], 0
    for row in (line for line in guide.splitlines() if line.startswith("| ")):
        linked = re.findall(r"\]\(((?:lessons|labs)/[^)#]+\.ipynb)\)", row) or default
        for stop in re.findall(r"`(#{2,3} [^`]+)`", row):
            seen += 1
            for nb in linked:
                if nb not in headings:
                    cells = nbformat.read(ROOT / "zh" / nb, as_version=4).cells
                    headings[nb] = {line.strip() for c in cells if c.cell_type == "markdown"
                                    for line in c.source.splitlines() if line.startswith("#")}
            if not any(stop in headings[nb] for nb in linked):
                missing.append(f"{stop!r} (row: {row[:60]}…)")
    assert seen >= 10 and missing == []
