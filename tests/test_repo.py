"""The repository's own promises: Binder installs what requirements.txt pins, the README's
commands are the ones CI runs, and nothing imports as a side effect."""

import re
import subprocess
import sys
from pathlib import Path

from conftest import file_seconds

ROOT = Path(__file__).resolve().parents[1]


def _pins(path):
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_binder_pins_equal_requirements():
    req = _pins(ROOT / "requirements.txt")
    binder = _pins(ROOT / "binder" / "requirements.txt")
    assert req and binder == req


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"<!-- install -->\s*```bash\n(.*?)\n```", readme, re.S).group(1)
    test = re.search(r"<!-- test -->\s*```bash\n(.*?)\n```", readme, re.S).group(1)
    assert "pip install -r requirements.txt" in install
    # CI takes both commands out of README rather than keeping copies that could drift
    assert "readme_block install" in ci and "readme_block test" in ci
    assert test.strip().startswith("python -m pytest")
    # the real-browser tests are their own README command, which CI runs after the suite
    browser = re.search(r"<!-- browser -->\s*```bash\n(.*?)\n```", readme, re.S).group(1)
    assert "readme_block browser" in ci and "python -m pytest tests/browser" in browser


def test_importing_the_library_has_no_side_effects():
    code = ("import sys, dpcourse, dpcourse.devices, dpcourse.launch, dpcourse.data, "
            "dpcourse.models, dpcourse.train, dpcourse.checks, dpcourse.tools.authoring, "
            "dpcourse.bench; "
            "assert 'tensorflow' not in sys.modules, 'torch-only modules imported TensorFlow'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_repository_address_is_written_once():
    """README's clone command and Binder link use pyproject's [project.urls] Repository, and no
    placeholder such as <owner> is left for a learner to fill in."""
    import tomllib

    url = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    owner_repo = url.removeprefix("https://github.com/")
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("<!-- install -->", 1)[0]
    assert f"git clone {url}.git" in quick and "\ncd " + owner_repo.split("/")[1] in quick
    assert f"mybinder.org/v2/gh/{owner_repo}/main" in readme
    assert "<owner>" not in readme


# --- the docs name only what exists ----------------------------------------------------------
# README.md and ARCHITECTURE.md name modules (`dpcourse.tools.authoring`), attributes
# (`dpcourse.launch.spawn`), files (`lib/dpcourse/zero.py`, `tests/test_labNN_checks.py`) and
# commands (`python -m dpcourse.bench ddp --repeats 3`). A rename that forgets a page fails here.

DOCS = ("README.md", "ARCHITECTURE.md")
_CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
_NAME = re.compile(r"(?<![\w/.-])dpcourse(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"^(?:lib|tests|lessons|solutions|labs|website|binder|\.ci|\.github)/"
                   r"[\w./<>-]*$")
_COMMAND = re.compile(r"python(?:3[.\d]*)? -m ([\w.]+)([^`\n#;&>]*)")
_GENERATED = {"tests/artifacts/"}   # made by the browser tests, ignored by git


def doc_code(text: str) -> list[str]:
    """Every inline code span and fenced block of a Markdown text, without the backticks."""
    return [span.strip("`") for span in _CODE.findall(text)]


_SHORT = re.compile(r"(?<![\w/.-])([a-z_]\w*)\.([A-Za-z_]\w*)")
_FILE_TYPES = {"py", "ipynb", "md", "txt", "cfg", "toml", "json", "png", "html", "git"}
MODULES = {p.stem for p in (ROOT / "lib" / "dpcourse").iterdir()
           if p.suffix == ".py" or (p / "__init__.py").exists()} - {"__init__", "__main__"}


def doc_names(text: str) -> set[str]:
    """`dpcourse.x.y` names, and `x.y` where x is a module of the package (`viz.show_code`,
    `ddp.setup_rank`), as lessons write them after `from dpcourse import x`."""
    names = set()
    for span in doc_code(text):
        names |= set(_NAME.findall(span))
        names |= {f"dpcourse.{mod}.{attr}" for mod, attr in _SHORT.findall(span)
                  if mod in MODULES and attr not in _FILE_TYPES}
    return names


def doc_paths(text: str) -> set[str]:
    return {s for s in doc_code(text) if _PATH.match(s)}


def doc_commands(text: str) -> set[tuple[str, str, tuple[str, ...]]]:
    """(module, subcommand or "", --flags) for every `python -m ...`; `a|b` names alternatives."""
    found = set()
    for span in doc_code(text):
        for module, rest in _COMMAND.findall(span):
            words = rest.replace("[", " ").replace("]", " ").split()
            flags = tuple(sorted({w.split("=")[0] for w in words if w.startswith("--")}))
            first = words[0] if words and not words[0].startswith("-") else ""
            for sub in first.split("|"):
                found.add((module, sub, flags))
    return found


_RESOLVE = """
import importlib, importlib.util, json, sys
def resolves(name):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False
names, modules = json.load(sys.stdin)
print(json.dumps([[n for n in names if not resolves(n)],
                  [m for m in modules if importlib.util.find_spec(m) is None]]))
"""


def missing_names_and_modules(names, modules):
    """The names that neither import nor are attributes of a module, and the `-m` modules that
    cannot be found, resolved in a fresh interpreter (importing them here would load TF)."""
    import json

    proc = subprocess.run([sys.executable, "-c", _RESOLVE], input=json.dumps(
        [sorted(names), sorted(modules)]), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def command_problems(commands) -> list[str]:
    """What is wrong with each `python -m dpcourse...` command: no such subcommand or option,
    per the command's own --help (run as a learner would run it)."""
    problems, helps = [], {}

    def help_of(*argv):
        if argv not in helps:
            proc = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True,
                                  text=True, timeout=120, cwd=ROOT)
            helps[argv] = (proc.returncode, proc.stdout + proc.stderr)
        return helps[argv]

    for module, sub, flags in sorted(commands):
        if not module.startswith("dpcourse"):
            continue
        rc, top = help_of(module)
        if rc != 0 or not top.startswith("usage:"):
            problems.append(f"`python -m {module}` has no command line: {top[-300:]}")
            continue
        choices = re.search(r"\{([\w,-]+)\}", top.split("\n\n")[0])
        subs = set(choices.group(1).split(",")) if choices else set()
        text = top
        if subs and sub:
            if sub not in subs:
                problems.append(f"`python -m {module} {sub}`: no such subcommand ({sorted(subs)})")
                continue
            rc, text = help_of(module, sub)
        for flag in flags:
            if not re.search(rf"{re.escape(flag)}\b", text):
                problems.append(f"`python -m {module} {sub} {flag}`: no such option")
    return problems


def path_exists(path: str) -> bool:
    """A path, or a pattern: NN stands for two digits, NN_name for a lesson's file name and
    <anything> for any name."""
    pattern = path.replace("NN_name", "NN_*").replace("NN", "[0-9][0-9]")
    pattern = re.sub(r"<[^>]+>", "*", pattern)
    return path in _GENERATED or any(ROOT.glob(pattern.rstrip("/")))


def test_every_name_path_and_command_in_the_docs_exists():
    texts = {doc: (ROOT / doc).read_text() for doc in DOCS}
    names = set().union(*(doc_names(t) for t in texts.values()))
    commands = set().union(*(doc_commands(t) for t in texts.values()))
    paths = set().union(*(doc_paths(t) for t in texts.values()))
    # the docs do name the things this test is about (an empty scan would prove nothing)
    assert {"dpcourse.tools.authoring", "dpcourse.launch.spawn"} <= names, names
    assert ("dpcourse", "build", ()) in commands, commands
    assert ("dpcourse.bench", "ddp", ("--json", "--repeats")) in commands, commands
    assert "lib/dpcourse/scripts/train_ddp.py" in paths, paths
    bad_names, bad_modules = missing_names_and_modules(names, {m for m, _, _ in commands})
    assert not bad_names, f"the docs name what does not exist: {bad_names}"
    assert not bad_modules, f"`python -m` of modules that do not exist: {bad_modules}"
    bad_paths = sorted(p for p in paths if not path_exists(p))
    assert not bad_paths, f"the docs name files that do not exist: {bad_paths}"
    problems = command_problems(commands)
    assert not problems, "\n".join(problems)


def test_the_docs_check_catches_a_stale_name_path_and_command():
    stale = ("Run `python -m dpcourse.authoring build`, then `python -m dpcourse buld 03` and "
             "`python -m dpcourse.bench ddp --no-such-flag`; see `dpcourse.launch.no_such_thing` "
             "and `viz.no_such_figure()` in `lib/dpcourse/bench.py` (not `zero.py`) and "
             "`tests/test_labNN_nothing.py`.")
    names, commands, paths = doc_names(stale), doc_commands(stale), doc_paths(stale)
    bad_names, bad_modules = missing_names_and_modules(names, {m for m, _, _ in commands})
    assert bad_names == ["dpcourse.authoring", "dpcourse.launch.no_such_thing",
                         "dpcourse.viz.no_such_figure"]
    assert bad_modules == ["dpcourse.authoring"]
    assert sorted(p for p in paths if not path_exists(p)) == [
        "lib/dpcourse/bench.py", "tests/test_labNN_nothing.py"]
    problems = command_problems(commands - {("dpcourse.authoring", "build", ())})
    assert len(problems) == 2, problems
    assert "buld" in problems[0] and "--no-such-flag" in problems[1], problems


def test_the_architecture_map_places_every_module_once():
    """ARCHITECTURE.md's map of lib/dpcourse (names, then what they are for) names each module
    and package of the library exactly once, and nothing that is not there: a new module has
    to be placed among the audiences."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"```\nlib/dpcourse/\n(.*?)```", text, re.S).group(1)
    placed = [name.strip("/") for line in block.splitlines() if line.strip()
              for name in re.split(r"\s{2,}", line.strip())[0].split()]
    assert sorted(placed) == sorted(MODULES | {"__main__"}), (
        f"not on the map: {sorted(MODULES - set(placed))}; on the map but not in the library: "
        f"{sorted(set(placed) - MODULES - {'__main__'})}; twice: "
        f"{sorted({n for n in placed if placed.count(n) > 1})}")


def test_the_suite_order_table_names_every_file():
    """tests/conftest.py hands the xdist workers the slowest files first, by the seconds in
    tests/file_seconds.txt (CI's "slowest files" table, copied in). A new test file or notebook
    missing from it would be guessed at: name it there, with its seconds from CI's log."""
    table = set(file_seconds())
    files = {str(p.relative_to(ROOT)) for pattern in ("tests/test_*.py", "lessons/*.ipynb",
                                                       "solutions/*.ipynb")
             for p in ROOT.glob(pattern)}
    assert not files - table, f"missing from tests/file_seconds.txt: {sorted(files - table)}"
    assert not table - files, f"no longer there: {sorted(table - files)}"
