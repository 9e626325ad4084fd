"""lessons/INSTRUCTOR_GUIDE.md must not drift from the course it describes.

Checked here, without a network or a kernel (well under 2 s):

* every relative link in the guide points at a file or folder that exists, and every link to
  a section of the guide (``#anchor``) at one of its headings;
* the rows of a table that link a lesson and give minutes add up to that lesson's header time
  (``**Time:** about N minutes`` in the notebook's first cell, as ``authoring.header_minutes``
  reads it): one row, or the parts of a lesson split around its lab;
* each plan's rows add up to its stated total, start when the row before ends, the 3-hour plan
  fits in 180 minutes, each day of the 2-day plan is at most 7 hours and the two cover every
  lesson;
* in the 3-hour plan every row's talk, hands-on and buffer minutes add up to its minutes and
  their columns to the stated totals, every lesson or lab row names the cell where everyone
  stops and that cell is a heading of the notebook the row links, and every heading the cuts
  for a late room name is one of the plan's lessons';
* every message quoted in “curly quotes” in the failures tables still occurs in a file its row
  links (raw text, or the file's string literals joined as Python joins adjacent ones; runs of
  white space count as one space);
* every ``python -m dpcourse…`` command names a subcommand and options its parser has, and
  every option named on its own in the prose belongs to one of those commands;
* the install the guide shows is README's ``<!-- install -->`` block, word for word;
* every ``DPCOURSE_…`` variable the guide names is read somewhere in the library.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import tokenize
from pathlib import Path

import nbformat

from dpcourse.tools import authoring


ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "lessons" / "INSTRUCTOR_GUIDE.md"
LESSON_RE = re.compile(r"^(\d\d)_\w+\.ipynb$")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
QUOTE_RE = re.compile(r"“([^”]+)”")
HEADING_RE = re.compile(r"`(#{2,3} [^`]+)`")  # a notebook heading named in the guide


def guide_text() -> str:
    return GUIDE.read_text(encoding="utf-8")


def lesson_times() -> dict[str, int]:
    """Each lesson's header time, as the library reads it (``authoring.header_minutes``)."""
    times = {}
    for path in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb")):
        minutes = authoring.header_minutes(nbformat.read(path, as_version=4))
        assert minutes is not None, f"{path.name}: no '**Time:** about N minutes' in its header"
        times[path.name] = minutes
    return times


def table_rows(lines: list[str]) -> list[dict[str, str]]:
    """The body rows of the first markdown table in ``lines`` (header and rule skipped)."""
    rows, started = [], False
    for line in lines:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not started:
                header, started = cells, True
                continue
            if set("".join(cells)) <= set("-: "):
                continue
            rows.append(dict(zip(header, cells)))
        elif started:
            break
    return rows


def section(title: str) -> list[str]:
    lines = guide_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## ") and title in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1:end]


def all_rows(lines: list[str]) -> list[dict[str, str]]:
    """Every table row in ``lines``, each table parsed with its own header."""
    return [row for table in tables(lines) for row in table]


