"""Installing the course anywhere (issue 34): pyproject.toml declares what the library imports,
requirements.txt's pins lie inside those ranges, dpcourse.versions names a wrong torch with the
command that fixes it, and a lesson and a lab run alone — copied into an empty folder, in an
environment whose only course is the built wheel, installed by the notebooks' own first cell.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import dpcourse
from dpcourse import versions
from dpcourse.tools import authoring

ROOT = authoring.ROOT
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# the same release under another name: the pinned CPU set installs TensorFlow as tensorflow-cpu
ALIASES = {"tensorflow-cpu": "tensorflow"}


def declared() -> dict[str, Requirement]:
    """pyproject's dependencies and every extra's, by canonical name."""
    reqs = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        reqs += extra
    out: dict[str, Requirement] = {}
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name not in out or out[name].specifier == req.specifier, f"{name} declared twice"
        out[name] = req
    return out


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact pin"
            found[canonicalize_name(req.name)] = spec.version
    return found


def pins_outside_ranges(pinned: dict[str, str], ranges: dict[str, Requirement]) -> list[str]:
    """Every pin that pyproject does not declare, or whose version its range refuses."""
    bad = []
    for name, version in pinned.items():
        req = ranges.get(ALIASES.get(name, name))
        if req is None:
            bad.append(f"{name}=={version}: pinned, but pyproject.toml does not declare it")
        elif not req.specifier.contains(version, prereleases=True):
            bad.append(f"{name}=={version}: outside pyproject.toml's {req}")
    return bad


# ---- pyproject.toml's ranges and the pins ---------------------------------------------------

@pytest.mark.parametrize("path", ["requirements.txt", "binder/requirements.txt",
                                  "classroom/requirements.txt"])
def test_every_pin_lies_in_pyproject_range(path):
    pinned = pins(ROOT / path)
    assert pinned
    assert pins_outside_ranges(pinned, declared()) == []


def test_a_pin_outside_its_range_is_named():
    ranges = declared()
    assert pins_outside_ranges({"torch": "2.13.1"}, ranges) == [
        "torch==2.13.1: outside pyproject.toml's torch>=2.14"]
    assert pins_outside_ranges({"tensorflow-cpu": "2.20.0"}, ranges) == [
        "tensorflow-cpu==2.20.0: outside pyproject.toml's tensorflow>=2.21"]
    assert "not declare" in pins_outside_ranges({"left-pad": "1.0"}, ranges)[0]


def test_the_cpu_index_build_is_the_pinned_release_and_ranks_first():
    """binder/requirements.txt adds PyTorch's CPU index and keeps `torch==2.14.1`: the CPU wheel
    (local label +cpu) satisfies that pin and ranks above PyPI's 2.14.1, so pip takes it."""
    from packaging.specifiers import SpecifierSet

    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in (
        ROOT / "binder" / "requirements.txt").read_text().splitlines()
    assert SpecifierSet("==2.14.1").contains("2.14.1+cpu")
    assert Version("2.14.1+cpu") > Version("2.14.1")


