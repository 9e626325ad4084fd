"""The build's promises: notebooks match their sources, labs match their solutions, and each
lab runs up to its first TODO and stops there with a clear message."""

import copy
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from dpcourse.tools import authoring

ROOT = authoring.ROOT
LABS = sorted((ROOT / "labs").glob("*.ipynb"))


@pytest.fixture(scope="module", autouse=True)
def _each_source_parsed_once():
    """jupytext parses the 23 sources in about 2 s of CPU, and check_sync (here, and again
    through `python -m dpcourse check`) and the rules below each read every one: each file's
    text is parsed once for the module, keyed by its bytes (a file a test rewrites is parsed
    again), and every caller gets its own copy (the build writes outputs into its notebook)."""
    real, parsed = authoring.read_source, {}

    def read_source(path):
        key = (Path(path).resolve(), Path(path).read_bytes())
        if key not in parsed:
            parsed[key] = real(path)
        return copy.deepcopy(parsed[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(authoring, "read_source", read_source)
        yield


@pytest.fixture(scope="module")
def sync_problems():
    """check_sync reads and regenerates every notebook (seconds): once for the module."""
    return authoring.check_sync()


def test_everything_is_in_sync(sync_problems):
    assert sync_problems == []


def test_there_is_a_lab_for_every_solution_and_a_source_for_every_lesson():
    solutions = sorted((ROOT / "solutions").glob("lab*.py"))
    assert solutions, "no solutions found"
    assert {p.stem for p in solutions} == {p.stem for p in LABS}
    assert sorted((ROOT / "lessons").glob("*.py"))


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_is_generated_and_clean(lab):
    nb = nbformat.read(lab, as_version=4)
    header = nb.cells[0]
    assert "generated-header" in header.metadata.get("tags", [])
    assert f"solutions/{lab.stem}.py" in header.source and "Do not edit" in header.source
    assert "`python -m dpcourse build`" in header.source   # the command that exists (below)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    text = "\n".join(c.source for c in code)
    assert "### BEGIN SOLUTION" not in text and "### END SOLUTION" not in text
    assert "raise NotImplementedError" in text


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_stops_at_its_first_todo(lab):
    """Run the lab as a learner would before writing anything: every cell before the first
    TODO's check runs, and the run stops with the TODO's NotImplementedError."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(lab, as_version=4)
    first_todo = next(i for i, c in enumerate(nb.cells)
                      if c.cell_type == "code" and "raise NotImplementedError" in c.source)
    # shutdown "immediate": the kernel is killed (its process group with it) once the run has
    # stopped, not asked to exit and waited for (about 1 s a lab, more for TensorFlow's)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(lab.parent)}})
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "NotImplementedError", err.value.evalue
    assert "TODO" in err.value.evalue
    failed = next(i for i, c in enumerate(nb.cells)
                  if c.cell_type == "code" and any(o.get("output_type") == "error" for o in c.outputs))
    assert failed >= first_todo
    assert all(not any(o.get("output_type") == "error" for o in c.outputs)
               for c in nb.cells[:failed] if c.cell_type == "code")


def test_make_lab_replaces_regions_and_keeps_indentation():
    src = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("def f(x):\n    ### BEGIN SOLUTION: add one\n    return x + 1\n"
                                  "    ### END SOLUTION\n"),
        nbformat.v4.new_code_cell("print('only in the solution')", metadata={"tags": ["solution-only"]}),
    ])
    lab = authoring.make_lab(src, "solutions/labXX.py")
    assert lab.cells[1].source == ("def f(x):\n    # TODO: add one\n"
                                   "    raise NotImplementedError('TODO: add one')")
    assert len(lab.cells) == 2  # header + f; the solution-only cell is gone
    ns = {}
    exec(lab.cells[1].source, ns)
    with pytest.raises(NotImplementedError, match="TODO: add one"):
        ns["f"](1)


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "without END"),
    ("x = 1\n### END SOLUTION\n", "without BEGIN"),
    ("x = 1\n", "no ### BEGIN SOLUTION"),
])
def test_make_lab_rejects_broken_markers(source, message):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    with pytest.raises(ValueError, match=message):
        authoring.make_lab(nb, "solutions/labXX.py")


def test_check_sync_notices_drift(tmp_path):
    (tmp_path / "lessons").mkdir()
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs").mkdir()
    (tmp_path / "lessons" / "99_x.py").write_text("# %%\nprint(1)\n")
    assert any("no 99_x.ipynb" in p for p in authoring.check_sync(tmp_path))
    authoring.build(["99_x"], root=tmp_path)
    assert authoring.check_sync(tmp_path) == []
    (tmp_path / "lessons" / "99_x.py").write_text("# %%\nprint(2)\n")
    assert any("does not match its source" in p for p in authoring.check_sync(tmp_path))
    (tmp_path / "labs" / "lab77_orphan.ipynb").write_text(nbformat.writes(nbformat.v4.new_notebook()))
    assert any("has no source" in p for p in authoring.check_sync(tmp_path))


def test_every_lesson_has_a_parameters_cell():
    """So an instructor can re-run any lesson at scale with papermill, without editing it."""
    for src in authoring.sources():
        if src.parent.name != "lessons" or src.stem.startswith("00"):
            continue
        nb = authoring.read_source(src)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{src.name}: no parameters cell"


def test_ignored_outputs_are_marked_properly_and_say_why():
    """nbval honours NBVAL_IGNORE_OUTPUT only alone on its line; the next line says why."""
    for src in authoring.sources():
        for i, cell in enumerate(authoring.read_source(src).cells):
            lines = cell.source.splitlines()
            for j, line in enumerate(lines):
                if "NBVAL_IGNORE_OUTPUT" in line and cell.cell_type == "code":
                    assert line.strip() == "# NBVAL_IGNORE_OUTPUT", \
                        f"{src.name} cell {i}: put the marker alone on its line"
                    assert j + 1 < len(lines) and lines[j + 1].strip().startswith("#") and \
                        len(lines[j + 1].strip()) > 12, f"{src.name} cell {i}: say why on the next line"


def test_papermill_reruns_a_lesson_with_other_parameters(tmp_path):
    """What instructors do: re-run a lesson with other knobs, unedited. Lesson 02's claims
    (DP from scratch == the plain module, ...) must hold for 3 devices as well as the stored 4."""
    import papermill

    out = tmp_path / "02_three_devices.ipynb"
    papermill.execute_notebook(str(ROOT / "lessons" / "02_data_parallel.ipynb"), str(out),
                               parameters={"n_devices": 3, "seed": 1}, kernel_name="python3",
                               cwd=str(ROOT / "lessons"), progress_bar=False,
                               # the notebook written once, at the end, not after every cell;
                               # the kernel killed once done (nbclient's options)
                               request_save_on_cell_execute=False, shutdown_kernel="immediate")
    nb = nbformat.read(out, as_version=4)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "n_devices = 3" in injected[0].source
    assert not any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)


def test_every_markdown_line_in_a_source_is_commented():
    """In a percent-format source a markdown line must start with '#': jupytext keeps a bare
    line as text, so the mistake would pass the build and show as stray prose only in the
    .py file a reader diffs (this happened once in lesson 07)."""
    for src in authoring.sources():
        in_markdown = False
        for number, line in enumerate(src.read_text().splitlines(), 1):
            if line.startswith("# %%"):
                in_markdown = "[markdown]" in line
            elif in_markdown and line.strip():
                assert line.startswith("#"), f"{src.name}:{number}: markdown line without '#'"


def test_python_m_dpcourse_build_check_times_are_the_build_commands(tmp_path, sync_problems,
                                                                   capsys, monkeypatch):
    """`python -m dpcourse check` is authoring's sync check (same verdict, same lines), and
    build, times and mutate answer under `python -m dpcourse` with their own options."""
    # `python -m dpcourse` reaching __main__.main is proven by the real command lines of
    # test_workshop (workshop-check --plan) and test_script_checks (diagnose --json); `check`
    # goes through that main() here, from another folder as before (a subprocess cost an
    # interpreter and jupytext's import, ~3 s)
    from dpcourse.__main__ import main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = main(["check"])
    out = capsys.readouterr().out
    problems = sync_problems
    assert code == (1 if problems else 0), out[-2000:]
    assert out.splitlines() == problems + [
        "in sync" if not problems else f"{len(problems)} problem(s)"]
    # the --help pages go through the same main() in this process

    for sub, option in (("build", "--times"), ("times", "paths"), ("mutate", "--list")):
        with pytest.raises(SystemExit) as done:
            main([sub, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m dpcourse {sub}") and option in out


# ---- the install cell (issue 34): every notebook first runs the same one -------------------

NOTEBOOKS = sorted(p for d in ("lessons", "solutions", "labs") for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_notebook_first_runs_the_same_install_cell(path):
    """Every lesson, solution and lab: its first code cell is the build's install cell, identical
    everywhere (one text, the version's tag), with no stored output (silent where the course is
    installed). A notebook built before the cell existed fails here: rebuild it."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [c for c in code if authoring.INSTALL_TAG in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and code[0] is tagged[0], f"{path.name}: no install cell; rebuild it"
    assert code[0].source == authoring.install_source()
    assert code[0].outputs == []


def test_the_install_cell_goes_before_the_first_code_cell_once():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title"),
                                         nbformat.v4.new_code_cell("x = 1")])
    authoring.add_install_cell(authoring.add_install_cell(nb))
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code"]
    assert nb.cells[1].source == authoring.install_source() and nb.cells[2].source == "x = 1"
    src = authoring.read_source(ROOT / "lessons" / "02_data_parallel.py")
    assert sum(authoring.INSTALL_TAG in c.metadata.get("tags", []) for c in src.cells) == 1
    # the lesson's own frame stays its first cell; the cell adds nothing to its honest time
    assert src.cells[0].cell_type == "markdown"
    without = nbformat.v4.new_notebook(cells=[c for c in src.cells if c.cell_type == "markdown"
                                              or authoring.INSTALL_TAG not in c.metadata.get("tags", [])])
    assert authoring.estimate_time(src) == authoring.estimate_time(without)


def test_the_install_cell_names_this_version_and_is_silent_where_the_course_is():
    import tomllib

    import dpcourse

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    source = authoring.install_source()
    assert f'"git+{project["urls"]["Repository"]}@v{dpcourse.__version__}"' in source
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0 and out.stdout == "", out.stderr[-2000:]


def test_a_name_with_a_folder_builds_that_folder_only(tmp_path):
    """`build lessons/05` is the lesson alone: a lesson and its lab's solution share a name."""
    for folder, stem in (("lessons", "05_mirrored"), ("solutions", "lab05_mirrored"),
                         ("solutions", "lab06_ring")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{stem}.py").write_text("# %%\n")
    names = lambda *n: [p.stem for p in authoring.sources(tmp_path, list(n))]
    assert names("05_mirrored") == ["05_mirrored", "lab05_mirrored"]
    assert names("lessons/05") == ["05_mirrored"]
    assert names("solutions/lab0") == ["lab05_mirrored", "lab06_ring"]
    assert names("lab06") == ["lab06_ring"]