def links(text: str) -> list[str]:
    return [t for t in LINK_RE.findall(text)
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def resolve(target: str) -> Path:
    return (GUIDE.parent / target.split("#")[0]).resolve()


def minutes(clock: str) -> int:
    h, m = clock.strip("*").split(":")
    return int(h) * 60 + int(m)


# --- links and lesson times -----------------------------------------------------------------


def test_every_relative_link_exists():
    missing = [t for t in links(guide_text()) if not resolve(t).exists()]
    assert not missing, f"the guide links files that do not exist: {missing}"


def slug(heading: str) -> str:
    """The anchor GitHub (and the site's MyST) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_to_a_section_of_the_guide_finds_its_heading():
    anchors = {slug(line.lstrip("#")) for line in guide_text().splitlines()
               if line.startswith("#")}
    targets = re.findall(r"\]\(#([^)\s]+)\)", guide_text())
    assert targets, "the guide links none of its sections: the pattern is stale"
    missing = sorted(set(targets) - anchors)
    assert not missing, f"no heading for these links: {missing}"


def test_the_guide_links_lessons_labs_and_solutions():
    kinds = {resolve(t).parent.name for t in links(guide_text())}
    assert {"lessons", "labs", "solutions"} <= kinds


def tables(lines: list[str]) -> list[list[dict[str, str]]]:
    """Every table in ``lines``, each as its rows."""
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(table_rows(lines[i:j]))
            i = j
        else:
            i += 1
    return out


def test_lesson_times_equal_the_lesson_headers():
    times = lesson_times()
    assert len(times) >= 12, sorted(times)
    stated = 0
    for rows in tables(guide_text().splitlines()):
        per_lesson: dict[str, list[int]] = {}
        for row in rows:
            if "min" not in row or not row["min"].strip("*").isdigit():
                continue
            label = row.get("lesson") or row.get("block") or ""
            lesson = [t for t in links(label) if LESSON_RE.match(Path(t).name)]
            if lesson:
                per_lesson.setdefault(Path(lesson[0]).name, []).append(int(row["min"].strip("*")))
        for name, parts in per_lesson.items():
            assert name in times, f"the guide times {name}, which is not a lesson"
            assert sum(parts) == times[name], (
                f"the guide gives {name} {' + '.join(map(str, parts))} min; its header says "
                f"{times[name]}")
            stated += 1
    assert stated >= 12 + 5, "fewer lesson times found than the guide's tables hold"
    # In prose: "[...](NN_name.ipynb) (N min)"
    for name, n in re.findall(r"\]\((\d\d_\w+\.ipynb)\)\s*\((\d+) min\)", guide_text()):
        assert int(n) == times[name], f"the guide says {name} takes {n} min; header: {times[name]}"


def test_the_glance_table_lists_every_lesson():
    rows = table_rows(section("The lessons at a glance"))
    named = {Path(t).name for r in rows for t in links(r["lesson"])}
    assert named == set(lesson_times()), sorted(set(lesson_times()) ^ named)


# --- the plans --------------------------------------------------------------------------------


def subsection(title: str, sub: str) -> list[str]:
    lines = section(title)
    start = next(i for i, line in enumerate(lines) if line.startswith("### ") and sub in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("### ")),
               len(lines))
    return lines[start + 1:end]


def plan(title: str, sub: str | None = None) -> tuple[list[dict], int, int]:
    """The plan's rows, its stated total (minutes) and its stated end (clock minutes)."""
    rows = table_rows(subsection(title, sub) if sub else section(title))
    totals = [r for r in rows if "total" in r["block"]]
    assert len(totals) == 1, f"{title}: expected one total row"
    body = [r for r in rows if r is not totals[0]]
    return body, int(totals[0]["min"].strip("*")), minutes(totals[0]["start"])


def check_plan(title: str, sub: str | None = None) -> tuple[list[dict], int]:
    body, total, end = plan(title, sub)
    counted = [int(r["min"]) for r in body if r["min"].isdigit()]
    assert sum(counted) == total, f"{title}: rows add up to {sum(counted)}, stated total {total}"
    clock = minutes(body[0]["start"])
    for row in body:
        assert minutes(row["start"]) == clock, f"{title}: {row['block']!r} starts at {row['start']}"
        if row["min"].isdigit():
            clock += int(row["min"])
        else:  # a pause that the total leaves out, e.g. "lunch (45 min, not counted)"
            m = re.search(r"\((\d+) min, not counted\)", row["block"])
            assert m, f"{title}: row {row['block']!r} has no minutes"
            clock += int(m.group(1))
    assert clock == end, f"{title}: the last row ends at {clock // 60}:{clock % 60:02d}"
    return body, total


def test_three_hour_plan_adds_up_and_fits():
    body, total = check_plan("A 3-hour workshop")
    assert total <= 180, f"the 3-hour plan takes {total} minutes"


SPLIT = ("talk", "hands-on", "buffer")


def test_three_hour_plan_counts_talk_hands_on_and_buffer_apart():
    rows = table_rows(section("A 3-hour workshop"))
    totals = next(r for r in rows if "total" in r["block"])
    sums = dict.fromkeys(SPLIT, 0)
    for row in rows:
        if row is totals or row["block"] == "break":
            continue
        parts = [int(row[k]) for k in SPLIT]
        assert sum(parts) == int(row["min"]), (
            f"{row['block']!r}: talk + hands-on + buffer = {sum(parts)}, not {row['min']}")
        for k, v in zip(SPLIT, parts):
            sums[k] += v
    for k in SPLIT:
        assert int(totals[k].strip("*")) == sums[k], f"the {k} column adds up to {sums[k]}"
    assert sums["buffer"] >= 10, "a 3-hour plan with less than 10 minutes of buffer"
    said = f"{sums['talk']} minutes of talk, {sums['hands-on']} of hands-on and {sums['buffer']}"
    assert said in guide_text(), f"the prose does not say the plan's split ({said})"
    assert rows[0]["block"] == "logins", "the plan does not start with the logins"


def notebook_headings(path: Path) -> set[str]:
    """The markdown headings (``## ...``, ``### ...``) of a notebook, from its source."""
    if path.with_suffix(".py").exists():
        lines = [line[2:] for line in path.with_suffix(".py").read_text().splitlines()
                 if line.startswith("# #")]
    else:  # a generated lab: its notebook is all there is
        nb = json.loads(path.read_text(encoding="utf-8"))
        lines = [line for c in nb["cells"] if c["cell_type"] == "markdown"
                 for line in "".join(c["source"]).splitlines()]
    return {" ".join(line.split()) for line in lines if re.match(r"#{2,3} ", line)}


def test_every_step_names_a_stop_cell_that_its_notebook_has():
    rows = table_rows(section("A 3-hour workshop"))
    named = 0
    for row in rows:
        targets = [resolve(t) for t in links(row["block"])]
        if not targets:
            continue
        stops = HEADING_RE.findall(row["everyone stops at"])
        assert stops, f"{row['block']!r} names no cell where everyone stops"
        for stop in stops:
            assert " ".join(stop.split()) in notebook_headings(targets[0]), (
                f"{targets[0].name} has no heading {stop!r}")
            named += 1
    assert named >= 6


def test_the_cuts_for_a_late_room_name_headings_of_the_plans_lessons():
    lines = subsection("A 3-hour workshop", "When you are behind")
    rows = table_rows(lines)
    assert len(rows) >= 4, "fewer cuts than the plan has blocks to cut from"
    plan_rows = table_rows(section("A 3-hour workshop"))
    notebooks = {resolve(t) for r in plan_rows for t in links(r["block"])}
    headings = set().union(*(notebook_headings(p) for p in notebooks))
    clocks = [minutes(r["start"]) for r in plan_rows if "total" not in r["block"]]
    for row in rows:
        assert clocks[0] <= minutes(row["at"]) <= clocks[-1], f"a cut at {row['at']}"
        assert int(row["gives back"]) > 0
        for heading in HEADING_RE.findall(row["cut"]):
            assert " ".join(heading.split()) in headings, f"no lesson in the plan has {heading!r}"


def test_two_day_plan_adds_up_and_covers_every_lesson():
    covered = set()
    for day in ("Day 1", "Day 2"):
        body, total = check_plan("A 2-day course", day)
        # A class day: 9:00 to 17:00 at most, with a 45-minute lunch not counted (435 minutes).
        assert 240 <= total <= 435, f"{day} takes {total} minutes, not 4 h to 7 h 15 min"
        h, m = divmod(total, 60)
        assert f"{total} minutes ({h} h {m} min)" in guide_text(), f"{day}'s stated length is stale"
        covered |= {Path(t).name for r in body for t in links(r["block"])}
    assert set(lesson_times()) <= covered, sorted(set(lesson_times()) - covered)


# --- quoted messages ----------------------------------------------------------------------------


def joined_literals(path: Path) -> str:
    """A Python file's string literals, adjacent ones joined (as the compiler joins them)."""
    out, run = [], []
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.STRING:
                body = re.sub(r"^[rRbBuUfF]*", "", tok.string)
                q = 3 if body[:3] in ('"""', "'''") else 1
                run.append(body[q:-q])
            elif tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT) and run:
                continue
            elif run:
                out.append("".join(run))
                run = []
    out.append("".join(run))
    return "\n".join(out)