def test_what_the_library_imports_is_declared():
    """Every third-party top-level import in lib/dpcourse is a dependency or an extra's."""
    import_names = {"IPython": "ipython", "tensorflow": "tensorflow", "triton": "torch"}
    stdlib = set(sys.stdlib_module_names) | {"dpcourse", "__future__"}
    found = set()
    for path in (ROOT / "lib" / "dpcourse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            found |= {canonicalize_name(import_names.get(t, t)) for t in tops if t not in stdlib}
    assert found and found <= set(declared()), sorted(found - set(declared()))
    # torch's own triton comes with torch; the rest of the run-time imports are not extras
    base = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert {"torch", "numpy", "matplotlib", "cloudpickle", "psutil", "packaging"} <= base


def test_this_environment_satisfies_every_declared_dependency():
    missing = []
    for text in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["tf"]:
        req = Requirement(text)
        names = [req.name] + [a for a, b in ALIASES.items() if b == req.name]
        found = [v for n in names if (v := _installed(n))]
        if not found or not req.specifier.contains(found[0], prereleases=True):
            missing.append(f"{req}: found {found or 'nothing'}")
    assert missing == []


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_versions_module_holds_pyproject_floors_and_the_pins():
    ranges, pinned = declared(), pins(ROOT / "requirements.txt")
    for name, floor in versions.FLOORS.items():
        assert str(ranges[name].specifier) == f">={floor}", name
    for name, tested in versions.TESTED.items():
        if name == "python":
            assert (ROOT / "binder" / "runtime.txt").read_text().strip() == f"python-{tested}"
        else:
            assert pinned[name if name != "tensorflow" else "tensorflow-cpu"] == tested, name
    assert PROJECT["version"] == dpcourse.__version__


# ---- the version check, with made-up versions ------------------------------------------------

GOOD = {"python": "3.11.7", "torch": "2.14.1", "torchvision": "0.29.1", "tensorflow": "2.21.0",
        "tensorflow-dist": "tensorflow-cpu", "keras": "3.15.1"}


def _problems(notebook=True, loaded=None, **changes):
    return versions.version_problems({**GOOD, **changes}, loaded or {}, notebook=notebook)


def test_the_tested_set_and_this_environment_get_no_sentence(capsys):
    assert _problems() == []
    assert versions.version_problems() == []
    assert versions.check_versions() is None
    assert capsys.readouterr().out == ""


def test_an_old_torch_gets_the_fix_and_the_lessons_it_breaks():
    (sentence,) = _problems(torch="2.12.0+cpu", torchvision="0.27.0")
    assert sentence.startswith("torch 2.12.0+cpu is older than the course needs (2.14 or newer)")
    assert "lab 08 calls dist.reduce_scatter_single" in sentence
    assert "lesson 03 passes" in sentence and "not tried on 2.12" in sentence
    # a release the course was run on says what that run showed instead
    (sentence,) = _problems(torch="2.11.0+cu130", torchvision="0.26.0")
    assert "on torch 2.11 (one H100" in sentence and "not tried" not in sentence
    assert "`%pip install torch==2.14.1 torchvision==0.29.1`, then restart the kernel" in sentence
    (sentence,) = _problems(torch="2.13.1")
    assert "lab 08" in sentence and "lesson 03" not in sentence
    (sentence,) = _problems(notebook=False, torch="2.13.1")
    assert "`pip install torch==2.14.1 torchvision==0.29.1`" in sentence


def test_missing_or_mismatched_torch_and_old_tensorflow():
    assert _problems(torch=None)[0].startswith("torch is not installed")
    (sentence,) = _problems(torchvision="0.28.0")
    assert sentence.startswith("torchvision 0.28.0 is older") and "torch==2.14.1" in sentence
    (sentence,) = _problems(tensorflow="2.19.0", keras="3.10.0")
    assert sentence.startswith("tensorflow 2.19.0 and keras 3.10.0: older than lesson 05")
    assert "`%pip install tensorflow-cpu==2.21.0 keras==3.15.1`" in sentence
    assert _problems(tensorflow=None, keras=None, **{"tensorflow-dist": None}) == []


def test_a_newer_release_or_python_is_a_note_and_a_stale_import_says_restart():
    (note,) = _problems(torch="2.15.0")
    assert note.startswith("note: torch 2.15.0 is not the tested release (2.14.1)")
    assert _problems(torch="2.14.0") == []    # a patch release of the tested one
    (note,) = _problems(python="3.12.3")
    assert note == "note: Python 3.12 is expected to work, but the course is tested on 3.11 only."
    assert _problems(python="3.9.18")[0].startswith("Python 3.9.18 is too old")
    assert _problems(loaded={"torch": "2.14.1+cu130"}) == []   # the local label is one release
    (stale,) = _problems(loaded={"torch": "2.12.0"})
    assert stale.startswith("torch 2.12.0 is loaded in this kernel but 2.14.1 is installed")


def test_importing_the_package_or_the_check_imports_no_framework():
    code = ("import sys, dpcourse; assert 'dpcourse.versions' not in sys.modules; "
            "import dpcourse.versions; "
            "assert not {'torch', 'tensorflow'} & set(sys.modules), 'a framework was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stderr[-2000:]


# ---- a lesson and a lab alone, with only the built package -----------------------------------

LESSON = ROOT / "lessons" / "02_data_parallel.ipynb"
LAB = ROOT / "solutions" / "lab02_data_parallel.ipynb"
SITE = Path(metadata.distribution("torch").locate_file(""))  # this environment's site-packages


def _course_free_view(view: Path) -> None:
    """Every package of this environment but the course: links to site-packages' entries, the
    editable dpcourse (its dist-info and the .pth that puts lib/ on the path) left out. A .pth
    line names the folder, so no .pth inside it runs (lib/ never reaches sys.path)."""
    view.mkdir()
    for entry in SITE.iterdir():
        name = entry.name.lower()
        if name.startswith(("dpcourse", "__editable__")) or name.endswith(".pth"):
            continue
        (view / entry.name).symlink_to(entry)


def _run(cmd, cwd, env, timeout):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd[:4]} exited {out.returncode}:\n{out.stdout[-3000:]}\n" \
                                f"{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_a_lesson_and_a_lab_run_alone_from_the_built_wheel(tmp_path):
    """What a learner who downloads one notebook meets: the first cell installs the course (here
    from the wheel built from this checkout, through $DPCOURSE_SOURCE, as Colab does from the
    tag) into an environment that has torch and TensorFlow but no course; then lesson 02 and lab
    02's solution, copied alone into an empty folder, pass strict nbval there. No download:
    torch and the rest come from this environment; pip runs with --no-index."""
    t0 = time.perf_counter()
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "lib", src / "lib", ignore=shutil.ignore_patterns("__pycache__",
                                                                              "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL"))}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(tmp_path / "dist"), str(src)], tmp_path, env, 300)
    (wheel,) = (tmp_path / "dist").glob("dpcourse-*.whl")

    _course_free_view(tmp_path / "view")
    venv = tmp_path / "venv"
    _run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env, 120)
    python = str(venv / "bin" / "python")
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "course_free_view.pth").write_text(f"{tmp_path / 'view'}\n")

    alone = tmp_path / "alone"
    alone.mkdir()
    notebooks = [shutil.copy(p, alone) for p in (LESSON, LAB)]
    no_course = subprocess.run([python, "-c", "import dpcourse"], cwd=alone, env=env,
                               capture_output=True, text=True, timeout=60)
    assert "No module named 'dpcourse'" in no_course.stderr   # the repository is out of reach

    cells = [next(c for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code")
             for p in notebooks]
    assert all(authoring.INSTALL_TAG in c.metadata.get("tags", []) for c in cells)
    installed = _run([python, "-c", cells[0].source], alone,
                     env | {"DPCOURSE_SOURCE": str(wheel)}, 300)
    assert installed.stdout == f"Installed the course library (dpcourse) from {wheel}.\n"
    where = _run([python, "-c", "import dpcourse; print(dpcourse.__file__)"], alone, env, 60)
    assert where.stdout.startswith(str(site / "dpcourse")), where.stdout
    # the same cell where the course is installed: silent (a stored empty output, nbval below)
    again = _run([python, "-c", cells[1].source], alone, env, 120)
    assert again.stdout == ""

    shutil.copy(ROOT / "tests" / "sanitize.cfg", tmp_path / "sanitize.cfg")
    ran = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                "--nbval-current-env", f"--nbval-sanitize-with={tmp_path / 'sanitize.cfg'}",
                "--nbval-cell-timeout=300", "--rootdir", str(alone),
                *[p.rsplit("/", 1)[1] for p in notebooks]], alone, env, 600)
    assert re.search(r"\b\d+ passed\b", ran.stdout) and "failed" not in ran.stdout, ran.stdout
    print(f"alone: wheel, environment, install and strict nbval of {len(notebooks)} notebooks "
          f"in {time.perf_counter() - t0:.0f} s")
