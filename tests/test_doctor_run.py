"""python -m dpcourse doctor --run: what it runs, and that a passing, a wrong-output, a raising
and a hanging notebook are each reported as such (the failing ones on small notebooks this test
writes, the passing one on lesson 00)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from dpcourse.tools import doctor_run

ROOT = Path(__file__).resolve().parents[1]


def _run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    return subprocess.run([sys.executable, "-m", "dpcourse", "doctor", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd="/")


def test_it_runs_the_gpu_tests_then_every_lesson_and_solution():
    proc = _run_cli("--run", "--list")
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split()
    lessons = sorted(f"lessons/{p.name}" for p in (ROOT / "lessons").glob("*.ipynb"))
    solutions = sorted(f"solutions/{p.name}" for p in (ROOT / "solutions").glob("*.ipynb"))
    assert listed == ["tests/test_gpu.py"] + lessons + solutions
    # every lesson and lab source has its notebook listed (lesson 11 made it 12 and 11)
    assert lessons == sorted(f"lessons/{p.stem}.ipynb"
                             for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    assert solutions == sorted(f"solutions/{p.stem}.ipynb"
                               for p in (ROOT / "solutions").glob("lab[0-9][0-9]_*.py"))
    assert len(lessons) >= 12 and len(solutions) >= 11
    only = _run_cli("--run", "--list", "--only", "lab06", "--only", "00_start").stdout.split()
    assert only == ["lessons/00_start_here.ipynb", "solutions/lab06_ring_allreduce.ipynb"]
    # a name matches lessons and labs alike: "07_inside" is lesson 07 and lab07
    assert len(_run_cli("--run", "--list", "--only", "07_inside").stdout.split()) == 2


@pytest.mark.parametrize("args, message", [
    (["--run", "--only", "no-such-lesson"], "no lesson or solution notebook matches"),
    (["--only", "03"], "--only, --profile and --list go with --run"),
    (["--run", "--timeout", "0"], "--timeout must be a positive number"),
])
def test_bad_input_is_one_line(args, message):
    proc = _run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _notebook(path: Path, cells: list[tuple[str, str | None]]) -> Path:
    nb = nbformat.v4.new_notebook()
    for count, (source, stored) in enumerate(cells, 1):
        cell = nbformat.v4.new_code_cell(source, execution_count=count)
        if stored is not None:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
        nb.cells.append(cell)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


def test_rows_say_wrong_output_raised_and_too_slow(tmp_path, no_leftovers):
    # (a passing notebook's row, its exact counts and no failure: on lesson 00 below, through
    # the whole command, which makes its rows with the same run_one)
    wrong = _notebook(tmp_path / "wrong.ipynb", [("print(1 + 1)", "2\n"), ("print(2 + 2)", "5\n"),
                                                 ("import sys; print(1, file=sys.stderr)", None)])
    raises = _notebook(tmp_path / "raises.ipynb",
                       [("raise ValueError('the ring lost a chunk')", None)])
    slow = _notebook(tmp_path / "slow.ipynb", [("import time; time.sleep(60)", None)])
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    # The too-slow notebook mostly waits out its 8 s bound, and the other two mostly wait for
    # their pytest and kernel to start and stop: the three run side by side (a thread each),
    # not one after another; each run is still its own pytest and kernel.
    with ThreadPoolExecutor(2) as pool:
        too_slow = pool.submit(doctor_run.run_one, ROOT, slow, timeout=8, env=env)
        raised = pool.submit(doctor_run.run_one, ROOT, raises, timeout=120, env=env)
        _rows_of_the_other_two(wrong, raised, env)
        r = too_slow.result()
    assert not r.passed and "did not finish within 8 s" in r.failures[0]

    text = doctor_run.format_row(r)
    assert text.startswith("FAIL") and "slow.ipynb" in text
    rows = [doctor_run.Result("a", True, 1.0), doctor_run.Result("b", False, 2.0)]
    assert doctor_run.summary(rows) == "1 of 2 passed in 3 s; failed: b"


def _rows_of_the_other_two(wrong, raised, env):
    r = doctor_run.run_one(ROOT, wrong, timeout=120, env=env)
    assert not r.passed and r.counts["failed"] == 2 and r.counts["passed"] == 1
    assert len(r.failures) == 2 and r.failures[0].startswith("Cell 1:")
    # the row says what differed, not only that something did (a GPU machine's report is read
    # on another machine): the stored and the new line, and a stray stderr
    assert "mismatch 'stdout'" in r.details[0] and "- 4" in r.details[0] and "+ 5" in r.details[0]
    assert "{'stderr'}" in r.details[1]
    shown = doctor_run.format_row(r)
    assert "mismatch 'stdout'" in shown and "{'stderr'}" in shown

    r = raised.result()  # the raising notebook's row, run beside this one
    assert not r.passed
    assert r.failures[0].startswith("Cell 0:") and "the ring lost a chunk" in r.failures[0]


def test_the_whole_command_on_one_real_lesson_as_json(no_leftovers):
    # Lesson 00 (a few seconds): the command end to end, as a GPU owner would run it.
    proc = _run_cli("--run", "--only", "00_start", "--json", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["profile"].startswith("profile ")
    [row] = result["results"]
    assert row["path"] == "lessons/00_start_here.ipynb" and row["passed"], row
    # every code cell a passed row, none skipped, no failure and no detail
    cells = [c for c in nbformat.read(ROOT / row["path"], as_version=4).cells
             if c.cell_type == "code"]
    assert len(cells) >= 3
    assert row["counts"] == {"passed": len(cells), "failed": 0, "skipped": 0}, row
    assert row["failures"] == [] and row["details"] == [], row