def searchable(path: Path) -> str:
    if path.suffix == ".ipynb" and path.with_suffix(".py").exists():
        path = path.with_suffix(".py")  # the lesson's source, not its JSON
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        text += "\n" + joined_literals(path)
    return text


def test_quoted_messages_still_exist():
    rows = all_rows(section("What learners hit"))
    assert len(rows) >= 25, len(rows)
    checked = 0
    for row in rows:
        quotes = QUOTE_RE.findall(" ".join(row.values()))
        files = [resolve(t) for t in links(row.get("where", ""))]
        assert files, f"a failures row links no file: {row}"
        texts = " ".join(" ".join(searchable(p).split()) for p in files)
        for q in quotes:
            assert " ".join(q.split()) in texts, (
                f"“{q}” is no longer in {[p.name for p in files]}")
            checked += 1
    assert checked >= 30


# --- commands ------------------------------------------------------------------------------------


def commands() -> list[tuple[str, list[str]]]:
    """Every `python -m dpcourse...` in the guide's code: (module, words after it)."""
    code = re.findall(r"```.*?```|`[^`\n]+`", guide_text(), flags=re.S)
    found = []
    for span in code:
        for m in re.finditer(r"python -m (dpcourse(?:\.\w+)?)([^`\n#|;>&]*)", span):
            found.append((m.group(1), m.group(2).split()))
    return found


