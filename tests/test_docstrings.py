"""What a lesson shows is public, and its docstring says where it is shown (d2l's "Defined in").

Every ``viz.show_code(obj, ...)`` in ``lessons/*.py`` whose argument is a library object (not a
string snippet) is imported here. It must have a public name (no leading underscore: a learner
who reads it in a lesson may call it) and a docstring with a line like
``Shown in lesson 07, §2.`` naming the lesson and the section (``§k`` for a numbered heading
``## k. ...``, ``§"heading"`` for an unnumbered one) in which the call stands.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

LESSONS = Path(__file__).resolve().parents[1] / "lessons"


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Names a lesson binds to dpcourse modules: ``from dpcourse import ddp_practice as dp``."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpcourse"):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dpcourse") and a.asname:
                    out[a.asname] = a.name
    return out


def _sections(source: str) -> list[tuple[int, str]]:
    return [(i, m.group(1).strip()) for i, line in enumerate(source.splitlines(), 1)
            if (m := re.match(r"# ## (.*)", line))]


def shown_targets() -> list[tuple[str, str, str, tuple[str, ...], int]]:
    """(lesson number, module, name, the sections it may name, first line) of every shown library
    object, once per lesson. The sections: the heading each ``show_code`` call stands under; a
    call under a ``## Lab NN`` heading may also name the numbered section before it."""
    found: dict = {}
    for path in sorted(LESSONS.glob("[0-9][0-9]_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        aliases, heads = _aliases(tree), _sections(source)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "show_code"):
                continue
            before = [h for line, h in heads if line < node.lineno] or [""]
            places = [before[-1]]
            if before[-1].startswith("Lab "):
                places += [h for h in before if re.match(r"\d+\.\s", h)][-1:]
            for arg in node.args:
                if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name):
                    module = aliases.get(arg.value.id, f"dpcourse.{arg.value.id}")
                    key = (path.name[:2], module, arg.attr)
                    entry = found.setdefault(key, [[], node.lineno])
                    entry[0] += [p for p in places if p not in entry[0]]
    return [(*key, tuple(places), line) for key, (places, line) in found.items()]


TARGETS = shown_targets()

def test_the_lessons_show_library_code():
    """The scan finds what it looks for (a test that finds nothing passes for nothing)."""
    assert len(TARGETS) > 50
    assert {t[0] for t in TARGETS} >= {"01", "02", "03", "04", "05", "06", "07", "08", "09", "10"}


def shown_line(doc: str) -> str:
    """The text from the docstring's last "Shown in" to its end, on one line."""
    at = doc.rfind("Shown in ")
    return " ".join(doc[at:].split()) if at >= 0 else ""


def section_named(shown: str, lesson: str, heading: str) -> bool:
    """``lesson NN, §k`` for a heading ``k. ...``, ``lesson NN, §"text"`` where the heading starts
    with the quoted text."""
    numbered = re.match(r"(\d+)\.\s", heading)
    if numbered:
        return re.search(rf"lesson {lesson}, §{int(numbered.group(1))}\b", shown) is not None
    quoted = re.findall(rf'lesson {lesson}, §"([^"]+)"', shown)
    return any(heading.startswith(q) for q in quoted)


@pytest.mark.parametrize("lesson, module, name, places, line", TARGETS,
                         ids=[f"{t[0]}:{t[1].split('.')[-1]}.{t[2]}" for t in TARGETS])
def test_what_a_lesson_shows_is_public_and_says_where(lesson, module, name, places, line):
    obj = getattr(importlib.import_module(module), name, None)
    assert obj is not None, f"lesson {lesson} line {line} shows {module}.{name}, which is gone"
    assert not name.startswith("_"), (
        f"lesson {lesson} line {line} shows the private {module}.{name}: what a lesson shows is "
        f"public (rename it)")
    shown = shown_line(inspect.getdoc(obj) or "")
    assert f"lesson {lesson}" in shown, (
        f"{module}.{name}'s docstring should end with 'Shown in lesson {lesson}, §...' "
        f"(got {shown!r})")
    assert any(section_named(shown, lesson, heading) for heading in places), (
        f"{module}.{name} is shown in lesson {lesson} under {' or '.join(places)!r}; its "
        f"docstring says {shown!r}")


def test_section_names_are_read_as_the_docstrings_write_them():
    assert section_named('Shown in lesson 03, §"How DDP does it".', "03", "How DDP does it")
    assert section_named("Shown in lesson 02, §2.", "02", "2. Replicate")
    assert not section_named("Shown in lesson 02, §2.", "02", "4. Gather, loss, backward")
    assert not section_named("Shown in lesson 02, §12.", "02", "1. Scatter")
    assert section_named("Shown in lesson 01, §1; lesson 04, §9.", "04", "9. BatchNorm")
    assert shown_line("Text.\n\nShown in lesson 09,\n    §1.") == "Shown in lesson 09, §1."



def shown_objects() -> set[tuple[str, int]]:
    """(lesson, id of the object) for everything a ``viz.show_code`` call in a lesson shows,
    resolved through the lesson's imports; showing a class's method shows the class too."""
    out = set()
    for path in sorted(LESSONS.glob("[0-9][0-9]_*.py")):
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "show_code"):
                continue
            for arg in node.args:
                chain = []
                while isinstance(arg, ast.Attribute):
                    chain.insert(0, arg.attr)
                    arg = arg.value
                if not (isinstance(arg, ast.Name) and chain):
                    continue
                obj = importlib.import_module(aliases.get(arg.id, f"dpcourse.{arg.id}"))
                for attr in chain:
                    obj = getattr(obj, attr, None)
                    out.add((path.name[:2], id(obj)))
    return out


def claimed_targets() -> list[tuple[str, str, str]]:
    """(lesson, module, name) for every function or class in the library whose docstring says
    "Shown in lesson NN": what the converse test below holds to its word."""
    import pkgutil

    import dpcourse

    out = []
    for info in pkgutil.walk_packages(dpcourse.__path__, "dpcourse."):
        if info.name.startswith(("dpcourse.checks", "dpcourse.scripts", "dpcourse.__main__")):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:      # an optional dependency (TensorFlow) this machine lacks
            continue
        for name, obj in vars(module).items():
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != info.name:
                continue      # imported from elsewhere: checked where it is defined
            for lesson in re.findall(r"lesson (\d\d)", shown_line(inspect.getdoc(obj) or "")):
                out.append((lesson, info.name, name))
    return sorted(set(out))


def test_a_docstring_that_says_shown_is_shown():
    """d2l's "Defined in" is only worth its line if it is true: every library object whose
    docstring says "Shown in lesson NN" is shown (``viz.show_code``) in that lesson."""
    claimed = claimed_targets()   # here, not at import: it imports TensorFlow, which the
    assert len(claimed) > 50      # other xdist worker would pay for at collection (~5 s CPU)
    shown = shown_objects()
    missing = [f"{m}.{n} says lesson {lesson}" for lesson, m, n in claimed
               if (lesson, id(getattr(importlib.import_module(m), n))) not in shown]
    assert not missing, ("these docstrings say 'Shown in lesson NN', but no viz.show_code in "
                         "that lesson shows them (show them, or drop the line): "
                         + "; ".join(missing))