def help_text(module: str, args: list[str]) -> str:
    """What ``python -m module *args --help`` prints, run in this process (no subprocess)."""
    mod = importlib.import_module(module + ".__main__" if module == "dpcourse" else module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            mod.main([*args, "--help"])
        except SystemExit:
            pass
    return out.getvalue()


def test_every_command_exists():
    found = commands()
    assert any(m == "dpcourse" and a[:1] == ["doctor"] for m, a in found), found
    assert any(m == "dpcourse" and a[:1] == ["progress"] for m, a in found), found
    for module, words in found:
        top = help_text(module, [])
        groups = re.findall(r"\{([\w,-]+)\}", top.split("\n\n")[0])
        subs = set(groups[0].split(",")) if groups else set()
        sub = words[0] if words and subs else None  # none: the module itself is named
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        assert top.startswith("usage:"), f"`python -m {module}` has no command line"
        if sub is not None:
            assert sub in subs, (
                f"`python -m {module} {sub}`: no such subcommand (has {sorted(subs)})")
        text = help_text(module, [sub]) if sub else top
        for flag in flags:
            assert re.search(rf"{re.escape(flag)}\b", text), (
                f"`python -m {module} {sub or ''} {flag}`: no such option")


def test_options_named_alone_exist():
    """An option the prose names on its own (`--only 03`, `--plan`) belongs to some command."""
    helps = "\n".join(help_text(m, w[:1] if w and not w[0].startswith("-") else [])
                      for m, w in commands())
    alone = re.findall(r"`(--[\w-]+)(?![\w.])[^`]*`", guide_text())  # not --JupyterHub.x
    assert alone, "no option named on its own: the pattern is stale"
    for flag in set(alone):
        assert re.search(rf"{re.escape(flag)}\b", helps), f"no command has the option {flag}"


HUB_CONFIG = ROOT / "classroom" / "jupyterhub_config.py"


def test_hub_settings_named_are_the_classroom_configs():
    """`--JupyterHub.bind_url` and the like: a setting the classroom's configuration sets."""
    named = set(re.findall(r"--((?:JupyterHub|Spawner|Authenticator)\.\w+)", guide_text()))
    assert named, "the guide names no hub setting: the pattern is stale"
    config = HUB_CONFIG.read_text()
    for setting in named:
        assert f"c.{setting}" in config, f"classroom's hub configuration never sets {setting}"


def test_install_is_the_readme_install():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- install -->\s*```bash\n(.*?)```", readme, flags=re.S)
    assert m, "README.md lost its <!-- install --> block"
    prepare = "\n".join(section("What to prepare"))
    assert f"```bash\n{m.group(1)}```" in prepare, "the guide's install differs from README's"


def test_named_environment_variables_are_read_by_the_library():
    lib = "\n".join(p.read_text() for p in (ROOT / "lib" / "dpcourse").rglob("*.py"))
    lib += HUB_CONFIG.read_text()  # the classroom hub's own settings
    for name in set(re.findall(r"\bDPCOURSE_[A-Z_]+", guide_text())):
        assert name in lib, f"the guide names {name}, which the library never reads"
